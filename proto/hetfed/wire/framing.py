"""Protobuf's wire format read and written by hand where the generated code would copy a large bytes field.

Only for the chunked messages (``PushUpdateRequest``, ``PullInstructionsResponse``): a chunk's ``data`` is
framed straight from the sender's buffer into the one serialized message (one copy, where building ``Chunk``
and its parent message and serializing them made four), and read on arrival as a view of the received bytes
(none, where parsing and reading the field made two). Everything else about those messages still goes
through the generated classes, and the tests check every framed message byte for byte against protobuf's own
serialization.
"""

from __future__ import annotations

from collections.abc import Iterator

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
