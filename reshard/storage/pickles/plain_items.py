"""Decode small ``torch.save`` items (a step counter, a scheduler's counters) without torch.

Why: `inspect` and `plan` read a few tiny items: an object item holding an int or a dict of
them, or a 0-d / 1-element tensor item such as Adam's ``step``. Decoding them with
``torch.load`` makes every command import torch, which costs 1.4 s on a quiet 2-core machine
and over 20 s on a loaded one, to read a handful of bytes. Such an item is a ``torch.save`` zip
archive: ``data.pkl`` (a protocol-2 pickle), ``byteorder`` and ``data/<key>`` storage members.

What is admitted: `decode_item` checks the archive (`item_pickle`: stored,
non-overlapping members under one folder, one ``data.pkl``) and the pickle's cost
(`reshard.storage.pickles.safe_pickle.check_cost`), then unpickles with `_PlainUnpickler`, whose
``find_class`` admits only ``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2`` /
``_v3``, the legacy typed storage classes of the dtypes decoded here (``torch.FloatStorage`` ...
``torch.BoolStorage``), ``torch.UntypedStorage`` and ``torch.<dtype>`` names of the table in
`reshard.model.dtypes`. Each is mapped to an inert stand-in of this module: **nothing the file
names is imported or called**, and this module imports no torch, not even lazily.

A tensor becomes a `PlainTensor` (dtype, shape, values in row-major order), decoded with numpy
from its storage bytes honouring storage offset and strides, only for bool, int8..int64,
uint8..uint64, float16, bfloat16, float32 and float64, at most ``max_elements`` elements, no
``requires_grad``, no backward hooks. Values are Python ``int``/``float``/``bool``, identical to
``torch.load(...).tolist()`` bit for bit: bfloat16 and float16 widen through float32 as torch's do,
so NaN payloads (and the quieting of a signalling NaN) come out the same.

The fallback contract: anything else (another global such as ``datetime`` or an optimizer
class, a float8 or complex tensor, a larger tensor (or an empty one with a dimension past
``max_elements``), a BUILD on a stand-in, a big-endian archive, a storage that does not
fit, a pickle that does not unpickle, a value holding a bare storage or dtype) raises `NotPlain`,
which is **not an error**: the caller falls back to ``torch.load(weights_only=True)``
(`reshard.storage.checkpoints.dcp.torch_load_item`), which decides whether the item is refused, and how.
Only an archive or a pickle that is refused for every reader (`BadInput` from ``item_pickle`` or
``check_cost``) propagates as an error.
"""
from __future__ import annotations

import collections
import io
import itertools
import pickle
import struct
import sys
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from reshard.errors import BadInput
from reshard.model.dtypes import DType, lookup
from reshard.storage.pickles.safe_pickle import check_cost

__all__ = ["NotPlain", "PlainTensor", "decode_item"]

TOTAL_ELEMENTS_FACTOR = 64
"""One item may decode at most this many times ``max_elements`` tensor elements in all: a pickle
that rebuilds thousands of small tensors is no counter, and torch.load's own bounds then apply."""

_NUMPY: dict[str, str] = {
    # DType.name -> numpy dtype of its storage bytes (little-endian); bool and bfloat16 are converted below
    "bool": "u1", "uint8": "u1", "int8": "i1", "int16": "<i2", "int32": "<i4", "int64": "<i8",
    "uint16": "<u2", "uint32": "<u4", "uint64": "<u8",
    "float16": "<f2", "bfloat16": "<u2", "float32": "<f4", "float64": "<f8",
}
"""The dtypes decoded here, each to numpy's reading of its bytes. Any other dtype is `NotPlain`."""

_TYPED_STORAGES: dict[str, str] = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
}
"""torch's legacy typed storage classes (how ``torch.save`` names the storage of these dtypes) -> dtype."""

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header, 30 bytes


class NotPlain(Exception):
    """The item needs torch to decode (the caller falls back to torch.load)."""


def _no_state(self: Any, state: Any) -> None:
    """``__setstate__`` of every class here: a pickle's BUILD may not change a stand-in or a decoded tensor.

    A frozen slotted dataclass otherwise gets one from `dataclasses` that sets its fields from any
    tuple or dict, frozen or not."""
    raise NotPlain(f"the pickle changes a {type(self).__name__} after building it (BUILD)")


@dataclass(frozen=True, slots=True)
class PlainTensor:
    """A small tensor's value as plain data: ``values`` holds its elements in row-major order.

    Frozen and slotted, as are the stand-ins below, and a pickle's BUILD opcode cannot change one
    after it is made (`_no_state`); copying and pickling go through the constructor (``__reduce__``)."""

    dtype: DType
    shape: tuple[int, ...]
    values: tuple

    __setstate__ = _no_state

    def __reduce__(self) -> tuple:
        return (PlainTensor, (self.dtype, self.shape, self.values))

    @property
    def numel(self) -> int:
        return len(self.values)

    def __int__(self) -> int:
        return int(self.item())  # as int(tensor): one element only

    def __float__(self) -> float:
        return float(self.item())

    def item(self) -> Any:
        """The one element, as ``Tensor.item()`` gives it (ValueError unless there is exactly one)."""
        if len(self.values) != 1:
            raise ValueError(f"a tensor of {len(self.values)} elements has no single item")
        return self.values[0]

    def tolist(self) -> Any:
        """Nested lists by ``shape``, as ``Tensor.tolist()`` gives them (the bare value for a 0-d tensor)."""
        if not self.shape:
            return self.values[0]

        def nest(dims: tuple[int, ...], start: int) -> list:
            if len(dims) == 1:
                return list(self.values[start:start + dims[0]])
            inner = 1
            for n in dims[1:]:
                inner *= n
            return [nest(dims[1:], start + i * inner) for i in range(dims[0])]

        return nest(self.shape, 0)


@dataclass(frozen=True, slots=True)
class _StorageType:
    """Stand-in for a storage class the pickle names: its dtype, or None for ``UntypedStorage``."""

    dtype: DType | None

    __setstate__ = _no_state


@dataclass(frozen=True, slots=True)
class _Storage:
    """Stand-in for one storage: the bytes of its ``data/<key>`` member, the dtype it was typed with (or None)."""

    data: memoryview
    dtype: DType | None

    __setstate__ = _no_state



def item_pickle(data: bytes, *, key: str, where: str) -> bytes:
    """The ``data.pkl`` of the torch.save archive ``data``, once the archive is known not to inflate.

    ``torch.load`` inflates deflate-compressed members (a 1 MB item can hold gigabytes of
    zeros), but ``torch.save`` stores every member uncompressed. So an item is refused
    (`BadInput`, key and file named) unless it is a zip archive whose members all lie under
    one folder, are STORED (central directory and local header agree), unencrypted, fit
    inside the item without overlapping, and include exactly one ``data.pkl``: its members
    then hold at most the item's own length, whatever they claim.
    """
    def refuse(what: str) -> BadInput:
        return BadInput(f"item '{key}' {what}", where=where,
                        hint="torch.save writes plain uncompressed zip archives; this item is corrupt or forged "
                             "(a compression bomb, or not written by torch.distributed.checkpoint).")

    try:
        infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, struct.error) as exc:
        raise refuse(f"is not a torch.save zip archive ({str(exc)[:120]})") from None
    if not infos:
        raise refuse("is an empty zip archive")
    prefix = infos[0].filename.split("/", 1)[0] + "/"
    names: set[str] = set()
    spans: list[tuple[int, int]] = []
    pkl: tuple[int, int] | None = None
    for zi in infos:
        name = zi.filename
        if not name.startswith(prefix) or name in names:
            raise refuse(f"has members outside one folder or twice ('{name[:80]}')")
        names.add(name)
        if zi.compress_type != zipfile.ZIP_STORED or zi.flag_bits & 0x1 or zi.file_size != zi.compress_size:
            raise refuse(f"has a compressed or encrypted member '{name[:80]}' (declared {zi.file_size:,} bytes "
                         f"from {zi.compress_size:,})")
        head = data[zi.header_offset:zi.header_offset + _LOCAL_HEADER.size]
        if len(head) != _LOCAL_HEADER.size:
            raise refuse(f"has a member '{name[:80]}' whose header lies outside it")
        magic, _v, flags, method, *_rest, name_len, extra_len = _LOCAL_HEADER.unpack(head)
        if magic != b"PK\x03\x04" or method != zipfile.ZIP_STORED or flags & 0x1:
            raise refuse(f"has a member '{name[:80]}' whose local header says it is compressed or is not a header")
        start = zi.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if start + zi.file_size > len(data):
            raise refuse(f"has a member '{name[:80]}' of {zi.file_size:,} bytes running past its end")
        spans.append((start, start + zi.file_size))
        if name == prefix + "data.pkl":
            pkl = (start, start + zi.file_size)
    spans.sort()
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise refuse("has members that overlap (one byte range read as several members)")
    if pkl is None:
        raise refuse("has no data.pkl (not a torch.save archive)")
    return data[pkl[0]:pkl[1]]


class _Archive:
    """The members of an item already checked by `item_pickle`, found by name, as slices of its bytes."""

    def __init__(self, data: bytes):
        self.view = memoryview(data)
        self.spans: dict[str, tuple[int, int]] = {}
        infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
        self.prefix = infos[0].filename.split("/", 1)[0] + "/"
        for zi in infos:
            head = data[zi.header_offset:zi.header_offset + _LOCAL_HEADER.size]
            *_rest, name_len, extra_len = _LOCAL_HEADER.unpack(head)
            start = zi.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            self.spans[zi.filename] = (start, start + zi.file_size)

    def member(self, name: str) -> memoryview | None:
        span = self.spans.get(self.prefix + name)
        return None if span is None else self.view[span[0]:span[1]]


def _ordered_dict(*args: Any) -> collections.OrderedDict:
    """``collections.OrderedDict()`` as pickled (no arguments; the items follow as SETITEMS)."""
    if args:
        raise NotPlain("OrderedDict with constructor arguments")
    return collections.OrderedDict()


class _Rebuilder:
    """The stand-in for ``torch._utils._rebuild_tensor_v2``/``_v3``: a `PlainTensor` or `NotPlain`."""

    def __init__(self, max_elements: int):
        self.max_elements = max_elements
        self.budget = TOTAL_ELEMENTS_FACTOR * max(1, max_elements)

    def v2(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
           hooks: Any = None, metadata: Any = None, *rest: Any) -> PlainTensor:
        if not isinstance(storage, _Storage) or storage.dtype is None:
            raise NotPlain("_rebuild_tensor_v2 over something other than a typed storage")
        return self._build(storage, storage.dtype, offset, size, stride, requires_grad, hooks, metadata, rest)

    def v3(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
           dtype: Any, metadata: Any = None, *rest: Any) -> PlainTensor:
        if not isinstance(storage, _Storage) or storage.dtype is not None or not isinstance(dtype, DType):
            raise NotPlain("_rebuild_tensor_v3 over something other than an untyped storage and a dtype")
        return self._build(storage, dtype, offset, size, stride, requires_grad, hooks, metadata, rest)

    def _build(self, storage: _Storage, dtype: DType, offset: Any, size: Any, stride: Any, requires_grad: Any,
               hooks: Any, metadata: Any, rest: tuple) -> PlainTensor:
        if rest or requires_grad is not False or hooks or metadata:
            raise NotPlain("a tensor with requires_grad, backward hooks or metadata")
        if dtype.name not in _NUMPY:
            raise NotPlain(f"a tensor of {dtype} (not decoded without torch)")
        shape, strides = _ints(size), _ints(stride)
        if type(offset) is not int or offset < 0 or len(shape) != len(strides) or min(shape + strides, default=0) < 0:
            raise NotPlain("a tensor whose size, stride or offset is not a tuple of non-negative ints")
        numel = span = 1
        for n in shape:
            numel *= n
            span *= max(n, 1)
        if numel > self.max_elements:
            raise NotPlain(f"a tensor of {numel} elements (more than {self.max_elements})")
        if span > self.max_elements:  # an empty tensor of 0 x 10**12: no counter, and its tolist() is huge
            raise NotPlain(f"an empty tensor of shape {shape} (dimensions past {self.max_elements})")
        self.budget -= numel
        if self.budget < 0:
            raise NotPlain("more tensor elements in one item than a counter holds")
        flat = np.frombuffer(storage.data, dtype=np.uint8)
        count = len(flat) // dtype.itemsize
        index = [offset + sum(i * s for i, s in zip(pos, strides)) for pos in itertools.product(*map(range, shape))]
        if index and max(index) >= count:
            raise NotPlain("a tensor reaching past the end of its storage")
        elems = flat[:count * dtype.itemsize].view(_NUMPY[dtype.name])[np.asarray(index, dtype=np.int64)]
        if dtype.name == "bfloat16":  # its bits are a float32's top half: widened exactly
            elems = (elems.astype(np.uint32) << 16).view("<f4")
        elif dtype.name == "float16":
            # Through float32 as torch's .item()/.tolist() go (Half -> float -> double): the last step
            # quiets a signalling NaN as torch's does; numpy's direct half -> double would keep it.
            elems = elems.astype("<f4")
        elif dtype.name == "bool":
            elems = elems != 0
        return PlainTensor(dtype, shape, tuple(elems.tolist()))


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, tuple) or not all(type(x) is int for x in v):
        raise NotPlain("a tensor size or stride that is not a tuple of ints")
    return v


class _PlainUnpickler(pickle.Unpickler):
    """Resolves only the admitted globals, each to a stand-in; every other global is `NotPlain`."""

    def __init__(self, pkl: bytes, archive: _Archive, max_elements: int):
        super().__init__(io.BytesIO(pkl), encoding="utf-8")
        self.archive = archive
        self.rebuild = _Rebuilder(max_elements)
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return _ordered_dict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self.rebuild.v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return self.rebuild.v3
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch" and name in _TYPED_STORAGES:
            return _StorageType(lookup(_TYPED_STORAGES[name]))
        if module == "torch" and "." not in name:
            found = lookup(name)  # a table of names, never getattr(torch, name)
            if found is not None:
                return found
        raise NotPlain(f"the pickle names {module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise NotPlain("a persistent id that is not a storage")
        _tag, stype, key, location, numel = pid
        if not isinstance(stype, _StorageType) or not isinstance(key, str) or not isinstance(location, str) \
                or type(numel) is not int or numel < 0:
            raise NotPlain("a malformed storage reference")
        have = self.storages.get(key)
        if have is not None:
            if have.dtype != stype.dtype:
                raise NotPlain(f"storage '{key}' referenced with two types")
            return have
        if "/" in key or key in ("", ".", ".."):
            raise NotPlain(f"a storage key '{key[:40]}' that is not a member name")
        data = self.archive.member(f"data/{key}")
        if data is None:
            raise NotPlain(f"storage member data/{key[:40]} is missing")
        want = numel * (stype.dtype.itemsize if stype.dtype is not None else 1)
        if len(data) != want:
            raise NotPlain(f"storage member data/{key[:40]} holds {len(data)} bytes, not {want}")
        self.storages[key] = _Storage(data, stype.dtype)
        return self.storages[key]


_PLAIN_SCALARS = frozenset((type(None), bool, int, float, str))


def _check_plain(value: Any) -> None:
    """`NotPlain` unless ``value`` is built of plain values and containers only (no stand-in leaks out).

    An OrderedDict may not carry attributes (a forged BUILD could hang a stand-in on one)."""
    todo, seen = [value], set()
    while todo:
        x = todo.pop()
        t = type(x)
        if t in _PLAIN_SCALARS:
            continue
        if id(x) in seen:
            continue
        seen.add(id(x))
        if t is PlainTensor:
            if not ({*map(type, x.values)} <= _PLAIN_SCALARS and {*map(type, x.shape)} <= {int}):
                raise NotPlain("a tensor stand-in holding something else than plain values")
        elif t is list or t is tuple:
            todo.extend(x)
        elif t is dict or (t is collections.OrderedDict and not vars(x)):
            todo.extend(x.keys())
            todo.extend(x.values())
        else:
            raise NotPlain(f"the item holds a {t.__name__}")


def contains_tensor(value: Any) -> bool:
    """Whether a decoded value holds a `PlainTensor` anywhere (a caller that wants torch's values
    for tensors inside containers reads those through torch instead)."""
    todo = [value]
    while todo:
        x = todo.pop()
        t = type(x)
        if t is PlainTensor:
            return True
        if t is list or t is tuple:
            todo.extend(x)
        elif t is dict or t is collections.OrderedDict:
            todo.extend(x.values())
    return False


def decode_item(data: bytes, *, key: str, where: str, max_elements: int = 64) -> Any:
    """The value of the ``torch.save`` item ``data`` (already untransformed and CRC-checked), without torch.

    Tensors come back as `PlainTensor`; objects as the plain Python values torch.load would give.
    Raises `BadInput` for an archive or pickle no reader accepts (key and file named), and
    `NotPlain` for anything that needs torch, for the caller to pass to ``torch.load``.
    """
    pkl = item_pickle(data, key=key, where=where)
    check_cost(pkl, where=where, what=f"the pickle of item '{key}'")
    archive = _Archive(data)
    order = archive.member("byteorder")
    if order is None:
        if sys.byteorder != "little":
            raise NotPlain("no byteorder mark on a big-endian machine")
    elif bytes(order) != b"little":
        raise NotPlain(f"byteorder {bytes(order[:16])!r}")
    try:
        value = _PlainUnpickler(pkl, archive, max_elements).load()
    except NotPlain:
        raise
    except Exception as exc:  # a pickle the stand-ins cannot build: torch.load decides what it is
        raise NotPlain(f"unpickling failed: {type(exc).__name__}: {str(exc)[:200]}") from None
    _check_plain(value)
    return value


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """What a tensor item's ``data.pkl`` says, its bytes unread: dtype, shape, stride and storage
    offset (in elements), and the one storage member it lies in with that member's size."""

    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_key: str
    storage_nbytes: int

    __setstate__ = _no_state


@dataclass(frozen=True, slots=True)
class _StorageRef:
    key: str
    dtype: DType | None  # None: an UntypedStorage (its numel counts bytes)
    nbytes: int

    __setstate__ = _no_state


class _LayoutUnpickler(_PlainUnpickler):
    """The same admitted globals; storages stay references and a tensor becomes its `TensorLayout`."""

    def __init__(self, pkl: bytes):
        pickle.Unpickler.__init__(self, io.BytesIO(pkl), encoding="utf-8")
        self.rebuild = self  # find_class hands out self.rebuild.v2 / .v3
        self.refs: dict[str, _StorageRef] = {}

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise NotPlain("a persistent id that is not a storage")
        _tag, stype, key, location, numel = pid
        if not isinstance(stype, _StorageType) or not isinstance(key, str) or not isinstance(location, str) \
                or type(numel) is not int or numel < 0 or (self.refs and key not in self.refs):
            raise NotPlain("not exactly one well-formed storage reference")
        ref = _StorageRef(key, stype.dtype, numel * (stype.dtype.itemsize if stype.dtype is not None else 1))
        if self.refs.setdefault(key, ref) != ref:
            raise NotPlain(f"storage '{key}' referenced with two types")
        return ref

    def v2(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
           hooks: Any = None, *rest: Any) -> TensorLayout:
        if not isinstance(storage, _StorageRef) or storage.dtype is None:
            raise NotPlain("_rebuild_tensor_v2 over something other than a typed storage")
        return self._layout(storage, storage.dtype, offset, size, stride, requires_grad, hooks, rest)

    def v3(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
           dtype: Any, *rest: Any) -> TensorLayout:
        if not isinstance(storage, _StorageRef) or storage.dtype is not None or not isinstance(dtype, DType):
            raise NotPlain("_rebuild_tensor_v3 over something other than an untyped storage and a dtype")
        return self._layout(storage, dtype, offset, size, stride, requires_grad, hooks, rest)

    @staticmethod
    def _layout(storage: _StorageRef, dtype: DType, offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, rest: tuple) -> TensorLayout:
        if requires_grad is not False or hooks or any(r for r in rest):
            raise NotPlain("a tensor with requires_grad, backward hooks or metadata")
        shape, strides = _ints(size), _ints(stride)
        if type(offset) is not int or offset < 0 or len(shape) != len(strides) or min(shape + strides, default=0) < 0:
            raise NotPlain("a tensor whose size, stride or offset is not a tuple of non-negative ints")
        return TensorLayout(dtype, shape, strides, offset, storage.key, storage.nbytes)


def tensor_layout(pkl: bytes) -> TensorLayout:
    """The layout of the one plain tensor a tensor item's ``data.pkl`` rebuilds, without torch;
    `NotPlain` for anything else (its caller then asks torch's weights-only unpickler).

    The pickle is small and bounded by its caller; the same globals as `decode_item` are admitted,
    every one an inert stand-in."""
    try:
        value = _LayoutUnpickler(pkl).load()
    except NotPlain:
        raise
    except Exception as exc:
        raise NotPlain(f"unpickling failed: {type(exc).__name__}: {str(exc)[:200]}") from None
    if type(value) is not TensorLayout:
        raise NotPlain("the pickle is not one plain tensor")
    return value
