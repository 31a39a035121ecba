"""Which trajectories of a fragment hold a non-finite number (a NaN or an infinity).

A GPU that starts computing NaN sends chunks that look like any other: same shapes, same
dtypes. Trained as they are, one NaN row turns a group's advantages, the step's loss and then
every weight into NaN. The trainer therefore checks, per trajectory, everything of it that it
is about to use: the latents and log-probs of its trained timesteps, a forward-process
fragment's clean latents, the reward and its terms, and the conditioning rows. A trajectory
with any non-finite value is discarded (reason :data:`NONFINITE`) before advantages are
computed; the rest of its group is trained as a smaller group.

Pure functions over tensors: no actor, no socket.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from digenrl.core.credits import NONFINITE

__all__ = ["NONFINITE", "fragment_tensors", "nonfinite_rows"]


def nonfinite_rows(n: int, *, tensors: Iterable[torch.Tensor] = (),
                   values: Mapping[str, Sequence[float]] | None = None,
                   rewards: Sequence[float] = ()) -> torch.Tensor:
    """``[n]`` bool (on the CPU), True for each trajectory with a non-finite value anywhere
    it appears.

    ``tensors``: per-trajectory tensors (first dimension ``n``: latents, log-probs, clean
    latents, conditioning); a tensor of another first dimension is per-prompt or shared and
    is checked whole, flagging every row when it is not finite. ``rewards`` and each list of
    ``values`` (reward terms) hold one number per trajectory. The tensors are checked where
    they are, with one copy to the host per device (not one per tensor: each is a sync).
    """
    finite: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if not t.is_floating_point() or t.numel() == 0:
            continue  # integers and booleans hold no NaN
        t = t.detach()
        rows = (torch.isfinite(t.reshape(n, -1)).all(dim=1) if t.dim() >= 1 and t.shape[0] == n
                else torch.isfinite(t).all().expand(n))
        finite.setdefault(t.device, []).append(rows)
    bad = torch.zeros(n, dtype=torch.bool)
    for rows_list in finite.values():
        bad |= ~torch.stack(rows_list).all(dim=0).cpu()
    for seq in [rewards, *(values or {}).values()]:
        if len(seq):
            r = torch.as_tensor(list(seq), dtype=torch.float64)
            if r.numel() == n:
                bad |= ~torch.isfinite(r)
            elif not bool(torch.isfinite(r).all()):
                bad[:] = True
    return bad


def fragment_tensors(records: Mapping[int, object], final: torch.Tensor | None,
                     cond: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """What a trainer reads of a fragment: each record's ``x_t``, ``x_next`` and ``log_prob``
    (records without them, a forward-process fragment's draw slots, add nothing), the clean
    latents ``final`` and the conditioning tensors."""
    out: list[torch.Tensor] = []
    for rec in records.values():
        out += [t for name in ("x_t", "x_next", "log_prob")
                if isinstance(t := getattr(rec, name, None), torch.Tensor)]
    if final is not None:
        out.append(final)
    out += [t for t in cond.values() if isinstance(t, torch.Tensor)]
    return out
