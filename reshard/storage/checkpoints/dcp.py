"""Safe, byte-range reader for PyTorch Distributed Checkpoint directories.

A DCP checkpoint is a directory holding `.metadata` (a pickle, written last by rank 0 as the
commit) and `__{rank}_{n}.distcp` data files. Every item (one chunk of one tensor, or one
plain object) is its own ``torch.save`` blob at ``[offset, offset + length)`` of a data file,
optionally passed through stream transforms such as zstd.

This module knows bytes and formats, nothing of training: it turns `.metadata` into plain
records without executing code, and reads single items from their byte ranges with
``torch.load(weights_only=True)``. Every dtype whose items are plain storage bytes is read
(float8, float4, uint16-64, bits and complex included: `reshard.model.dtypes.unstorable_reason`);
a tensor of any other (a quantized dtype, whose items carry the quantizer) is refused when
`.metadata` is read, every such key named with its dtype, so inspect and plan exit 2 before
anything is planned.
"""
from __future__ import annotations

import io
import os
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from reshard.errors import BadInput, Incomplete, UnsafeInput
from reshard import safefs
from reshard.model.checkpoint import ItemLocation
from reshard.model.dtypes import DType, unstorable_reason
from reshard.storage.checkpoints import save_plans
from reshard.storage.pickles.plain_items import NotPlain, decode_item, item_pickle
from reshard.storage.pickles.safe_pickle import INT_ONLY, Record, check_cost, load_metadata_pickle

if TYPE_CHECKING:  # handed in by the caller that opened the checkpoint (`reshard.storage.source.Source`)
    from reshard.storage.objectstore.remote import RemoteCheckpoint

METADATA_FILE = ".metadata"
MIN_METADATA_CAP = 256 << 20
"""`.metadata` may always be this large. Beyond it, no more than the data it describes (`metadata_cap`)."""


@dataclass
class RawTensor:
    key: str
    shape: tuple[int, ...]
    dtype: DType
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]  # (offsets, sizes)


@dataclass
class RawObject:
    key: str


@dataclass
class RawMetadata:
    """`.metadata` decoded into plain Python, validated for shape (not for consistency)."""

    entries: dict[str, RawTensor | RawObject]
    # (key, chunk offsets or None for objects) -> location
    locations: dict[tuple[str, tuple[int, ...] | None], ItemLocation]
    planner_paths: dict[str, tuple]
    version: str | None
    # `all_local_plans` as each rank's planned items (save_plans.decode), or why it is unreadable; None: absent
    local_plans: Any = None


def read_raw_metadata(ckpt: Path, rc: RemoteCheckpoint | None = None) -> RawMetadata:
    """Read and validate `.metadata` with the safe unpickler; raise Incomplete when the
    checkpoint was never committed.

    `.metadata` is opened through `reshard.safefs`: a symlink out of the checkpoint, a
    device or a FIFO is refused by name, and a file larger than `metadata_cap` is refused.
    """
    path = committed_metadata(ckpt, rc)
    where = str(path)
    try:
        data = safefs.read_bounded(path, limit=metadata_cap(ckpt, rc), root=ckpt, what=".metadata")
    except FileNotFoundError:  # a dangling symlink
        raise BadInput(".metadata is a symbolic link to a file that does not exist", where=where) from None
    md = load_metadata_pickle(data, where)
    return _decode(md, where)


def committed_metadata(ckpt: Path, rc: RemoteCheckpoint | None = None) -> Path:
    """The path of ``ckpt``'s `.metadata`, or why there is none: no such directory, not a
    checkpoint (with the nearest one below as a hint), or a checkpoint never committed."""
    path = ckpt / METADATA_FILE
    if not ckpt.exists():
        raise BadInput("no such checkpoint directory", where=str(ckpt))
    if not ckpt.is_dir():
        raise BadInput("a DCP checkpoint is a directory, this is a file", where=str(ckpt))
    if not os.path.lexists(path):
        if not _looks_like_dcp(ckpt, rc):
            near = nearest_checkpoint(ckpt)
            raise BadInput("not a DCP checkpoint: the directory has no .metadata and no .distcp data files",
                           where=str(ckpt),
                           hint=(f"Did you mean {near}?" if near is not None else
                                 "Give the directory a trainer saved with torch.distributed.checkpoint "
                                 "(it holds .metadata beside __0_0.distcp files)."))
        extra = " A '.metadata.tmp' exists: rank 0 died while committing." if (ckpt / ".metadata.tmp").exists() else ""
        raise Incomplete(
            "not committed: the checkpoint has no .metadata, so a writer died before the commit" + extra,
            where=str(ckpt),
            hint="Resume from the previous checkpoint; this one cannot be trusted to be complete.",
        )
    if not os.path.exists(path):  # a dangling symlink
        raise BadInput(".metadata is a symbolic link to a file that does not exist", where=str(path))
    return path


def check_relative_path(rel: str, *, where: str, key: str | None) -> None:
    """A data file named by `.metadata` must be a plain name inside the checkpoint directory."""
    safefs.check_name(rel, where=where)
    if "/" in rel or "\\" in rel:
        who = f"storage of '{key}'" if key is not None else "a storage entry"
        raise safefs.UnsafeFile(f"{who} points outside the checkpoint ('{rel}')", where=where,
                                hint="Refusing to read files outside the checkpoint directory.")


def _looks_like_dcp(ckpt: Path, rc: RemoteCheckpoint | None = None) -> bool:
    """Whether a directory without `.metadata` is a DCP checkpoint whose commit never happened.

    Only data files (``*.distcp``) or a half-written ``.metadata.tmp`` say a writer was here;
    an empty directory, a folder of notes or a run directory is no checkpoint at all. ``rc``: the
    store ``ckpt`` stands for, when it is a staged directory.
    """
    if rc is not None:  # a remote checkpoint's data objects are in its listing, not in the directory
        return bool(rc.data_files()) or ".metadata.tmp" in rc.sizes
    try:
        with os.scandir(ckpt) as it:
            return any(e.name.endswith(".distcp") or e.name == ".metadata.tmp" for e in it)
    except OSError:
        return False


def nearest_checkpoint(root: Path, *, depth: int = 3, budget: int = 2000) -> Path | None:
    """The shallowest committed checkpoint below ``root`` (latest name first at one depth), or None.

    Breadth-first, at most ``depth`` levels and ``budget`` directories, symlinks not followed:
    a hint for a user who named the run directory instead of ``step_3/``, never a crawl.
    """
    level, seen = [root], 0
    for _ in range(depth):
        below: list[Path] = []
        for d in level:
            try:
                with os.scandir(d) as it:
                    subs = sorted((Path(e.path) for e in it if e.is_dir(follow_symlinks=False)),
                                  key=lambda p: _natural(p.name))
            except OSError:
                continue
            seen += len(subs)
            below.extend(subs)
            if seen > budget:
                break
        hits = [p for p in below if (p / METADATA_FILE).is_file()]
        if hits:
            return hits[-1]
        level = below
        if seen > budget or not level:
            break
    return None


def _natural(name: str) -> tuple:
    """``step_10`` after ``step_9``: digits compared as numbers."""
    import re

    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def metadata_cap(ckpt: Path, rc: RemoteCheckpoint | None = None) -> int:
    """How large a `.metadata` reshard reads: `MIN_METADATA_CAP`, or the bytes of the data beside it.

    Not a constant: a 16,384-rank checkpoint of a 405B model has 22 M storage entries and a
    `.metadata` of about 9 GB, which a constant cap sized for today's files would refuse.
    Every entry names an item of at least a torch.save header in a data file, so a real
    `.metadata` is far smaller than its data (0.15% at 8B x 1,024 ranks); one larger than all
    the other files of its directory together describes bytes that are not there. ``rc``: the
    store ``ckpt`` stands for (its data objects are in its listing, not in the directory).
    """
    if rc is not None:  # a remote checkpoint's data objects, from its one listing
        return max(MIN_METADATA_CAP, rc.data_bytes())
    total = 0
    try:
        with os.scandir(ckpt) as it:
            for e in it:
                if e.name != METADATA_FILE and e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
    except OSError:
        return MIN_METADATA_CAP
    return max(MIN_METADATA_CAP, total)


def bad_metadata(where: str, what: str) -> BadInput:
    return BadInput(
        f"malformed checkpoint metadata: {what}",
        where=where,
        hint="The file is corrupt or was not written by torch.distributed.checkpoint.",
    )


def chunk_rank_mismatch(where: str, key: str, index: int, offsets: tuple[int, ...], sizes: tuple[int, ...],
                        shape: tuple[int, ...]) -> BadInput:
    """The refusal of chunk ``index`` of tensor ``key`` whose offsets or sizes have another rank than its shape,
    naming the key and the chunk (torch's planner gives every chunk its tensor's rank)."""
    dims = f"{len(offsets)} dims" if len(offsets) == len(sizes) else f"{len(offsets)} and {len(sizes)} dims"
    return BadInput(
        f"malformed checkpoint metadata: chunk {index} of tensor '{key}' has offsets {list(offsets)} and sizes "
        f"{list(sizes)} ({dims}), but the tensor's shape {list(shape)} has {len(shape)}",
        where=where, keys=[key],
        hint="torch.distributed.checkpoint gives every chunk its tensor's rank; the file is corrupt or forged.")


def unwritable_dtypes(where: str, found: list[tuple[str, DType]]) -> BadInput:
    """The refusal of a checkpoint holding tensors of a dtype reshard cannot write (`reshard.model.dtypes.unstorable_reason`:
    every dtype whose items are plain storage bytes is written, float8/float4/uint16-64/bits/complex included), every
    such key named with its dtype, before anything is planned."""
    listed = ", ".join(f"'{k}' ({str(d).removeprefix('torch.')})" for k, d in found[:8]) + (" ..." if len(found) > 8 else "")
    reasons = sorted({f"{str(d).removeprefix('torch.')} is {unstorable_reason(d)}" for _, d in found})
    quantized = any("quantized" in r for r in reasons)
    return BadInput(
        f"{len(found)} tensor(s) have a dtype reshard cannot read or write: {listed} ({'; '.join(reasons)})",
        where=where, keys=[k for k, _ in found],
        hint=("Save such tensors dequantized (t.dequantize()), or as their int_repr() beside the scale and zero "
              "point, and checkpoint again; reshard plans nothing for this checkpoint" if quantized else
              "Save such tensors in a dtype with a storage and checkpoint again; reshard plans nothing for this "
              "checkpoint"))


def _int_tuple(v: Any, where: str, what: str, key: str) -> tuple[int, ...]:
    """``v`` as a tuple of ints, or BadInput naming ``what`` of ``key`` (the message is built only then)."""
    if type(v) is tuple and {*map(type, v)} <= INT_ONLY:  # the common case, once per chunk: no copy, C speed
        return v
    if not isinstance(v, (tuple, list)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise bad_metadata(where, f"{what} of '{key}' is not a tuple of integers")
    return tuple(int(x) for x in v)


def _decode(md: Any, where: str) -> RawMetadata:
    if not isinstance(md, Record) or type(md).__name__ != "Metadata":
        raise bad_metadata(where, f"top-level object is {type(md).__name__}, not Metadata")
    sdm = md.get("state_dict_metadata")
    if not isinstance(sdm, dict):
        raise bad_metadata(where, "state_dict_metadata is not a mapping")
    entries: dict[str, RawTensor | RawObject] = {}
    unwritable: list[tuple[str, DType]] = []
    for key, value in sdm.items():
        if not isinstance(key, str):
            raise bad_metadata(where, f"entry key {key!r} is not a string")
        kind = type(value).__name__
        if kind == "BytesStorageMetadata":
            entries[key] = RawObject(key)
        elif kind == "TensorStorageMetadata":
            props = value.get("properties")
            dtype = props.get("dtype") if isinstance(props, Record) else None
            if not isinstance(dtype, DType):
                raise bad_metadata(where, f"tensor '{key}' has no valid dtype")
            if unstorable_reason(dtype) is not None:
                unwritable.append((key, dtype))
            shape = _int_tuple(value.get("size"), where, "global shape", key)
            chunks_in = value.get("chunks")
            if not isinstance(chunks_in, list):
                raise bad_metadata(where, f"chunks of '{key}' are not a list")
            chunks = []
            add = chunks.append
            rank = len(shape)
            for c in chunks_in:
                if not isinstance(c, Record):
                    raise bad_metadata(where, f"a chunk of '{key}' is not a chunk record")
                d = c.__dict__
                o = _int_tuple(d.get("offsets"), where, "chunk offsets", key)
                s = _int_tuple(d.get("sizes"), where, "chunk sizes", key)
                if len(o) != rank or len(s) != rank:
                    # Refused here, by name: the columns keep a key's chunks as rows of its rank, one
                    # key after another, so a chunk of another rank would shift every later key's rows.
                    raise chunk_rank_mismatch(where, key, len(chunks), o, s, shape)
                add((o, s))
            entries[key] = RawTensor(key, shape, dtype, chunks)
        else:
            raise bad_metadata(where, f"entry '{key}' has unknown storage type {kind}")
    if unwritable:
        raise unwritable_dtypes(where, unwritable)
    storage = md.get("storage_data")
    if not isinstance(storage, dict):
        raise bad_metadata(where, "storage_data is not a mapping (not written by the filesystem writer?)")
    locations: dict[tuple[str, tuple[int, ...] | None], ItemLocation] = {}
    checked: set[str] = set()  # a few file names, each stored with thousands of items: checked once each
    for idx, info in storage.items():
        if not isinstance(idx, Record) or not isinstance(info, Record):
            raise bad_metadata(where, "storage_data holds unexpected objects")
        di, dd = idx.__dict__, info.__dict__
        fqn = di.get("fqn")
        if not isinstance(fqn, str):
            raise bad_metadata(where, "a storage index has no key name")
        off = di.get("offset")
        offsets = None if off is None else _int_tuple(off, where, "storage offset", fqn)
        rel = dd.get("relative_path")
        if type(rel) is not str:
            raise bad_metadata(where, f"storage of '{fqn}' has no file name")
        if rel not in checked:
            check_relative_path(rel, where=where, key=fqn)
            checked.add(rel)
        o, n = dd.get("offset"), dd.get("length")
        if not (isinstance(o, int) and isinstance(n, int)) or o < 0 or n < 0:
            raise bad_metadata(where, f"storage of '{fqn}' has an invalid byte range")
        tds = dd.get("transform_descriptors") or ()
        if tds:
            if not isinstance(tds, (list, tuple)) or not all(isinstance(t, str) for t in tds):
                raise bad_metadata(where, f"storage of '{fqn}' has invalid transforms")
            tds = tuple(tds)
        locations[(fqn, offsets)] = ItemLocation(rel, o, n, tds)
    # `all_local_plans` (Megatron-Core's torch_dist save stores every rank's SavePlan here) is
    # read as inert records into plain item lists; the index takes them as evidence of how many
    # ranks saved only when they agree item for item with `storage_data` (reshard.storage.checkpoints.save_plans).
    planner = md.get("planner_data")
    paths: dict[str, tuple] = {}
    if isinstance(planner, dict):
        for k, v in planner.items():
            if isinstance(k, str) and isinstance(v, (tuple, list)):
                paths[k] = tuple(v)
    version = md.get("version")
    return RawMetadata(entries, locations, paths, version if isinstance(version, str) else None,
                       save_plans.decode(md.get("all_local_plans")))


# ---------------------------------------------------------------------------- item bytes

def read_item_bytes(ckpt: Path, loc: ItemLocation, *, key: str, rc: RemoteCheckpoint | None = None) -> bytes:
    """The raw (still transformed) bytes of one item, checked for length. ``rc``: the store
    ``ckpt`` stands for, handed down by whoever opened it (`reshard.storage.source.Source`): the
    item's byte range is fetched from it, since a staged directory holds no data file."""
    if rc is not None:
        return rc.read_range(loc.file, loc.offset, loc.length, key=key)
    path = ckpt / loc.file
    try:
        fd = safefs.open_read(path, root=ckpt)
        try:
            data = _pread_all(fd, loc.offset, loc.length)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise Incomplete(f"data file '{loc.file}' is missing (needed for '{key}')", where=str(ckpt),
                         hint="The checkpoint is incomplete; restore the file or use another checkpoint.") from None
    except OSError as exc:
        raise BadInput(f"cannot read '{key}': {exc}", where=str(path)) from None
    if len(data) != loc.length:
        raise Incomplete(
            f"'{key}' needs bytes [{loc.offset}, {loc.offset + loc.length}) but the file ends at {loc.offset + len(data)}",
            where=str(path),
            hint="The data file is truncated; the checkpoint is incomplete.",
        )
    return data


def _pread_all(fd: int, offset: int, length: int) -> bytes:
    """Up to ``length`` bytes at ``offset``, fewer only where the file ends."""
    parts, got = [], 0
    while got < length:
        b = os.pread(fd, min(length - got, 64 << 20), offset + got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


MAX_INFLATE_RATIO = 1024        # a compressed item may inflate this much (zeros compress ~1000x) ...
MAX_INFLATE_SLACK = 64 << 20    # ... plus this, when its caller does not know how large it must be


def untransform(data: bytes, transforms: Sequence[str], *, key: str, where: str, limit: int | None = None) -> bytes:
    """Undo an item's stream transforms (DCP applies them in order on save; undone in reverse).

    The result is capped: at ``limit`` bytes when the caller knows the item's size (a tensor
    chunk: its elements, dtype and archive overhead), else at `MAX_INFLATE_RATIO` times the
    stored bytes plus `MAX_INFLATE_SLACK`, so a small compressed item cannot inflate without bound.
    """
    cap = limit if limit is not None else MAX_INFLATE_RATIO * len(data) + MAX_INFLATE_SLACK
    for desc in reversed(list(transforms)):
        name, _, version = desc.partition("/")
        if name == "stream.zstd" and version.split(".")[0] == "1":
            data = _zstd_decompress(data, key=key, where=where, limit=cap)
        else:
            raise BadInput(f"item '{key}' uses transform '{desc}', which reshard does not know", where=where,
                           hint="Convert the checkpoint with the tool that wrote it, or file an issue with the descriptor.")
    return data


def _zstd_decompress(data: bytes, *, key: str, where: str, limit: int) -> bytes:
    try:
        import zstandard  # type: ignore[import-not-found]
    except ImportError:
        zstandard = None
    try:
        if zstandard is not None:
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as r:
                out = r.read(limit + 1)
        else:
            import pyzstd  # type: ignore[import-not-found]

            d = pyzstd.ZstdDecompressor()
            out = d.decompress(data, max_length=limit + 1)
    except ImportError:
        raise BadInput(f"item '{key}' is zstd-compressed and no zstd module is installed", where=where,
                       hint="pip install 'reshard[zstd]' (the zstandard package) and run again.") from None
    except Exception as exc:  # pragma: no cover - corrupt stream
        raise BadInput(f"item '{key}' has a corrupt zstd stream: {exc}", where=where) from None
    if len(out) > limit:
        raise BadInput(f"item '{key}' inflates to more than {limit:,} bytes from {len(data):,}", where=where,
                       hint="Its chunk cannot need that many; the item is corrupt or forged (a compression bomb).")
    return out


def tensor_item_limit(numel: int, itemsize: int) -> int:
    """The most bytes a decoded ``torch.save`` item of one chunk can need: its storage plus the archive around it."""
    return numel * itemsize + (1 << 20)


OBJECT_INFLATION = 64
"""An object item's loaded value may hold at most this many times its stored bytes (plus
`OBJECT_SLACK`), counted expanded: every container slot 8 bytes, every string its length,
every tensor its elements times their size, once per place it appears. Real object items
(counters, hyperparameters, sampler states) hold less than their stored bytes."""
OBJECT_SLACK = 1 << 20


@dataclass
class TrustedUnpickles:
    """The object items this process unpickled with arbitrary classes allowed (``--trust-pickle``).

    Collected as they are loaded so the command can say, once, on one line, which items it
    let run code (`warning`); the CLI takes the line when the command ends.
    """

    items: dict[tuple[str, str], None] = field(default_factory=dict)  # (key, file), in load order

    def record(self, key: str, where: str) -> None:
        self.items[(key, where)] = None

    def take(self) -> list[tuple[str, str]]:
        """What was recorded since the last call, ``(key, file)`` in load order (and forget it):
        a worker of a distributed run hands it to the one process that warns for the run
        (`reshard.engine.distributed`), which records it again."""
        items, self.items = list(self.items), {}
        return items

    def warning(self) -> str | None:
        """The one warning line for what was recorded since the last call (and forget it), or None."""
        items = self.take()
        if not items:
            return None
        keys = list(dict.fromkeys(k for k, _ in items))
        files = list(dict.fromkeys(w for _, w in items))
        return (f"warning: --trust-pickle: unpickled {len(keys)} object item{'s' if len(keys) != 1 else ''} with "
                f"arbitrary classes allowed (any code in them ran): {', '.join(repr(k) for k in keys)} "
                f"(from {', '.join(files)})")


TRUSTED_UNPICKLES = TrustedUnpickles()


def _loaded_size(obj: Any, limit: int) -> int:
    """Bytes ``obj`` holds counted expanded (see `OBJECT_INFLATION`), stopping once past ``limit``."""
    import torch

    total, todo = 0, [obj]
    while todo and total <= limit:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, (str, bytes, bytearray)):
            total += len(x)
        elif isinstance(x, dict):
            total += 16 * len(x)
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            total += 8 * len(x)
            todo.extend(x)
        else:
            total += 8
    return total


def _is_unsafe_global(msg: str) -> bool:
    low = msg.lower()
    return "unsupported global" in low or "global " in low and "not an allowed global" in low


def torch_load_item(data: bytes, *, key: str, where: str, trust_pickle: bool, tensor: bool = False) -> Any:
    """``torch.load`` of one item's bytes, bounded, with ``weights_only=True`` unless trusted.

    Before loading: the archive may not inflate (`item_pickle`) and its ``data.pkl`` may build
    no more than `reshard.storage.pickles.safe_pickle.pickle_budget` of its length (the same cost scan as
    `.metadata`). After: the value may hold no more than `OBJECT_INFLATION` times the item's
    bytes (an expanded view, or one tensor referenced a million times). ``trust_pickle``
    applies to object items only: an item that ``weights_only=True`` refuses for a global is
    then loaded with arbitrary classes allowed and recorded in `TRUSTED_UNPICKLES` (the
    command's warning). A tensor item (``tensor=True``) never needs more than the safe set,
    so it is refused whatever ``trust_pickle`` says.
    """
    import torch  # only here, where an item's bytes are decoded

    check_cost(item_pickle(data, key=key, where=where), where=where, what=f"the pickle of item '{key}'")
    try:
        try:
            # io.BytesIO is a user blob DCP pickles (`dcp.save({"blob": io.BytesIO(...)})`): its
            # pickle builds a bytes buffer and nothing else, so object items may hold one.
            with torch.serialization.safe_globals([] if tensor else [io.BytesIO]):
                obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            msg = str(exc)
            if not _is_unsafe_global(msg) and not (trust_pickle and not tensor):
                raise
            if not trust_pickle or tensor:
                first = msg.strip().splitlines()
                detail = next((ln.strip() for ln in first if "GLOBAL" in ln or "global" in ln), first[0] if first else "")
                raise UnsafeInput(
                    f"item '{key}' is a pickle that references code outside the safe set ({detail[:200]})",
                    where=where,
                    hint="reshard refuses to run it. A tensor item never needs more than the safe set, so "
                         "--trust-pickle does not apply to it: the checkpoint is corrupt or forged." if tensor else
                         "reshard refuses to run it. If you wrote this checkpoint yourself, pass --trust-pickle.",
                ) from None
            TRUSTED_UNPICKLES.record(key, where)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except UnsafeInput:
        raise
    except pickle.UnpicklingError as exc:
        msg = str(exc)
        detail = msg.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()[0] if msg.strip() else ""
        raise BadInput(f"item '{key}' is not a readable torch.save blob ({detail[:200]})", where=where,
                       hint="The data file is corrupt.") from None
    except Exception as exc:
        raise BadInput(f"item '{key}' is not a readable torch.save blob ({type(exc).__name__}: {str(exc)[:200]})",
                       where=where, hint="The data file is corrupt.") from None
    limit = OBJECT_INFLATION * len(data) + OBJECT_SLACK
    size = _loaded_size(obj, limit)
    if size > limit:
        raise BadInput(f"item '{key}' of {len(data):,} bytes loads as a value of more than {limit:,} bytes "
                       f"({OBJECT_INFLATION}x its size plus {OBJECT_SLACK:,})", where=where,
                       hint="Real items hold about their own size; this one is corrupt or forged (an amplifying pickle).")
    return obj


def checked_item_bytes(ckpt: Path, loc: ItemLocation, *, key: str, limit: int | None = None,
                       rc: RemoteCheckpoint | None = None) -> bytes:
    """One item's bytes as ``torch.load`` reads them: read from its byte range, its stream
    transforms undone (bounded by ``limit``, `untransform`), every member checked against its
    writer's CRC-32 (`CorruptItem`, exit 2). What every reader of an item starts from."""
    from reshard.storage.checkpoints.fastread import check_item_crcs

    where = str(ckpt / loc.file)
    data = untransform(read_item_bytes(ckpt, loc, key=key, rc=rc), loc.transforms, key=key, where=where, limit=limit)
    check_item_crcs(data, key=key, where=where)
    return data


def load_item(ckpt: Path, loc: ItemLocation, *, key: str, trust_pickle: bool = False, limit: int | None = None,
              tensor: bool = False, rc: RemoteCheckpoint | None = None) -> Any:
    """Read one item (a tensor chunk, ``tensor=True``, or an object) from its byte range (`torch_load_item`)."""
    data = checked_item_bytes(ckpt, loc, key=key, limit=limit, rc=rc)
    return torch_load_item(data, key=key, where=str(ckpt / loc.file), trust_pickle=trust_pickle, tensor=tensor)


def check_loadable(data: bytes, *, key: str, where: str, trust_pickle: bool) -> None:
    """Prove an object item loads as ``torch.load(weights_only=True)`` would load it, before it is
    carried unchanged: decoded without torch when it is plain (`reshard.storage.pickles.plain_items` admits a
    subset of torch's weights-only set), else by `torch_load_item` itself, which raises as it always
    did (an unsafe global, an amplifying pickle, a corrupt archive)."""
    try:
        decode_item(data, key=key, where=where)
    except NotPlain:
        torch_load_item(data, key=key, where=where, trust_pickle=trust_pickle)
