"""`reshard verify`'s fast path (`reshard.verification.compare`) and the crc32 integrity record.

Real checkpoints throughout: a 4-rank ``dcp.save`` (gloo ranks, `make_sharded`) and the same
global values written by `DcpWriter` in other chunkings (dim 1 and a 2-D grid, so the
intersections are strided in one side or both). The fast path must give exactly the result
of the reference path (``fast=False``: every chunk decoded with torch.load), and must
really be the path taken (`reshard.verification.compare.COUNTERS`).
"""
from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch

from reshard.storage.files import integrity
from reshard.errors import BadInput, ReshardError
from reshard.model.geometry import Box
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.verification import compare
from reshard.storage.checkpoints import dcp as rdcp
from reshard.storage.checkpoints.dcp_writer import DcpWriter
from reshard.testing.synthetic import make_sharded, minimal_manifest, synthetic_value
from reshard.verification.checkpoints import progress_bytes, verify_checkpoints
from reshard.render.progress import Progress

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHAPE = (12, 10)   # 4 ranks on dim 0 -> 3 rows each
N = 2


def _globals() -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.weight": synthetic_value(i, SHAPE) for i in range(N)}


def _pieces(shape, cuts: list[list[int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes of a grid: ``cuts[d]`` are the boundaries along dim d (0 and the size implied)."""
    import itertools

    axes = []
    for d, s in enumerate(shape):
        b = [0] + list(cuts[d]) + [s]
        axes.append([(b[k], b[k + 1] - b[k]) for k in range(len(b) - 1)])
    return [(tuple(o for o, _ in combo), tuple(n for _, n in combo)) for combo in itertools.product(*axes)]


def _write(path: Path, tensors: dict[str, torch.Tensor], grids: dict[str, list[list[int]]], ranks: int = 3) -> Path:
    """The tensors through `DcpWriter`, key ``k`` cut by ``grids[k]``, chunks dealt to ``ranks`` files."""
    path.mkdir(parents=True)
    w = DcpWriter(path)
    n = 0
    for key, t in tensors.items():
        w.declare_tensor(key, tuple(t.shape), t.dtype)
        for offs, sizes in _pieces(tuple(t.shape), grids[key]):
            w.write_chunk(n % ranks, key, offs, t[tuple(slice(o, o + s) for o, s in zip(offs, sizes))])
            n += 1
    w.finish()
    return path


def _manifest(path: Path, world: int, integ: dict | None) -> None:
    minimal_manifest(path, world_size=world, tool="tests/test_verify_fast.py", experiment_id="verify-fast",
                     integrity=integ)


def _checksums(path: Path, algorithm: str) -> dict[str, str]:
    """Every item's checksum, computed here from the bytes on disk (independent of any writer)."""
    ix = CheckpointIndex.open(path)
    out = {}
    for e in ix.entries.values():
        for loc in ([c.location for c in e.chunks] if e.is_tensor else [e.location]):
            out[integrity.item_name(loc.file, loc.offset)] = integrity.digest(rdcp.read_item_bytes(path, loc, key=e.key),
                                                                               algorithm)
    return out


def _flip_payload_bit(path: Path, key: str, index: tuple[int, ...], bit: int = 0) -> tuple[str, int]:
    """Flip one bit of element ``index`` (global) of ``key`` in place, in the file (the zip still loads)."""
    from reshard.storage.checkpoints.fastread import storage_byte_range

    ix = CheckpointIndex.open(path)
    e = ix.entries[key]
    for c in e.chunks:
        if c.box.contains(Box(tuple(index), (1,) * len(index))):
            loc = c.location
            start, _nbytes, dtype, shape = storage_byte_range(path / loc.file, loc.offset, loc.length)
            flat = 0
            for i, o, s in zip(index, c.box.offsets, shape):
                flat = flat * s + (i - o)
            pos = start + flat * dtype.itemsize + bit // 8
            with open(path / loc.file, "r+b") as f:
                f.seek(pos)
                b = f.read(1)
                f.seek(pos)
                f.write(bytes([b[0] ^ (1 << (bit % 8))]))
            return loc.file, loc.offset
    raise AssertionError(f"{index} not in {key}")


def _compared_bytes(p: Progress) -> int:
    """The bytes the "comparing" phase counted (it must reach its total, A's bytes)."""
    (ph,) = [ph for ph in p.phases if ph.name == "comparing"]
    assert ph.done == ph.total
    return ph.done


def _same(r: dict, slow: dict) -> bool:
    """Equal results (by repr: NaN values compare equal, complex values allowed)."""
    return repr(r) == repr(slow)


def _fast_run(a: Path, b: Path, **kw) -> tuple[dict, dict]:
    compare.reset_counters()
    r = verify_checkpoints(a, b, **kw)
    return r, compare.counters()


GRIDS = {"model.layers.0.weight": [[], [3, 7]],        # three column blocks: strided in both sides
         "model.layers.1.weight": [[5], [4]]}          # a 2 x 2 grid


@pytest.fixture(params=["inline", "pooled"])
def mode(request, monkeypatch) -> str:
    """Both drivers of the fast path: small keys compared by the calling thread (these test
    tensors are all small), and every key cut into tasks for the thread pool."""
    if request.param == "pooled":
        monkeypatch.setattr(compare, "SMALL_KEY_BYTES", 0)
    return request.param


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verify_fast")
    return {
        "ws4": make_sharded(root / "ws4", world_size=4, n_tensors=N, shape=SHAPE, shard_dim=0),
        "grid": _write(root / "grid", _globals(), GRIDS),
    }


# ------------------------------------------------------------------------------- geometry helpers
def test_contiguous_run_and_split_box():
    sizes = (4, 6, 5)
    run = compare.contiguous_run
    assert run(Box((0, 0, 0), sizes), sizes) == 0
    assert run(Box((2, 0, 0), (2, 6, 5)), sizes) == 2 * 30                 # whole rows of dim 0
    assert run(Box((1, 3, 0), (1, 2, 5)), sizes) == 30 + 15                # inside one dim-0 row
    assert run(Box((1, 3, 2), (1, 1, 3)), sizes) == 30 + 15 + 2            # inside one innermost row
    assert run(Box((1, 0, 0), (2, 2, 5)), sizes) is None                   # two rows, partial dim 1
    assert run(Box((0, 0, 1), (1, 1, 4)), (1, 1, 5)) == 1
    assert run(Box((), ()), ()) == 0                                        # a scalar
    box = Box((2, 1, 0), (3, 4, 5))
    for limit in (4, 20, 80, 100, 10_000):
        pieces = list(compare.split_box(box, 4, limit))
        assert sum(p.numel for p in pieces) == box.numel
        assert all(box.contains(p) for p in pieces)
        assert all(p.numel * 4 <= max(limit, 4) for p in pieces)
        assert all(compare.contiguous_run(p.relative_to(box), box.sizes) is not None for p in pieces)
        flat = [compare.contiguous_run(p.relative_to(box), box.sizes) for p in pieces]
        assert flat == sorted(flat) and flat[0] == 0  # row-major order, adjacent
        assert all(flat[k] + pieces[k].numel == flat[k + 1] for k in range(len(pieces) - 1))


# ------------------------------------------------------------------------------- equal
def test_differently_chunked_equal_through_the_fast_path(mode, ckpts):
    a, b = ckpts["ws4"], ckpts["grid"]
    boxes = [{c.box for c in CheckpointIndex.open(p).entries["model.layers.0.weight"].chunks} for p in (a, b)]
    assert boxes[0] != boxes[1]
    bar = Progress()
    r, n = _fast_run(a, b, progress=bar)
    assert r["equal"] is True and r["differences"] == [], r["differences"]
    assert n["keys_equal"] == N and not n.get("keys_fallback") and not n.get("keys_different"), n
    assert n["parts_strided"] > 0  # column blocks against row blocks: strided views
    assert n["bytes"] == N * 120 * 4
    assert _compared_bytes(bar) == progress_bytes(CheckpointIndex.open(a))
    slow = verify_checkpoints(a, b, fast=False)
    assert _same(r, slow)  # the same result dict, stats included
    assert r["compared"] == {"tensors": N, "objects": 0, "elements": N * 120, "bytes": N * 120 * 4}

    r, n = _fast_run(b, a)  # and the other way round (B's chunks drive the work)
    assert r["equal"] is True and n["keys_equal"] == N


def test_contiguous_pieces_and_small_slabs(ckpts, tmp_path):
    """A dim-0 re-cut compares byte runs; tiny slabs cut chunks into many pieces, same answer."""
    rows = _write(tmp_path / "rows", _globals(), {k: [[5, 8], []] for k in _globals()}, ranks=2)
    r, n = _fast_run(ckpts["ws4"], rows)
    assert r["equal"] is True and n["keys_equal"] == N
    assert n["parts_contiguous"] > 0 and not n.get("parts_strided"), n
    ia, ib = CheckpointIndex.open(ckpts["ws4"]), CheckpointIndex.open(ckpts["grid"])
    keys = sorted(_globals())
    names = set(_checksums(ckpts["grid"], "crc32"))
    for slab in (64, 100, 256):
        res = compare.compare_tensors(ia, ib, keys, slab_bytes=slab, workers=3, hash_b="crc32", hash_names=names)
        assert {k: v.status for k, v in res.verdicts.items()} == {k: "equal" for k in keys}
        # B's items read whole while comparing: their checksums are the real ones
        assert res.digests and res.digests == {k: v for k, v in _checksums(ckpts["grid"], "crc32").items()
                                               if k in res.digests}
        assert len(res.digests) == ib.item_count()


# ------------------------------------------------------------------------------- differences
def test_flipped_element_reported_exactly_as_the_slow_path(mode, ckpts, tmp_path):
    key = "model.layers.0.weight"
    sd = _globals()
    before = float(sd[key][7, 8])
    sd[key][7, 8] = 42.0      # in the last column block of "grid"
    sd[key][9, 1] += 1.0      # later in row-major order, another block
    changed = _write(tmp_path / "changed", sd, GRIDS)
    for a, b in ((ckpts["ws4"], changed), (changed, ckpts["ws4"]), (ckpts["grid"], changed)):
        r, n = _fast_run(a, b)
        slow = verify_checkpoints(a, b, fast=False)
        assert _same(r, slow)
        assert n["keys_different"] == 1 and n["keys_equal"] == N - 1, n
        (d,) = r["differences"]
        assert (d["key"], d["kind"], d["index"], d["count"], d["numel"]) == (key, "value", [7, 8], 2, 120)
        assert {d["a"], d["b"]} == {before, 42.0}
        assert r["compared"]["elements"] == N * 120

    # a single flipped low bit, written straight into the file: the item now contradicts the
    # CRC-32 its writer recorded, which is corrupt input (exit 2) on both paths, not a difference
    flipped = _write(tmp_path / "flipped", _globals(), GRIDS)
    _flip_payload_bit(flipped, "model.layers.1.weight", (10, 2))
    for a, b in ((ckpts["ws4"], flipped), (flipped, ckpts["ws4"])):
        for fast in (True, False):
            with pytest.raises(BadInput, match="item 'model.layers.1.weight' in __.*distcp fails its CRC-32") as info:
                verify_checkpoints(a, b, fast=fast)
            assert info.value.exit_code == 2


def _nan(payload: int) -> float:
    return struct.unpack("<f", struct.pack("<I", 0x7FC00000 | payload))[0]


def test_nan_payloads_and_signed_zeros_are_bitwise(mode, tmp_path):
    def state(w_nan: int, zero: float, c_im: float) -> dict[str, torch.Tensor]:
        w = torch.arange(48, dtype=torch.float32).reshape(6, 8)
        w[1, 5] = torch.tensor(struct.unpack("<f", struct.pack("<I", 0x7FC00000 | w_nan))[0])
        w[4, 2] = zero
        c = torch.complex(torch.arange(20, dtype=torch.float64), torch.ones(20, dtype=torch.float64)).reshape(4, 5)
        c[2, 3] = complex(1.5, c_im)
        return {"model.w": w,                                   # 4-byte elements
                "model.h": (torch.arange(30) / 7).to(torch.bfloat16).reshape(5, 6),   # 2-byte
                "model.c": c,                                   # 16 bytes: byte views with a trailing dim
                "model.m": torch.arange(12).reshape(3, 4) % 3 == 0,                   # bool
                "model.s": torch.tensor(2.5, dtype=torch.float64)}                    # a scalar

    grids_a = {"model.w": [[3], []], "model.h": [[2], []], "model.c": [[1, 3], []], "model.m": [[1], []], "model.s": []}
    grids_b = {"model.w": [[], [5]], "model.h": [[], [4]], "model.c": [[2], [2]], "model.m": [[], [3]], "model.s": []}
    a = _write(tmp_path / "a", state(1, 0.0, 2.0), grids_a, ranks=2)
    same = _write(tmp_path / "same", state(1, 0.0, 2.0), grids_b, ranks=3)
    r, n = _fast_run(a, same)
    assert r["equal"] is True, r["differences"]
    assert n["keys_equal"] == 5 and n["parts_strided"] > 0
    assert torch.isnan(CheckpointIndex.open(a).read_tensor("model.w")[1, 5])

    other = _write(tmp_path / "other", state(2, -0.0, float("nan")), grids_b, ranks=3)
    r, n = _fast_run(a, other)
    slow = verify_checkpoints(a, other, fast=False)
    assert _same(r, slow)
    got = {d["key"]: d for d in r["differences"]}
    assert set(got) == {"model.w", "model.c"}, got
    assert (got["model.w"]["index"], got["model.w"]["count"]) == ([1, 5], 2)  # another NaN payload, and -0.0
    assert got["model.c"]["index"] == [2, 3]
    assert n["keys_different"] == 2 and n["keys_equal"] == 3


# ------------------------------------------------------------------------------- integrity
def test_crc32_record_checked_and_flipped_byte_named(mode, ckpts, tmp_path, monkeypatch):
    a = tmp_path / "a"
    shutil.copytree(ckpts["ws4"], a)
    _manifest(a, 4, None)  # both sides with a manifest: the semantics agree
    b = _write(tmp_path / "b", _globals(), GRIDS)
    sums = _checksums(b, "crc32")
    rec = integrity.record(sums, algorithm="crc32")
    assert rec["algorithm"] == "crc32" and all(len(v) == 8 for v in rec["items"].values())
    assert list(rec["items"]) == sorted(rec["items"], key=integrity._split)
    _manifest(b, 3, rec)
    ib = CheckpointIndex.open(b)
    assert integrity.check_items(ib, rec) == []
    assert integrity.check_items(ib, rec, slab_bytes=100, workers=3) == []    # large items in slabs
    assert integrity.check_items(ib, integrity.record(_checksums(b, "sha256"))) == []  # sha256 too
    reads = []
    orig = integrity._Reader.hash_batch

    def counting(self, batch, algorithm):
        reads.extend(name for _, loc, _ in batch for name in [f"{loc.file}:{loc.offset}"])
        return orig(self, batch, algorithm)

    monkeypatch.setattr(integrity._Reader, "hash_batch", counting)
    r, n = _fast_run(a, b)
    monkeypatch.setattr(integrity._Reader, "hash_batch", orig)
    assert r["equal"] is True and n["keys_equal"] == N, r["differences"]
    assert reads == []  # B's items were hashed while being compared: read once, not twice

    key = "model.layers.1.weight"
    file, offset = _flip_payload_bit(b, key, (6, 6), bit=3)
    issues = integrity.check_items(ib, rec)
    assert [(i["kind"], i["key"], i["file"], i["offset"], i["algorithm"]) for i in issues] == [
        ("mismatch", key, file, offset, "crc32")]
    assert issues[0]["expected"] == sums[f"{file}:{offset}"] and issues[0]["actual"] != issues[0]["expected"]
    msg = integrity.describe(issues[0])
    assert f"item '{key}' ({file}" in msg and "crc32" in msg
    for fast in (True, False):
        with pytest.raises(BadInput) as exc:
            verify_checkpoints(a, b, fast=fast)
        assert exc.value.exit_code == 2
        # named by the manifest's record, or (fast: read while comparing, first) by the item's own zip CRC-32
        assert (f"item '{key}' ({file}" in str(exc.value) or f"item '{key}' in {file} fails its CRC-32" in str(exc.value))
        assert str(b / file) in str(exc.value)


def test_unknown_algorithm_refused(ckpts, tmp_path):
    ix = CheckpointIndex.open(ckpts["grid"])
    bogus = {"algorithm": "md5", "items": {k: "0" * 32 for k in _checksums(ckpts["grid"], "crc32")}}
    with pytest.raises(BadInput) as exc:
        integrity.check_items(ix, bogus)
    assert "'md5'" in str(exc.value) and "crc32" in str(exc.value)
    with pytest.raises(ValueError):
        integrity.record({}, algorithm="md5")
    with pytest.raises(ValueError):
        integrity.new_hasher("md5")

    # in a manifest: verify refuses it (exit 2) instead of passing unchecked
    b = _write(tmp_path / "b", _globals(), GRIDS)
    _manifest(b, 3, integrity.record(_checksums(b, "crc32"), algorithm="crc32"))
    m = json.loads((b / "manifest.json").read_text())
    m["integrity"]["algorithm"] = "md5"
    (b / "manifest.json").write_text(json.dumps(m))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ReshardError) as exc:
            verify_checkpoints(ckpts["ws4"], b)
    assert exc.value.exit_code == 2 and "md5" in str(exc.value)


def test_hash_item_and_digest_agree(ckpts):
    import hashlib
    import zlib

    ix = CheckpointIndex.open(ckpts["grid"])
    e = ix.entries["model.layers.0.weight"]
    loc = e.chunks[0].location
    raw = rdcp.read_item_bytes(ix.root, loc, key=e.key)
    assert integrity.hash_item(ix.root, loc, key=e.key) == hashlib.sha256(raw).hexdigest()
    assert integrity.hash_item(ix.root, loc, key=e.key, algorithm="crc32") == format(zlib.crc32(raw), "08x")
    h = integrity.new_hasher("crc32")
    h.update(raw[:10])
    h.update(raw[10:])
    assert h.hexdigest() == integrity.digest(raw, "crc32")


def test_b_files_parts_add_up(mode, ckpts, tmp_path):
    """A distributed worker verifies the chunks of B in its own files: the parts' elements add
    up to the whole, every part counts every key, and a difference shows in its file's part."""
    a = ckpts["ws4"]
    key = "model.layers.1.weight"
    sd = _globals()
    sd[key][11, 9] = -1.0
    b = _write(tmp_path / "b", sd, GRIDS)
    whole = verify_checkpoints(a, b)
    files = sorted({c.location.file for e in CheckpointIndex.open(b).entries.values() for c in e.chunks})
    assert len(files) == 3
    parts = []
    for f in files:
        bar = Progress()
        r = verify_checkpoints(a, b, b_files={f}, progress=bar)
        assert _same(r, verify_checkpoints(a, b, b_files={f}, fast=False))
        assert _compared_bytes(bar) == progress_bytes(CheckpointIndex.open(a))
        assert (r["compared"]["tensors"], r["compared"]["objects"]) == (whole["compared"]["tensors"],
                                                                         whole["compared"]["objects"])
        parts.append(r)
    assert sum(p["compared"]["elements"] for p in parts) == whole["compared"]["elements"] == N * 120
    assert sum(p["compared"]["bytes"] for p in parts) == whole["compared"]["bytes"]
    found = [d for p in parts for d in p["differences"]]
    assert [(d["key"], d["index"], d["count"]) for d in found] == [(key, [11, 9], 1)]
    assert (found[0]["a"], found[0]["b"]) == (whole["differences"][0]["a"], -1.0)
