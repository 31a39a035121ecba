"""A message field's kind and the checks of a value against it, for encoding and decoding.

A field's annotation becomes its kind (:func:`kind_of`): ``"int"``, ``"float"``, ``"str"``,
``"bool"``, ``"bytes"``, ``"list:<scalar>"``, ``"literal:a|b"``, ``"dict"`` (a msgpack-able
map), ``"tensor"`` or ``"tensors"`` (a dict of tensors). Encoding checks each value with
:func:`encode_check` (exact types, the fast test) and :func:`check_value` (which converts or
names what is wrong); the checked decoder uses :func:`decoded_check`; the typed decoder uses
:func:`typed_kind`, the kind as a msgspec type. :mod:`digenrl.transport.codec` holds the
message classes and the wire format that use them.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any, Literal

import torch

INT_MIN = -(1 << 63)
INT_MAX = (1 << 64) - 1  # msgpack carries unsigned 64-bit too
MAX_DEPTH = 16  # nesting of a dict or list field's values


_SCALARS: dict[Any, str] = {int: "int", float: "float", str: "str", bool: "bool", bytes: "bytes"}
_EXACT = {"str": str, "bool": bool, "bytes": bytes}


def kind_of(tp: Any) -> str:
    """The kind of a field annotated ``tp``; TypeError for a type no message field may have."""
    if tp in _SCALARS:
        return _SCALARS[tp]
    if typing.get_origin(tp) is typing.Literal:
        # a closed set of strings (a role, a state): "literal:a|b", checked both ways
        choices = typing.get_args(tp)
        if not choices or not all(type(c) is str and c and "|" not in c for c in choices):
            raise TypeError(f"unsupported message field type {tp!r}: Literal of strings only")
        return "literal:" + "|".join(choices)
    if tp is torch.Tensor:
        return "tensor"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and len(args) == 1 and args[0] in _SCALARS:
        return "list:" + _SCALARS[args[0]]
    if origin is dict and args and args[0] is str:
        return "tensors" if args[1] is torch.Tensor else "dict"
    raise TypeError(f"unsupported message field type {tp!r}")  # our bug, not a peer's


def check_value(where: str, kind: str, value: Any) -> Any:
    """Validate one non-tensor field for encoding; returns the msgpack-ready value."""
    if kind == "int":
        if type(value) is not int:
            raise ValueError(f"{where} = {value!r}: expected an int")
        if not INT_MIN <= value <= INT_MAX:
            raise ValueError(f"{where} = {value!r}: outside the 64-bit range")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} = {value!r}: expected a float")
        return float(value)
    if kind in _EXACT:
        if type(value) is not _EXACT[kind]:
            raise ValueError(f"{where} = {value!r}: expected {kind}")
        return value
    if kind.startswith("literal:"):
        if type(value) is not str or value not in kind[8:].split("|"):
            raise ValueError(f"{where} = {value!r}: expected one of {kind[8:]}")
        return value
    if kind.startswith("list:"):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} = {value!r}: expected a list")
        inner = kind[5:]
        return [check_value(f"{where}[{i}]", inner, v) for i, v in enumerate(value)]
    assert kind == "dict", kind
    _check_plain(where, value, 0)
    return value


def _check_plain(where: str, value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, float, str, bytes)):
        return
    if isinstance(value, int):
        if not INT_MIN <= value <= INT_MAX:
            raise ValueError(f"{where} = {value!r}: outside the 64-bit range")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(f"{where}[{i}]", v, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not a str")
            _check_plain(f"{where}[{k!r}]", v, depth + 1)
    else:
        raise ValueError(f"{where} = {value!r}: {type(value).__name__} is not msgpack-able")


def decoded_ok(kind: str, value: Any) -> bool:
    return decoded_check(kind)(value)


def plain_ok(value: Any, depth: int = 0, ranged: bool = True) -> bool:
    """msgpack allows bytes map keys; JSONDict keys must be str, and nesting is bounded.

    Also the encoder's fast check (with ints bounded to 64 bits): anything it refuses goes
    through :func:`_check_plain`, which names the offending element. ``ranged=False`` leaves
    the ints' range out: see :func:`plain_types_ok`.
    """
    if type(value) is dict:
        for k in value:  # a loop, not all(<generator>): ~0.5 us less on every heartbeat
            if type(k) is not str:
                return False
        items: Any = value.values()
    elif type(value) is list:
        items = value
    else:
        return False
    if value and depth >= MAX_DEPTH:
        return False
    leaves = _LEAVES if ranged else _LEAVES_ANY_INT
    for v in items:
        tv = type(v)
        if tv in leaves:
            continue
        if tv is int:
            if not INT_MIN <= v <= INT_MAX:
                return False
        elif not ((tv is dict or tv is list) and plain_ok(v, depth + 1, ranged)):
            return False
    return True


_LEAVES = frozenset({str, float, bool, bytes, type(None)})
_LEAVES_ANY_INT = _LEAVES | {int}

def plain_types_ok(value: Any) -> bool:
    """:func:`plain_ok` less the int ranges, for where they hold anyway: on a decoded value
    (msgpack cannot carry an int outside them) and before msgspec's encoder, which raises
    OverflowError outside exactly ``INT_MIN..INT_MAX`` (the generated encoder then gives up,
    and the long way names the value)."""
    return plain_ok(value, 0, False)


def _int_ok(v: Any) -> bool:
    return type(v) is int and INT_MIN <= v <= INT_MAX


def _list_ok(inner: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: type(v) is list and all(map(inner, v))


_SCALAR_OK: dict[str, Callable[[Any], bool]] = {
    "int": _int_ok,
    "float": lambda v: type(v) is float,
    "str": lambda v: type(v) is str,
    "bool": lambda v: type(v) is bool,
    "bytes": lambda v: type(v) is bytes,
}
_ENCODE_OK: dict[str, Callable[[Any], bool]] = {
    **_SCALAR_OK, **{f"list:{k}": _list_ok(f) for k, f in _SCALAR_OK.items()},
    "dict": lambda v: type(v) is dict and plain_ok(v)}
"""Exact-type checks: True means the value travels as it is; False sends it through the
slower :func:`check_value`, which converts it (an int for a float) or raises naming it."""

_FLOAT_IN = lambda v: type(v) is float or type(v) is int  # noqa: E731 - msgpack may shorten 1.0
_DECODED_OK: dict[str, Callable[[Any], bool]] = {
    **_SCALAR_OK, "float": _FLOAT_IN, "int": lambda v: type(v) is int,
    **{f"list:{k}": _list_ok(f) for k, f in _SCALAR_OK.items()},
    "list:int": _list_ok(lambda v: type(v) is int), "list:float": _list_ok(_FLOAT_IN),
    "dict": lambda v: type(v) is dict and plain_ok(v)}


FLOATS_EXACT = _list_ok(lambda v: type(v) is float)
"""A list of floats as this codec writes it (an int in it is another writer's: the checked
decoder's long way makes it a float)."""


def _literal_ok(kind: str) -> Callable[[Any], bool]:
    choices = frozenset(kind[8:].split("|"))
    return lambda v: type(v) is str and v in choices


def encode_check(kind: str) -> Callable[[Any], bool]:
    return _literal_ok(kind) if kind.startswith("literal:") else _ENCODE_OK[kind]


def decoded_check(kind: str) -> Callable[[Any], bool]:
    return _literal_ok(kind) if kind.startswith("literal:") else _DECODED_OK[kind]


WIRE_TYPE = {"int": int, "float": float, "str": str, "bool": bool, "bytes": bytes, "list": list,
              "dict": dict, "literal": str}


def typed_kind(kind: str) -> Any:
    """The msgspec type of a non-tensor field's kind (what _DECODED_OK accepts, less the dict
    contents, which plain_ok checks after it)."""
    scalars: dict[str, Any] = {"int": int, "float": float, "str": str, "bool": bool,
                               "bytes": bytes, "dict": dict[str, Any]}
    if kind.startswith("literal:"):
        return Literal[tuple(kind[8:].split("|"))]
    if kind.startswith("list:"):
        return list[scalars[kind[5:]]]  # type: ignore[misc]
    return scalars[kind]
