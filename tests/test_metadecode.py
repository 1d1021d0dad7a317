"""The native `.metadata` decoder (reshard/storage/pickles/metadecode.c) reads what the safe path reads, or declines.

`metadecode.decode` streams a DCP `.metadata` into columns without building a Python object per
chunk; the safe path (`reshard.storage.checkpoints.dcp.read_raw_metadata`: the allow-listing unpickler, then
`_decode`) stays the reference. The decoder is a fast path, never a judge, so every check here is
one of two outcomes:

- on real files (``dcp.save`` in this process with bytes items, 0-d tensors, several dtypes, a
  pathlib checkpoint id and zstd transforms; a 4-rank FSDP2 save; the synthetic frontier writer
  with FSDP2 x TP; reshard's own writer, `metadata_pickle`) its columns, turned into the
  reference's records here, equal the reference's field by field, also read in blocks small
  enough that every opcode crosses a block boundary;
- on hostile and damaged files (truncations, bit flips, a memo fetch of a list, an unknown global,
  a huge declared length, Megatron's `all_local_plans`, amplifying pickles, an opcode across a
  frame's end, the corpora of test_costscan and test_hostile_pickle, random pickles) it answers
  None or exactly the reference's result, and never crashes.

Cost, one process on the shared 2-core machine: about 10 s for the module (torch and hypothesis
imports, the in-process saves, the frontier file), plus the session's `plain_fsdp2_ckpt` (about
10-15 s when this module is the first to ask for it; shared with the rest of the suite).
"""
from __future__ import annotations

import io
import os
import pickle
import random
import struct
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from reshard.errors import BadInput, ReshardError
from reshard.model.checkpoint import ItemLocation
from reshard.model.dtypes import DTYPES, unstorable_reason
from reshard.paths import formats_root
from reshard.safefs import check_name
from reshard.storage.checkpoints.dcp import RawObject, RawTensor, read_raw_metadata
from reshard.storage.pickles.safe_pickle import pickle_budget

metadecode = pytest.importorskip(
    "reshard.storage.pickles.metadecode",
    reason="the native decoder is not built (no C compiler at install time: setup.py builds it optionally)")


# ------------------------------------------------------------------------------------------ helpers

def allow_roles() -> dict[tuple[str, str], str]:
    """The toml's allow list as decode() takes it: a record's role is its class name, else its kind."""
    with open(formats_root() / "dcp_metadata.toml", "rb") as f:
        spec = tomllib.load(f)
    return {(e["module"], e["name"]): (e["name"] if e["kind"] == "record" else e["kind"]) for e in spec["allow"]}


ALLOW = allow_roles()
DTYPE_NAMES = frozenset(DTYPES)


def decode_file(path: Path, *, block: int = 1 << 24, size: int | None = None) -> dict | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        n = os.fstat(fd).st_size if size is None else size
        return metadecode.decode(fd, n, ALLOW, DTYPE_NAMES, pickle_budget(n), block=block)
    finally:
        os.close(fd)


def decode_bytes(data: bytes, tmp: Path, *, block: int = 1 << 24) -> dict | None:
    p = tmp / "m.pkl"
    p.write_bytes(data)
    return decode_file(p, block=block)


def i64(b: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(b) // 8}q", b))


def as_records(c: dict) -> tuple[dict, dict, dict, str | None]:
    """The columns as the reference's (entries, locations, planner paths, version)."""
    entries: dict = {}
    counts, offs, sizes = i64(c["chunk_count"]), i64(c["chunk_offsets"]), i64(c["chunk_sizes"])
    assert len(c["keys"]) == len(c["kinds"]) == len(c["dtypes"]) == len(c["shapes"]) == len(counts)
    at = 0
    for key, kind, dt, shape, n in zip(c["keys"], c["kinds"], c["dtypes"], c["shapes"], counts):
        if kind == 1:
            assert (dt, shape, n) == (None, None, 0)
            entries[key] = RawObject(key)
            continue
        nd = len(shape)
        chunks = [(tuple(offs[at + i * nd: at + (i + 1) * nd]), tuple(sizes[at + i * nd: at + (i + 1) * nd]))
                  for i in range(n)]
        at += n * nd
        entries[key] = RawTensor(key, shape, DTYPES[dt], chunks)
    assert at == len(offs) == len(sizes)
    n_rows = len(c["st_fqn"]) // 4
    fq = struct.unpack(f"<{n_rows}i", c["st_fqn"])
    nd = struct.unpack(f"<{n_rows}b", c["st_ndim"])
    so = i64(c["st_offsets"])
    fi = struct.unpack(f"<{n_rows}i", c["st_file"])
    tr = struct.unpack(f"<{n_rows}i", c["st_transforms"])
    o, ln, ix = i64(c["st_offset"]), i64(c["st_length"]), i64(c["st_index"])
    assert len(o) == len(ln) == len(ix) == n_rows
    locations: dict = {}
    at = 0
    for r in range(n_rows):
        offsets = None
        if nd[r] >= 0:
            offsets = tuple(so[at: at + nd[r]])
            at += nd[r]
        locations[(c["fqns"][fq[r]], offsets)] = ItemLocation(c["files"][fi[r]], o[r], ln[r],
                                                              c["transforms"][tr[r]] if tr[r] >= 0 else ())
    assert at == len(so)
    pd = c["planner_data"]
    paths = {k: tuple(v) for k, v in pd.items() if isinstance(k, str) and isinstance(v, (tuple, list))} \
        if isinstance(pd, dict) else {}
    return entries, locations, paths, c["version"]


def reference(ckpt: Path):
    """read_raw_metadata's records, or the class of its refusal."""
    try:
        return read_raw_metadata(ckpt)
    except ReshardError as exc:
        return type(exc)


def assert_same(ckpt: Path, cols: dict) -> None:
    ref = read_raw_metadata(ckpt)
    entries, locations, paths, version = as_records(cols)
    assert list(entries) == list(ref.entries)
    for k, e in ref.entries.items():
        assert entries[k] == e, k
    assert list(locations.items()) == list(ref.locations.items())
    assert paths == ref.planner_paths
    assert version == ref.version
    assert ref.local_plans is None


def python_must_refuse(cols: dict) -> bool:
    """Whether the columns hold what the checks left to Python refuse: a negative byte range, a file name
    that leaves the checkpoint, a dtype reshard cannot store (the decoder reports these faithfully)."""
    n = len(cols["st_fqn"]) // 4
    if n and min(i64(cols["st_offset"]) + i64(cols["st_length"])) < 0:
        return True
    for name in cols["files"]:
        try:
            check_name(name, where="-")
        except ReshardError:
            return True
        if "/" in name or "\\" in name:
            return True
    return any(d is not None and unstorable_reason(DTYPES[d]) is not None for d in cols["dtypes"])


def same_or_none(ckpt: Path, *, block: int = 1 << 24) -> str:
    """decode() on ckpt/.metadata: None, or exactly the reference's records. Which, as a word ("python":
    the reference refuses what the columns show and Python's checks on them will refuse too)."""
    cols = decode_file(ckpt / ".metadata", block=block)
    if cols is None:
        return "none"
    ref = reference(ckpt)
    if isinstance(ref, type):
        assert python_must_refuse(cols), f"decoded what the reference refuses ({ref.__name__})"
        return "python"
    assert_same(ckpt, cols)
    return "same"


# ------------------------------------------------------------------------------------------ real files

def _save(path: Path, sd: dict, **writer) -> Path:
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, **writer), checkpoint_id=path, no_dist=True)
    return path


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(6, 4, generator=g), "b": torch.zeros(4, dtype=torch.bfloat16),
                  "emb": torch.arange(12, dtype=torch.int64).reshape(3, 2, 2), "flag": torch.ones(2, dtype=torch.bool),
                  "f8": torch.zeros(3, dtype=torch.float8_e4m3fn), "big": torch.zeros(300, 2)},
        "step": torch.tensor(7),
        "extra": {"lr": 0.1, "names": ["a", "b"], "nested": {"x": (1, 2)}},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """In-process dcp.save checkpoints: plain (checkpoint_id a pathlib Path: StorageMeta), zstd-compressed."""
    import warnings

    from torch.distributed.checkpoint._extension import ZStandard

    root = tmp_path_factory.mktemp("metadecode")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"plain": _save(root / "plain", _state()),
                "zstd": _save(root / "zstd", _state(), _extensions=[ZStandard()])}


@pytest.fixture(scope="module")
def frontier(tmp_path_factory) -> Path:
    """The synthetic frontier writer's `.metadata` (torch's own pickle, streamed): a small Llama, FSDP2 x TP, 8 ranks."""
    from reshard.testing.synthetic_metadata import LlamaConfig, make_llama_metadata_checkpoint

    cfg = LlamaConfig("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    out = tmp_path_factory.mktemp("frontier") / "ckpt"
    return make_llama_metadata_checkpoint(out, cfg, ranks=8, tp=2).path


@pytest.mark.parametrize("which", ["plain", "zstd"])
def test_in_process_saves_decode_to_the_reference(saved, which):
    """Tensors of five dtypes (a 0-d one), bytes items, StorageMeta, and zstd transforms: the same records."""
    cols = decode_file(saved[which] / ".metadata")
    assert cols is not None
    assert_same(saved[which], cols)
    assert cols["version"] == "1.0.0"
    assert set(cols["dtypes"]) >= {"float32", "bfloat16", "int64", "bool", "float8_e4m3fn", None}
    assert cols["storage_meta"]["checkpoint_id"] == "/".join(saved[which].parts)  # a PosixPath, joined as _path does
    assert cols["storage_meta"]["load_id"] is None and cols["storage_meta"]["modules"] == []
    assert (cols["transforms"] != []) == (which == "zstd")
    # what the reference does not keep, against torch's own objects (our own file: unpickled as it is)
    md = _metadata_object(saved[which])
    assert i64(cols["st_index"]) == [-1 if k.index is None else k.index for k in md.storage_data]
    assert cols["storage_meta"]["save_id"] == md.storage_meta.save_id
    assert cols["planner_data"] == md.planner_data
    if which == "zstd":
        assert all("zstd" in t for ts in cols["transforms"] for t in ts)


def test_every_block_boundary(saved):
    """Read 1, 2, 3, 7 and 64 bytes at a time: every opcode and payload is cut by a block somewhere."""
    ref = decode_file(saved["zstd"] / ".metadata")
    for block in (1, 2, 3, 7, 64):
        assert decode_file(saved["zstd"] / ".metadata", block=block) == ref, block


def test_fsdp2_checkpoint_decodes_to_the_reference(plain_fsdp2_ckpt):
    """A 4-rank FSDP2 save from real processes: DTensor chunks, load-balanced dedup, optimizer state."""
    cols = decode_file(plain_fsdp2_ckpt / ".metadata")
    assert cols is not None
    assert_same(plain_fsdp2_ckpt, cols)
    assert max(i64(cols["chunk_count"])) == 4
    assert cols["memo_kept"] < 100  # the memo entries kept are names and classes, not one per chunk


def test_frontier_writer_decodes_to_the_reference(frontier):
    """The synthetic frontier `.metadata` (FSDP2 x TP on 8 ranks) decodes to the reference's records."""
    cols = decode_file(frontier / ".metadata", block=4096)
    assert cols is not None
    assert_same(frontier, cols)
    assert len(cols["files"]) == 8 and len(cols["st_fqn"]) // 4 > len(cols["keys"])
    assert cols["memo_kept"] < 100


def test_reshards_own_writer_decodes_to_the_reference(tmp_path):
    """`.metadata` as reshard's convert writes it (reshard.storage.pickles.metadata_pickle: a vocabulary memoized
    and POPped up front, shared TensorProperties states, 64 KiB frames): 400 tensors of 4 chunks each,
    zstd transforms on half, and bytes items, decoded to the reference's records."""
    from reshard.storage.pickles.metadata_pickle import ObjectMeta, TensorMeta, metadata_bytes

    items: list = []
    at = 0
    for t in range(400):
        chunks = []
        for c in range(4):
            tds = ("stream.zstd/1",) if t % 2 else ()
            chunks.append(((c * 8, 0), (8, 16), ItemLocation(f"__{c}_0.distcp", at, 1000 + t, tds)))
            at += 1000 + t
        items.append(TensorMeta(f"layers.{t}.w", ("float32", "bfloat16")[t % 2], (32, 16), chunks, ("layers", str(t), "w")))
    items += [ObjectMeta(f"extra.{i}", ItemLocation("__0_0.distcp", at + i, 1), ("extra", str(i))) for i in range(5)]
    data = metadata_bytes(items, version="1.0.0")
    assert len(data) > 2 * 65536 and b"\x940" in data  # several frames; MEMOIZE then POP
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".metadata").write_bytes(data)
    cols = decode_file(ck / ".metadata", block=4093)
    assert cols is not None
    assert_same(ck, cols)
    assert len(cols["st_fqn"]) // 4 == 1605 and len(cols["transforms"]) == 1


# ------------------------------------------------------------------------------------------ hostile files

def _metadata_object(ckpt: Path):
    """The checkpoint's Metadata as torch's own objects (our own file: trusted)."""
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)


def test_declines_what_is_outside_the_subset(saved, tmp_path):
    """Each forgery: None (the safe path then refuses or reads it)."""
    good = (saved["plain"] / ".metadata").read_bytes()
    md = _metadata_object(saved["plain"])
    control = _beside(saved["plain"], tmp_path / "control", pickle.dumps(md, protocol=4))
    assert same_or_none(control) == "same"  # torch's objects pickled here decode: each case below is one change
    cases: dict[str, bytes] = {}
    # Megatron's all_local_plans: a Metadata field the decoder does not read
    md.all_local_plans = [1]
    cases["all_local_plans"] = pickle.dumps(md, protocol=4)
    del md.all_local_plans
    # a global outside the allow list, and one listed but outside the subset
    cases["unknown global"] = good.replace(b"\x8c\x08Metadata", b"\x8c\x08Metadatb")
    # a memo fetch of a list: the planner data value referred to twice
    md.planner_data = {"a": shared, "b": shared} if (shared := ["x"]) else None
    cases["get of a list"] = pickle.dumps(md, protocol=4)
    md = _metadata_object(saved["plain"])
    # an int outside int64
    key = next(iter(md.storage_data))
    md.storage_data[key].offset = 1 << 70
    cases["int past int64"] = pickle.dumps(md, protocol=4)
    md = _metadata_object(saved["plain"])
    # a chunk whose rank differs from its tensor's
    tsm = md.state_dict_metadata["model.w"]
    tsm.chunks[0].offsets = torch.Size([0, 0, 0])
    tsm.chunks[0].sizes = torch.Size([6, 4, 1])
    cases["chunk rank"] = pickle.dumps(md, protocol=4)
    # protocol 2 (GLOBAL text opcodes), a huge declared length, nesting too deep
    cases["protocol 2"] = pickle.dumps(_metadata_object(saved["plain"]), protocol=2)
    at = good.index(b"\x8c\x13state_dict_metadata")
    cases["huge length"] = good[:at] + b"\x8d" + struct.pack("<Q", 1 << 62) + good[at + 2:]
    md = _metadata_object(saved["plain"])
    deep: object = ("leaf",)
    for _ in range(100):
        deep = (deep,)
    md.planner_data = {"deep": deep}
    cases["deep"] = pickle.dumps(md, protocol=4)
    for name, data in cases.items():
        ck = _beside(saved["plain"], tmp_path / name.replace(" ", "_"), data)
        assert decode_file(ck / ".metadata") is None, name


def _beside(src: Path, dst: Path, metadata: bytes) -> Path:
    """A checkpoint directory whose data files are src's (hard links) and whose `.metadata` is given."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != ".metadata":
            os.link(f, dst / f.name)
    (dst / ".metadata").write_bytes(metadata)
    return dst


@pytest.mark.parametrize("refs", [10, 3000])
def test_memo_fetches_are_costed_like_the_cost_scan(saved, tmp_path, refs):
    """planner_data holding one 20 KB string ``refs`` times (a memo fetch each): within the budget at 10
    (decoded, the same records), past it at 3,000, where the reference refuses and decode declines."""
    md = _metadata_object(saved["plain"])
    s = "k" * 20000
    md.planner_data = {f"k{i}": (s,) for i in range(refs)}
    ck = _beside(saved["plain"], tmp_path / "ck", pickle.dumps(md, protocol=4))
    ref = reference(ck)
    cols = decode_file(ck / ".metadata")
    if refs == 10:
        assert cols is not None and cols["planner_data"] == md.planner_data
        assert_same(ck, cols)
    else:
        assert ref is BadInput and cols is None


def test_an_opcode_across_a_frame_end_is_declined(saved, tmp_path):
    """A FRAME made to end inside the version string's bytes. The reference reads `.metadata` through a file
    object, and CPython's unpickler then drops the part of an opcode its frame buffer holds and reads on
    after the frame: other bytes than the stream's (found by fuzzing: decode answered where the reference
    refused). decode declines any opcode across a frame's end."""
    import pickletools

    good = (saved["plain"] / ".metadata").read_bytes()
    at = good.rindex(b"\x8c\x051.0.0")
    frame = max(pos for op, _, pos in pickletools.genops(good) if op.name == "FRAME" and pos < at)
    cut = good[:frame + 1] + struct.pack("<Q", at + 4 - (frame + 9)) + good[frame + 9:]
    assert pickle.loads(cut).version == "1.0.0"  # read from memory, the frame's length does not matter
    ck = _beside(saved["plain"], tmp_path / "ck", cut)
    assert reference(ck) is BadInput  # read as a file: 'utf-8' codec can't decode byte 0x94
    assert decode_file(ck / ".metadata") is None


def _bodies_of(test) -> list[bytes]:
    """The ``body`` parameters of a parametrized test in another module: its corpus, reused as it is."""
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize" and mark.args[0] == "body":
            return list(mark.args[1])
    raise AssertionError(f"{test.__name__} has no body parameters")


def test_cost_scan_corpus_is_declined(tmp_path):
    """tests/test_costscan.py's hostile bodies (memo indices past the pickle, lengths claiming a terabyte, a
    FRAME past the end, self-reference, DUP, EXT1, unknown opcodes, stack underflows, protocol 0, empty):
    none is DCP metadata, so every one is None, read whole and one byte at a time."""
    import test_costscan

    bodies = _bodies_of(test_costscan.test_hostile_bodies_are_judged_the_same)
    assert len(bodies) >= 30
    for body in bodies:
        for block in ((1, 1 << 20) if len(body) < 4096 else (1 << 20,)):
            assert decode_bytes(body, tmp_path, block=block) is None, body[:40]


def test_hostile_pickle_corpus_is_declined(tmp_path):
    """tests/test_hostile_pickle.py's amplifiers (one chunk record listed 20,000 times by memo reference; one
    state dict applied to 2,000 records) and synthetic.write_malicious_metadata (a payload that runs code
    when unpickled, hidden in planner_data or as the whole pickle): None, and nothing is executed."""
    import test_hostile_pickle as hp
    from reshard.testing.synthetic import write_malicious_metadata

    ck = hp._tiny_ckpt(tmp_path / "tiny")
    assert same_or_none(ck) == "same"  # the honest checkpoint these start from decodes
    hp._amplifying_metadata(ck, refs=20_000, dims=40)
    assert decode_file(ck / ".metadata") is None
    assert decode_bytes(hp._records_sharing_one_state(2_000, 50), tmp_path) is None
    marker = tmp_path / "executed"
    for embed in (True, False):
        p = write_malicious_metadata(tmp_path / f"evil{embed}", marker, embed=embed)
        assert decode_file(p) is None
    assert not marker.exists()


def test_random_pickles_are_declined(tmp_path):
    """Pickles of random shared structures (test_costscan's strategy) at protocols 2-5: never Metadata, so None."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import test_costscan

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(test_costscan._structures(), st.integers(2, 5), st.sampled_from([1, 3, 1 << 20]))
    def check(obj, protocol, block):
        assert decode_bytes(pickle.dumps(obj, protocol=protocol), tmp_path, block=block) is None

    check()


def test_truncations_and_bit_flips_are_none_or_the_reference(saved, tmp_path):
    """A few hundred damaged copies of a real `.metadata` (cut at every 13th byte, single bits and bytes
    flipped): decode answers None or exactly what the reference reads, and never crashes."""
    good = (saved["zstd"] / ".metadata").read_bytes()
    ck = _beside(saved["zstd"], tmp_path / "ck", good)
    rng = random.Random(1)
    variants = [good[:n] for n in range(0, len(good), 13)]
    for _ in range(300):
        b = bytearray(good)
        i = rng.randrange(len(b))
        b[i] = b[i] ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(256)
        variants.append(bytes(b))
    outcomes = {"none": 0, "same": 0, "python": 0}
    for v in variants:
        (ck / ".metadata").write_bytes(v)
        outcomes[same_or_none(ck, block=rng.choice((5, 64, 1 << 20)))] += 1
    assert outcomes["none"] > len(variants) // 4 and outcomes["same"] > 0, outcomes


def test_size_bounds_the_read(saved, tmp_path):
    """decode reads `size` bytes and no more: a size short of the file is a truncated pickle (None)."""
    p = saved["plain"] / ".metadata"
    assert decode_file(p, size=p.stat().st_size - 1) is None
    assert decode_file(p, size=p.stat().st_size) is not None
