"""The ``torch.save`` archive of one tensor, framed around storage bytes the caller streams.

A DCP tensor item is what ``torch.save(tensor)`` writes: a zip file (every member STORED)
whose members are, in this order::

    archive/data.pkl                 pickle: torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())
                                     (v3, with the dtype last, for dtypes without a legacy storage class)
    archive/.format_version          b"1"
    archive/.storage_alignment       b"64"
    archive/byteorder                b"little"
    archive/data/0                   the storage bytes (row-major, the tensor's own)
    archive/version                  b"3\\n"
    archive/.data/serialization_id   40 digits
    central directory, zip64 end record and locator, end record

Every member's data starts at a multiple of 64 bytes (an ``FB`` extra field of ``Z``
padding), local headers carry no sizes (flag bit 3) and each member is followed by a data
descriptor with its CRC-32 and size, as PyTorch's own writer does. Why write it by hand:
a conversion then never needs the tensor as a tensor. `head` is everything before the
storage bytes and depends only on dtype and shape; `tail` is everything after and needs
only the storage's CRC-32. So a writer can put `head` in place, stream the storage from
the source files (``os.copy_file_range`` or a slab buffer) while computing its CRC, and
append `tail`; the item's length is known before a byte is written, so several workers can
fill one data file at precomputed offsets.

**Dtypes.** ``torch.save`` names the storage of a dtype that has a legacy typed-storage
class (float32 as ``torch.FloatStorage``, ...) and rebuilds it with ``_rebuild_tensor_v2``;
every newer dtype (float8 e4m3fn/e5m2 and their fnuz variants, float8_e8m0fnu,
float4_e2m1fn_x2, uint16/32/64, bits8/16 and the packed bits, complex32) has none, so torch
pickles ``_rebuild_tensor_v3(storage, 0, size, stride, False, OrderedDict(), dtype)`` over a
``torch.storage.UntypedStorage`` whose size is counted in bytes. Both are framed here
(`writable`); the storage bytes are the tensor's either way. What is left out cannot be an
item of plain storage bytes: quantized dtypes (their pickle carries the quantizer's scale
and zero point) and the sub-byte ``int1``..``int7``/``uint1``..``uint7`` (names without a
storage, which ``torch.save`` itself refuses). `unwritable_reason` says why, for the index
to refuse such a checkpoint by key and dtype before anything is planned.

The pickle is produced by the standard pickler (protocol 2, as torch) and is byte for byte
the one ``torch.save`` writes for a contiguous tensor (``tests/test_archive.py`` checks
it, and that ``torch.load(weights_only=True)`` returns the tensor); only the
serialization id differs (torch derives it from a C++ hash; here it is derived from the
storage CRC and size, so it is deterministic too). Members or offsets of 4 GiB and more
would need zip64 extra fields: `fits` says when this framing applies, and callers fall
back to ``torch.save`` otherwise.
"""
from __future__ import annotations

import io
import pickle
import struct
import sys
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

from typing import TYPE_CHECKING, Any

from reshard.model.dtypes import DType, from_torch, unstorable_reason

if TYPE_CHECKING:
    import torch

__all__ = ["Framing", "writable", "archive_bytes", "crc32_combine", "fits", "framing", "object_archive", "unwritable_reason"]

ALIGN = 64
_U32 = 0xFFFFFFFF
_PREFIX = "archive/"
_FLAGS = 0x0808                      # bit 3: data descriptor follows; bit 11: UTF-8 names
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<4sIII")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
_LOCATOR = struct.Struct("<4sIQI")
_EOCD = struct.Struct("<4sHHHHIIH")


class _Storage:
    """Stands for the tensor's storage in the pickle; `persistent_id` names it."""


class _Global:
    """A global the pickle names by module and name without importing it (``torch.FloatStorage``,
    ``torch._utils._rebuild_tensor_v2``, ``torch.uint16``): framing an item then needs no torch,
    whose import is two seconds of CPU a conversion that only splices bytes never needed."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __reduce_ex__(self, protocol: int) -> str:
        return self.name  # a string: the pickler saves it as a global, by `_NamingPickler.save_global`

    def __call__(self, *args: Any) -> Any:  # the pickler asks that a reduce function be callable
        raise TypeError(f"{self.module}.{self.name} is a name in a pickle, not callable here")


class _NamingPickler(pickle._Pickler):
    """The standard protocol-2 pickler (the pure-Python one, whose output is the C pickler's) that writes
    a `_Global` as the GLOBAL opcode torch's own objects give, and names the storage by persistent id."""

    def __init__(self, file: Any, storage: Any, pid: tuple):
        super().__init__(file, protocol=2)
        self._storage, self._pid = storage, pid

    def persistent_id(self, obj: Any) -> Any:
        return self._pid if obj is self._storage else None

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, _Global):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
            self.memoize(obj)
            return
        super().save_global(obj, name)


class _Rebuild:
    """``_rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())``, or v3 with ``dtype``
    appended when the storage is untyped (``dtype`` not None)."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...], stride: tuple[int, ...],
                 dtype: _Global | None = None):
        self.args: tuple = (storage, 0, shape, stride, False, OrderedDict())
        if dtype is not None:
            self.args += (dtype,)

    def __reduce__(self):
        fn = "_rebuild_tensor_v3" if len(self.args) == 7 else "_rebuild_tensor_v2"
        return (_Global("torch._utils", fn), self.args)


_LEGACY = {"float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage", "int64": "LongStorage",
           "int32": "IntStorage", "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
           "bool": "BoolStorage", "bfloat16": "BFloat16Storage", "complex128": "ComplexDoubleStorage",
           "complex64": "ComplexFloatStorage"}
"""dtype name -> the legacy typed-storage class ``torch.save`` names for it (``torch.storage.
_dtype_to_storage_type_map()`` less the quantized dtypes, which are not writable;
tests/test_archive.py compares the two); every other writable dtype is written over an untyped
storage (``_rebuild_tensor_v3``). A table, not torch's map: framing a tensor needs no torch."""


def writable(dtype: "DType | torch.dtype") -> bool:
    """Whether this module frames items of ``dtype``: every dtype whose storage bytes are the tensor's
    (`reshard.model.dtypes.unstorable_reason`: not quantized, not sub-byte)."""
    return unstorable_reason(from_torch(dtype)) is None


def unwritable_reason(dtype: "DType | torch.dtype") -> str | None:
    """Why reshard cannot write items of ``dtype`` (None: it can), in words for an error message."""
    return unstorable_reason(from_torch(dtype))


def _storage_pid(dtype: DType, numel: int) -> tuple:
    """The persistent id ``torch.save`` gives the storage of a ``dtype`` tensor of ``numel`` elements."""
    legacy = _LEGACY.get(dtype.name)
    if legacy is not None:
        return ("storage", _Global("torch", legacy), "0", "cpu", numel)
    if writable(dtype):
        return ("storage", _Global("torch.storage", "UntypedStorage"), "0", "cpu", numel * dtype.itemsize)
    raise ValueError(f"reshard cannot write {dtype} items: {unwritable_reason(dtype)}")


def data_pkl(dtype: "torch.dtype | DType", shape: tuple[int, ...]) -> bytes:
    """``archive/data.pkl`` for a C-contiguous tensor of ``dtype`` and ``shape`` with its own storage."""
    return _data_pkl(from_torch(dtype), tuple(int(s) for s in shape))


@lru_cache(maxsize=1024)
def _data_pkl(dtype: DType, shape: tuple[int, ...]) -> bytes:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    numel = acc
    storage = _Storage()
    buf = io.BytesIO()
    _NamingPickler(buf, storage, _storage_pid(dtype, numel)).dump(
        _Rebuild(storage, shape, tuple(reversed(stride)),
                 None if dtype.name in _LEGACY else _Global("torch", dtype.name)))
    return buf.getvalue()


def _padding(pos: int, name: bytes) -> bytes:
    start = pos + _LOCAL.size + len(name) + 4
    pad = (-start) % ALIGN
    return b"FB" + struct.pack("<H", pad) + b"Z" * pad


def _local(name: bytes, pos: int) -> bytes:
    extra = _padding(pos, name)
    return _LOCAL.pack(b"PK\x03\x04", 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra


def _descriptor(crc: int, size: int) -> bytes:
    return _DESCRIPTOR.pack(b"PK\x07\x08", crc, size, size)


_POLY = 0xEDB88320  # CRC-32 (reflected)


def _multmodp(a: int, b: int) -> int:
    """``a(x) * b(x) mod P(x)`` for reflected 32-bit polynomials (zlib's multmodp)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) mod P for k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@lru_cache(maxsize=4096)
def _shift_operator(nbytes: int) -> int:
    """``x^(8 * nbytes) mod P``: appending ``nbytes`` zero bytes, as one multiplication."""
    p, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's algorithm).

    Lets an item's checksum be composed from its parts (head, storage, tail) without
    reading the storage twice. Native where `reshard.storage.files.fastcrc` was built (under a
    microsecond; a copy combines several times per item); else the operator for a length is
    cached (chunks come in few sizes), so a combine is one 32-step multiplication in Python.
    """
    if _native_combine is not None:
        return _native_combine(crc1, crc2, len2)
    if len2 <= 0:
        return crc1
    return _multmodp(_shift_operator(len2), crc1) ^ crc2


try:
    from reshard.storage.files.fastcrc import combine as _native_combine
except ImportError:  # built without a C compiler
    _native_combine = None


@dataclass(frozen=True)
class Framing:
    """Where things go in one tensor item; ``head`` is final, the tail needs the storage CRC."""

    head: bytes
    storage_nbytes: int
    tail_nbytes: int
    members: tuple[tuple[str, int, int, int], ...]   # (name, local header offset, size, crc) in head

    @property
    def length(self) -> int:
        return len(self.head) + self.storage_nbytes + self.tail_nbytes

    @property
    def storage_offset(self) -> int:
        """Offset of the storage's first byte from the start of the item."""
        return len(self.head)

    def tail(self, storage_crc: int) -> bytes:
        """Everything after the storage bytes, given their CRC-32."""
        return _tail(self, storage_crc)

    def item_crc(self, storage_crc: int, tail: bytes | None = None) -> int:
        """CRC-32 of the whole item, composed from its parts."""
        t = tail if tail is not None else self.tail(storage_crc)
        c = crc32_combine(zlib.crc32(self.head), storage_crc, self.storage_nbytes)
        return crc32_combine(c, zlib.crc32(t), len(t))


_SMALL = [(".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", sys.byteorder.encode())]


def fits(nbytes: int) -> bool:
    """Whether an item with ``nbytes`` of storage can use this framing (no zip64 fields needed)."""
    return nbytes < _U32 - (1 << 20)


def framing(dtype: "torch.dtype | DType", shape: tuple[int, ...]) -> Framing:
    """The framing of a C-contiguous ``dtype`` tensor of ``shape``; see the module docstring.

    Cached by dtype and shape (a `Framing` is immutable): a checkpoint's chunks come in few
    shapes, and framing one costs a pickling, which per item would be most of a small item's cost."""
    return _framing(from_torch(dtype), tuple(int(s) for s in shape))


@lru_cache(maxsize=1024)
def _framing(dtype: DType, shape: tuple[int, ...]) -> Framing:
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * dtype.itemsize
    if not fits(nbytes):
        raise ValueError(f"a {nbytes}-byte storage needs zip64 framing; use torch.save")
    out = bytearray()
    members = []
    for name, data in [("data.pkl", data_pkl(dtype, tuple(shape)))] + _SMALL:
        members.append((_PREFIX + name, len(out), len(data), zlib.crc32(data)))
        out += _local((_PREFIX + name).encode(), len(out)) + data
        out += _descriptor(zlib.crc32(data), len(data))
    members.append((_PREFIX + "data/0", len(out), nbytes, -1))
    out += _local((_PREFIX + "data/0").encode(), len(out))
    f = Framing(head=bytes(out), storage_nbytes=nbytes, tail_nbytes=0, members=tuple(members))
    return Framing(head=f.head, storage_nbytes=nbytes, tail_nbytes=len(_tail(f, 0)), members=f.members)


def _tail(f: Framing, storage_crc: int) -> bytes:
    members = list(f.members)
    name0, off0, size0, _ = members[-1]
    members[-1] = (name0, off0, size0, storage_crc)
    out = bytearray(_descriptor(storage_crc, size0))
    pos = len(f.head) + size0 + len(out)
    sid = f"{storage_crc:020d}{size0 % 10**20:020d}".encode()
    for name, data in [("version", b"3\n"), (".data/serialization_id", sid)]:
        members.append((_PREFIX + name, pos, len(data), zlib.crc32(data)))
        rec = _local((_PREFIX + name).encode(), pos) + data + _descriptor(zlib.crc32(data), len(data))
        out += rec
        pos += len(rec)
    out += _directory(members, pos)
    return bytes(out)


def _directory(members: list[tuple[str, int, int, int]], cd_start: int) -> bytes:
    """The central directory of ``members`` (name, local header offset, size, CRC-32) starting at
    ``cd_start``, then the zip64 end record, its locator and the end record, as torch's writer puts them."""
    cd = bytearray()
    for name, off, size, crc in members:
        nb = name.encode()
        cd += _CENTRAL.pack(b"PK\x01\x02", 0, 0, _FLAGS, 0, 0, 0, crc, size, size, len(nb), 0, 0, 0, 0, 0, off) + nb
    out = bytearray(cd)
    n = len(members)
    out += _EOCD64.pack(b"PK\x06\x06", 44, 0x031E, 0x2D, 0, 0, n, n, len(cd), cd_start)
    out += _LOCATOR.pack(b"PK\x06\x07", 0, cd_start + len(cd), 1)
    out += _EOCD.pack(b"PK\x05\x06", 0, 0, n, n, len(cd), cd_start, 0)
    return bytes(out)


_PLAIN_NAMES_HASH = "02908468677762923104"
"""The first half of the ``.data/serialization_id`` torch's writer gives an archive whose records are
exactly data.pkl, .format_version, .storage_alignment, byteorder and version (an object without
tensors): c10's ``hash_combine`` over ``std::hash`` of those names, in the order of libstdc++'s
``unordered_set``, 20 digits. A constant for that set of names (``tests/test_torchfree_convert.py``
compares whole items with ``torch.save``'s)."""

_U64 = (1 << 64) - 1


def _hash_combine(seed: int, value: int) -> int:
    """c10's ``hash_combine`` on 64-bit ``size_t``."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2)) & _U64)) & _U64


def object_archive(pickled: bytes) -> bytes:
    """The item ``torch.save(obj)`` writes for an object whose protocol-2 pickle is ``pickled`` and
    which holds no tensor (no storage records): data.pkl and the small records, ``version``, and the
    serialization id torch derives from the records' names and CRC-32s, byte for byte. A conversion
    writes the plain values a plan makes (a reseeded rank's ints and floats) this way, without torch."""
    out = bytearray()
    members = []
    combined = 0
    for name, data in [("data.pkl", pickled)] + _SMALL + [("version", b"3\n")]:
        crc = zlib.crc32(data)
        combined = _hash_combine(combined, crc)
        members.append((_PREFIX + name, len(out), len(data), crc))
        out += _local((_PREFIX + name).encode(), len(out)) + data + _descriptor(crc, len(data))
    sid = f"{_PLAIN_NAMES_HASH}{combined:020d}".encode()
    members.append((_PREFIX + ".data/serialization_id", len(out), len(sid), zlib.crc32(sid)))
    out += _local((_PREFIX + ".data/serialization_id").encode(), len(out)) + sid + _descriptor(zlib.crc32(sid), len(sid))
    out += _directory(members, len(out))
    return bytes(out)


def archive_bytes(t: "torch.Tensor") -> bytes:
    """The whole item for a small tensor, in memory (tests and small objects)."""
    import torch

    t = t.detach()
    # a bool made contiguous through its bytes: torch's bool copy writes 0x01 for any non-zero byte
    t = t.view(torch.uint8).contiguous().view(torch.bool) if t.dtype == torch.bool else t.contiguous()
    f = framing(t.dtype, tuple(t.shape))
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    crc = zlib.crc32(raw)
    return f.head + raw + f.tail(crc)
