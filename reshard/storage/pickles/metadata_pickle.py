"""The bytes of DCP's `.metadata` pickle, written without importing torch.

Why: `reshard.storage.checkpoints.dcp_writer` used to build real ``torch.distributed.checkpoint.metadata.Metadata``
objects and ``pickle.dump`` them. Importing ``torch.distributed.checkpoint`` to do so costs seconds
(``python -X importtime`` on the 2-core test machine, busy: 2.4 s, 1.5 s of it ``import torch``;
this module: 0.13 s), which a ``reshard convert --data link`` that touches no tensor byte would pay
only for this file. Torch's pickling is slow too: ``pickle.dumps`` of a Metadata of 1 M chunks took
16-29 s there, busy (``_StorageInfo.__getstate__`` in Python, a memo entry per object), this 2.2 s. Here the
pickle is emitted opcode by opcode from plain data (`TensorMeta`, `ObjectMeta`), naming torch's
classes as strings, so that ``pickle.loads`` in a process with torch gives a ``Metadata`` equal,
field by field and type by type, to the one the writer built with torch
(``tests/test_metadata_pickle.py`` compares them, and loads a real checkpoint with ``dcp.load``).

What it mirrors (torch 2.13, read from ``pickletools.dis`` of torch's own pickle):

- dataclasses (``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``MetadataIndex``,
  ``StorageMeta``, ``_StorageInfo``) pickle as ``copyreg.__newobj__``: the class, ``()``, NEWOBJ,
  then BUILD with the instance's ``__dict__``; a class whose dict is empty
  (``BytesStorageMetadata``) has no BUILD. The dict holds exactly what the instance holds:
  ``MetadataIndex.__init__`` sets ``offset`` only for tensors and always sets ``index`` (None),
  ``_StorageInfo.__getstate__`` drops None fields (``transform_descriptors`` when there are none);
- ``TensorProperties`` pickles its ``__getstate__`` tuple ``(dtype, layout, requires_grad,
  memory_format, pin_memory)`` with ``torch.strided`` as ``torch.serialization._get_layout("torch.strided")``
  and ``torch.contiguous_format`` as ``_MEM_FORMAT_ENCODING(0)``;
- ``torch.Size(t)`` reduces to ``(torch.Size, (t,))``; a dtype reduces to the global ``torch.<name>``
  with its canonical name (``torch.float`` is ``torch.float32``).

Only names from DCP's vocabulary are emitted: every global here is admitted by
``formats/dcp_metadata.toml``, the allow list of reshard's own reader (`reshard.storage.pickles.safe_pickle`),
which the tests check. Protocol 4, framed in 64 KiB frames like CPython's pickler (so a reader
given a file object reads a frame at a time). What recurs (globals, field names, keys, file names,
transform names, each dtype's TensorProperties state) is memoized once and named by BINGET, so a
million chunks do not repeat it, and nothing else is memoized; the output is smaller than torch's own
pickle of the same ``Metadata`` (0.64 of it at 1 M chunks, and no larger for a tiny one: what is
used once is written in place). Everything is validated cheaply on
the way (a str key, a known dtype name, tuples of ints, ItemLocations): a bad input is a ValueError
naming the key. A chunk whose (offsets, sizes) equal ones already validated reuses their encoding.
"""
from __future__ import annotations

from dataclasses import dataclass
from struct import Struct
from typing import Any, Iterable, Sequence

from reshard.model.checkpoint import ItemLocation

__all__ = ["DTYPE_NAMES", "ObjectMeta", "TensorMeta", "metadata_bytes"]


# The canonical name of each dtype torch binds (what ``dtype.__reduce__()`` returns), and its aliases.
_CANONICAL: tuple[str, ...] = (
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64",
    "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
    "complex32", "complex64", "complex128",
    "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
)
_ALIASES: dict[str, str] = {
    "short": "int16", "int": "int32", "long": "int64", "half": "float16", "float": "float32",
    "double": "float64", "chalf": "complex32", "cfloat": "complex64", "cdouble": "complex128", "bit": "uint1",
}
DTYPE_NAMES: frozenset[str] = frozenset(_CANONICAL) | frozenset(_ALIASES)
"""Every attribute name torch 2.13 binds to a dtype (tests/test_metadata_pickle.py checks it against
``vars(torch)``): the only dtype names `metadata_bytes` writes, as the global ``torch.<canonical name>``."""


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of the checkpoint: global shape, dtype (torch's attribute name, e.g. ``"bfloat16"``),
    its chunks as ``(offsets, sizes, location)`` and its path in the nested state dict (``planner_data``)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...], ItemLocation]]
    path: tuple


@dataclass(frozen=True)
class ObjectMeta:
    """One non-tensor item (a ``BytesStorageMetadata`` entry): where its ``torch.save`` blob lies, and its path."""

    key: str
    location: ItemLocation
    path: tuple


# ---------------------------------------------------------------------------- opcodes (pickle protocol 4)

_PROTO4 = b"\x80\x04"
_FRAME = b"\x95"
_STOP = b"."
_MARK = b"("
_POP = b"0"
_MEMOIZE = b"\x94"
_STACK_GLOBAL = b"\x93"
_EMPTY_TUPLE = b")"
_EMPTY_DICT = b"}"
_EMPTY_LIST = b"]"
_NEWOBJ = b"\x81"
_REDUCE = b"R"
_BUILD = b"b"
_SETITEMS = b"u"
_APPEND = b"a"
_APPENDS = b"e"
_TUPLE = b"t"
_TUPLE_N = (b")", b"\x85", b"\x86", b"\x87")  # EMPTY_TUPLE, TUPLE1, TUPLE2, TUPLE3
_NONE = b"N"
_TRUE = b"\x88"
_FALSE = b"\x89"

_U8 = Struct("<Q")
_U4 = Struct("<I")
_I4 = Struct("<i")
_U2 = Struct("<H")

_FRAME_TARGET = 64 * 1024  # CPython's pickler frames at this size
_BATCH = 1000  # items per SETITEMS/APPENDS, as CPython's pickler batches them
_INT_ONLY = frozenset((int,))
_LONG1 = [b"\x8a" + bytes((n,)) for n in range(10)]  # LONG1 and its length byte, for up to 9 bytes


def _int(x: int) -> bytes:
    """An int as CPython's pickler writes it: BININT1, BININT2, BININT or LONG1/LONG4."""
    if 0 <= x <= 0xFF:
        return b"K" + bytes((x,))
    if 0 <= x <= 0xFFFF:
        return b"M" + _U2.pack(x)
    if -0x80000000 <= x <= 0x7FFFFFFF:
        return b"J" + _I4.pack(x)
    n = (x.bit_length() >> 3) + 1
    enc = x.to_bytes(n, "little", signed=True)
    if x < 0 and n > 1 and enc[-1] == 0xFF and (enc[-2] & 0x80):
        enc = enc[:-1]
    return (b"\x8a" + bytes((len(enc),)) if len(enc) < 256 else b"\x8b" + _I4.pack(len(enc))) + enc


def _str(s: str) -> bytes:
    """A str as SHORT_BINUNICODE or BINUNICODE (UTF-8 with surrogates passed, as pickle does)."""
    b = s.encode("utf-8", "surrogatepass")
    if len(b) < 256:
        return b"\x8c" + bytes((len(b),)) + b
    if len(b) <= 0xFFFFFFFF:
        return b"X" + _U4.pack(len(b)) + b
    return b"\x8d" + _U8.pack(len(b)) + b  # pragma: no cover - a key of 4 GiB


def _get(i: int) -> bytes:
    """BINGET or LONG_BINGET of memo slot ``i``."""
    return b"h" + bytes((i,)) if i < 256 else b"j" + _U4.pack(i)


def _ints(t: Any) -> bool:
    """Whether ``t`` is a tuple or list of exact ints (no bools), at C speed."""
    return isinstance(t, (tuple, list)) and {*map(type, t)} <= _INT_ONLY


# The globals, by the order they are memoized (only those the content needs are emitted).
_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_GLOBALS: dict[str, tuple[str, str]] = {
    "Metadata": (_MD, "Metadata"),
    "StorageMeta": (_MD, "StorageMeta"),
    "TensorStorageMetadata": (_MD, "TensorStorageMetadata"),
    "TensorProperties": (_MD, "TensorProperties"),
    "ChunkStorageMetadata": (_MD, "ChunkStorageMetadata"),
    "BytesStorageMetadata": (_MD, "BytesStorageMetadata"),
    "MetadataIndex": (_MD, "MetadataIndex"),
    "_StorageInfo": (_FS, "_StorageInfo"),
    "Size": ("torch", "Size"),
    "_get_layout": ("torch.serialization", "_get_layout"),
    "_MEM_FORMAT_ENCODING": (_MD, "_MEM_FORMAT_ENCODING"),
}
EMITTED_GLOBALS: frozenset[tuple[str, str]] = frozenset(_GLOBALS.values())
"""Every (module, name) `metadata_bytes` may emit besides ``torch.<dtype>`` (checked against the allow list)."""


class _Section:
    """A run of whole opcodes, kept as pieces of about 64 KiB (`cut` is called between opcodes).

    The pickle is built as a few sections side by side (the entries and the storage records in one
    pass over the chunks) and joined in reading order at the end by `_framed`.
    """

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.buf = bytearray()  # the same object for the section's whole life: callers may keep a reference

    def cut(self) -> None:
        if len(self.buf) >= _FRAME_TARGET:
            self.pieces.append(bytes(self.buf))
            self.buf.clear()

    def close(self) -> list[bytes]:
        if self.buf:
            self.pieces.append(bytes(self.buf))
            self.buf.clear()
        return self.pieces


def _framed(pieces: list[bytes]) -> bytes:
    """PROTO 4, then the pieces (each whole opcodes) in frames of at least 64 KiB where there is that much."""
    out: list[bytes] = [_PROTO4]
    group: list[bytes] = []
    size = 0
    for p in pieces:
        group.append(p)
        size += len(p)
        if size >= _FRAME_TARGET:
            out += [_FRAME, _U8.pack(size), *group]
            group, size = [], 0
    if group:
        out += [_FRAME, _U8.pack(size), *group]
    return b"".join(out)


class _Memo:
    """The unpickler's memo as the writer sees it: the next index MEMOIZE will take."""

    def __init__(self) -> None:
        self.next = 0

    def take(self) -> bytes:
        """The BINGET of the value the MEMOIZE about to be written stores."""
        ref = _get(self.next)
        self.next += 1
        return ref


def _check_location(key: str, loc: Any) -> None:
    if not isinstance(loc, ItemLocation):
        raise ValueError(f"'{key}': location is a {type(loc).__name__}, not an ItemLocation")
    if type(loc.file) is not str or not loc.file:
        raise ValueError(f"'{key}': location has no file name ({loc.file!r})")
    if type(loc.offset) is not int or type(loc.length) is not int or loc.offset < 0 or loc.length < 0:
        raise ValueError(f"'{key}': location {loc.file} has an invalid byte range ({loc.offset!r}, {loc.length!r})")
    if not isinstance(loc.transforms, (tuple, list)) or not all(type(t) is str for t in loc.transforms):
        raise ValueError(f"'{key}': location {loc.file} has transforms that are not strings ({loc.transforms!r})")


def _value(key: str, v: Any, depth: int = 0) -> bytes:
    """A planner path's element: str, int, bool, None, or a tuple/list of them (nested)."""
    if type(v) is str:
        return _str(v)
    if type(v) is int:
        return _int(v)
    if v is None:
        return _NONE
    if v is True or v is False:
        return _TRUE if v else _FALSE
    if type(v) in (tuple, list) and depth < 32:
        inner = b"".join(_value(key, x, depth + 1) for x in v)
        if type(v) is list:
            return _EMPTY_LIST + (_MARK + inner + _APPENDS if v else b"")
        return (inner + _TUPLE_N[len(v)]) if len(v) <= 3 else (_MARK + inner + _TUPLE)
    raise ValueError(f"'{key}': the path holds a {type(v).__name__} ({v!r:.60}); only str, int, bool, "
                     "None and tuples or lists of them are written")


def metadata_bytes(items: Iterable[TensorMeta | ObjectMeta], *, version: str) -> bytes:
    """The pickle of DCP ``Metadata`` for ``items`` (in this order), as ``DcpWriter`` commits it.

    ``state_dict_metadata`` has one entry per item, ``storage_data`` a ``MetadataIndex`` ->
    ``_StorageInfo`` per chunk and per object, ``planner_data`` each item's path, ``storage_meta``
    a default ``StorageMeta()`` and ``version`` the given string. Raises ValueError naming the key
    for an input a ``Metadata`` cannot hold (unknown dtype name, a key given twice, offsets that are
    not ints or not of the tensor's rank, two chunks at the same offsets).
    """
    items = list(items)
    if type(version) is not str:
        raise ValueError(f"version must be a str, not {type(version).__name__}")
    seen: set[str] = set()
    n_tensors = n_chunks = n_objects = 0
    dtypes: dict[str, int] = {}  # canonical dtype name -> tensors of that dtype
    for it in items:
        key = getattr(it, "key", None)
        if type(key) is not str:
            raise ValueError(f"an item's key is {key!r}, not a str")
        if key in seen:
            raise ValueError(f"'{key}' is given twice")
        seen.add(key)
        if isinstance(it, TensorMeta):
            if type(it.dtype) is not str or it.dtype not in DTYPE_NAMES:
                raise ValueError(f"'{key}': unknown dtype name {it.dtype!r} (not one of torch's dtype attribute names)")
            if not _ints(it.shape) or any(d < 0 for d in it.shape):
                raise ValueError(f"'{key}': shape {it.shape!r} is not a tuple of non-negative ints")
            if not isinstance(it.chunks, (list, tuple)):
                raise ValueError(f"'{key}': chunks are a {type(it.chunks).__name__}, not a list")
            n_tensors += 1
            n_chunks += len(it.chunks)
            name = _ALIASES.get(it.dtype, it.dtype)
            dtypes[name] = dtypes.get(name, 0) + 1
        elif isinstance(it, ObjectMeta):
            _check_location(key, it.location)
            n_objects += 1
        else:
            raise ValueError(f"'{key}': a {type(it).__name__}, neither TensorMeta nor ObjectMeta")
        if not isinstance(it.path, (tuple, list)):
            raise ValueError(f"'{key}': path {it.path!r} is not a tuple")
    n_items = n_chunks + n_objects  # storage records

    # -- the vocabulary: what the content uses more than once (globals, field names, the layout and
    # memory format values, each dtype's TensorProperties state) is built once at the start, memoized
    # and popped, and named by BINGET afterwards; what it uses once is written where it is used.
    memo = _Memo()
    head = _Section()
    hb = head.buf

    def vocab(opcodes: bytes, uses: int) -> bytes:
        """What to write at each of ``uses`` places for the value ``opcodes`` build."""
        if uses < 2:
            return opcodes
        hb.extend(opcodes)
        hb.extend(_MEMOIZE)
        ref = memo.take()
        hb.extend(_POP)
        return ref

    uses = {
        "Metadata": 1, "StorageMeta": 1, "TensorStorageMetadata": n_tensors, "TensorProperties": n_tensors,
        "ChunkStorageMetadata": n_chunks, "BytesStorageMetadata": n_objects, "MetadataIndex": n_items,
        "_StorageInfo": n_items, "Size": n_tensors + 3 * n_chunks,
        "_get_layout": min(1, len(dtypes)), "_MEM_FORMAT_ENCODING": min(1, len(dtypes)),
    }
    appears = {name: min(1, n) for name, n in uses.items()}  # a global defined once appears once
    module_uses: dict[str, int] = {"torch": len(dtypes)}  # each dtype's global: torch.<name>
    for name, (module, _attr) in _GLOBALS.items():
        module_uses[module] = module_uses.get(module, 0) + appears[name]
    modules = {m: vocab(_str(m), n) for m, n in module_uses.items() if n}
    G = {name: vocab(modules[module] + _str(attr) + _STACK_GLOBAL, uses[name])
         for name, (module, attr) in _GLOBALS.items() if uses[name]}
    field_uses = {"properties": n_tensors, "size": n_tensors, "chunks": n_tensors, "offsets": n_chunks,
                  "sizes": n_chunks, "fqn": n_items, "index": n_items, "offset": n_chunks + n_items,
                  "relative_path": n_items, "length": n_items}
    F = {f: vocab(_str(f), n) for f, n in field_uses.items() if n}
    props: dict[str, bytes] = {}  # canonical dtype name -> (torch.<dtype>, strided, False, contiguous, False)
    if dtypes:
        layout = vocab(G["_get_layout"] + _str("torch.strided") + b"\x85" + _REDUCE, len(dtypes))
        memfmt = vocab(G["_MEM_FORMAT_ENCODING"] + b"K\x00\x85" + _REDUCE, len(dtypes))
        for name, n in dtypes.items():
            props[name] = vocab(_MARK + modules["torch"] + _str(name) + _STACK_GLOBAL
                                + layout + _FALSE + memfmt + _FALSE + _TUPLE, n)
    # Metadata: NEWOBJ, then (at the very end) BUILD with its state dict
    hb += G["Metadata"] + _EMPTY_TUPLE + _NEWOBJ + _EMPTY_DICT + _MARK + _str("state_dict_metadata") + _EMPTY_DICT

    # -- one pass over the items: state_dict_metadata (`sdm`) and storage_data (`st`) side by side.
    # Memo indices are taken in reading order: each key is memoized in `sdm` (one per item), so
    # the file names memoized in `st`, which is read after `sdm`, are numbered from there.
    sdm, st = _Section(), _Section()
    sb, tb = sdm.buf, st.buf
    key_ref = [memo.take() for _ in items]
    size_prefix = G.get("Size", b"")
    chunk_pre = G.get("ChunkStorageMetadata", b"") + _EMPTY_TUPLE + _NEWOBJ + _EMPTY_DICT + _MARK + F.get("offsets", b"")
    chunk_mid, chunk_post = F.get("sizes", b""), _SETITEMS + _BUILD
    if n_items:
        mi_pre = G["MetadataIndex"] + _EMPTY_TUPLE + _NEWOBJ + _EMPTY_DICT + _MARK + F["fqn"]
        si_pre = _SETITEMS + _BUILD + G["_StorageInfo"] + _EMPTY_TUPLE + _NEWOBJ + _EMPTY_DICT + _MARK + F["relative_path"]
        mi_tensor, mi_object = F["index"] + _NONE + F["offset"], F["index"] + _NONE + si_pre
        f_offset, f_length = F["offset"], F["length"]
    files: dict[str, bytes] = {}    # file name -> BINGET of it + the "offset" field name
    lengths: dict[int, bytes] = {}  # item length -> "length" field, the int, the end of the record
    sizes: dict[tuple, bytes] = {}  # tuple -> the Size global, the tuple, TUPLE1, REDUCE
    # (offsets, sizes) -> (the chunk record, the index's offset Size and the _StorageInfo's head, the offsets)
    pairs: dict[tuple, tuple[bytes, bytes, tuple]] = {}

    def size(key: str, t: Any, what: str) -> bytes:
        """``torch.Size(t)``, validated (a tuple or list of ints) and encoded once per distinct tuple."""
        if not _ints(t):
            raise ValueError(f"'{key}': {what} {t!r:.80} is not a tuple of ints")
        t = tuple(t)
        b = sizes.get(t)
        if b is None:
            inner = b"".join(map(_int, t))
            b = sizes[t] = size_prefix + ((inner + _TUPLE_N[len(t)]) if len(t) <= 3 else (_MARK + inner + _TUPLE)) \
                + b"\x85" + _REDUCE
        return b

    def pair(key: str, c: Any, rank: int) -> tuple[bytes, bytes, tuple]:
        """A chunk's two records that depend on its geometry only, validated; cached by (offsets, sizes)."""
        if not isinstance(c, (tuple, list)) or len(c) != 3:
            raise ValueError(f"'{key}': a chunk is {c!r:.80}, not (offsets, sizes, location)")
        o, s = size(key, c[0], "chunk offsets"), size(key, c[1], "chunk sizes")
        off = tuple(c[0])
        if len(off) != rank or len(c[1]) != rank:
            raise ValueError(f"'{key}': a chunk has offsets {list(off)} and sizes {list(c[1])}, the tensor {rank} dims")
        if any(x < 0 for x in off) or any(x < 0 for x in c[1]):
            raise ValueError(f"'{key}': a chunk has negative offsets or sizes ({list(off)}, {list(c[1])})")
        got = pairs[(off, tuple(c[1]))] = (chunk_pre + o + chunk_mid + s + chunk_post, o + si_pre, off)
        return got

    def file(key: str, loc: ItemLocation) -> bytes:
        """The file name of ``loc`` and the "offset" field name: the name itself and MEMOIZE the first time, a
        BINGET after."""
        ref = files.get(loc.file)
        if ref is not None:
            return ref
        _check_location(key, loc)
        files[loc.file] = memo.take() + f_offset
        return _str(loc.file) + _MEMOIZE + f_offset

    def length(n: int) -> bytes:
        b = lengths.get(n)
        if b is None:
            b = lengths[n] = f_length + _int(n) + _SETITEMS + _BUILD
        return b

    strings: dict[str, bytes] = {}  # "transform_descriptors" and the transforms' names -> their BINGET

    def string(text: str) -> bytes:
        """A string of the storage records: itself and MEMOIZE the first time, a BINGET after."""
        ref = strings.get(text)
        if ref is not None:
            return ref
        strings[text] = memo.take()
        return _str(text) + _MEMOIZE

    def info(key: str, loc: Any) -> None:
        """A ``_StorageInfo``'s fields after its relative_path key, validated (the slow path: transforms, odd values)."""
        _check_location(key, loc)
        tb.extend(file(key, loc))
        tb.extend(_int(loc.offset))
        if loc.transforms:
            tb.extend(f_length + _int(loc.length) + string("transform_descriptors") + _EMPTY_LIST)
            if len(loc.transforms) == 1:
                tb.extend(string(loc.transforms[0]) + _APPEND)
            else:
                tb.extend(_MARK + b"".join(map(string, loc.transforms)) + _APPENDS)
            tb.extend(_SETITEMS + _BUILD)
        else:
            tb.extend(length(loc.length))

    count = 0  # storage records since the last SETITEMS
    if n_items:
        tb += _MARK
    for i0 in range(0, len(items), _BATCH):
        sb += _MARK
        for i in range(i0, min(i0 + _BATCH, len(items))):
            it = items[i]
            key = it.key
            sb += _str(key) + _MEMOIZE
            kref = key_ref[i]
            if isinstance(it, ObjectMeta):
                sb += G["BytesStorageMetadata"] + _EMPTY_TUPLE + _NEWOBJ
                tb += mi_pre + kref + mi_object
                info(key, it.location)
                count += 1
                if count == _BATCH:
                    tb += _SETITEMS + _MARK
                    count = 0
                continue
            sb += (G["TensorStorageMetadata"] + _EMPTY_TUPLE + _NEWOBJ + _EMPTY_DICT + _MARK
                   + F["properties"] + G["TensorProperties"] + _EMPTY_TUPLE + _NEWOBJ
                   + props[_ALIASES.get(it.dtype, it.dtype)] + _BUILD
                   + F["size"] + size(key, it.shape, "shape") + F["chunks"] + _EMPTY_LIST)
            rank = len(it.shape)
            chunks = it.chunks
            mi_head = (mi_pre + kref + mi_tensor) if chunks else b""
            seen_offsets: set[tuple] = set()
            for c0 in range(0, len(chunks), _BATCH):
                batch = chunks[c0:c0 + _BATCH]
                if len(batch) > 1:
                    sb += _MARK
                for c in batch:
                    try:
                        o, s, loc = c
                        rec = pairs.get((o, s))
                    except (TypeError, ValueError):  # not a triple, or unhashable (lists): the slow path says what
                        rec = None
                    if rec is None or len(o) != rank:
                        rec = pair(key, c, rank)
                        loc = c[2]
                    sb += rec[0]
                    off = rec[2]
                    if off in seen_offsets:
                        raise ValueError(f"'{key}': two chunks at the same offsets {list(off)}")
                    seen_offsets.add(off)
                    tb += mi_head
                    tb += rec[1]
                    x = loc.offset if loc.__class__ is ItemLocation else None
                    if x.__class__ is int and x >= 0 and not loc.transforms and loc.length.__class__ is int:
                        ref = files.get(loc.file)
                        tb += ref if ref is not None else file(key, loc)
                        if 0xFFFF < x <= 0x7FFFFFFF:  # the int as _int writes it, inline for the common sizes
                            tb += b"J" + _I4.pack(x)
                        elif 0x7FFFFFFF < x < 1 << 63:
                            nb = (x.bit_length() >> 3) + 1
                            tb += _LONG1[nb] + x.to_bytes(nb, "little")
                        else:
                            tb += _int(x)
                        n = loc.length
                        lb = lengths.get(n)
                        if lb is None:
                            if n < 0:
                                _check_location(key, loc)
                            lb = length(n)
                        tb += lb
                    else:
                        info(key, loc)
                    count += 1
                    if count == _BATCH:
                        tb += _SETITEMS + _MARK
                        count = 0
                    if len(tb) >= _FRAME_TARGET:
                        st.cut()
                    if len(sb) >= _FRAME_TARGET:
                        sdm.cut()
                sb += _APPENDS if len(batch) > 1 else _APPEND
            sb += _SETITEMS + _BUILD
            sdm.cut()
        sb += _SETITEMS
    if n_items:
        tb += _SETITEMS

    # -- planner_data: key -> path (a tuple, whatever sequence was given), read between the two
    mid = _Section()
    mb = mid.buf
    mb += _str("planner_data") + _EMPTY_DICT
    for i0 in range(0, len(items), _BATCH):
        mb += _MARK
        for i in range(i0, min(i0 + _BATCH, len(items))):
            mb += key_ref[i] + _value(items[i].key, tuple(items[i].path))
            mid.cut()
        mb += _SETITEMS
    mb += _str("storage_data") + _EMPTY_DICT

    # -- storage_meta: StorageMeta() with its defaults; the version; Metadata's BUILD
    tail = _Section()
    tail.buf += (_str("storage_meta") + G["StorageMeta"] + _EMPTY_TUPLE + _NEWOBJ + _EMPTY_DICT + _MARK
                 + _str("checkpoint_id") + _NONE + _str("save_id") + _NONE + _str("load_id") + _NONE
                 + _str("modules") + _EMPTY_LIST + _SETITEMS + _BUILD
                 + _str("version") + _str(version) + _SETITEMS + _BUILD + _STOP)
    return _framed(head.close() + sdm.close() + mid.close() + st.close() + tail.close())
