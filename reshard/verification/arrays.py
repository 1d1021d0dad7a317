"""Integer tensors compared bit for bit as numpy arrays, without torch.

Why: a conversion that changes the world size reseeds each rank's RNG state (three integer
tensors per rank: python's and numpy's mt19937 words as int64, torch's generator state as uint8)
and, having written them without torch (`reshard.model.tensor_values`), still verifies the
output against the source value for value. Decoding those few kilobytes through ``torch.load``
imported torch (1.7 s of CPU on a quiet 2-core machine, far more on a loaded one) in a
conversion that otherwise never touches a tensor. For integer dtypes (bool, int8..int64,
uint8..uint64) a bitwise comparison is an element comparison of the stored bytes read as
integers, and the values a difference quotes are those integers, what torch's ``.item()`` gives;
so `read_box_array` reads a box of such a tensor from a local DCP checkpoint straight from its
items' storage bytes, and `reshard.verification.checkpoints` compares and reports it as it
does the tensors it decodes. Every other dtype, a tolerance, a remote checkpoint, a transformed
or unusual item goes through torch as before (None here).

What is checked is what ``torch.load`` would check: each item is located by
`reshard.storage.checkpoints.fastread.item_layout` (the zip's central directory, its ``data.pkl``
and ``byteorder`` CRC-checked and unpickled by the allow-listing stand-ins, exactly one plain
tensor over one storage of the metadata's dtype and shape), the storage bytes read are checked
against the CRC-32 its writer recorded (`CorruptItem` otherwise, as the torch path raises).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from reshard import safefs
from reshard.model.checkpoint import checked_box
from reshard.model.dtypes import DType
from reshard.model.geometry import Box, whole
from reshard.model.tensor_values import ArrayTensor
from reshard.storage.checkpoints.crcledger import CorruptItem
from reshard.storage.checkpoints.fastread import item_layout
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.storage.files.fileio import ShortRead, crc32, read_exact

__all__ = ["numpy_dtype", "readable", "read_box_array", "read_value", "first_difference"]

_KINDS = {"int": "<i", "uint": "<u"}


def numpy_dtype(dtype: DType) -> np.dtype | None:
    """The numpy dtype whose elements are ``dtype``'s as integers (bool as its byte), or None."""
    if dtype.kind == "bool":
        return np.dtype("u1")
    prefix = _KINDS.get(dtype.kind)
    if prefix is None or dtype.itemsize not in (1, 2, 4, 8):
        return None
    return np.dtype(f"{prefix}{dtype.itemsize}")


def readable(ix: Any, key: str) -> bool:
    """Whether `read_box_array` may read ``key`` of ``ix``: an integer (or bool) tensor of a local DCP checkpoint."""
    if not isinstance(ix, CheckpointIndex) or getattr(ix, "remote", None) is not None:
        return False
    e = ix.entries.get(key)
    return e is not None and e.is_tensor and numpy_dtype(e.dtype) is not None


def read_box_array(ix: CheckpointIndex, key: str, box: Box) -> np.ndarray | None:
    """``box`` of tensor ``key`` as a numpy array of `numpy_dtype`, read from its items' storage bytes;
    None when an item needs torch to read (transformed, not C-contiguous, unusual): the caller then
    decodes the box through torch, which decides and raises as it always did."""
    e = checked_box(ix.entry(key), box, where=str(ix.root))
    npd = numpy_dtype(e.dtype)
    if npd is None:
        return None
    out = np.empty(box.sizes, dtype=npd)
    filled = 0
    fds: dict[str, int] = {}
    try:
        for c in e.chunks:
            inter = c.box.intersect(box) if e.shape else (c.box if not c.box.offsets else None)
            if inter is None:
                continue
            loc = c.location
            if loc is None or loc.transforms:
                return None
            fd = fds.get(loc.file)
            if fd is None:
                fd = fds[loc.file] = safefs.open_read(ix.root / loc.file, root=ix.root)
            lay = item_layout(ix.root / loc.file, loc.offset, loc.length, fd=fd)
            if (lay is None or not lay.contiguous or lay.dtype != e.dtype or lay.shape != tuple(c.box.sizes)
                    or lay.storage_offset != 0):
                return None
            raw = bytearray(lay.storage_nbytes)
            try:
                read_exact(fd, raw, lay.storage_file_offset)
            except ShortRead:
                return None  # the torch path says what is wrong with the item
            got = crc32(raw)
            if lay.storage_crc and got != lay.storage_crc:  # 0: written without CRCs (no record)
                raise CorruptItem(key, ix.root / loc.file, lay.storage_crc, got)
            chunk = np.frombuffer(raw, dtype=npd, count=c.box.numel).reshape(c.box.sizes)
            out[inter.relative_to(box).slices()] = chunk[inter.relative_to(c.box).slices()]
            filled += inter.numel
    finally:
        for fd in fds.values():
            os.close(fd)
    if filled != box.numel:
        return None  # the torch path names what is missing
    return out


def read_value(ix: Any, key: str) -> ArrayTensor | None:
    """Integer tensor ``key`` of ``ix`` whole, as an `ArrayTensor` (what a plan's reseeded value is, so
    `reshard.verification.objects.identical` compares the two by their bytes without torch); None when
    `readable` says no or an item needs torch to read."""
    if not readable(ix, key):
        return None
    e = ix.entries[key]
    a = read_box_array(ix, key, whole(tuple(e.shape or ())))
    return ArrayTensor(e.dtype, a) if a is not None else None


def first_difference(ta: np.ndarray, tb: np.ndarray, dtype: DType) -> tuple[int, int, Any, Any]:
    """``(count, flat index of the first, its value in A, in B)`` of the elements of two arrays of
    `numpy_dtype` that differ (count 0: none); a value as ``Tensor.item()`` gives it, a bool as
    False or True, or its byte in hex (``0x02``) when it is neither, as
    `reshard.verification.objects.element` reports it."""
    bad = (ta != tb).reshape(-1)
    n = int(np.count_nonzero(bad))
    if not n:
        return 0, -1, None, None
    flat = int(np.argmax(bad))

    def value(t: np.ndarray) -> Any:
        x = t.reshape(-1)[flat].item()
        if dtype.kind == "bool":
            return bool(x) if x <= 1 else f"0x{x:02x}"
        return x

    return n, flat, value(ta), value(tb)
