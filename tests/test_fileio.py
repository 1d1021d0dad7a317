"""`reshard.storage.files.fileio`: direct (``O_DIRECT``) reads at any offset return exactly the file's bytes."""
from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.storage.files import fileio

SIZE = 3 * fileio.ALIGN * 7 + 123  # not a multiple of the alignment: reads may run into the end


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("fileio") / "data.bin"
    data = os.urandom(SIZE)
    path.write_bytes(data)
    return path, data


def _direct_fd(path: Path) -> int:
    fd = fileio.open_direct(path, os.O_RDONLY)
    if fd is None:
        pytest.skip("no direct I/O on this file system")
    return fd


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_direct_reads_equal_the_file_bytes(data_file, data):
    path, content = data_file
    pos = data.draw(st.integers(0, SIZE - 1))
    n = data.draw(st.integers(1, SIZE - pos))
    aligned_dst = data.draw(st.booleans())
    stage_blocks = data.draw(st.integers(2, 12))  # small stages: the read goes round by round
    fd = _direct_fd(path)
    try:
        stage = fileio.aligned_buffer(stage_blocks * fileio.ALIGN)
        view = fileio.aligned_buffer(n)[:n] if aligned_dst else memoryview(bytearray(n))
        crc = data.draw(st.sampled_from([None, 0, 0x1234ABCD]))  # with a CRC: taken as the bytes are copied
        got = fileio.read_direct(fd, view, pos, stage, crc)
        assert bytes(view) == content[pos:pos + n]
        assert got == (None if crc is None else zlib.crc32(content[pos:pos + n], crc))
    finally:
        os.close(fd)


def test_read_at_returns_the_crc_on_every_path(data_file, tmp_path):
    """`read_at` with a CRC: the direct read's (staged or straight) and the page cache's give zlib's value."""
    path, content = data_file
    files = fileio.FdCache()
    stage = fileio.ThreadBuffers()
    try:
        for pos, n in ((0, 4 * fileio.ALIGN), (5, 3 * fileio.ALIGN), (fileio.ALIGN + 7, 1000)):
            for direct in (True, False):
                view = fileio.aligned_buffer(n)[:n]
                got = fileio.read_at(files, path, view, pos, lambda k: stage.take("stage", k), direct=direct, crc=7)
                assert bytes(view) == content[pos:pos + n]
                assert got == zlib.crc32(content[pos:pos + n], 7)
    finally:
        files.close()


def test_large_aligned_buffers_are_whole_and_writable():
    """A buffer of `HUGE_FROM` or more (mapped in whole huge pages where the kernel has them) still
    has the length asked for, rounded to `ALIGN`, and is private zeroed memory."""
    n = fileio.HUGE_FROM * 2 + 5
    buf = fileio.aligned_buffer(n)
    assert len(buf) == -(-n // fileio.ALIGN) * fileio.ALIGN
    assert fileio._address(buf) % fileio.ALIGN == 0
    assert not any(buf[:4096]) and not any(buf[-4096:])
    buf[-1:] = b"x"
    assert bytes(buf[-1:]) == b"x"


def test_a_direct_read_past_the_end_is_a_short_read(data_file):
    path, _ = data_file
    fd = _direct_fd(path)
    try:
        with pytest.raises(fileio.ShortRead):
            fileio.read_direct(fd, memoryview(bytearray(100)), SIZE - 50, fileio.aligned_buffer(100 + 2 * fileio.ALIGN))
    finally:
        os.close(fd)


def test_aligned_buffers_are_page_aligned():
    for n in (1, fileio.ALIGN, 5 * fileio.ALIGN + 1):
        buf = fileio.aligned_buffer(n)
        assert len(buf) >= n and len(buf) % fileio.ALIGN == 0
        assert fileio._address(buf) % fileio.ALIGN == 0


def test_start_writeback_is_only_a_hint(tmp_path):
    """It never fails: not on a real file, not on a closed descriptor (the fsync reports errors)."""
    p = tmp_path / "f"
    p.write_bytes(b"x" * 10000)
    fd = os.open(p, os.O_RDWR)
    fileio.start_writeback(fd, 0, 10000)
    os.close(fd)
    fileio.start_writeback(fd, 0, 10000)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_placed_writes_put_exactly_their_bytes(tmp_path_factory, data):
    """Whole blocks go direct, edges through the page cache: the file ends up with exactly
    the bytes written, wherever the range starts and ends, and nothing around it changes."""
    path = tmp_path_factory.mktemp("placed") / "f.bin"
    before = os.urandom(6 * fileio.ALIGN)
    path.write_bytes(before)
    pos = data.draw(st.integers(0, 3 * fileio.ALIGN))
    n = data.draw(st.integers(1, 3 * fileio.ALIGN))
    payload = os.urandom(n)
    lead = pos % fileio.ALIGN
    out = fileio.aligned_buffer(lead + n)
    out[lead:lead + n] = payload
    fd = os.open(path, os.O_RDWR)
    dfd = fileio.open_direct(path, os.O_WRONLY)
    try:
        fileio.write_placed(fd, dfd, out, lead, pos, n)
    finally:
        os.close(fd)
        if dfd is not None:
            os.close(dfd)
    assert path.read_bytes() == before[:pos] + payload + before[pos + n:]
