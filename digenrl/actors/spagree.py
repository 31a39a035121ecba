"""The ranks of a sequence-parallel group agree on the attempt they train for a slot.

The ranks of a group must train the same commits in the same order (their forward passes
exchange tokens). Each takes a step's commits by fragment index, but a ``Revoke`` is a
message to each rank on its own: it may reach one rank of the group before an attempt's
commit and another after it, and then one rank would train the attempt while the other
drops it and waits for the slot's next attempt. So before a rank of a group consumes the
lowest open slot of its step it runs one round with the group (:func:`agree`): each rank puts in
``(fragment, task id of its candidate commit, whether it has seen that task revoked)``, and
every rank reads the same verdict from the same numbers (:func:`decide`):

* every rank holds the same task and none has seen it revoked: ``TRAIN`` it;
* a rank's task is lower than another's, or the highest task is revoked on some rank:
  ``DROP`` it (a slot has a newer attempt only once its older one was revoked, and task ids
  only grow: ``CreditLedger.admit``), and wait for the next attempt;
* a rank holds the highest task, unrevoked, while another still holds an older one: ``WAIT``
  (keep it for the next round, which the other rank joins with this task once it arrives).

Rounds pair up because every rank of a group runs one round per consumption attempt of its
lowest open slot, and the ranks open and close slots together (a slot closes only on a
``TRAIN`` verdict, or as a duplicate of a closed one, which no rank puts to a round).
A revoked attempt one rank consumed before its ``Revoke`` reached it is trained by the whole
group, as a one-rank trainer would: its later attempt is then a duplicate on every rank.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

Verdict = Literal["train", "drop", "wait"]
TRAIN: Verdict = "train"
DROP: Verdict = "drop"
WAIT: Verdict = "wait"


def decide(mine: int, round_: list[tuple[int, int, bool]]) -> Verdict:
    """The verdict for this rank's task ``mine`` from every rank's ``(fragment, task, revoked
    here)`` in group-rank order (see the module doc)."""
    fragments = {f for f, _, _ in round_}
    assert len(fragments) == 1, f"sequence-parallel ranks put different slots to one round: {round_}"
    top = max(t for _, t, _ in round_)
    if mine < top or any(revoked for _, t, revoked in round_ if t == top):
        return DROP
    return TRAIN if all(t == top for _, t, _ in round_) else WAIT


def agree(group: dist.ProcessGroup, fragment: int, task_id: int, revoked: bool,
          device: torch.device | str = "cpu") -> Verdict:
    """One round of the group (a collective: every rank of ``group`` calls it); ``device``:
    where the exchanged numbers live (the model's: NCCL exchanges device tensors)."""
    n = dist.get_world_size(group)
    mine = torch.tensor([fragment, task_id, int(revoked)], dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(parts, mine, group=group)
    round_ = [(int(p[0]), int(p[1]), bool(p[2])) for p in parts]
    return decide(task_id, round_)
