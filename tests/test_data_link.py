"""`reshard convert --data link` (issue 18): transitions that copy no tensor bytes, loaded by real torch jobs.

A 4-rank FSDP2 checkpoint of the reference trainer (`fully_shard` + `dcp.save` on spawned gloo
ranks, per-rank RNG and sampler state, scheduler, counters) is converted with ``--data link``
to 2 and 3 ranks. Then, in one spawn of 3 processes, a 2-rank and a 3-rank job build the
reference model and AdamW at that size (FSDP2) and call stock ``dcp.load`` with torch's
``DefaultLoadPlanner`` (tests/_dcp_load_worker.py). Checked:

- every loaded local shard equals the source's global value bit for bit, and what the
  optimizer and model were handed too; objects (trainer counters, sampler, scheduler, param
  groups) equal the source's; every key of the output is read by some rank;
- at 3 ranks a rank's shard spans two saved chunks (rows 43..85 of 128 over the source's
  32-row chunks), read from both by the default planner;
- the output's tensor chunks are the source's (boxes, offsets, lengths) in files that share
  the source's bytes: the same inode for a hard link, equal bytes and a different inode for
  a reflink, whichever the report says it used; the keys the plan rewrites (RNG reseeded)
  are in new files of their own;
- `reshard verify SRC DST` exits 0, `reshard inspect DST` finds it complete and consistent;
- conversions that need new bytes are refused with the reason and `--data copy` as the way
  out (dtype cast, --only, --output-format local, --workers, a fused TP layout re-cut, a
  destination on another file system), leaving nothing behind;
- the source is never modified (hash and mtime of every file before and after).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import cli
from reshard.train.launch import start_ranks
from reshard.reference import TrainConfig, run_reference
from reshard.reference.trainer import free_port
from reshard.semantics.manifest import read_manifest
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.storage.files.linkfs import shares_inode

SOURCE_STEP = 2
TARGETS = {"link2": 2, "link3": 3}
SPAN_KEY = "model.blocks.0.mlp.fc1.weight"  # 128 rows: 32-row chunks on 4 ranks, 43/43/42 rows on 3


def snapshot(directory: Path) -> dict[str, tuple[str, int, int]]:
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(directory))] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime_ns, st.st_size)
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_link")


@pytest.fixture(scope="module")
def source(root) -> Path:
    cfg = TrainConfig(dp=4, micro_batch=2, grad_accum=3, steps=SOURCE_STEP, save_at=[SOURCE_STEP], out=str(root / "src4"),
                      experiment_id="link-src4")
    (src,) = run_reference([cfg])
    return src


@pytest.fixture(scope="module")
def before(source) -> dict:
    return snapshot(source)


@pytest.fixture(scope="module")
def links(root, source, before) -> dict[str, dict]:
    out = {}
    for name, n in TARGETS.items():
        dst = root / "out" / name
        code, text, err = cli(["convert", source, dst, "--to", f"dp={n}", "--data", "link"])
        out[name] = {"code": code, "out": text, "err": err, "dst": dst, "n": n}
    return out


@pytest.fixture(scope="module")
def loaded(root, links) -> dict[str, list[dict]]:
    """One spawn of 3 processes: a 2-rank and a 3-rank FSDP2 job, each `dcp.load`s its output."""
    import _dcp_load_worker

    for name, c in links.items():
        assert c["code"] == 0, f"{name}: convert exited {c['code']}: {c['out']}{c['err']}"
    jobs = [{"tag": name, "n": c["n"], "dst": str(c["dst"]), "port": free_port(),
             "cfg": {"dp": c["n"], "micro_batch": 2, "grad_accum": 24 // (2 * c["n"])}} for name, c in links.items()]
    out_dir = root / "loaded"
    out_dir.mkdir()
    start_ranks(_dcp_load_worker.worker, (jobs, str(out_dir)), max(j["n"] for j in jobs))
    results = {}
    for job in jobs:
        per_rank = [torch.load(out_dir / f"{job['tag']}_rank{r}.pt", weights_only=False) for r in range(job["n"])]
        for r in per_rank:
            assert r["error"] is None, f"{job['tag']} rank {r['rank']} failed to load:\n{r['error']}"
        results[job["tag"]] = per_rank
    return results


def report_of(dst: Path) -> dict:
    return json.loads((dst / "reshard-report.json").read_text())


# ------------------------------------------------------------------------------ the output
@pytest.mark.parametrize("name", list(TARGETS))
def test_convert_link_succeeds_and_says_the_files_are_shared(links, name):
    c = links[name]
    assert c["code"] == 0, c["out"] + c["err"]
    assert "shared" in c["out"] and ("never modify the source in place" in c["out"]  # hard links
                                     or "clones of the source's" in c["out"]), c["out"]  # reflinks
    r = report_of(c["dst"])
    d = r["data"]
    assert d["mode"] == "link" and d["method"] in ("reflink", "hardlink")
    assert r["verification"]["equal"] and r["verification"]["linked_tensors_by_identity"] == d["linked_tensors"] > 0
    # only the new files count as written, and they are small: the rewritten keys, not the tensors
    assert r["bytes_written"] == sum((c["dst"] / f).stat().st_size for f in d["written_files"])
    assert r["bytes_written"] < d["shared_bytes"] / 10
    entry = read_manifest(c["dst"]).lineage[-1]
    assert entry.policies["data_files"]["mode"] == "link"
    assert entry.policies["data_files"]["method"] == d["method"]
    assert "never modify the source" in entry.policies["data_files"]["note"]
    md = (c["dst"] / "reshard-report.md").read_text()
    assert "Data files shared with the source" in md


@pytest.mark.parametrize("name", list(TARGETS))
def test_shared_files_are_what_the_report_says(links, source, name):
    c = links[name]
    d = report_of(c["dst"])["data"]
    assert {x["source_file"] for x in d["shared"]} == {f"__{r}_0.distcp" for r in range(4)}
    for x in d["shared"]:
        a, b = source / x["source_file"], c["dst"] / x["file"]
        same_inode = shares_inode(a, b)
        detected = "hardlink" if same_inode else "reflink"
        assert x["method"] == detected, (x, same_inode)
        assert a.read_bytes() == b.read_bytes()
        if detected == "hardlink":
            assert os.stat(b).st_nlink >= 2


@pytest.mark.parametrize("name", list(TARGETS))
def test_tensor_chunks_are_the_sources_and_rewritten_keys_are_new(links, source, name):
    c = links[name]
    si, di = CheckpointIndex.open(source), CheckpointIndex.open(c["dst"])
    assert di.complete
    plan = report_of(c["dst"])["plan"]
    rewritten = {k["key"] for k in plan["keys"] if k["action"] in ("rewritten", "added")}
    assert any(k.startswith("rng.") for k in rewritten)  # the RNG is reseeded for the new positions
    for key, e in di.entries.items():
        locs = [ch.location for ch in e.chunks] if e.is_tensor else [e.location]
        if key in rewritten:
            assert all(loc.file.startswith("__reshard_0_") for loc in locs), (key, locs)
            continue
        se = si.entries[key]
        if e.is_tensor:
            assert [(ch.box, ch.location.offset, ch.location.length) for ch in e.chunks] == \
                   [(ch.box, ch.location.offset, ch.location.length) for ch in se.chunks], key
            assert [ch.location.file for ch in e.chunks] == ["linked" + ch.location.file for ch in se.chunks], key
        else:
            assert (e.location.file, e.location.offset) == ("linked" + se.location.file, se.location.offset), key


# ------------------------------------------------------------------------------ loaded by stock dcp.load
@pytest.mark.parametrize("name", list(TARGETS))
def test_load_reads_every_key(links, loaded, name):
    keys = set(CheckpointIndex.open(links[name]["dst"]).entries)
    union = set().union(*(set(r["requested"]) for r in loaded[name]))
    assert union == keys, (sorted(keys - union)[:5], sorted(union - keys)[:5])


@pytest.mark.parametrize("name", list(TARGETS))
def test_loaded_values_equal_the_source_bitwise(links, loaded, source, name):
    src = CheckpointIndex.open(source)
    dst = CheckpointIndex.open(links[name]["dst"])
    full: dict[str, torch.Tensor] = {}
    checked = 0
    for r in loaded[name]:
        assert r["world"] == links[name]["n"]
        for key, rec in r["tensors"].items():
            g = full.setdefault(key, src.read_tensor(key))
            assert rec["global_shape"] == tuple(g.shape), key
            local = rec["local"]
            expect = g[tuple(slice(o, o + s) for o, s in zip(rec["offsets"], local.shape))]
            assert bits_equal(local, expect), f"{name} rank {r['rank']}: {key} differs from the source"
            assert bits_equal(r["applied"][key], local), f"{name} rank {r['rank']}: {key} changed when applied"
            checked += 1
        obj = r["objects"]
        assert obj["trainer"]["step"] == SOURCE_STEP == src.read_object("trainer.step")
        assert obj["trainer"]["tokens_seen"] == src.read_object("trainer.tokens_seen")
        for k, v in obj["scheduler"].items():
            assert v == src.read_object(f"scheduler.{k}"), k
        for i, group in enumerate(obj["param_groups"]):
            for h, v in group.items():
                assert v == src.read_object(f"optim.param_groups.{i}.{h}"), (i, h)
        # the reseeded RNG state this rank read lies in the output's new file
        for k in r["requested"]:
            if k.startswith("rng."):
                e = dst.entries[k]
                locs = [ch.location for ch in e.chunks] if e.is_tensor else [e.location]
                assert all(loc.file.startswith("__reshard_0_") for loc in locs), k
    assert checked >= 100 * len(loaded[name])


def test_a_rank_spanning_two_saved_chunks_loads_exactly(loaded, source):
    """At 3 ranks, rank 1 holds rows 43..85 of a 128-row weight saved in 32-row chunks (two of them)."""
    src = CheckpointIndex.open(source)
    e = src.entries[SPAN_KEY]
    rec = next(r for r in loaded["link3"] if r["rank"] == 1)["tensors"][SPAN_KEY]
    start, rows = rec["offsets"][0], rec["local"].shape[0]
    spanned = [ch for ch in e.chunks if ch.box.offsets[0] < start + rows and start < ch.box.offsets[0] + ch.box.sizes[0]]
    assert len(spanned) == 2, [(ch.box.offsets, ch.box.sizes) for ch in e.chunks]
    assert bits_equal(rec["local"], src.read_tensor(SPAN_KEY)[start:start + rows])


def test_plan_says_link_is_available_and_what_each_rank_reads(source):
    code, out, err = cli(["plan", source, "--to", "dp=3", "--json"])
    assert code == 0, out + err
    d = json.loads(out)["data_link"]
    assert d["available"] and not d["reasons"] and d["shared_files"] == 4
    reads = d["reads"]["per_rank"]
    assert [x["rank"] for x in reads] == [0, 1, 2]
    # 3 ranks over 4 saved chunks: what a rank reads (whole saved items) is more than what it keeps
    assert all(x["tensor_bytes"] >= x["keeps"] > 0 and x["bytes"] >= x["tensor_bytes"] for x in reads)
    assert d["reads"]["amplification"] > 1.0
    code, text, _ = cli(["plan", source, "--to", "dp=3"])
    assert "data link   available" in text and "reads at most" in text


# ------------------------------------------------------------------------------ verify, inspect, the source
@pytest.mark.parametrize("name", list(TARGETS))
def test_verify_and_inspect_accept_the_output(links, source, name):
    code, out, err = cli(["verify", source, links[name]["dst"]])
    assert code == 0, out + err
    code, out, err = cli(["inspect", links[name]["dst"]])
    assert code == 0, out + err
    assert "complete and consistent" in out


def test_a_second_link_conversion_of_a_linked_output(links, source, root):
    """A linked output is a source like any other: its shared names are kept, and its own new files never take
    the name of a file it shares (here the first hop's RNG file is not shared: the RNG is reseeded again)."""
    first = links["link2"]["dst"]
    dst = root / "out" / "link2to4"
    code, out, err = cli(["convert", first, dst, "--to", "dp=4", "--data", "link"])
    assert code == 0, out + err
    d = report_of(dst)["data"]
    assert {x["file"] for x in d["shared"]} <= {f"linked__{r}_0.distcp" for r in range(4)} | {"__reshard_0_0.distcp",
                                                                                           "__reshard_0_1.distcp"}
    shared = {x["file"] for x in d["shared"]}
    assert d["written_files"] and all(f.startswith("__reshard_") for f in d["written_files"])
    assert not shared & set(d["written_files"])
    assert ("__reshard_0_0.distcp" in shared) == any(f.startswith("__reshard_1_") for f in d["written_files"])
    code, out, err = cli(["verify", first, dst])
    assert code == 0, out + err


# ------------------------------------------------------------------------------ refusals
@pytest.fixture(scope="module")
def fused(root) -> Path:
    from reshard.testing.synthetic_llama import LlamaShape, make_llama_checkpoint

    return make_llama_checkpoint(root / "fused_tp2", shape=LlamaShape(), tp=2, dp=1, fused=True, seed=5)


@pytest.mark.parametrize("extra, says", [
    (["--dtype", "bf16"], "--dtype bf16 casts tensors"),
    (["--only", "model"], "--only model asks for a reduced copy"),
    (["--output-format", "local"], "--output-format local"),
    (["--workers", "2"], "runs in one process"),
])
def test_refused_when_new_bytes_are_needed(source, before, root, extra, says):
    dst = root / "refused" / "_".join(a.strip("-") for a in extra)
    code, out, err = cli(["convert", source, dst, "--to", "dp=2", "--data", "link", *extra])
    assert code == 2, out + err
    assert says in err and "--data copy" in err, err
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}.reshard-tmp-*"))


def test_refused_for_a_tp_layout_rewritten(fused, root):
    dst = root / "refused" / "fused_tp1"
    code, out, err = cli(["convert", fused, dst, "--to", "dp=1,tp=1", "--data", "link"])
    assert code == 2, out + err
    assert "TP-dependent layout" in err and "--data copy" in err, err
    assert not dst.exists()
    code, out, err = cli(["plan", fused, "--to", "dp=1,tp=1", "--json"])
    d = json.loads(out)["data_link"]
    assert not d["available"] and any("TP-dependent layout" in r for r in d["reasons"]) and "reads" not in d


def test_refused_on_another_file_system(source, before):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(source).st_dev:
        pytest.skip("no second file system to try")
    parent = shm / f"reshard-link-test-{os.getpid()}"
    parent.mkdir()
    try:
        dst = parent / "out"
        code, out, err = cli(["convert", source, dst, "--to", "dp=2", "--data", "link"])
        assert code == 2, out + err
        assert "another file system" in err and "--data copy" in err, err
        assert not dst.exists() and not [p for p in parent.iterdir() if ".reshard-tmp-" in p.name]
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_hard_links_share_later_in_place_writes(source, root):
    """What the report warns about, shown: with a hard link, writing into the source's file in place
    changes the output's file (a reflink would not). On a copy of the source, never on it."""
    copy = root / "scratch_src"
    shutil.copytree(source, copy)
    dst = root / "out" / "scratch_link"
    code, out, err = cli(["convert", copy, dst, "--to", "dp=2", "--data", "link"])
    assert code == 0, out + err
    x = report_of(dst)["data"]["shared"][0]
    a, b = copy / x["source_file"], dst / x["file"]
    old = b.read_bytes()
    with open(a, "r+b") as f:  # in place, as `dd conv=notrunc` or a careless re-save would
        f.seek(0)
        f.write(bytes(255 - v for v in old[:8]))
    if x["method"] == "hardlink":
        assert b.read_bytes() != old
    else:
        assert b.read_bytes() == old


def test_source_never_modified(source, before, links, loaded):
    assert snapshot(source) == before


# ------------------------------------------------------------------------------ pieces
def test_new_files_never_take_a_shared_name():
    from reshard.planning.linking import linked_name, new_file_namer

    assert linked_name("__3_0.distcp") == "linked__3_0.distcp"
    assert linked_name("linked__3_0.distcp") == "linked__3_0.distcp"
    assert linked_name("__reshard_0_1.distcp") == "__reshard_0_1.distcp"
    assert new_file_namer({"linked__0_0.distcp"})(2) == "__reshard_0_2.distcp"
    assert new_file_namer({"__reshard_0_0.distcp", "__reshard_1_3.distcp"})(0) == "__reshard_2_0.distcp"


def test_overlap_sweep_equals_every_pair():
    """The dim-0 sweep finds exactly the (target box, saved chunk) pairs that overlap, with their sizes."""
    import random

    import numpy as np

    from reshard.planning.linking import overlaps

    def grid(shape, cuts):
        edges = [sorted({0, d, *c}) for d, c in zip(shape, cuts)]
        boxes = [((a,), (b - a,)) for a, b in zip(edges[0], edges[0][1:])]
        for e in edges[1:]:
            boxes = [(o + (a,), s + (b - a,)) for o, s in boxes for a, b in zip(e, e[1:])]
        return boxes

    rnd = random.Random(18)
    for _ in range(200):
        shape = tuple(rnd.randint(1, 40) for _ in range(rnd.randint(1, 3)))
        src = grid(shape, [rnd.sample(range(1, d), min(d - 1, rnd.randint(0, 5))) if d > 1 else [] for d in shape])
        tgt = grid(shape, [rnd.sample(range(1, d), min(d - 1, rnd.randint(0, 5))) if d > 1 else [] for d in shape])
        arr = lambda bs, i: np.array([b[i] for b in bs], dtype=np.int64).reshape(len(bs), -1)  # noqa: E731
        ti, sj, ov = overlaps(arr(tgt, 0), arr(tgt, 1), arr(src, 0), arr(src, 1))
        got = sorted(zip(ti.tolist(), sj.tolist(), ov.tolist()))
        want = []
        for i, (to, ts) in enumerate(tgt):
            for j, (so, ss) in enumerate(src):
                n = 1
                for a, la, b, lb in zip(to, ts, so, ss):
                    n *= max(0, min(a + la, b + lb) - max(a, b))
                if n:
                    want.append((i, j, n))
        assert got == sorted(want), (shape, src, tgt)


@pytest.fixture
def reflink_fs(tmp_path):
    """A loop-mounted XFS with reflinks (root, mkfs.xfs and mount needed; skipped otherwise)."""
    import subprocess

    if os.geteuid() != 0 or not shutil.which("mkfs.xfs") or not shutil.which("mount"):
        pytest.skip("a reflink file system needs root and mkfs.xfs")
    img, mnt = tmp_path / "xfs.img", tmp_path / "xfs"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(320 << 20)
    if subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(img)], capture_output=True).returncode != 0 or \
            subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot make or mount a loop XFS here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_reflinks_where_the_file_system_can(source, reflink_fs):
    """On a file system with reflinks the shared files are clones: other inodes, the same bytes, and a
    later in-place write to the source's file does not reach the output."""
    src = reflink_fs / "src"
    shutil.copytree(source, src)
    dst = reflink_fs / "out"
    code, out, err = cli(["convert", src, dst, "--to", "dp=3", "--data", "link"])
    assert code == 0, out + err
    d = report_of(dst)["data"]
    assert d["method"] == "reflink" and "by reflink" in out
    for x in d["shared"]:
        a, b = src / x["source_file"], dst / x["file"]
        assert x["method"] == "reflink" and not shares_inode(a, b) and a.read_bytes() == b.read_bytes()
    x = d["shared"][0]
    old = (dst / x["file"]).read_bytes()
    with open(src / x["source_file"], "r+b") as f:
        f.write(bytes(255 - v for v in old[:8]))
    assert (dst / x["file"]).read_bytes() == old
    code, out, err = cli(["verify", source, dst])
    assert code == 0, out + err
