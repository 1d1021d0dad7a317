"""`reshard.storage.checkpoints.archive`: the hand-framed torch.save archive is what torch writes and reads.

torch's own ``torch.save`` and ``torch.load(weights_only=True)`` are the judges: the
framing must give the same members at the same offsets as ``torch.save`` (only the
serialization id differs), every member's CRC-32 must be right, and torch must load the
tensor back bit for bit.
"""
from __future__ import annotations

import io
import subprocess
import sys
import zipfile
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.storage.checkpoints.archive import archive_bytes, crc32_combine, data_pkl, fits, framing

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    n = torch.Size(shape).numel()
    return raw[: n * dtype.itemsize].view(dtype).reshape(shape).clone()


def _members(blob: bytes) -> list[tuple[str, int, int]]:
    return [(i.filename, i.header_offset, i.file_size) for i in zipfile.ZipFile(io.BytesIO(blob)).infolist()]


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(1, 5), min_size=0, max_size=4), seed=st.integers(0, 99))
def test_framing_matches_torch_save_and_loads_bitwise(dtype, shape, seed):
    t = _tensor(dtype, tuple(shape), seed)
    ours = archive_bytes(t)
    buf = io.BytesIO()
    torch.save(t, buf)
    ref = buf.getvalue()
    assert len(ours) == len(ref)
    assert _members(ours) == _members(ref)
    zo, zr = zipfile.ZipFile(io.BytesIO(ours)), zipfile.ZipFile(io.BytesIO(ref))
    assert zo.testzip() is None  # every member's CRC-32 is right
    for name in zr.namelist():
        if not name.endswith("serialization_id"):
            assert zo.read(name) == zr.read(name), name
    back = torch.load(io.BytesIO(ours), weights_only=True)
    assert back.dtype == t.dtype and back.shape == t.shape and back.is_contiguous()
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_empty_tensor_loads():
    t = torch.zeros(0, 4)
    back = torch.load(io.BytesIO(archive_bytes(t)), weights_only=True)
    assert back.shape == (0, 4) and back.dtype == torch.float32


def test_head_and_length_do_not_depend_on_the_data():
    """What makes reservation possible: the item's length is known from dtype and shape alone."""
    a, b = _tensor(torch.float32, (3, 7), 1), _tensor(torch.float32, (3, 7), 2)
    f = framing(torch.float32, (3, 7))
    assert len(archive_bytes(a)) == len(archive_bytes(b)) == f.length
    assert archive_bytes(a)[: len(f.head)] == archive_bytes(b)[: len(f.head)] == f.head
    assert f.storage_offset % 64 == 0  # torch's 64-byte alignment of the storage record


def test_item_crc_is_the_crc_of_the_whole_item():
    t = _tensor(torch.bfloat16, (4, 9), 3)
    blob = archive_bytes(t)
    f = framing(t.dtype, tuple(t.shape))
    scrc = zlib.crc32(blob[f.storage_offset: f.storage_offset + f.storage_nbytes])
    assert f.item_crc(scrc) == zlib.crc32(blob)


@settings(max_examples=100, deadline=None)
@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
def test_crc32_combine(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_data_pkl_is_the_one_torch_writes():
    t = torch.arange(24, dtype=torch.int32).reshape(2, 3, 4)
    buf = io.BytesIO()
    torch.save(t, buf)
    assert data_pkl(t.dtype, tuple(t.shape)) == zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("archive/data.pkl")


def test_data_pkl_of_every_writable_dtype_is_torchs_without_importing_torch():
    """The pickle is written with stand-in globals (no torch import on the splice path): for every dtype
    reshard writes, and shapes of every width of integer opcode, it is the one torch.save writes."""
    from reshard.storage.checkpoints.archive import _LEGACY, writable

    legacy = {str(k).removeprefix("torch."): v for k, v in torch.storage._dtype_to_storage_type_map().items()
              if writable(k)}
    assert legacy == _LEGACY
    dtypes = [d for d in vars(torch).values() if isinstance(d, torch.dtype) and writable(d)]
    assert len(set(dtypes)) >= 20
    for d in set(dtypes):
        for shape in [(2, 3, 4), (5,), (), (300, 7), (2, 70000), (1, 1, 1, 1)]:  # 1-, 2- and 4-byte ints
            t = torch.empty(shape, dtype=d)
            buf = io.BytesIO()
            torch.save(t, buf)
            assert data_pkl(d, shape) == zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("archive/data.pkl"), (d, shape)
    code = ("import sys; from reshard.storage.checkpoints.archive import framing; from reshard.model.dtypes import "
            "dtype_named; framing(dtype_named('float32'), (3, 4)); framing(dtype_named('uint16'), (5,)); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_storages_of_4_gib_are_refused():
    assert fits(1 << 30)
    assert not fits(1 << 32)
    with pytest.raises(ValueError, match="zip64"):
        framing(torch.uint8, (1 << 32,))
