"""Protobuf serialization into one pre-sized buffer, each tensor's bytes written once, straight from its array.

``SerializeToString`` of a message full of tensors costs three copies of every tensor (array -> ``bytes`` -> the
message -> the serialized bytes), and upb cannot serialize a bytes field or sub-message of 2 GiB or more. Here the
message is built with every tensor's ``data`` replaced by a placeholder (its index among the ``Placed`` sources, as
:func:`framing.lift` writes them); protobuf serializes that small message, :func:`layout` walks it and recomputes
every enclosing length, and :func:`serialize` allocates the whole message once and converts each array into its
place. The bytes equal protobuf's ``SerializeToString`` of the same message with the tensors' bytes set (the tests
check every payload kind); only their size is not bounded by protobuf's 2 GiB.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import Message

from hetfed.v1 import tensor_pb2 as tpb
from hetfed.wire import framing

_TENSOR_DATA = tpb.Tensor.DESCRIPTOR.fields_by_name["data"].number
# Narrowing to bfloat16 goes through temporaries: this many elements at a time bounds them (16 MiB of float32).
_BLOCK = 1 << 22


@dataclass(frozen=True)
class Placed:
    """A tensor's bytes to write: ``array`` converted to the little-endian ``raw`` dtype (or rounded to
    bfloat16 bits, ``raw`` then ``<u2``), C order."""

    array: np.ndarray
    raw: np.dtype
    bfloat16: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes on the wire."""
        return int(self.array.size) * self.raw.itemsize

    def write(self, out: np.ndarray) -> None:
        """Convert the array into ``out`` (uint8, ``nbytes`` long): one pass over it, no whole-tensor copy."""
        with np.errstate(over="ignore"):  # narrowing may overflow to +-inf by design (IEEE rounding)
            if not self.bfloat16:
                np.copyto(out.view(self.raw).reshape(self.array.shape), self.array, casting="unsafe")
                return
            flat, bits = self.array.reshape(-1), out.view("<u2")
            for lo in range(0, flat.size, _BLOCK):
                bits[lo:lo + _BLOCK] = to_bfloat16_bits(flat[lo:lo + _BLOCK])


def to_bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round to nearest even) and return the 16-bit patterns."""
    bits = np.ascontiguousarray(array, dtype="<f4").view("<u4")
    rounding = ((bits >> 16) & 1) + 0x7FFF
    out = ((bits + rounding) >> 16).astype("<u2")
    nan = np.isnan(array)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def placeholder(index: int) -> bytes:
    """The stand-in for source ``index``'s bytes in the message to serialize."""
    return index.to_bytes(framing.INDEX_BYTES, "little")


# A piece of the serialized message: bytes to copy, or the index of a source to write there.
Piece = bytes | memoryview | int


def layout(small: bytes, root: framing.Descriptor, sizes: Sequence[int]) -> tuple[list[Piece], int]:
    """The pieces of the whole message and its size: ``small`` (``root``, serialized with placeholders) with
    each placeholder standing for a tensor's data of ``sizes[index]`` bytes. Raises ``ValueError`` when a
    placeholder is not one (a tensor's data set to something else)."""
    view = memoryview(small)
    plan = framing.lift_plan(root, tpb.Tensor.DESCRIPTOR)
    pieces: list[Piece] = []
    size = _walk(view, 0, view.nbytes, root.full_name, plan, sizes, pieces)
    return pieces, size


def _walk(view: memoryview, start: int, end: int, name: str, plan: dict[str, dict[int, str]],
          sizes: Sequence[int], out: list[Piece]) -> int:
    """Append the pieces of ``view[start:end]`` (a message of type ``name``) to ``out``; returns their size."""
    children = plan[name]
    data_field = _TENSOR_DATA if name == tpb.Tensor.DESCRIPTOR.full_name else 0
    size, kept = 0, start
    for number, wire_type, at, value, stop in framing.fields(view, start, end):
        if wire_type != framing.WIRE_LEN or (number != data_field and number not in children):
            continue
        out.append(view[kept:at])
        size += at - kept
        if number == data_field:
            if stop - value != framing.INDEX_BYTES:
                raise ValueError("a tensor's data is not a placeholder")
            index = int.from_bytes(view[value:stop], "little")
            head = framing.tag(number, framing.WIRE_LEN) + framing.write_varint(sizes[index])
            out.append(head)
            out.append(index)
            size += len(head) + sizes[index]
        else:
            inner: list[Piece] = []
            inner_size = _walk(view, value, stop, children[number], plan, sizes, inner)
            head = framing.tag(number, framing.WIRE_LEN) + framing.write_varint(inner_size)
            out.append(head)
            out.extend(inner)
            size += len(head) + inner_size
        kept = stop
    out.append(view[kept:end])
    return size + (end - kept)


def serialize(message: Message, sources: Sequence[Placed]) -> memoryview:
    """``message`` (a protobuf message whose tensors' data are ``placeholder`` s of ``sources``) serialized into
    one new buffer, each source converted into its place; a read-only view of the buffer."""
    small = message.SerializeToString()
    pieces, size = layout(small, message.DESCRIPTOR, [s.nbytes for s in sources])
    buffer = np.empty(size, np.uint8)
    pos = 0
    for piece in pieces:
        if isinstance(piece, int):
            n = sources[piece].nbytes
            sources[piece].write(buffer[pos:pos + n])
        else:
            n = len(piece)
            buffer[pos:pos + n] = np.frombuffer(piece, np.uint8)
        pos += n
    if pos != size:
        raise ValueError(f"wrote {pos} of the {size} bytes laid out")
    return buffer.data.toreadonly()
