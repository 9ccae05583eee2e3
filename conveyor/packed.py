"""Packed numeric arrays, the wire form of token ids, logprobs and loss masks.

On the wire a token array is one msgpack ``bin`` of little-endian int32 (token ids), float32
(logprobs) or uint8 (loss masks). In memory it is a typed ``memoryview`` (format "i", "f" or
"B"): decoding is zero-copy (the view points into the received record), ``len``/indexing/
``tolist()`` work, and ``torch.frombuffer`` / ``numpy.frombuffer`` take it without a copy.
Constructors accept any sequence of numbers and pack it.
"""

from __future__ import annotations

import array
import sys
from typing import Any

_BIG_ENDIAN = sys.byteorder == "big"
_ITEMSIZE = {"i": 4, "f": 4, "B": 1}


def _packed(value: Any, fmt: str, field_name: str) -> memoryview:
    if isinstance(value, memoryview) and value.format == fmt and value.ndim == 1:
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):  # wire form: raw little-endian bytes
        raw = value if isinstance(value, memoryview) else memoryview(value)
        if raw.format not in ("B", "b", "c"):
            raw = raw.cast("B")
        if len(raw) % _ITEMSIZE[fmt]:
            raise ValueError(f"{field_name}: {len(raw)} bytes is not a multiple of {_ITEMSIZE[fmt]}")
        if _BIG_ENDIAN and _ITEMSIZE[fmt] > 1:
            arr = array.array(fmt)
            arr.frombytes(raw)
            arr.byteswap()
            return memoryview(arr)
        return raw.cast(fmt)  # type: ignore[call-overload]  # fmt is one of the struct codes
    arr = array.array(fmt, value)
    if _BIG_ENDIAN and _ITEMSIZE[fmt] > 1:
        # Stored little-endian so that encode can send the buffer as is.
        raise NotImplementedError("big-endian hosts are not supported")
    return memoryview(arr)


def int32_array(values: Any) -> memoryview:
    """Token ids as a packed int32 view."""
    return _packed(values, "i", "int32_array")


def float32_array(values: Any) -> memoryview:
    """Logprobs as a packed float32 view."""
    return _packed(values, "f", "float32_array")


def uint8_array(values: Any) -> memoryview:
    """A loss mask as a packed uint8 view."""
    return _packed(values, "B", "uint8_array")
