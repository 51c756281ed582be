"""A step's scalars as one TensorBoard ``Summary``, made without a Python call per scalar.

``Summary(value=[Summary.Value(tag=t, simple_value=v), ...])`` builds one protobuf object per
scalar in Python: for the 200 module norms of a 400-tensor model, more time than the check that
measured them. Here the serialized summary of a list of tags is laid out once (each value's bytes:
its tag, then the field key of ``simple_value`` and four bytes for the float), and each write
copies that template, puts the numbers in as float32 in one numpy assignment and parses it back
(in C): the same message, byte for byte, as protobuf builds from the values.
"""

from __future__ import annotations

import numpy as np
from tensorboard.compat.proto.summary_pb2 import Summary

__all__ = ["scalar_summary"]

_KEEP = 16  # tag lists remembered (a sink writes a few: the report's, the update's, the clip's)
_LAYOUTS: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _layout(tags: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(the serialized summary with zeros for the numbers, the byte offsets of the numbers: 4 each)."""
    parts, offsets, at = [], [], 0
    for tag in tags:
        name = tag.encode("utf-8")
        value = b"\x0a" + _varint(len(name)) + name + b"\x15"  # Value.tag (1, bytes), Value.simple_value (2, float)
        head = b"\x0a" + _varint(len(value) + 4)  # Summary.value (1, message)
        parts.append(head + value + b"\x00\x00\x00\x00")
        at += len(head) + len(value)
        offsets.append(at)
        at += 4
    where = (np.asarray(offsets, dtype=np.int64)[:, None] + np.arange(4)).ravel()
    return np.frombuffer(b"".join(parts), dtype=np.uint8), where


def scalar_summary(metrics: dict[str, float]) -> Summary:
    """``Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in metrics.items()])``."""
    tags = tuple(metrics)
    made = _LAYOUTS.get(tags)
    if made is None:
        if len(_LAYOUTS) >= _KEEP:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        made = _LAYOUTS[tags] = _layout(tags)
    template, where = made
    with np.errstate(over="ignore"):  # (as protobuf: a number beyond float32 is inf)
        try:
            numbers = np.array(list(metrics.values()), dtype=np.float32)
        except (TypeError, ValueError, RuntimeError):  # (a value numpy does not take as it is: its float)
            numbers = np.array([float(v) for v in metrics.values()], dtype=np.float32)
    data = template.copy()
    data[where] = numbers.astype("<f4").view(np.uint8)
    return Summary.FromString(data.tobytes())
