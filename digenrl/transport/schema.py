"""What a decoded message may hold beyond its field types: ranges, sizes, shapes.

The codec checks types (an int is an int, a role is one of its Literal values); this module
checks the values a well-typed message can still get wrong, before any handler sees it:
ids and versions non-negative, seconds finite, strings and lists bounded, the free-form
dicts (``Heartbeat.stats``, ``StepDone.metrics``, ``Commit.reward_terms``, ...) flat maps of
numbers of bounded size, a chunk's tensors of matching shapes, a clean sample's latents
floating. :func:`check` raises
:class:`ProtocolError` with reason ``"invalid"``, so a socket counts and drops such a message
like an undecodable one.

These are bounds that hold in every run. Whether a value fits *this* run (a step below
``run.steps``, a task that was assigned, a report from the node that owns it) is for the
receiver: the ledger, the scheduler and the actors check that.

Rules are keyed by message tag and need nothing from :mod:`digenrl.transport.protocol`, so
the codec can apply them without an import cycle. A rule is a predicate plus the words
that say what was expected; cheap on purpose (a chunk pays a few attribute reads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from digenrl.transport.errors import ProtocolError

I62 = 1 << 62
"""Bound of ids, steps and versions (what the ledger issues stays far below)."""
MAX_NAME = 128          # node ids, dict keys, GPU names
MAX_TEXT = 4096         # reasons, hosts, endpoints, checksums
MAX_PROMPT = 1 << 16    # one prompt's characters
MAX_LIST = 1 << 16      # prompts, seeds, rewards per message
MAX_KEYS = 256          # entries of a free-form dict
MAX_SEGMENTS = 64       # segments of a weight version


def _range(lo: float, hi: float, *, open_lo: bool = False) -> Callable[[Any], bool]:
    """A number in ``[lo, hi)`` (``(lo, hi)`` with ``open_lo``); NaN fails every comparison."""
    if open_lo:
        return lambda v: lo < v < hi
    return lambda v: lo <= v < hi


def _max_len(limit: int) -> Callable[[Any], bool]:
    """A str of at most ``limit`` characters or a list of at most ``limit`` items."""
    return lambda v: len(v) <= limit


_nonneg = _range(0, I62)


def _small(limit: int) -> Callable[[Any], bool]:
    return _range(0, limit)


_seconds = _range(0.0, 1e9)  # NaN and inf fail both comparisons or the bound


def _name(v: str) -> bool:
    return 0 < len(v) <= MAX_NAME and v.isprintable()


def _text(limit: int = MAX_TEXT) -> Callable[[Any], bool]:
    return _max_len(limit)


def _number(v: Any) -> bool:
    t = type(v)
    return t is float or (t is int and -I62 <= v < I62)


def _numbers(v: dict[str, Any]) -> bool:
    """A flat map of bounded size: short str keys, int or float values (NaN allowed: a
    metric may honestly be NaN; strings, lists and maps are not numbers)."""
    return len(v) <= MAX_KEYS and all(len(k) <= MAX_NAME and _number(x) for k, x in v.items())


def _counts(v: dict[str, Any]) -> bool:
    return len(v) <= 64 and all(0 < len(k) <= MAX_NAME and type(x) is int and 0 <= x < I62
                                for k, x in v.items())


def _reward_terms(v: dict[str, Any]) -> bool:
    return len(v) <= 64 and all(len(k) <= MAX_NAME and type(x) is list and len(x) <= MAX_LIST
                                and all(_number(e) for e in x) for k, x in v.items())


def _owners(v: dict[str, Any]) -> bool:
    return 0 < len(v) <= 10_000 and all(k.isdigit() and len(k) <= 6 and type(x) is int
                                        and 0 <= x < 1 << 16 for k, x in v.items())


def _endpoints(v: dict[str, Any]) -> bool:
    return len(v) <= 4096 and all(len(k) <= MAX_NAME and type(x) is str and len(x) <= MAX_TEXT
                                  for k, x in v.items())


def _gpu(v: dict[str, Any]) -> bool:
    """An NVML snapshot (telemetry/nvml.py): a few scalars and a bounded list of flat maps."""
    if len(v) > 16:
        return False
    for k, x in v.items():
        if len(k) > MAX_NAME:
            return False
        if type(x) is list:
            if len(x) > 64 or not all(type(g) is dict and len(g) <= 32 and all(
                    len(gk) <= MAX_NAME and (x2 is None or _number(x2) or type(x2) is bool
                                             or (type(x2) is str and len(x2) <= MAX_TEXT))
                    for gk, x2 in g.items()) for g in x):
                return False
        elif not (x is None or _number(x) or type(x) is bool or (type(x) is str and len(x) <= MAX_TEXT)):
            return False
    return True


def _ints(limit: int, lo: int = 0) -> Callable[[list[int]], bool]:
    return lambda v: len(v) <= MAX_LIST and all(lo <= e < limit for e in v)


def _segment_names(v: list[str]) -> bool:
    return len(v) <= MAX_SEGMENTS and all(len(x) <= MAX_NAME for x in v)


def _segment_sums(v: list[str]) -> bool:
    return len(v) <= MAX_SEGMENTS and all(len(x) <= 128 for x in v)


def _segments_whole(m: Any) -> str | None:
    """A version's segments: one entry each in every list, parts adding up, none newer."""
    n = len(m.segments)
    if not (len(m.segment_since) == len(m.segment_parts) == len(m.segment_sums) == n):
        return "segments, segment_since, segment_parts and segment_sums of one length"
    if n and sum(m.segment_parts) != m.nparts:
        return f"segment_parts adding up to nparts = {m.nparts}"
    if any(s > m.version for s in m.segment_since):
        return f"segment versions <= version {m.version}"
    return None


def _prompts(v: list[str]) -> bool:
    return len(v) <= MAX_LIST and all(len(p) <= MAX_PROMPT for p in v)


def _chunk_tensors(m: Any) -> str | None:
    x, y, lp = m.x_t, m.x_next, m.log_prob
    if x.dim() < 2 or x.shape != y.shape or not (x.dtype.is_floating_point and y.dtype.is_floating_point):
        return (f"x_t {tuple(x.shape)} {x.dtype}, x_next {tuple(y.shape)} {y.dtype}: expected "
                "floating tensors of one shape (N, ...)")
    if lp.shape != (x.shape[0],) or not lp.dtype.is_floating_point:
        return f"log_prob {tuple(lp.shape)}: expected ({x.shape[0]},) floating"
    return None


def _clean_tensors(m: Any) -> str | None:
    x = m.x0
    if x.dim() < 2 or x.shape[0] < 1 or not x.dtype.is_floating_point:
        return f"x0 {tuple(x.shape)} {x.dtype}: expected floating latents (N, ...) with N >= 1"
    return None


def _commit_whole(m: Any) -> str | None:
    if m.images.numel() and str(m.images.dtype) != "torch.uint8":
        return f"images {m.images.dtype}: expected uint8"
    if len(m.cond) > 64:
        return f"{len(m.cond)} conditioning tensors: expected at most 64"
    if not m.prompt_ids or len(m.rewards) % len(m.prompt_ids):
        return f"{len(m.rewards)} rewards for {len(m.prompt_ids)} prompts: expected whole groups"
    return None


def _commit_discard(m: Any) -> str | None:
    if m.discard:  # a fragment discarded by its rollout (a reward worker's failure) carries no rewards
        if m.rewards or m.reward_terms:
            return f"discard = {m.discard!r} with {len(m.rewards)} rewards: expected none"
        if not m.prompt_ids:
            return "a discarded commit without prompt ids"
        return _commit_tensors(m)
    if not m.rewards:
        return "no rewards and no discard reason"
    return _commit_whole(m)


def _commit_tensors(m: Any) -> str | None:
    if m.images.numel() and str(m.images.dtype) != "torch.uint8":
        return f"images {m.images.dtype}: expected uint8"
    if len(m.cond) > 64:
        return f"{len(m.cond)} conditioning tensors: expected at most 64"
    return None


def _assign_whole(m: Any) -> str | None:
    if len(m.metadata) != len(m.prompts):
        return f"{len(m.metadata)} metadata records for {len(m.prompts)} prompts"
    return None


def _score_whole(m: Any) -> str | None:
    x = m.images
    if x.dim() != 4 or x.shape[1] != 3 or str(x.dtype) != "torch.uint8":
        return f"images {tuple(x.shape)} {x.dtype}: expected uint8 (N, 3, H, W)"
    if not (len(m.prompts) == len(m.metadata) == x.shape[0]):
        return f"{x.shape[0]} images, {len(m.prompts)} prompts, {len(m.metadata)} metadata: expected one each"
    return None


def _samples_whole(m: Any) -> str | None:
    g = m.grid
    if g.dim() != 3 or g.shape[2] != 3 or str(g.dtype) != "torch.uint8" or not g.numel():
        return f"grid {tuple(g.shape)} {g.dtype}: expected uint8 (H, W, 3)"
    return None


def _scored_whole(m: Any) -> str | None:
    if bool(m.error) == bool(m.rewards):
        return "expected rewards or an error, not both or neither"
    if not all(_number(r) for r in m.rewards):
        return "rewards: expected numbers"
    return None


def _metadata(v: list[str]) -> bool:
    return len(v) <= MAX_LIST and all(len(x) <= MAX_PROMPT for x in v)


def _sigmas(m: Any) -> str | None:
    if not (0.0 <= m.sigma_next <= m.sigma <= 1.0):
        return f"sigma = {m.sigma!r}, sigma_next = {m.sigma_next!r}: expected 0 <= sigma_next <= sigma <= 1"
    return _chunk_tensors(m)


_NONNEG = (_nonneg, "an integer in [0, 2**62)")
_SECONDS = (_seconds, "finite seconds >= 0")
_NAME = (_name, f"1 to {MAX_NAME} printable characters")
_TEXT = (_text(), f"at most {MAX_TEXT} characters")
_NUMBERS = (_numbers, f"a map of at most {MAX_KEYS} short names to numbers")
_FRAGMENT = (_small(1 << 20), "a fragment index in [0, 2**20)")
_T_INDEX = (_small(1 << 20), "a timestep index in [0, 2**20)")
_RANK = (_small(1 << 16), "a rank in [0, 65536)")


Rule = tuple[Callable[[Any], bool], str]
RULES: dict[str, dict[str, Rule]] = {
    "hello": {"node_id": _NAME, "gpu": (_text(MAX_NAME), "a short GPU name"),
              "incarnation": _NONNEG, "pid": _NONNEG, "host": _TEXT, "data_endpoint": _TEXT,
              "weights_endpoint": _TEXT},
    "welcome": {"node_id": _NAME, "run_id": _TEXT, "config_toml": (_text(1 << 20), "at most 1 MiB"),
                "endpoints": (_endpoints, "a map of names to addresses"), "rank": _RANK,
                "world_size": _RANK},
    "heartbeat": {"node_id": _NAME, "incarnation": _NONNEG, "policy_version": _NONNEG, "seq": _NONNEG,
                  "gpu": (_gpu, "an NVML snapshot"), "stats": _NUMBERS},
    "assign": {"task_id": _NONNEG, "step": _NONNEG, "fragment": _FRAGMENT,
               "prompt_ids": (_ints(I62), "prompt indices >= 0"), "prompts": (_prompts, "bounded prompts"),
               "seeds": (_max_len(MAX_LIST), "at most 65536 seeds"),
               "group_size": (_range(1, MAX_LIST + 1), "a group size >= 1"),
               "version_floor": _NONNEG, "lease_s": (_range(0.0, 1e9, open_lo=True), "finite seconds > 0"),
               "sde_steps": (_ints(1 << 20), "timestep indices"), "owners": (_owners, "timestep -> rank"),
               "metadata": (_metadata, "bounded JSON records")},
    "chunk": {"task_id": _NONNEG, "step": _NONNEG, "fragment": _FRAGMENT, "t_index": _T_INDEX,
              "policy_version": _NONNEG},
    "clean_sample": {"task_id": _NONNEG, "step": _NONNEG, "fragment": _FRAGMENT,
                     "policy_version": _NONNEG},
    "commit": {"task_id": _NONNEG, "step": _NONNEG, "fragment": _FRAGMENT, "node_id": _NAME,
               "policy_version": _NONNEG, "prompt_ids": (_ints(I62), "prompt indices >= 0"),
               "rewards": (_max_len(MAX_LIST), "at most 65536 rewards"),
               "reward_terms": (_reward_terms, "a map of term names to lists of numbers"),
               "gen_seconds": _SECONDS, "discard": (_text(MAX_NAME), "a short reason or ''")},
    "score": {"task_id": _NONNEG, "step": _NONNEG, "prompts": (_prompts, "bounded prompts"),
              "metadata": (_metadata, "bounded JSON records")},
    "scored": {"task_id": _NONNEG, "rewards": (_max_len(MAX_LIST), "at most 65536 rewards"),
               "reward_terms": (_reward_terms, "a map of term names to lists of numbers"),
               "error": _TEXT, "seconds": _SECONDS},
    "consumed": {"task_id": _NONNEG, "step": _NONNEG, "fragment": _FRAGMENT, "rank": _RANK,
                 "policy_version": _NONNEG,
                 "trained": (_range(0, MAX_LIST + 1), "0 to 65536 trajectories"),
                 "discarded": (_counts, "a map of reasons to counts"), "train_seconds": _SECONDS},
    "version_announce": {"version": _NONNEG, "step": _NONNEG,
                         "nparts": (_range(0, (1 << 20) + 1), "0 or more parts"),
                         "nbytes": _NONNEG, "checksum": (_text(128), "a short checksum"),
                         "segments": (_segment_names, "at most 64 short names"),
                         "segment_since": (_ints(I62), "versions >= 0"),
                         "segment_parts": (_ints(1 << 20), "part counts"),
                         "segment_sums": (_segment_sums, "at most 64 short checksums")},
    "weights_request": {"version": _NONNEG, "part": (_small(1 << 20), "a part index")},
    "weights_part": {"version": _NONNEG, "part": (_small(1 << 20), "a part index"),
                     "nparts": (_range(1, (1 << 20) + 1), "1 or more parts"),
                     "checksum": (_text(128), "a short checksum")},
    "weights_missing": {"version": _NONNEG, "part": (_small(1 << 20), "a part index"),
                        "newest": (_range(-1, I62), "a version >= -1 (-1: none)")},
    "weights_pending": {"version": _NONNEG, "part": (_small(1 << 20), "a part index"),
                        "landed": (_small(1 << 20), "a part count")},
    "weights_route": {"upstream": _TEXT, "upstream_node": (_text(MAX_NAME), "a node id or ''")},
    "weights_held": {"node_id": _NAME, "version": _NONNEG},
    "step_done": {"step": _NONNEG, "version": _NONNEG, "metrics": _NUMBERS},
    "samples": {"step": _NONNEG, "prompt_ids": (_ints(I62), "prompt indices >= 0"),
                "caption": (_text(MAX_PROMPT), f"at most {MAX_PROMPT} characters")},
    "tag_offer": {"node_id": _NAME, "rank": _RANK,
                  "free_mb": (_range(-1.0, 1e12), "MiB >= -1 (-1: unknown)")},
    "revoke": {"task_id": _NONNEG, "reason": _TEXT},
    "shutdown": {"reason": _TEXT},
}
WHOLE: dict[str, Callable[[Any], str | None]] = {
    "chunk": _sigmas, "clean_sample": _clean_tensors, "commit": _commit_discard, "assign": _assign_whole, "score": _score_whole,
    "scored": _scored_whole, "samples": _samples_whole, "version_announce": _segments_whole}
"""Checks across fields (shapes of a message's tensors), by tag."""


def check(msg: Any) -> None:
    """Raise ProtocolError (reason ``invalid``) naming the first field out of bounds."""
    tag = msg.TAG
    values = msg.__dict__
    for name, (ok, expected) in RULES.get(tag, {}).items():
        value = values[name]
        if not ok(value):
            raise ProtocolError(f"{type(msg).__name__}.{name} = {value!r:.120}: expected {expected}",
                                reason="invalid")
    whole = WHOLE.get(tag)
    if whole is not None:
        why = whole(msg)
        if why is not None:
            raise ProtocolError(f"{type(msg).__name__}: {why}", reason="invalid")
