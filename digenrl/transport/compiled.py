"""Each message class's encoder and typed-decoder finish, generated once at registration.

The codec's generic code walks a class's fields in a loop and calls a check per field
(:mod:`digenrl.transport.kinds`). On the per-message path that loop is most of what the codec
costs: ~9 us to decode and ~7 us to encode a Heartbeat inside a ping-pong, against ~3 us each
in a tight loop (docs/benchmarks.md, Transport: "Generated per-class code"). So, as
``dataclasses`` does for ``__init__``, each class gets two plain functions written for its
fields: the checks are inline expressions, the header one dict display, the message one
``__dict__`` update.

They are the generic code's fast path, never its replacement: each does exactly what the
generic code does for values that pass its checks and gives up (returns None) on anything
else, so that the generic code, which converts a value or names what is wrong, runs.
tests/test_codec_compiled.py holds them to that, field kind by field kind.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from digenrl.transport.kinds import encode_check, plain_types_ok

_INLINE: dict[str, str] = {
    "int": "type({v}) is int",  # the range: msgspec's encoder raises OverflowError outside it
    "float": "type({v}) is float",
    "str": "type({v}) is str",
    "bool": "type({v}) is bool",
    "bytes": "type({v}) is bytes",
}
"""A kind's encode check (kinds._ENCODE_OK) as an expression over the local ``{v}``; literals
and dicts are written inline too (compile_encoder), lists call the generic check. Ints and
dicts leave the 64-bit range to the writer: msgspec raises OverflowError outside exactly
``INT_MIN..INT_MAX``, and the generated encoder then gives up like any failed check."""


def _build(name: str, source: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    code = compile(source, f"<digenrl.transport.compiled {name}>", "exec")
    exec(code, namespace)
    fn: Callable[..., Any] = namespace[name]
    return fn


def compile_encoder(cls: type, kinds: dict[str, str], tag: str, *, to_frame: Callable[..., Any],
                    tensor_dict: Callable[..., Any], write: Callable[[Any], bytes]
                    ) -> Callable[[dict[str, Any], int], list[Any] | None]:
    """``encode(values, version)``: the frames of a message whose ``__dict__`` is ``values``,
    or None when a plain field fails its exact-type check or an int is out of range (the
    generic encoder then converts it or raises naming it). Tensor fields go through
    ``to_frame`` (one tensor) and ``tensor_dict`` (a dict of them) with the names the generic
    encoder gives them, so a bad tensor raises the same ValueError."""
    ns: dict[str, Any] = {"TAG": tag, "plain_ok": plain_types_ok, "to_frame": to_frame,
                          "tensor_dict": tensor_dict, "write": write}
    names = list(kinds)
    if len(names) > 1:  # one C call reads every field
        ns["FIELDS"] = operator.itemgetter(*names)
        body = [f"    {', '.join(f'x_{n}' for n in names)} = FIELDS(values)"]
    else:
        body = [f"    x_{n} = values[{n!r}]" for n in names]
    checks, plain, tensors = [], [], []
    for i, (n, kind) in enumerate(kinds.items()):
        if kind in ("tensor", "tensors"):
            tensors.append((n, kind))
            continue
        plain.append(n)
        template = _INLINE.get(kind)
        if kind.startswith("literal:"):
            ns[f"CHOICES_{i}"] = frozenset(kind[8:].split("|"))
            template = f"(type({{v}}) is str and {{v}} in CHOICES_{i})"
        elif kind == "dict":
            template = "(type({v}) is dict and plain_ok({v}))"
        elif template is None:  # lists: the generic check, called once
            ns[f"OK_{i}"] = encode_check(kind)
            template = f"OK_{i}({{v}})"
        checks.append(template.format(v=f"x_{n}"))
    if checks:
        body += [f"    if not ({' and '.join(checks)}):", "        return None"]
    body += ["    entries = []", "    frames = [b'']"]
    for n, kind in tensors:
        where = f"{cls.__name__}.{n}"
        if kind == "tensor":
            body += [f"    d, s, r = to_frame({where!r}, x_{n})",
                     f"    entries.append([{n!r}, None, d, s, r.nbytes])",
                     "    frames.append(r)"]
        else:
            body.append(f"    tensor_dict({where!r}, {n!r}, x_{n}, entries, frames)")
    header = ", ".join(["'t': TAG", "'v': version", *(f"{n!r}: x_{n}" for n in plain),
                        "'_tensors': entries"])
    body += ["    try:", f"        frames[0] = write({{{header}}})",
             "    except OverflowError:", "        return None", "    return frames"]
    return _build("encode", "def encode(values, version):\n" + "\n".join(body) + "\n", ns)


def compile_finish(cls: type, kinds: dict[str, str], checks: list[tuple[str, Callable[[Any], bool]]],
                   *, version: int, direct: bool, whole: Callable[[Any], str | None] | None,
                   tensors: Callable[..., bool], lean: Callable[..., Any], plan: Any
                   ) -> Callable[[Any, Any, int, int], Any]:
    """``finish(header, frames, n, max_frame_bytes)``: the message of a typed header (the
    class's msgspec header struct) and its ``n`` frames, or None for anything the typed path
    does not accept: another version, tensor entries that do not match the frames
    (``tensors``: the codec's ``_typed_tensors``), a failed check, a whole-message rule
    broken. May raise for a tensor description that does not match its frame (the caller
    treats that as None too).

    A class whose tensors are all single fields (a Chunk's three) reads frames laid out as
    its encoder writes them (one entry per field, in order, each a received frame) with
    ``lean`` (frames.received_frame_to_tensor) per tensor, inline; anything else, or a
    tensor ``lean`` declines, goes through ``tensors`` (the codec's ``_typed_tensors``)."""
    ns: dict[str, Any] = {"CLS": cls, "NEW": object.__new__, "WHOLE": whole, "PLAN": plan,
                          "tensors": tensors, "LEAN": lean}
    plain = [n for n, k in kinds.items() if k not in ("tensor", "tensors")]
    has_dicts = any(k == "tensors" for k in kinds.values())
    fields = ", ".join(f"{n!r}: h.{n}" for n in plain)
    body = [f"    if h.v != {version}:", "        return None",
            "    entries = h._tensors",
            f"    fields = {{{fields}}}"]
    has_tensors = len(plain) != len(kinds)
    singles = [n for n, k in kinds.items() if k == "tensor"]
    if has_tensors and not has_dicts:
        k = len(singles)
        match = " and ".join(f"entries[{i}][0] == {n!r} and entries[{i}][1] is None"
                             for i, n in enumerate(singles))
        got = " and ".join(f"t_{i} is not None" for i in range(k))
        body += ["    fast = False",
                 f"    if n == {k + 1} and len(entries) == {k} and {match}:"]
        body += [f"        t_{i} = LEAN(entries[{i}], frames[{i + 1}], max_frame_bytes)"
                 for i in range(k)]
        body += [f"        if {got}:"]
        body += [f"            fields[{n!r}] = t_{i}" for i, n in enumerate(singles)]
        body += ["            fast = True"]
    if has_tensors:
        cond = "True" if has_dicts else "not fast and (n > 1 or entries)"
        body += [f"    if ({cond}) and (len(entries) != n - 1",
                 "            or not tensors(PLAN, entries, frames, fields, max_frame_bytes)):",
                 "        return None",
                 f"    if len(fields) != {len(kinds)}:",
                 "        return None"]
    else:
        body += ["    if n > 1 or entries:", "        return None"]
    if checks:
        for i, (_, ok) in enumerate(checks):
            ns[f"CHECK_{i}"] = ok
        test = " and ".join(f"CHECK_{i}(fields[{n!r}])" for i, (n, _) in enumerate(checks))
        body += [f"    if not ({test}):", "        return None"]
    if direct:
        body += ["    msg = NEW(CLS)", "    msg.__dict__.update(fields)"]
    else:
        body.append("    msg = CLS(**fields)")
    if whole is not None:
        body += ["    if WHOLE(msg) is not None:", "        return None"]
    body.append("    return msg")
    return _build("finish", "def finish(h, frames, n, max_frame_bytes):\n" + "\n".join(body) + "\n",
                  ns)


def compile_init(cls: type, names: list[str]) -> Callable[..., None]:
    """A frozen dataclass's keyword-only ``__init__`` for fields without defaults, filling
    ``__dict__`` in one update instead of one ``object.__setattr__`` per field (a Heartbeat
    built with its two dicts 1.8 -> 1.2 us, a Chunk 1.8 -> 1.0, hot: every message a node
    sends is built once). Same
    signature, same instance dict, same TypeError for a missing, unknown or positional
    argument."""
    params = ", ".join(names)
    values = ", ".join(f"{n!r}: {n}" for n in names)
    star = "*, " if names else ""
    source = (f"def __init__(self, {star}{params}):\n"
              f"    self.__dict__.update({{{values}}})\n")
    fn = _build("__init__", source, {})
    fn.__qualname__ = f"{cls.__qualname__}.__init__"
    fn.__module__ = cls.__module__
    return fn
