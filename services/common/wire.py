"""Messages passed on as bytes: the records of a message's fields, as the wire format lays them.

The format is public and stable (https://protobuf.dev/programming-guides/encoding/): a message
is its fields' records end to end, in any order; a record of a message-typed field is its key
(the field number << 3 | 2) as a varint, the payload's length as a varint, then the payload. A
message whose only field is a repeated message (``GenerateBatchResponse.results``) is therefore
its elements' records joined: a service can take them apart and join them into another reply
without parsing them into messages and copying them (a step's samples are megabytes).
"""

from __future__ import annotations

LENGTH_DELIMITED = 2
"""The wire type of a message-typed (or bytes, or packed) field."""


def varint(value: int) -> bytes:
    """``value`` (>= 0) as a base-128 varint, low groups first."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def key(number: int) -> bytes:
    """The key of field ``number`` when length-delimited (a message, bytes, a packed array)."""
    return varint(number << 3 | LENGTH_DELIMITED)


def record(number: int, payload: bytes) -> bytes:
    """``payload`` (a message's bytes) as field ``number`` of an enclosing message."""
    return key(number) + varint(len(payload)) + payload


def records(data: bytes, number: int) -> list[memoryview]:
    """The records of ``data``, each whole (key and length included), when every one is field
    ``number`` length-delimited; ValueError otherwise, or when a record runs past the end."""
    key = number << 3 | LENGTH_DELIMITED
    view, found, at = memoryview(data), [], 0
    while at < len(view):
        start = at
        seen, at = _read_varint(view, at)
        if seen != key:
            raise ValueError(f"a record of key {seen} at byte {start}, not field {number}'s")
        length, at = _read_varint(view, at)
        at += length
        if at > len(view):
            raise ValueError(f"the record at byte {start} runs past the end ({at} > {len(view)})")
        found.append(view[start:at])
    return found


def _read_varint(view: memoryview, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(view) or shift > 63:
            raise ValueError(f"a malformed varint at byte {at}")
        byte = view[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7
