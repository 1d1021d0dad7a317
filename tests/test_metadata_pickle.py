"""`reshard.storage.pickles.metadata_pickle`: DCP's `.metadata` pickle written without torch.

The reference is torch itself: a ``Metadata`` built from torch's own classes exactly as
``DcpWriter._metadata`` built it before the emitter existed (`torch_metadata` below, kept
here so the comparison stays independent of the writer that now uses the emitter), compared
field by field *and type by type* with what ``pickle.loads`` makes of the emitter's bytes;
reshard's safe reader decodes both to the same; and a checkpoint saved by ``dcp.save`` whose
`.metadata` is replaced by the emitter's is loaded back strictly by ``dcp.load``, every value
compared bitwise.
"""
from __future__ import annotations

import dataclasses
import enum
import pickle
import pickletools
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from reshard.model.checkpoint import ItemLocation
from reshard.paths import formats_root
from reshard.storage.checkpoints.dcp import read_raw_metadata
from reshard.storage.pickles.safe_pickle import pickle_cost
from reshard.storage.pickles.metadata_pickle import (
    DTYPE_NAMES,
    EMITTED_GLOBALS,
    ObjectMeta,
    TensorMeta,
    metadata_bytes,
)

REPO = Path(__file__).resolve().parents[1]
VERSION = "1.0.0"  # dcp_writer._DCP_VERSION: torch's CURRENT_DCP_VERSION


def torch_metadata(items: list, version: str) -> Metadata:
    """The ``Metadata`` that ``DcpWriter._metadata`` builds for the same content (its code, with torch's classes)."""
    sdm, storage, planner = {}, {}, {}
    for it in items:
        if isinstance(it, TensorMeta):
            sdm[it.key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=getattr(torch, it.dtype)),
                size=torch.Size(it.shape),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in it.chunks],
            )
            for o, _s, loc in it.chunks:
                storage[MetadataIndex(it.key, o)] = _info(loc)
        else:
            sdm[it.key] = BytesStorageMetadata()
            storage[MetadataIndex(it.key)] = _info(it.location)
        planner[it.key] = tuple(it.path)
    return Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(), version=version)


def _info(loc: ItemLocation) -> _StorageInfo:
    if loc.transforms:
        return _StorageInfo(loc.file, loc.offset, loc.length, transform_descriptors=list(loc.transforms))
    return _StorageInfo(loc.file, loc.offset, loc.length)


def assert_same(a, b, at: str = "md") -> None:
    """``a`` and ``b`` equal and of the same types all the way down: dict keys (and their order),
    torch.Size against tuple, dtypes by identity, which fields each record holds in its ``__dict__``."""
    assert type(a) is type(b), f"{at}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert len(a) == len(b), f"{at}: {len(a)} vs {len(b)} items"
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert_same(ka, kb, f"{at}.key")
            assert_same(va, vb, f"{at}[{ka!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{at}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{at}[{i}]")
    elif dataclasses.is_dataclass(a):  # the fields it holds (their order is its __init__'s or __setstate__'s)
        assert sorted(vars(a)) == sorted(vars(b)), f"{at}: fields {sorted(vars(a))} vs {sorted(vars(b))}"
        for name in vars(a):
            assert_same(vars(a)[name], vars(b)[name], f"{at}.{name}")
    elif isinstance(a, (torch.dtype, torch.layout, torch.memory_format, enum.Enum)):
        assert a is b, f"{at}: {a} vs {b}"
    else:
        assert a == b, f"{at}: {a!r} vs {b!r}"


L = ItemLocation


def mixed_items() -> list:
    """Several dtypes (aliases too), a 0-d tensor, a tensor without chunks, objects, zstd items and plain ones,
    planner paths with ints of every size and nested tuples, a key with a lone surrogate, > 1,000 items and
    > 1,000 chunks (batches, frames, long memo indices), offsets and lengths past 2**31."""
    items = [
        TensorMeta("model.w", "bfloat16", (4, 2), [((0, 0), (2, 2), L("__0_0.distcp", 0, 812)),
                                                   ((2, 0), (2, 2), L("__1_0.distcp", 0, 700, ("stream.zstd/1",)))],
                   ("model", "w")),
        TensorMeta("model.f8", "float8_e4m3fn", (3,), [((0,), (3,), L("__0_0.distcp", 812, 900))], ("model", "f8")),
        ObjectMeta("step", L("__0_0.distcp", 1712, 600), ("step",)),
        TensorMeta("scalar", "float", (), [((), (), L("__0_0.distcp", 2312, 640))], ("scalar",)),
        TensorMeta("empty", "int64", (0, 5), [], ("empty",)),
        TensorMeta("opt.state.0.exp_avg", "half", (6, 2, 2, 2), [((0, 0, 0, 0), (6, 2, 2, 2), L("__1_0.distcp", 700, 9000))],
                   ("opt", "state", 0, "exp_avg")),
        ObjectMeta("extra.nested", L("__1_0.distcp", 9700, 300, ("stream.zstd/1", "x")), ("extra", ("a", 1), [2, "b"])),
        ObjectMeta("ünï.\udcff", L("__1_0.distcp", 10_000, 3), ("ünï\udcff", -1, -(1 << 70), 1 << 70, None, True)),
        TensorMeta("big", "long", (1 << 40, 3), [((1 << 38, 0), (1 << 38, 3), L("__2_0.distcp", (1 << 40) + 5, 1 << 33)),
                                                ((0, 0), (1 << 38, 3), L("__2_0.distcp", 0, 1 << 33)),
                                                ((2 << 38, 0), (2 << 38, 3), L("__2_0.distcp", 1 << 41, 70000))],
                   ("big",)),
        TensorMeta("k" * 300, "complex64", (2,), [((0,), (2,), L("f" * 300, 3, 4))], ("k" * 300,)),
        TensorMeta("many_chunks", "float32", (2500, 8),
                   [((i, 0), (1, 8), L(f"__{i % 7}_0.distcp", 100_000 + i * 1000, 900)) for i in range(2500)],
                   ("many_chunks",)),
    ]
    items += [TensorMeta(f"layers.{i}.w", "bfloat16", (2, 2), [((0, 0), (2, 2), L(f"__{i % 300}_0.distcp", 64 * i, 64))],
                         ("layers", f"{i}.w")) for i in range(1200)]
    items += [ObjectMeta(f"obj.{i}", L("__0_0.distcp", 10 ** 7 + i, 1), (f"obj.{i}",)) for i in range(1100)]
    return items


@pytest.fixture(scope="module")
def mixed():
    items = mixed_items()
    return items, metadata_bytes(items, version=VERSION), torch_metadata(items, VERSION)


def test_equal_to_torch_metadata(mixed):
    items, data, reference = mixed
    md = pickle.loads(data)
    assert md == reference
    torchs = pickle.dumps(reference)
    # what a reader gets from torch's own pickle (its __getstate__ drops _StorageInfo's None fields)
    assert_same(md, pickle.loads(torchs))
    assert_same(pickle._loads(data), pickle.loads(torchs))  # the pure-Python unpickler checks every frame boundary
    assert len(data) <= len(torchs), f"{len(data)} bytes, torch's own pickle {len(torchs)}"
    ops = [op.name for op, _arg, _pos in pickletools.genops(data)]
    assert ops.count("FRAME") > 1 and ops[0] == "PROTO"


@pytest.mark.parametrize("items", [
    [],
    [ObjectMeta("o", L("__0_0.distcp", 0, 5), ("o",))],
    [TensorMeta("e", "float32", (0,), [], ("e",))],
    [TensorMeta("w", "bfloat16", (2,), [((0,), (2,), L("__0_0.distcp", 0, 9, ("stream.zstd/1",)))], ("w",))],
], ids=["empty", "one-object", "no-chunks", "one-chunk"])
def test_small_contents(items):
    """What is used once is written in place (no memo), so even a tiny Metadata is no larger than torch's pickle."""
    data, reference = metadata_bytes(items, version=VERSION), torch_metadata(items, VERSION)
    assert pickle.loads(data) == reference
    assert_same(pickle._loads(data), pickle.loads(pickle.dumps(reference)))
    assert len(data) <= len(pickle.dumps(reference))


def test_every_torch_dtype_name(tmp_path):
    """DTYPE_NAMES is torch's dtype table; each name, alias or not, unpickles to that very dtype."""
    table = {n: v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    assert DTYPE_NAMES == set(table)
    items = [TensorMeta(f"t.{n}", n, (1,), [((0,), (1,), L("__0_0.distcp", i, 1))], ("t", n)) for i, n in enumerate(sorted(table))]
    data = metadata_bytes(items, version=VERSION)
    md = pickle.loads(data)
    for n, v in table.items():
        assert md.state_dict_metadata[f"t.{n}"].properties.dtype is v
        canonical = v.__reduce__()  # what torch's pickler names: "float32" for torch.float
        assert bytes((0x8C, len(canonical))) + canonical.encode() + b"\x93" in data  # the name, STACK_GLOBAL
        if canonical != n:
            assert bytes((0x8C, len(n))) + n.encode() + b"\x93" not in data
    assert md == torch_metadata(items, VERSION)
    assert_same(md, pickle.loads(pickle.dumps(torch_metadata(items, VERSION))))


def test_safe_reader_decodes_the_same(mixed, tmp_path):
    """reshard's own allow-listing reader takes the bytes (every global admitted by formats/dcp_metadata.toml)
    and decodes them exactly as it decodes torch's pickle of the same Metadata."""
    items, data, reference = mixed
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for d, b in ((ours, data), (theirs, pickle.dumps(reference))):
        d.mkdir()
        (d / ".metadata").write_bytes(b)
    a, b = read_raw_metadata(ours), read_raw_metadata(theirs)
    assert a == b
    # denser than torch's pickle, so more units per byte, but far inside the reader's budget of 8
    assert pickle_cost(data, limit=1 << 40) <= 2.5 * len(data)
    assert a.locations[("model.w", (2, 0))].transforms == ("stream.zstd/1",)
    assert a.planner_paths["extra.nested"] == ("extra", ("a", 1), [2, "b"])
    with open(formats_root() / "dcp_metadata.toml", "rb") as f:
        allowed = {(e["module"], e["name"]) for e in tomllib.load(f)["allow"]}
    assert EMITTED_GLOBALS <= allowed and ("torch", "*") in allowed  # dtypes: torch.<name>, by torch's table


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two checkpoints written by ``dcp.save`` in this process (no process group): plain, and zstd-compressed."""
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    g = torch.Generator().manual_seed(33)
    state = {
        "model": {"w": torch.randn(8, 4, generator=g).to(torch.bfloat16),
                  "b": torch.randn(4, generator=g),
                  "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
                  "n": torch.tensor(3.5, dtype=torch.float64),
                  "i": torch.arange(10, dtype=torch.int64).reshape(2, 5)},
        "step": 7,
        "extra": {"lr": 0.125, "names": ["a", "b"]},
    }
    root = tmp_path_factory.mktemp("mdpickle")
    plain, zstd = root / "plain", root / "zstd"
    dcp.save(state, checkpoint_id=str(plain), no_dist=True)
    dcp.save(state, storage_writer=FileSystemWriter(str(zstd), _extensions=[ZStandard()]), no_dist=True)
    return state, {"plain": plain, "zstd": zstd}


def _plain_items(md: Metadata) -> list:
    """Torch's Metadata as the emitter's plain inputs (what reshard knows of a checkpoint)."""
    def loc(idx):
        si = md.storage_data[idx]
        return L(si.relative_path, si.offset, si.length, tuple(si.transform_descriptors or ()))

    items = []
    for key, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            items.append(TensorMeta(key, str(v.properties.dtype).removeprefix("torch."), tuple(v.size),
                                    [(tuple(c.offsets), tuple(c.sizes), loc(MetadataIndex(key, c.offsets))) for c in v.chunks],
                                    md.planner_data[key]))
        else:
            items.append(ObjectMeta(key, loc(MetadataIndex(key)), md.planner_data[key]))
    return items


@pytest.mark.parametrize("kind", ["plain", "zstd"])
def test_dcp_load_reads_the_rewritten_metadata(saved, kind, tmp_path):
    """A real checkpoint's `.metadata` replaced by the emitter's: same records, and ``dcp.load`` (strict) gives back
    every value bitwise."""
    import shutil

    state, dirs = saved
    ck = tmp_path / kind
    shutil.copytree(dirs[kind], ck)
    md = FileSystemReader(str(ck)).read_metadata()
    (ck / ".metadata").write_bytes(metadata_bytes(_plain_items(md), version=md.version))
    again = FileSystemReader(str(ck)).read_metadata()
    assert_same(again.state_dict_metadata, md.state_dict_metadata)  # both read back from a pickle
    # dcp.save orders storage_data as it wrote the items and stores `index` hints (not compared: DcpWriter
    # never wrote them); every index equal, of the same types, and the same _StorageInfo
    assert again.storage_data == md.storage_data
    theirs = {idx: idx for idx in md.storage_data}
    for idx, info in again.storage_data.items():
        assert_same((idx.fqn, idx.offset), (theirs[idx].fqn, theirs[idx].offset))
        assert_same(info, md.storage_data[idx])
    assert_same(again.planner_data, md.planner_data)
    if kind == "zstd":
        assert all(si.transform_descriptors for si in again.storage_data.values())

    fresh = {"model": {k: torch.zeros_like(t) for k, t in state["model"].items()}, "step": 0,
             "extra": {"lr": 0.0, "names": []}}
    dcp.load(fresh, checkpoint_id=str(ck), no_dist=True)
    for k, t in state["model"].items():
        got = fresh["model"][k]
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
    assert fresh["step"] == 7 and fresh["extra"] == {"lr": 0.125, "names": ["a", "b"]}


NO_TORCH = r"""
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported: " + name)
        return None
sys.meta_path.insert(0, NoTorch())
from reshard.model.checkpoint import ItemLocation as L
from reshard.storage.pickles.metadata_pickle import ObjectMeta, TensorMeta, metadata_bytes
b = metadata_bytes([TensorMeta("w", "bfloat16", (2,), [((0,), (2,), L("__0_0.distcp", 0, 9, ("stream.zstd/1",)))], ("w",)),
                    ObjectMeta("o", L("__0_0.distcp", 9, 9), ("o",))], version="1.0.0")
assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
print(len(b))
"""


def test_no_torch_import():
    """The module and a call import no torch module (a finder that refuses any is put first)."""
    r = subprocess.run([sys.executable, "-c", NO_TORCH], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) > 100


def _one(**kw):
    base = dict(key="w", dtype="float32", shape=(4,), chunks=[((0,), (4,), L("__0_0.distcp", 0, 9))], path=("w",))
    base.update(kw)
    return TensorMeta(**base)


@pytest.mark.parametrize("items, message", [
    ([_one(dtype="float33")], "'w': unknown dtype name 'float33'"),
    ([_one(dtype="Size")], "unknown dtype name 'Size'"),
    ([_one(key=3)], "key is 3, not a str"),
    ([_one(), _one()], "'w' is given twice"),
    ([_one(shape=(4, -1))], "shape"),
    ([_one(chunks=[((0, 0), (4,), L("a", 0, 1))])], "offsets"),
    ([_one(chunks=[((0.0,), (4,), L("a", 0, 1))])], "chunk offsets (0.0,) is not a tuple of ints"),
    ([_one(chunks=[((0,), (2,), L("a", 0, 1)), ((0,), (2,), L("a", 1, 1))])], "two chunks at the same offsets [0]"),
    ([_one(chunks=[((0,), (4,), L("a", -1, 1))])], "invalid byte range"),
    ([_one(chunks=[((0,), (4,), ("a", 0, 1))])], "not an ItemLocation"),
    ([_one(path=("w", object()))], "the path holds a object"),
    ([ObjectMeta("o", L("", 0, 1), ("o",))], "no file name"),
])
def test_bad_input_is_refused(items, message):
    with pytest.raises(ValueError) as exc:
        metadata_bytes(items, version=VERSION)
    assert message in str(exc.value)
