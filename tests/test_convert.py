"""`reshard convert` end to end, against real torch jobs (the acceptance criteria of the issue).

1. Converted checkpoints load in a real FSDP2 job at the target size, exactly: every key
   the checkpoint holds is read by some rank, every value equals the source bit for bit,
   and each target rank's own file holds its shards (4 -> 2, 4 -> 3 uneven, 4 -> 1, 2 -> 4).
2. Resuming from a 4 -> 2 conversion with accumulation doubled continues the run: losses
   within 1e-4 (relative) of the uninterrupted run, the same learning rates, every sample
   consumed exactly once per epoch across the transition.
3. `reshard verify` accepts each conversion and names a changed element, whatever the
   chunking of the two sides.
4. The source directory is never modified.

Process start-up dominates on a small CPU box, so the whole file uses three spawns: 4 ranks
train the 4-rank source and the dropout-free baseline, 2 ranks train the 2-rank source and
then the resumed run, 4 ranks load every converted output (see tests/_dcp_load_worker.py).
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from conftest import cli, run_cli
from reshard.train.launch import start_ranks
from reshard.storage.checkpoints.index import RANK_FILE, CheckpointIndex
from reshard.storage.files.integrity import record as integrity_record
from reshard.storage.checkpoints import dcp as dcp_io
from reshard.storage.checkpoints.dcp_writer import CHECKSUM_ALGORITHM, DcpWriter
from reshard.semantics.manifest import read_manifest
from reshard.reference import TrainConfig, run_reference
from reshard.reference.trainer import free_port

K = 3                      # baseline checkpoint step (item 2)
RESUMED = 20               # steps run after the transition
TOL = 1e-4                 # relative loss tolerance across the transition
SOURCE_STEP = 2            # steps of the sources of item 1
TIMINGS: dict[str, float] = {}

# name -> (source name, target dp); the targets of item 1
CONVERSIONS = {"4to2": ("src4", 2), "4to3": ("src4", 3), "4to1": ("src4", 1), "2to4": ("src2", 4)}
ALL_CONVERSIONS = {**CONVERSIONS, "base4to2": ("base", 2)}
PATCH_KEY = "model.blocks.0.mlp.fc1.weight"
PATCH_INDEX = (50, 7)      # row 50 of 128: rank 1's piece on 3 ranks (rows 43..85), rank 1's on 4 (32..63)


# ------------------------------------------------------------------------------ helpers


def snapshot(directory: Path) -> dict[str, tuple[str, int, int]]:
    """relative path -> (sha256 of the bytes, mtime_ns, size) of every file under ``directory``."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(directory))] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime_ns, st.st_size)
    return out


def read_log(path: Path) -> dict[int, dict]:
    return {rec["step"]: rec for rec in map(json.loads, path.read_text().splitlines())}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN-safe, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def torch_chunk_rows(n: int, parts: int) -> list[tuple[int, int]]:
    """(start, stop) of rank r's rows under torch.chunk (what FSDP2 does), empty ranges for missing pieces."""
    pieces = torch.arange(n).chunk(parts)
    out = []
    for r in range(parts):
        if r < len(pieces) and len(pieces[r]):
            out.append((int(pieces[r][0]), int(pieces[r][-1]) + 1))
        else:
            out.append((n, n))
    return out


def is_sharded_state(key: str) -> bool:
    return key.startswith("model.") or bool(re.match(r"^optim\.state\..+\.exp_avg(_sq)?$", key))


def rank_of_file(name: str) -> int:
    m = RANK_FILE.match(name)
    assert m, name
    return int(m.group(1))


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def sources(root) -> dict[str, Path]:
    """Spawn 1 (4 ranks): the 4-rank source (global batch 24 = 2 x 3 x 4) and the dropout-free baseline."""
    src4 = TrainConfig(dp=4, micro_batch=2, grad_accum=3, steps=SOURCE_STEP, save_at=[SOURCE_STEP], out=str(root / "src4"),
                experiment_id="convert-src4")
    base = TrainConfig(dp=4, micro_batch=2, grad_accum=2, dropout=0.0, steps=K + RESUMED, total_steps=K + RESUMED,
                save_at=[K], out=str(root / "base"), log=str(root / "base.jsonl"), experiment_id="convert-base")
    t = time.perf_counter()
    a, b = run_reference([src4, base])
    TIMINGS["spawn 4 ranks: src4 + baseline"] = time.perf_counter() - t
    return {"src4": a, "base": b}


@pytest.fixture(scope="module")
def before(sources) -> dict[str, dict]:
    """Every source file's hash and mtime, taken before anything reads it (item 4)."""
    return {name: snapshot(p) for name, p in sources.items()}


@pytest.fixture(scope="module")
def first_conversions(root, sources, before) -> dict[str, tuple[int, str, str]]:
    """`reshard convert SRC DST --to dp=N` for the targets of spawn 1's checkpoints."""
    results = {}
    for name, (src, n) in ALL_CONVERSIONS.items():
        if src == "src2":
            continue
        t = time.perf_counter()
        results[name] = cli(["convert", sources[src], root / "out" / name, "--to", f"dp={n}"])
        TIMINGS[f"convert {name}"] = time.perf_counter() - t
    return results


@pytest.fixture(scope="module")
def second(root, sources, before, first_conversions) -> dict[str, Path]:
    """Spawn 2 (2 ranks): the 2-rank source, then the run resumed from the 4 -> 2 baseline conversion."""
    code, out, err = first_conversions["base4to2"]
    assert code == 0, out + err
    dst = root / "out" / "base4to2"
    m = read_manifest(dst)
    # the plan keeps the global batch (16): 2 ranks x micro-batch 2 need accumulation 4
    assert (m.batch.micro_batch, m.batch.grad_accum, m.batch.global_batch) == (2, 4, 16)
    src2 = TrainConfig(dp=2, micro_batch=2, grad_accum=6, steps=SOURCE_STEP, save_at=[SOURCE_STEP], out=str(root / "src2"),
                experiment_id="convert-src2")
    resume = TrainConfig(dp=2, micro_batch=m.batch.micro_batch, grad_accum=m.batch.grad_accum, dropout=0.0,
                  steps=K + RESUMED, total_steps=K + RESUMED, resume=str(dst), log=str(root / "resumed.jsonl"))
    t = time.perf_counter()
    (s2,) = run_reference([src2, resume])
    TIMINGS["spawn 2 ranks: src2 + resume"] = time.perf_counter() - t
    return {"src2": s2, "before_src2": snapshot(s2)}


@pytest.fixture(scope="module")
def conversions(root, sources, second, first_conversions) -> dict[str, dict]:
    """Every conversion: exit code, output, source and destination paths."""
    paths = {**sources, "src2": second["src2"]}
    results = dict(first_conversions)
    t = time.perf_counter()
    results["2to4"] = cli(["convert", paths["src2"], root / "out" / "2to4", "--to", "dp=4"])
    TIMINGS["convert 2to4"] = time.perf_counter() - t
    return {name: {"code": results[name][0], "out": results[name][1], "err": results[name][2],
                   "src": paths[src], "dst": root / "out" / name, "n": n}
            for name, (src, n) in ALL_CONVERSIONS.items()}


@pytest.fixture(scope="module")
def loaded(root, conversions) -> dict[str, list[dict]]:
    """Spawn 3 (4 ranks): every item-1 output loaded by an FSDP2 job of its target size."""
    import _dcp_load_worker

    for name in CONVERSIONS:
        c = conversions[name]
        assert c["code"] == 0, f"{name}: convert exited {c['code']}: {c['out']}{c['err']}"
    jobs = []
    for name in CONVERSIONS:
        n = conversions[name]["n"]
        jobs.append({"tag": name, "n": n, "dst": str(conversions[name]["dst"]), "port": free_port(),
                     "cfg": {"dp": n, "micro_batch": 2, "grad_accum": 24 // (2 * n)}})
    out_dir = root / "loaded"
    out_dir.mkdir()
    t = time.perf_counter()
    start_ranks(_dcp_load_worker.worker, (jobs, str(out_dir)), max(j["n"] for j in jobs))
    TIMINGS["spawn 4 ranks: load 4 outputs"] = time.perf_counter() - t
    results = {}
    for job in jobs:
        per_rank = [torch.load(out_dir / f"{job['tag']}_rank{r}.pt", weights_only=False) for r in range(job["n"])]
        for r in per_rank:
            assert r["error"] is None, f"{job['tag']} rank {r['rank']} failed to load:\n{r['error']}"
        results[job["tag"]] = per_rank
    return results


# ------------------------------------------------------------------------------ item 1
@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_convert_cli_succeeds(conversions, name):
    c = conversions[name]
    assert c["code"] == 0, c["out"] + c["err"]
    assert "converted" in c["out"] and "equal to the source" in c["out"], c["out"]
    ix = CheckpointIndex.open(c["dst"])
    assert ix.complete and ix.writer_ranks() == list(range(c["n"]))
    m = read_manifest(c["dst"])
    assert m.topology.dims["dp_shard"] == c["n"] and m.batch.global_batch == 24
    assert m.batch.micro_batch * m.batch.grad_accum * c["n"] == 24


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_load_uses_every_key(conversions, loaded, name):
    """The default planner found every key it asked for, and every checkpoint key was asked for."""
    c, per_rank = conversions[name], loaded[name]
    keys = set(CheckpointIndex.open(c["dst"]).entries)
    union = set().union(*(set(r["requested"]) for r in per_rank))
    assert union == keys, f"unused: {sorted(keys - union)[:10]}; not in checkpoint: {sorted(union - keys)[:10]}"
    shared = {k for k in keys if not k.startswith("rng.")}
    for r in per_rank:
        req = set(r["requested"])
        rng = {k for k in req if k.startswith("rng.")}
        assert shared <= req, f"rank {r['rank']} did not read {sorted(shared - req)[:5]}"
        assert rng and all(k.startswith(f"rng.rank_{r['rank']}.") for k in rng), sorted(rng)[:5]


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_loaded_values_equal_the_source_bitwise(conversions, loaded, name):
    c, per_rank = conversions[name], loaded[name]
    src = CheckpointIndex.open(c["src"])
    globals_: dict[str, torch.Tensor] = {}
    n_checked = 0
    for r in per_rank:
        assert set(r["tensors"]) == {k for k in src.entries if is_sharded_state(k) or k.endswith(".step")
                                     and k.startswith("optim.state.")}
        for key, rec in r["tensors"].items():
            g = globals_.setdefault(key, src.read_tensor(key))
            assert rec["global_shape"] == tuple(g.shape), key
            local = rec["local"]
            expect = g[tuple(slice(o, o + s) for o, s in zip(rec["offsets"], local.shape))]
            assert bits_equal(local, expect), f"{name} rank {r['rank']}: {key} differs from the source"
            # what set_model_state_dict / set_optimizer_state_dict handed the live modules
            assert bits_equal(r["applied"][key], local), f"{name} rank {r['rank']}: {key} changed when applied"
            n_checked += 1
        steps = {k: v["local"] for k, v in r["tensors"].items() if k.endswith(".step")}
        assert steps and all(float(v) == SOURCE_STEP for v in steps.values())
        obj = r["objects"]
        assert obj["trainer"] == {"step": src.read_object("trainer.step"), "tokens_seen": src.read_object("trainer.tokens_seen"),
                                  "samples_seen": src.read_object("trainer.samples_seen"), "micro_step": 0}
        assert obj["trainer"]["step"] == SOURCE_STEP
        assert obj["data"]["sampler"] == {k: src.read_object(f"data.sampler.{k}") for k in obj["data"]["sampler"]}
        for k, v in obj["scheduler"].items():
            assert v == src.read_object(f"scheduler.{k}"), k
        for i, group in enumerate(obj["param_groups"]):
            for h, v in group.items():
                assert v == src.read_object(f"optim.param_groups.{i}.{h}"), (i, h)
    assert n_checked == len(per_rank) * len(per_rank[0]["tensors"])


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_each_rank_file_holds_its_shards(conversions, loaded, name):
    c, per_rank = conversions[name], loaded[name]
    n = c["n"]
    ix = CheckpointIndex.open(c["dst"])
    sharded = [e for e in ix.tensors() if is_sharded_state(e.key)]
    assert len(sharded) == 37 + 2 * 36  # every parameter, both Adam moments of every trainable one
    for e in sharded:
        rows = torch_chunk_rows(e.shape[0], n)
        expected = {}
        for r, (start, stop) in enumerate(rows):
            if stop > start:
                expected[r] = ((start,) + (0,) * (len(e.shape) - 1), (stop - start,) + tuple(e.shape[1:]))
        got = {}
        for ch in e.chunks:
            start, stop = ch.box.offsets[0], ch.box.offsets[0] + ch.box.sizes[0]
            owners = [r for r, (a, b) in enumerate(rows) if a <= start and stop <= b and b > a]
            assert len(owners) == 1, f"{e.key}: chunk rows {start}..{stop} span ranks {rows}"
            r = owners[0]
            assert ch.location.file == f"__{r}_0.distcp", f"{e.key}: rank {r}'s rows {start}..{stop} in {ch.location.file}"
            got[r] = (ch.box.offsets, ch.box.sizes)
        assert got == expected, e.key
        for rec in per_rank:
            r = rec["rank"]
            local = rec["tensors"][e.key]
            box = expected.get(r)
            if box is None:  # an empty piece: torch.chunk ran out of rows for this rank
                assert local["local"].numel() == 0, (e.key, r)
            else:
                assert (local["offsets"], tuple(local["local"].shape)) == box, (e.key, r, local["offsets"])


# ------------------------------------------------------------------------------ item 2
def test_resume_with_doubled_accumulation_continues_the_run(root, second):
    base, resumed = read_log(root / "base.jsonl"), read_log(root / "resumed.jsonl")
    assert sorted(base) == list(range(1, K + RESUMED + 1))
    assert sorted(resumed) == list(range(K + 1, K + RESUMED + 1))
    assert all(resumed[s]["world_size"] == 2 for s in resumed) and all(base[s]["world_size"] == 4 for s in base)
    rel = {s: abs(resumed[s]["loss"] - base[s]["loss"]) / abs(base[s]["loss"]) for s in resumed}
    worst = max(rel, key=rel.get)
    print(f"\nresume 4->2 (accumulation 2->4): max relative loss difference {rel[worst]:.3e} at step {worst}; "
          "per step: " + ", ".join(f"{s}:{rel[s]:.1e}" for s in sorted(rel)))
    assert rel[worst] <= TOL, (f"max relative loss difference {rel[worst]:.3e} at step {worst} > {TOL}; per step: "
                               + ", ".join(f"{s}:{rel[s]:.2e}" for s in sorted(rel)))
    for s in resumed:
        assert resumed[s]["lr"] == base[s]["lr"], (s, resumed[s]["lr"], base[s]["lr"])

    # data: baseline steps 1..K, then the resumed steps K+1..K+20, in stream order
    assert resumed[K + 1]["sample_ids"] == base[K + 1]["sample_ids"]
    cfg = TrainConfig(dp=4, micro_batch=2, grad_accum=2)
    n, g = cfg.dataset_len, cfg.global_batch
    assert n % g == 0  # epochs end on step boundaries: a step's ids belong to one epoch
    per_epoch = n // g
    steps = [base[s]["sample_ids"] for s in range(1, K + 1)] + [resumed[s]["sample_ids"] for s in range(K + 1, K + RESUMED + 1)]
    assert all(len(ids) == g for ids in steps)
    epochs = [steps[i:i + per_epoch] for i in range(0, len(steps), per_epoch)]
    assert len(epochs[0]) == per_epoch  # at least one complete epoch spans the transition
    for e, ep in enumerate(epochs):
        ids = [i for step in ep for i in step]
        assert len(ids) == len(set(ids)), f"epoch {e}: ids repeated"
        if len(ep) == per_epoch:
            assert sorted(ids) == list(range(n)), f"epoch {e}: not every sample exactly once"
        assert all(0 <= i < n for i in ids)


# ------------------------------------------------------------------------------ item 3
def _planned_changes(dst: Path) -> set[str]:
    report = json.loads((dst / "reshard-report.json").read_text())
    return {k["key"] for k in report["plan"]["keys"] if k["action"] in ("rewritten", "dropped", "added")}


@pytest.mark.parametrize("name", list(ALL_CONVERSIONS))
def test_verify_accepts_each_conversion(conversions, capsys, name):
    """The output's conversion report names the keys rewritten on purpose; verify honours it."""
    c = conversions[name]
    code, out, err = run_cli(["verify", c["src"], c["dst"]], capsys)
    assert code == 0, out + err
    assert "expected rewrites taken from" in out


@pytest.mark.parametrize("name", list(ALL_CONVERSIONS))
def test_verify_differences_are_only_the_planned_rewrites(conversions, capsys, name):
    """What `verify` does report for a conversion: nothing but keys the plan rewrote on purpose."""
    c = conversions[name]
    code, out, err = run_cli(["verify", c["src"], c["dst"], "--json", "--strict"], capsys)
    r = json.loads(out)
    assert code == r["exit_code"] and code in (0, 1), err
    planned = _planned_changes(c["dst"])
    unplanned = [d for d in r["differences"] if d["key"] not in planned]
    assert unplanned == [], unplanned
    assert all(d["key"].startswith("rng.rank_") for d in r["differences"])
    assert r["compared"]["tensors"] > 100


def _patched_copy(src_ckpt: Path, dst: Path, key: str, index: tuple[int, ...]) -> tuple[float, float]:
    """Rewrite ``src_ckpt`` into ``dst`` item by item through DcpWriter: every item's bytes verbatim
    (same rank files, same chunking) except the one chunk of ``key`` holding ``index``, re-saved
    with that element changed. Returns (old, new) value."""
    ix = CheckpointIndex.open(src_ckpt)
    dst.mkdir(parents=True)
    w = DcpWriter(dst)
    change = None
    for k, e in ix.entries.items():
        if e.is_tensor:
            w.declare_tensor(k, e.shape, e.dtype, path=e.path)
            for ch in e.chunks:
                rank = rank_of_file(ch.location.file)
                inside = k == key and all(o <= i < o + s for i, o, s in zip(index, ch.box.offsets, ch.box.sizes))
                if inside:
                    t = dcp_io.load_item(ix.root, ch.location, key=k)
                    local = tuple(i - o for i, o in zip(index, ch.box.offsets))
                    old = float(t[local])
                    t[local] = old + 1.0
                    change = (old, float(t[local]))
                    w.write_chunk(rank, k, ch.box.offsets, t)
                else:
                    assert not ch.location.transforms
                    w.write_chunk_bytes(rank, k, ch.box.offsets, ch.box.sizes,
                                        dcp_io.read_item_bytes(ix.root, ch.location, key=k))
        else:
            assert not e.location.transforms
            w.write_object_bytes(rank_of_file(e.location.file), k, dcp_io.read_item_bytes(ix.root, e.location, key=k),
                                 path=e.path)
    w.finish()
    for name in ("manifest.json", "reshard-report.json", "reshard-report.md"):
        shutil.copy2(src_ckpt / name, dst / name)
    # the copy has other bytes: record its own item checksums (else verify rightly calls it corrupt)
    m = json.loads((dst / "manifest.json").read_text())
    m["integrity"] = integrity_record(w.checksums(), algorithm=CHECKSUM_ALGORITHM)
    (dst / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    assert change is not None
    return change


@pytest.fixture(scope="module")
def patched(root, conversions) -> dict:
    out3 = conversions["4to3"]["dst"]
    dst = root / "patched_4to3"
    old, new = _patched_copy(out3, dst, PATCH_KEY, PATCH_INDEX)
    return {"path": dst, "old": old, "new": new}


def test_patched_copy_differs_only_in_that_element(conversions, patched, capsys):
    out3 = conversions["4to3"]["dst"]
    a, b = CheckpointIndex.open(out3), CheckpointIndex.open(patched["path"])
    assert set(a.entries) == set(b.entries)
    assert [c.box for c in a.entries[PATCH_KEY].chunks] == [c.box for c in b.entries[PATCH_KEY].chunks]
    code, out, err = run_cli(["verify", out3, patched["path"], "--json"], capsys)
    r = json.loads(out)
    assert code == 1 and r["equal"] is False
    assert len(r["differences"]) == 1, r["differences"]
    d = r["differences"][0]
    assert (d["key"], d["kind"], d["index"], d["count"]) == (PATCH_KEY, "value", list(PATCH_INDEX), 1)
    assert (d["a"], d["b"]) == (patched["old"], patched["new"])
    code, out, _ = run_cli(["verify", out3, patched["path"]], capsys)  # the text form names it too
    assert code == 1 and PATCH_KEY in out


def test_verify_names_the_changed_key_across_chunkings(conversions, patched, capsys):
    """4-rank source against the 3-rank output: the patched key (and only it, beyond the RNG
    streams the conversion reseeded) is reported, at its global index."""
    src4 = conversions["4to3"]["src"]
    code, out, err = run_cli(["verify", src4, patched["path"], "--json"], capsys)
    r = json.loads(out)
    assert code == 1, err
    named = [d for d in r["differences"] if d["key"] == PATCH_KEY]
    assert len(named) == 1 and named[0]["index"] == list(PATCH_INDEX) and named[0]["count"] == 1, r["differences"]
    planned = _planned_changes(conversions["4to3"]["dst"])
    assert {d["key"] for d in r["differences"]} - planned == {PATCH_KEY}
    code, out, _ = run_cli(["verify", src4, patched["path"]], capsys)
    assert code == 1 and PATCH_KEY in out
    # the source and the unpatched 3-rank output differ only in the planned RNG rewrites
    code, out, _ = run_cli(["verify", src4, conversions["4to3"]["dst"], "--json"], capsys)
    assert {d["key"] for d in json.loads(out)["differences"]} <= planned


# ------------------------------------------------------------------------------ item 4
def test_sources_never_modified(sources, before, second, conversions, loaded, patched):
    """Runs after everything else in this file that reads the sources (conversions, loads, verify)."""
    for name, path in sources.items():
        assert snapshot(path) == before[name], f"{name} ({path}) changed"
    assert snapshot(second["src2"]) == second["before_src2"]
    assert before["src4"] and any(k.endswith(".distcp") for k in before["src4"])
    print("\ntimings: " + ", ".join(f"{k} {v:.1f}s" for k, v in TIMINGS.items()))
