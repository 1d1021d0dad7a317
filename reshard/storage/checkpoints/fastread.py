"""Zero-copy reads of DCP tensor items, without ``torch.load``.

A DCP tensor item is a ``torch.save`` zip archive (every member STORED, uncompressed)
at ``[offset, offset + length)`` of a data file. Its members, all under one top-level
folder (``archive/`` when saved to a stream, as DCP does)::

    data.pkl                 a small pickle: _rebuild_tensor_v2(persistent storage, offset, size, stride, ...)
                             (v3 over an untyped storage, dtype last, for float8, uint16-64, bits, complex32)
    byteorder                b"little" / b"big" (absent in very old saves)
    data/0                   the storage bytes
    version, .data/...       format bookkeeping

`read_tensor_item` parses the zip central directory inside the byte range (the
standard library's `zipfile` on a bounded, read-only window of the file), unpickles
``data.pkl`` with **torch's own weights-only unpickler** (``torch._weights_only_unpickler``,
the same restricted unpickler ``torch.load(weights_only=True)`` uses: only allow-listed
globals such as ``torch._utils._rebuild_tensor_v2``, storage classes, ``OrderedDict`` and
dtypes; nothing else is imported or called), with a ``persistent_load`` that hands it a
*meta* storage (no memory) so the pickle yields the tensor's dtype, shape, stride and
storage offset. Only then is one real buffer allocated and filled with ``os.preadv``
straight from the file (one copy: kernel -> tensor memory, no intermediate ``bytes``).

The result is bitwise the tensor ``torch.load(io.BytesIO(blob), weights_only=True)``
returns (same dtype, shape, stride, storage offset and storage bytes). Anything unusual
returns ``None`` so the caller falls back to ``torch.load``: compressed or encrypted
members, a pickle that is not exactly one plain tensor over exactly one storage, a
big-endian ``byteorder`` on this little-endian machine, a storage size that does not
match its member, a view out of the storage's bounds, a dtype or shape other than
expected. A pickle that references code outside the allow-list is *refused* by the
unpickler (``None`` here; the fallback ``torch.load(weights_only=True)`` then raises its
usual error), and is never executed.

`storage_byte_range` gives, for a C-contiguous item, where its element bytes lie in the
data file, so a writer can splice bytes (e.g. a dim-0 row range via `dim0_byte_range`)
with `copy_byte_range` (``os.copy_file_range``/``sendfile``, no user-space copy) without
decoding tensors.

**CRC-32.** Every read is checked against the CRC-32 the item's writer recorded in the
zip central directory, on the bytes as they are in memory anyway (no second read):
`read_tensor_item` checks the storage it read (``check_crc``, on by default; `_parse`
checks ``data.pkl`` and ``byteorder``), and `check_item_crcs` checks every member of an
item held whole in memory (`reshard.storage.checkpoints.dcp.load_item`, `inspect --deep`), slicing a
memoryview (no copies). A record of 0 is what torch writes when told not to compute CRCs:
such a member has no record and counts as *unrecorded*, never as failed. A contradiction
is `reshard.storage.checkpoints.crcledger.CorruptItem` (exit 2), naming the file and the key.
`MemberCrcs` does the same for an item that streams past in pieces, in order.
"""
from __future__ import annotations

import io
import math
import os
import struct
import sys
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO

from functools import lru_cache
from typing import TYPE_CHECKING

from reshard.errors import BadInput
from reshard import safefs
from reshard.model.dtypes import DType, from_torch
from reshard.storage.checkpoints.crcledger import CorruptItem
from reshard.storage.files.fileio import ShortRead, read_exact, crc32
from reshard.storage.pickles.plain_items import NotPlain, tensor_layout

__all__ = ["CrcStatus", "ItemLayout", "Member", "MemberCrcs", "check_file_crcs", "check_item_crcs", "item_members",
           "item_members_at", "read_tensor_item",
           "storage_byte_range", "dim0_byte_range", "copy_byte_range", "item_layout"]

if TYPE_CHECKING:
    import torch

MAX_PICKLE_BYTES = 1 << 20      # a plain tensor's data.pkl is ~300 bytes
MAX_MEMBERS = 64                # torch.save of one tensor writes ~6 members
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes
_LOCAL_MAGIC = b"PK\x03\x04"


class _Unusual(Exception):
    """Internal: the item is not the simple layout this module handles (caller falls back)."""


class _Seekable(io.RawIOBase):
    """A read-only, seekable file of ``_len`` bytes; subclasses say where the bytes come from (``readinto``)."""

    _len: int
    _pos: int

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            new = pos
        elif whence == 1:
            new = self._pos + pos
        elif whence == 2:
            new = self._len + pos
        else:
            raise ValueError(f"bad whence {whence}")
        if new < 0:
            raise OSError("seek before the start of the item")
        self._pos = new
        return new


class _Window(_Seekable):
    """Read-only view of ``[offset, offset + length)`` of an open file descriptor (positional reads)."""

    def __init__(self, fd: int, offset: int, length: int):
        self._fd, self._base, self._len, self._pos = fd, offset, length, 0

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = max(0, min(len(mv), self._len - self._pos))
        if n == 0:
            return 0
        got = os.preadv(self._fd, [mv[:n]], self._base + self._pos)
        self._pos += got
        return got

    def pread(self, pos: int, n: int) -> bytes:
        if pos < 0 or pos + n > self._len:
            raise _Unusual("read outside the item")
        data = os.pread(self._fd, n, self._base + pos)
        if len(data) != n:
            raise _Unusual("short read")
        return data


@dataclass(frozen=True)
class ItemLayout:
    """What ``data.pkl`` says about one tensor item, and where its storage bytes are."""

    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int          # in elements
    storage_nbytes: int
    storage_file_offset: int     # absolute offset of the storage's first byte in the data file
    storage_crc: int

    @property
    def contiguous(self) -> bool:
        return self.stride == _contiguous_strides(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


@lru_cache(maxsize=1)
def _meta_unpickler() -> type:
    """The unpickler class, made on first use: it subclasses torch's, and the CRC checks of this
    module (`check_item_crcs`, used on the metadata path) must not import torch."""
    import torch
    from torch import _weights_only_unpickler

    class MetaUnpickler(_weights_only_unpickler.Unpickler):
        """torch's weights-only unpickler; storages become meta storages (shape only, no bytes)."""

        def __init__(self, data: bytes):
            super().__init__(io.BytesIO(data), encoding="ASCII")
            self.storages: list[tuple[str, torch.dtype, int]] = []  # (key, dtype, nbytes)

        persistent_load = _meta_persistent_load

    return MetaUnpickler


def _meta_persistent_load(self: Any, pid: Any) -> Any:
    """A storage becomes a meta storage of its size: the pickle gives dtype, shape and strides, no bytes."""
    import torch

    if type(pid) is not tuple or len(pid) != 5:
        raise _Unusual("unexpected persistent id")
    typename, storage_type, key, location, numel = pid
    typename = torch.serialization._maybe_decode_ascii(typename)
    if typename != "storage" or not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
        raise _Unusual("unexpected persistent id")
    if self.storages:
        raise _Unusual("more than one storage")
    if storage_type is torch.UntypedStorage:  # _rebuild_tensor_v3 (float8, uint16, ...): numel counts bytes
        dtype = torch.uint8
    else:
        dtype = getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise _Unusual("unknown storage type")
    nbytes = numel * dtype.itemsize
    self.storages.append((key, dtype, nbytes))
    return torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(nbytes, device="meta"), dtype=dtype,
                                      _internal=True)


def _parse(fd: int, offset: int, length: int) -> ItemLayout:
    """Central directory + data.pkl of the item at ``[offset, offset + length)``; raises _Unusual."""
    win = _Window(fd, offset, length)
    try:
        zf = zipfile.ZipFile(win, "r")  # type: ignore[arg-type]
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise _Unusual(f"not a zip: {exc}") from None
    infos = zf.infolist()
    if not infos or len(infos) > MAX_MEMBERS:
        raise _Unusual("unexpected member count")
    prefix = infos[0].filename.split("/", 1)[0] + "/"
    members: dict[str, zipfile.ZipInfo] = {}
    for zi in infos:
        if not zi.filename.startswith(prefix) or zi.filename in members:
            raise _Unusual("members not under one folder")
        if zi.compress_type != zipfile.ZIP_STORED or zi.flag_bits & 0x1 or zi.file_size != zi.compress_size:
            raise _Unusual("compressed or encrypted member")
        members[zi.filename[len(prefix):]] = zi

    def member_data_offset(zi: zipfile.ZipInfo) -> int:
        name = zi.filename.encode("utf-8")
        if zi.header_offset + _LOCAL_HEADER.size + len(name) > length:
            raise _Unusual("read outside the item")
        raw = win.pread(zi.header_offset, _LOCAL_HEADER.size + len(name))  # the header and the name at once
        magic, _ver, flags, method, *_rest, name_len, extra_len = _LOCAL_HEADER.unpack(raw[:_LOCAL_HEADER.size])
        if magic != _LOCAL_MAGIC or method != zipfile.ZIP_STORED or flags & 0x1:
            raise _Unusual("bad local header")
        if name_len != len(name) or raw[_LOCAL_HEADER.size:] != name:
            raise _Unusual("local header name differs from the central directory")
        start = zi.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if start + zi.file_size > length:
            raise _Unusual("member extends past the item")
        return start

    def member_bytes(name: str, limit: int) -> bytes | None:
        zi = members.get(name)
        if zi is None:
            return None
        if zi.file_size > limit:
            raise _Unusual(f"{name} too large")
        data = win.pread(member_data_offset(zi), zi.file_size)
        if zi.CRC and crc32(data) != zi.CRC:  # 0: written without CRCs (no record)
            raise _Unusual(f"{name} fails its CRC")
        return data

    byteorder = member_bytes("byteorder", 16)
    if byteorder is None:
        if sys.byteorder != "little":
            raise _Unusual("no byteorder mark on a big-endian machine")
    elif byteorder != sys.byteorder.encode():
        raise _Unusual(f"byteorder {byteorder!r}")
    pkl = member_bytes("data.pkl", MAX_PICKLE_BYTES)
    if pkl is None:
        raise _Unusual("no data.pkl")
    try:  # without torch: the allow-listed stand-ins of reshard.storage.pickles.plain_items
        plain = tensor_layout(pkl)
        key, dtype, nbytes = plain.storage_key, plain.dtype, plain.storage_nbytes
        shape, stride, storage_offset = plain.shape, plain.stride, plain.storage_offset
    except NotPlain:  # anything else: torch's own weights-only unpickler decides
        key, dtype, nbytes, shape, stride, storage_offset = _torch_layout(pkl)
    zi = members.get(f"data/{key}")
    if zi is None or zi.file_size != nbytes:
        raise _Unusual("storage member missing or of the wrong size")
    if any(m.startswith("data/") and m != f"data/{key}" for m in members):
        raise _Unusual("extra storage members")
    return ItemLayout(dtype=dtype, shape=shape, stride=stride, storage_offset=storage_offset, storage_nbytes=nbytes,
                      storage_file_offset=offset + member_data_offset(zi), storage_crc=zi.CRC)


def _torch_layout(pkl: bytes) -> tuple[str, DType, int, tuple[int, ...], tuple[int, ...], int]:
    """(storage key, dtype, storage bytes, shape, stride, storage offset) of ``data.pkl`` by torch's
    weights-only unpickler over meta storages; `_Unusual` unless it is one plain tensor over one storage."""
    import torch

    up = _meta_unpickler()(pkl)
    try:
        obj = up.load()
    except _Unusual:
        raise
    except Exception as exc:  # UnpicklingError for a refused global, or any malformed pickle
        raise _Unusual(f"data.pkl refused: {type(exc).__name__}: {str(exc)[:200]}") from None
    if type(obj) is not torch.Tensor or len(up.storages) != 1 or obj.requires_grad:
        raise _Unusual("not exactly one plain tensor over one storage")
    key, dtype, nbytes = up.storages[0]
    # an untyped storage (uint8 here) carries a tensor of any dtype: its elements are whole bytes of it
    if (obj.dtype != dtype and dtype != torch.uint8) or obj.device.type != "meta":
        raise _Unusual("tensor and storage disagree")
    return key, from_torch(obj.dtype), nbytes, tuple(obj.shape), tuple(obj.stride()), int(obj.storage_offset())


def _open(path: str | os.PathLike) -> int:
    return safefs.open_read(path)  # a regular file inside its checkpoint directory


def item_layout(path: str | os.PathLike, offset: int, length: int, fd: int | None = None) -> ItemLayout | None:
    """The layout of the tensor item at ``[offset, offset + length)`` of ``path``, or None if unusual.

    ``fd``: ``path`` already open for reading (through `reshard.safefs`, as a caller's
    `reshard.storage.files.fileio.FdCache` opens it), so a caller locating many items of one
    file opens it once: opening checks the path and costs about 75 us, a third of locating an item."""
    if fd is not None:
        try:
            return _parse(fd, offset, length)
        except _Unusual:
            return None
    fd = _open(path)
    try:
        return _parse(fd, offset, length)
    except _Unusual:
        return None
    finally:
        os.close(fd)


def _read_exact(fd: int, buf: memoryview, pos: int) -> None:
    try:
        read_exact(fd, buf, pos)
    except ShortRead:
        raise _Unusual("short read of the storage") from None


def read_tensor_item(path: str | os.PathLike, offset: int, length: int, *, expected_dtype: Any = None,
                     expected_shape: tuple[int, ...] | None = None, check_crc: bool = True,
                     key: str | None = None) -> "torch.Tensor | None":
    """The tensor of the DCP item at ``[offset, offset + length)`` of ``path``, or None (use torch.load).

    Bitwise what ``torch.load(weights_only=True)`` of the same bytes returns (dtype, shape,
    stride, storage offset, storage bytes); the storage is read straight into the tensor's
    memory. ``None`` for anything this fast path does not handle (see the module docstring);
    never executes code from the file. OSError (missing file, I/O error) propagates.

    ``check_crc`` (default): the storage read must have the CRC-32 its writer recorded,
    else `CorruptItem` naming ``key`` (the buffer is in memory anyway: about 4 GB/s).
    """
    import torch

    fd = _open(path)
    try:
        lay = _parse(fd, offset, length)
        if expected_dtype is not None and lay.dtype != from_torch(expected_dtype):  # a DType or a torch.dtype
            return None
        if expected_shape is not None and lay.shape != tuple(expected_shape):
            return None
        buf = torch.empty(lay.storage_nbytes, dtype=torch.uint8)
        if lay.storage_nbytes:
            _read_exact(fd, _byte_view(buf), lay.storage_file_offset)
            if check_crc and lay.storage_crc:
                got = crc32(_byte_view(buf))
                if got != lay.storage_crc:
                    raise CorruptItem(key, path, lay.storage_crc, got)
        out = torch.empty((0,), dtype=lay.dtype.torch)
        out.set_(buf.untyped_storage(), lay.storage_offset, lay.shape, lay.stride)
        return out
    except _Unusual:
        return None
    except RuntimeError:  # set_ out of the storage's bounds
        return None
    finally:
        os.close(fd)


# ------------------------------------------------------------------------ CRC-32 of whole items
@dataclass(frozen=True)
class Member:
    """One member of an item's zip archive: where its bytes lie within the item, and its record."""

    name: str       # without the archive's top folder (``data.pkl``, ``data/0``, ...)
    start: int      # offset of its first data byte within the item
    size: int
    crc: int        # the recorded CRC-32 (0: none recorded)
    stored: bool    # STORED and not encrypted: the CRC-32 is over the bytes as they lie


@dataclass(frozen=True)
class CrcStatus:
    """What a CRC check of one item found (a contradiction raises instead)."""

    checked: int = 0      # members whose bytes matched their record
    unrecorded: int = 0   # members with data but a record of 0 (written without CRCs)
    unchecked: int = 0    # members whose record is over other bytes (compressed, encrypted)
    archive: bool = True  # False: not a zip archive at all (nothing recorded to check)

    @property
    def status(self) -> str:
        """``"checked"`` (every member with data matched), ``"unrecorded"`` or ``"unchecked"``."""
        if not self.archive or self.unchecked:
            return "unchecked"
        return "unrecorded" if self.unrecorded else "checked"


class _MemoryWindow(_Seekable):
    """A read-only, seekable file over a buffer (no copy of the buffer; reads copy what they return)."""

    def __init__(self, data: Any):
        self._mv = memoryview(data).cast("B")
        self._len, self._pos = len(self._mv), 0

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._mv) - self._pos))
        out[:n] = self._mv[self._pos:self._pos + n]
        self._pos += n
        return n


def _members(raw: io.RawIOBase, length: int, pread: Any) -> list[Member] | None:
    """The members of the zip archive read through ``raw`` (``pread(pos, n)``: bytes of it)."""
    try:
        zf = zipfile.ZipFile(raw, "r")  # type: ignore[arg-type]
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, KeyError):
        return None
    out = []
    for zi in infos:
        try:
            hdr = _LOCAL_HEADER.unpack(pread(zi.header_offset, _LOCAL_HEADER.size))
        except (_Unusual, struct.error, ValueError):
            return None
        magic, _ver, flags, method, *_rest, name_len, extra_len = hdr
        start = zi.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if magic != _LOCAL_MAGIC or start + zi.compress_size > length:
            return None
        name = zi.filename.split("/", 1)[1] if "/" in zi.filename else zi.filename
        stored = zi.compress_type == zipfile.ZIP_STORED and not zi.flag_bits & 0x1 and zi.file_size == zi.compress_size
        out.append(Member(name, start, zi.compress_size, zi.CRC, stored))
    return out


def item_members(data: Any) -> list[Member] | None:
    """The members of the item archive in ``data`` (any bytes-like object), or None when it
    is not a zip archive (or its records point outside it)."""
    mv = memoryview(data).cast("B")

    def pread(pos: int, n: int) -> bytes:
        if pos < 0 or pos + n > len(mv):
            raise _Unusual("read outside the item")
        return bytes(mv[pos:pos + n])

    return _members(_MemoryWindow(mv), len(mv), pread)


def item_members_at(path: str | os.PathLike, offset: int, length: int, *, root: Any = None) -> list[Member] | None:
    """`item_members` of the item at ``[offset, offset + length)`` of ``path`` (reads its zip records only)."""
    fd = safefs.open_read(path, root=root) if root is not None else _open(path)
    try:
        win = _Window(fd, offset, length)
        return _members(win, length, win.pread)
    finally:
        os.close(fd)


def _tally(members: list[Member], crc_of: Any, *, key: str | None, where: Any, label: Any = None) -> CrcStatus:
    checked = unrecorded = unchecked = 0
    for m in members:
        if not m.size:
            continue
        if not m.stored:
            unchecked += 1
            continue
        if not m.crc:
            unrecorded += 1
            continue
        got = crc_of(m)
        if got != m.crc:
            raise CorruptItem(key, where, m.crc, got, member=(label or _member_label)(m.name))
        checked += 1
    return CrcStatus(checked, unrecorded, unchecked)


def _member_label(name: str) -> str:
    return "storage" if name.startswith("data/") else name


def check_item_crcs(data: Any, *, key: str | None, where: Any) -> CrcStatus:
    """Check every member of the item held whole in ``data`` against its recorded CRC-32.

    ``data`` is the item's bytes as ``torch.load`` will read them (after storage
    transforms); memoryview slices, no copies. `CorruptItem` (exit 2) names ``key`` and
    ``where`` (the data file) on the first contradiction; members without a record are
    counted, not failed. Bytes that are not a zip archive have nothing to check
    (``archive=False``): ``torch.load`` decides what they are.
    """
    mv = memoryview(data).cast("B")
    members = item_members(mv)
    if members is None:
        return CrcStatus(archive=False)
    return _tally(members, lambda m: crc32(mv[m.start:m.start + m.size]), key=key, where=where)


class MemberCrcs:
    """The CRC-32 check of an item whose bytes stream past in order, in pieces of any size.

    ``update(pos, view)`` with ``view`` the item's bytes from ``pos`` (pieces in increasing,
    contiguous order); ``finish()`` checks every member against its record (`CorruptItem`)
    and returns the `CrcStatus`. Each byte is checksummed once, as it passes.
    """

    def __init__(self, members: list[Member], *, key: str | None, where: Any, label: Any = None):
        self.members, self.key, self.where = sorted(members, key=lambda m: m.start), key, where
        self.label = label
        self._crc = [0] * len(self.members)
        self._next = 0

    def update(self, pos: int, view: Any) -> None:
        mv = memoryview(view).cast("B")
        if pos != self._next:
            raise ValueError(f"item bytes fed out of order (at {pos}, expected {self._next})")
        end = pos + len(mv)
        for i, m in enumerate(self.members):
            lo, hi = max(pos, m.start), min(end, m.start + m.size)
            if lo < hi:
                self._crc[i] = crc32(mv[lo - pos:hi - pos], self._crc[i])
        self._next = end

    def finish(self) -> CrcStatus:
        got = {id(m): c for m, c in zip(self.members, self._crc)}
        last = max((m.start + m.size for m in self.members), default=0)
        if self._next < last:
            raise ValueError(f"item bytes fed up to {self._next}, the members end at {last}")
        return _tally(self.members, lambda m: got[id(m)], key=self.key, where=self.where, label=self.label)


FILE_SLAB = 8 << 20  # bytes per read of `check_file_crcs`


def check_file_crcs(fd: int, *, where: Any) -> CrcStatus:
    """Check every member of the ``torch.save`` zip archive open as ``fd`` (a whole file, such
    as an imported ``pytorch_model.bin``) against its recorded CRC-32, in one sequential pass
    of `FILE_SLAB` reads (the bytes then sit in the page cache for the loader that maps the
    file). `CorruptItem` names the file and the member; a legacy (non-zip) file has no
    records (``archive=False``)."""
    size = os.fstat(fd).st_size
    win = _Window(fd, 0, size)
    members = _members(win, size, win.pread)
    if members is None:
        return CrcStatus(archive=False)
    stream = MemberCrcs(members, key=None, where=where, label=str)
    end = max((m.start + m.size for m in members), default=0)
    buf = bytearray(min(FILE_SLAB, max(end, 1)))
    pos = 0
    while pos < end:
        view = memoryview(buf)[:min(len(buf), end - pos)]
        try:
            read_exact(fd, view, pos)
        except ShortRead:
            raise BadInput(f"the file ends before byte {end} while its CRC-32s are checked (truncated while read?)",
                           where=str(where)) from None
        stream.update(pos, view)
        pos += len(view)
    return stream.finish()


def _byte_view(t: "torch.Tensor") -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor's bytes (no numpy needed)."""
    import ctypes

    n = t.numel()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(bytearray())


def storage_byte_range(path: str | os.PathLike, offset: int, length: int) -> tuple[int, int, DType, tuple[int, ...]] | None:
    """``(file_offset, nbytes, dtype, shape)`` of a C-contiguous tensor item's element bytes, or None.

    ``[file_offset, file_offset + nbytes)`` of ``path`` are exactly the row-major bytes of
    the tensor (the storage offset is applied). None when the item is unusual or not
    C-contiguous (then decode it).
    """
    lay = item_layout(path, offset, length)
    if lay is None or not lay.contiguous:
        return None
    start = lay.storage_offset * lay.dtype.itemsize
    if start + lay.nbytes > lay.storage_nbytes:
        return None
    return lay.storage_file_offset + start, lay.nbytes, lay.dtype, lay.shape


def dim0_byte_range(file_offset: int, dtype: Any, shape: tuple[int, ...], start: int, rows: int) -> tuple[int, int]:
    """Within a C-contiguous item at ``file_offset``: ``(file_offset, nbytes)`` of rows ``[start, start + rows)`` of dim 0."""
    if not shape or start < 0 or rows < 0 or start + rows > shape[0]:
        raise ValueError(f"rows [{start}, {start + rows}) outside dim 0 of {list(shape)}")
    row = dtype.itemsize
    for s in shape[1:]:
        row *= s
    return file_offset + start * row, rows * row


def copy_byte_range(src: BinaryIO | int, src_offset: int, nbytes: int, dst: BinaryIO | int) -> int:
    """Append ``nbytes`` of ``src`` from ``src_offset`` to ``dst`` (at its current position), in-kernel.

    ``os.copy_file_range`` (Linux; reflink-capable on some file systems), else
    ``os.sendfile``, else a bounded read/write loop. A Python file object for ``dst`` is
    flushed first and its position advanced. Returns the bytes copied (== ``nbytes``).
    """
    sfd = src if isinstance(src, int) else src.fileno()
    if not isinstance(dst, int):
        dst.flush()
    dfd = dst if isinstance(dst, int) else dst.fileno()
    pos, left = src_offset, nbytes
    while left:
        n = 0
        try:
            if hasattr(os, "copy_file_range"):
                n = os.copy_file_range(sfd, dfd, left, pos)
            else:  # pragma: no cover - non-Linux
                n = os.sendfile(dfd, sfd, pos, left)
        except OSError:
            n = 0
        if n <= 0:  # unsupported, or cross-device on old kernels: plain copy
            chunk = os.pread(sfd, min(left, 8 << 20), pos)
            if not chunk:
                raise OSError(f"source ends {left} bytes early")
            n = os.write(dfd, chunk)
        pos += n
        left -= n
    if not isinstance(dst, int):
        dst.seek(0, os.SEEK_END)
    return nbytes

