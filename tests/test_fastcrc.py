"""The native CRC-32 of the data path (reshard/storage/files/fastcrc.c) gives zlib.crc32's values, bit for bit.

Every checksum a conversion records (the manifest's item CRC-32s, the zip records of the items it
writes) and every check against a source's records goes through `reshard.storage.files.fileio.crc32`,
which is this module where it was built: a value that differed from zlib's would change the
output's bytes or refuse a sound source. Cost: well under a second.
"""
from __future__ import annotations

import random
import zlib

import pytest

from reshard.storage.files import fileio

fastcrc = pytest.importorskip("reshard.storage.files.fastcrc", reason="the native CRC was not built (no C compiler)")


def test_every_short_length_and_start_value():
    rng = random.Random(45)
    data = rng.randbytes(4096 + 64)
    for n in range(0, 700):
        for start in (0, 1, 7, 8):  # unaligned starts: the table path's prologue, the folding's unaligned loads
            view = memoryview(data)[start:start + n]
            value = rng.getrandbits(32)
            assert fastcrc.crc32(view) == zlib.crc32(view), (n, start)
            assert fastcrc.crc32(view, value) == zlib.crc32(view, value), (n, start)


@pytest.mark.parametrize("width", [0, 128, 256])
def test_every_path_this_cpu_has(width):
    """The table path, the 128-bit and the 256-bit folding (each where this CPU has it: a wider one
    falls back to the next), over the lengths where one hands over to the next."""
    rng = random.Random(width)
    for n in list(range(0, 300)) + [383, 384, 385, 511, 512, 4096, 65536 + 48, (1 << 20) + 13]:
        data, value = rng.randbytes(n), rng.getrandbits(32)
        assert fastcrc.crc32_width(data, value, width) == zlib.crc32(data, value), (width, n)


def test_large_buffers_and_chaining():
    rng = random.Random(7)
    for n in (4095, 4096, 65535, 65536, 65537, (1 << 20) + 13, 9 << 20):
        data = rng.randbytes(n)
        assert fastcrc.crc32(data) == zlib.crc32(data), n
        cut = n // 3  # a CRC carried from one piece to the next, as the copy's slabs do
        assert fastcrc.crc32(data[cut:], fastcrc.crc32(data[:cut])) == zlib.crc32(data), n


def test_special_patterns():
    for data in (b"\x00" * 100_000, b"\xff" * 100_000, bytes(range(256)) * 300):
        assert fastcrc.crc32(data) == zlib.crc32(data)
        assert fastcrc.crc32(data, 0xFFFFFFFF) == zlib.crc32(data, 0xFFFFFFFF)


def test_buffer_kinds_and_refusals():
    data = bytearray(random.Random(1).randbytes(5000))
    assert fastcrc.crc32(data) == zlib.crc32(data)
    assert fastcrc.crc32(memoryview(data).cast("B")) == zlib.crc32(data)
    with pytest.raises(TypeError):
        fastcrc.crc32("text")  # as zlib: bytes-like only


def test_fileio_uses_the_native_crc():
    assert fileio.crc32 is fastcrc.crc32
    assert fastcrc.accelerated() in (0, 128, 256)


def test_combine_is_zlibs():
    """crc32_combine (archive's, native where built): the CRC of A + B from the parts' CRCs, at any length
    (beyond 4 GiB too)."""
    from reshard.storage.checkpoints import archive

    rng = random.Random(11)
    for _ in range(2000):
        a, b = rng.randbytes(rng.randrange(0, 200)), rng.randbytes(rng.randrange(0, 200))
        assert fastcrc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        assert archive.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    zeros = bytes(1 << 20)
    assert fastcrc.combine(zlib.crc32(b"head"), zlib.crc32(zeros), len(zeros)) == zlib.crc32(b"head" + zeros)
    for n1, n2 in ((1 << 32) + 5, (1 << 40) + 3), ((1 << 31), 77):  # beyond 4 GiB: combining is associative
        c1, c2, c3 = rng.getrandbits(32), rng.getrandbits(32), rng.getrandbits(32)
        assert fastcrc.combine(fastcrc.combine(c1, c2, n1), c3, n2) == fastcrc.combine(c1, fastcrc.combine(c2, c3, n2),
                                                                                         n1 + n2)
    assert fastcrc.combine(5, 7, 0) == 5


@pytest.mark.parametrize("copy", ["native", "unfused"])
def test_copy_crc_copies_and_gives_zlibs_crc(copy):
    """copy_crc (the direct reads' stage copy and checksum in one pass) and the pure-Python fallback:
    the bytes copied exactly, the CRC zlib's, at every offset, length and start value, across the
    native routine's block size (16 KiB) and its 128-byte streaming steps."""
    fn = fastcrc.copy_crc if copy == "native" else fileio.copy_then_crc
    rng = random.Random(23)
    data = rng.randbytes((1 << 20) + 300)
    lengths = list(range(0, 300)) + [16383, 16384, 16385, 3 * 16384 + 77, 65535, 65536, 65537, (1 << 20) + 13]
    for n in lengths:
        src_at, dst_at = rng.randrange(0, 64), rng.randrange(0, 64)  # any alignment on either side
        value = rng.getrandbits(32) if n % 2 else 0
        dst = bytearray(n + 128)
        got = fn(memoryview(dst)[dst_at:dst_at + n], memoryview(data)[src_at:src_at + n], value)
        assert got == zlib.crc32(data[src_at:src_at + n], value), n
        assert dst[dst_at:dst_at + n] == data[src_at:src_at + n], n
        assert not any(dst[:dst_at]) and not any(dst[dst_at + n:]), n  # nothing written outside


def test_copy_crc_refusals():
    with pytest.raises(ValueError):
        fastcrc.copy_crc(bytearray(10), b"x" * 11)  # lengths differ
    buf = bytearray(100)
    with pytest.raises(ValueError):
        fastcrc.copy_crc(memoryview(buf)[10:60], memoryview(buf)[0:50])  # overlapping
    with pytest.raises(TypeError):
        fastcrc.copy_crc(b"read-only", b"read-only")  # the destination must be writable


def test_fileio_uses_the_native_copy_crc():
    assert fileio.copy_crc is fastcrc.copy_crc
