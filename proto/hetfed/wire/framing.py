"""Protobuf's wire format read and written by hand where the generated code would copy a large bytes field.

Two places use it:

- the chunked messages (``PushUpdateRequest``, ``PullInstructionsResponse``): a chunk's ``data`` is framed
  straight from the sender's buffer into the one serialized message (one copy, where building ``Chunk`` and
  its parent message and serializing them made four), and read on arrival as a view of the received bytes
  (none, where parsing and reading the field made two);
- received updates and instructions (:func:`lift`): every tensor's ``data`` is left where it lies in the
  reassembled bytes, and protobuf parses the rest (none, where parsing the message and reading each tensor's
  field made two copies of every tensor).

Everything else about those messages still goes through the generated classes, and the tests check every
framed message byte for byte against protobuf's own serialization, and every lifted one against protobuf's
own parse.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeAlias

# protobuf's message Descriptor: the pure-Python class or upb's, which its type stubs tell apart.
Descriptor: TypeAlias = Any

WIRE_VARINT, WIRE_LEN = 0, 2


def read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it (``ValueError`` when truncated or overlong)."""
    value, shift, end = 0, 0, view.nbytes
    while True:
        if pos >= end or shift > 63:
            raise ValueError("a truncated or overlong varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def write_varint(value: int) -> bytes:
    """``value`` (non-negative) as a varint."""
    if value < 0:
        raise ValueError("write_varint takes non-negative integers")
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    """The key of field ``number`` with ``wire_type``."""
    return write_varint(number << 3 | wire_type)


def skip_field(view: memoryview, pos: int, key: int) -> int:
    """The position after the value of the field whose key ``key`` ended at ``pos``."""
    wire_type = key & 7
    if wire_type == 0:
        _, pos = read_varint(view, pos)
    elif wire_type == 1:
        pos += 8
    elif wire_type == 5:
        pos += 4
    elif wire_type == 2:
        length, pos = read_varint(view, pos)
        pos += length
    elif wire_type == 3:  # a (deprecated) group: its fields up to the matching end-group tag
        while True:
            inner, pos = read_varint(view, pos)
            if inner & 7 == 4:
                if inner >> 3 != key >> 3:
                    raise ValueError("a group closed by another field's end-group tag")
                break
            pos = skip_field(view, pos, inner)
    else:
        raise ValueError(f"wire type {wire_type} out of place")
    if pos > view.nbytes:
        raise ValueError("a field runs past the end of the message")
    return pos


def fields(view: memoryview, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int, int, int]]:
    """Each field of the message in ``view[start:end]``: (number, wire type, key offset, value offset, end).

    For a length-delimited field the value offset is after its length, so ``view[value:end]`` is its bytes.
    Raises ``ValueError`` on bytes that are not a well-formed message.
    """
    stop = view.nbytes if end is None else end
    pos = start
    while pos < stop:
        at = pos
        key, pos = read_varint(view, pos)
        if key >> 3 == 0:
            raise ValueError("field number 0")
        value = read_varint(view, pos)[1] if key & 7 == WIRE_LEN else pos
        pos = skip_field(view, pos, key)
        if pos > stop:
            raise ValueError("a field runs past the end of its message")
        yield key >> 3, key & 7, at, value, pos


# As deep as protobuf's own parser nests messages (upb's default decode depth).
MAX_DEPTH = 100
# A lifted field is replaced by its index among the lifted views, as this many little-endian bytes.
INDEX_BYTES = 4


def lift(view: memoryview, root: Descriptor, target: Descriptor, number: int) -> tuple[bytes, list[memoryview]]:
    """Lift field ``number`` (a bytes field) of every ``target`` message nested in ``view``'s ``root`` message.

    Returns the message with each such field's value replaced by its index among the lifted values
    (``INDEX_BYTES`` bytes, little-endian), and the lifted values as views of ``view``: protobuf parses the
    small message, and the reader looks each value up by its index (``lifted_value``). Only fields whose
    declared type leads to ``target`` are walked; every other byte is kept as it came, so the small message
    parses exactly as the whole one would, with the same values everywhere but in the lifted fields (a field
    repeated on the wire keeps protobuf's last-one-wins and its merging of repeated message fields). Raises
    ``ValueError`` on bytes that are not a well-formed message.
    """
    lifted: list[memoryview] = []
    # A function of the module, not a closure: a recursive closure is a reference cycle, which would keep
    # ``view`` (the whole received message) alive until the next garbage collection.
    small = _lift_walk(view, 0, view.nbytes, root.full_name, lift_plan(root, target), (target.full_name, number),
                       lifted, 0)
    return bytes(small), lifted


def lifted_value(placeholder: bytes, lifted: list[memoryview]) -> memoryview | bytes:
    """The value a :func:`lift` placeholder stands for (``b""`` where the field was absent)."""
    if not placeholder:
        return b""
    return lifted[int.from_bytes(placeholder, "little")]


_PLANS: dict[tuple[str, str], dict[str, dict[int, str]]] = {}


def lift_plan(root: Descriptor, target: Descriptor) -> dict[str, dict[int, str]]:
    """For each message type reachable from ``root``: its message fields whose type leads to ``target``."""
    cache_key = (root.full_name, target.full_name)
    if cache_key in _PLANS:
        return _PLANS[cache_key]
    types: dict[str, Descriptor] = {}
    stack = [root]
    while stack:
        d = stack.pop()
        if d.full_name not in types:
            types[d.full_name] = d
            stack.extend(f.message_type for f in d.fields if f.message_type is not None)
    leads = {target.full_name}
    changed = True
    while changed:  # a fixed point, so recursive message types are handled too
        changed = False
        for name, d in types.items():
            if name not in leads and any(f.message_type is not None and f.message_type.full_name in leads
                                         for f in d.fields):
                leads.add(name)
                changed = True
    plan = {name: {f.number: f.message_type.full_name for f in d.fields
                   if f.message_type is not None and f.message_type.full_name in leads}
            for name, d in types.items()}
    _PLANS[cache_key] = plan
    return plan


def _lift_walk(view: memoryview, start: int, end: int, name: str, plan: dict[str, dict[int, str]],
               lift_field: tuple[str, int], lifted: list[memoryview], depth: int) -> bytearray:
    """``view[start:end]``, a message of type ``name``, with its lifted fields replaced (see ``lift``)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"messages nested more than {MAX_DEPTH} deep")
    children = plan[name]
    number = lift_field[1] if name == lift_field[0] else 0  # 0: no field of this type is lifted
    out = bytearray()
    kept = start  # view[kept:at] is copied as it came, a stretch at a time
    for field, wire_type, at, value, stop in fields(view, start, end):
        if wire_type != WIRE_LEN:
            continue
        if field == number:
            out += view[kept:at]
            out += tag(field, WIRE_LEN) + _PLACEHOLDER_LENGTH + len(lifted).to_bytes(INDEX_BYTES, "little")
            lifted.append(view[value:stop])
        elif field in children:
            inner = _lift_walk(view, value, stop, children[field], plan, lift_field, lifted, depth + 1)
            out += view[kept:at]
            out += tag(field, WIRE_LEN) + write_varint(len(inner)) + inner
        else:
            continue
        kept = stop
    out += view[kept:end]
    return out


_PLACEHOLDER_LENGTH = write_varint(INDEX_BYTES)
