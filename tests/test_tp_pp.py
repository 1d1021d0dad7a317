"""Tensor- and pipeline-parallel conversions, end to end against real torch jobs.

1. TP round trip: a dp=2,tp=2 reference-trainer checkpoint (n_heads=4, dropout 0) goes
   tp=2 -> tp=1 (dp=2) -> tp=4 (dp=1) -> tp=2 (dp=2) through the CLI. Every model and
   optimizer tensor comes back byte-identical; each intermediate output loads into the
   reference trainer built at its layout and gives the same forward (loss, logits) as the
   source layout; each rank's file holds that rank's boxes.
2. PP: pp=2 -> pp=1 (every key read, the lm_head copy's optimizer state dropped with a
   reason, values bitwise equal), pp=2 -> pp=4 (n_layers=4) and pp=1 -> pp=2 (resumed by the
   trainer's own load path); the plan's stage map and per-rank memory match what the target
   job holds.
3. A parameter no partition rule covers stops a TP plan (exit 2, named).
4. Tied copies that differ: inspect names them; convert must refuse and commit nothing.

Process start-up dominates on a small CPU box, so the file uses two spawns of 4 processes
(see tests/_tp_pp_worker.py): one trains all sources (a 4-rank job, then a 2-rank job), one
loads every converted output (jobs of 1, 2 and 4 ranks, one after the other).
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from conftest import cli, run_cli
from reshard.train.launch import start_ranks
from reshard.semantics import manifest as mf
from reshard.storage.checkpoints.index import RANK_FILE, CheckpointIndex
from reshard.reference import TrainConfig
from reshard.reference.model import stage_layers
from reshard.reference.trainer import free_port

STEPS = 2
TIMINGS: dict[str, float] = {}
TP_BASE = {"n_heads": 4, "dropout": 0.0}
# name -> (source name, --to, target TrainConfig fields); the TP chain
TP_CHAIN = {"tp1": ("tp_src", "dp=2", {"dp": 2, "tp": 1}),
            "tp4": ("tp1", "dp=1,tp=4", {"dp": 1, "tp": 4}),
            "tp2": ("tp4", "dp=2,tp=2", {"dp": 2, "tp": 2})}
PP_CONVERSIONS = {"pp2to1": ("pp2_n2", "dp=1", {"dp": 1, "pp": 1, "n_layers": 2}),
                  "pp2to4": ("pp2_n4", "pp=4", {"dp": 1, "pp": 4, "n_layers": 4}),
                  "pp1to2": ("pp2to1", "pp=2", {"dp": 1, "pp": 2, "n_layers": 2})}
PP_TARGETS = ["pp2to4", "pp1to2"]
RTOL, ATOL = 1e-5, 1e-6
TIED_ALIAS = {"lm_head.weight": "tok_emb.weight"}  # named_parameters() lists a tied tensor once


# ------------------------------------------------------------------------------ helpers


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN-safe, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def is_state_tensor(key: str) -> bool:
    return key.startswith("model.") or key.startswith("optim.state.")


def report_plan(dst: Path) -> dict:
    return json.loads((dst / "reshard-report.json").read_text())["plan"]


def resave(src: Path, dst: Path, edit, *, family: str | None = None) -> Path:
    """Every entry of ``src`` as global values, edited, saved by one process; ``src``'s manifest, edited."""
    import torch.distributed.checkpoint as dcp

    ix = CheckpointIndex.open(src)
    sd = {k: (ix.read_tensor(k) if e.is_tensor else ix.read_object(k)) for k, e in ix.entries.items()}
    edit(sd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(dst), no_dist=True)
    m = mf.read_manifest(src)
    if family is not None:
        m = dataclasses.replace(m, model=dataclasses.replace(m.model, family=family))
    mf.write_manifest(dst, m)
    return dst


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp_pp")


@pytest.fixture(scope="module")
def sources(root) -> dict[str, Path]:
    """Spawn 1 (4 processes): the dp=2,tp=2 source (4 ranks), then the pp=2 sources (2 ranks)."""
    import _tp_pp_worker

    tp = TrainConfig(dp=2, tp=2, steps=STEPS, save_at=[STEPS], out=str(root / "tp_src"), experiment_id="tp-src",
                     **TP_BASE)
    pp2_n2 = TrainConfig(pp=2, dp=1, n_layers=2, steps=STEPS, save_at=[STEPS], out=str(root / "pp2_n2"),
                         experiment_id="pp2-n2")
    pp2_n4 = TrainConfig(pp=2, dp=1, n_layers=4, steps=STEPS, save_at=[STEPS], out=str(root / "pp2_n4"),
                         experiment_id="pp2-n4")
    for c in (tp, pp2_n2, pp2_n4):
        c.validate()
    jobs = [{"n": 4, "port": free_port(), "cfgs": [asdict(tp)]},
            {"n": 2, "port": free_port(), "cfgs": [asdict(pp2_n2), asdict(pp2_n4)]}]
    t = time.perf_counter()
    start_ranks(_tp_pp_worker.train_worker, (jobs,), 4)
    TIMINGS["spawn: train sources"] = time.perf_counter() - t
    return {name: root / name / f"step_{STEPS}" for name in ("tp_src", "pp2_n2", "pp2_n4")}


@pytest.fixture(scope="module")
def converted(root, sources) -> dict[str, dict]:
    """Every conversion of items 1 and 2, through the CLI, in chain order."""
    paths = dict(sources)
    results = {}
    for name, (src, to, _) in {**TP_CHAIN, **PP_CONVERSIONS}.items():
        dst = root / "out" / name
        t = time.perf_counter()
        code, out, err = cli(["convert", paths[src], dst, "--to", to])
        TIMINGS[f"convert {name}"] = time.perf_counter() - t
        results[name] = {"code": code, "out": out, "err": err, "src": paths[src], "dst": dst}
        paths[name] = dst
    return results


@pytest.fixture(scope="module")
def loaded(root, sources, converted) -> dict[str, list[dict]]:
    """Spawn 2 (4 processes): every output loaded by the reference trainer built at its layout."""
    import _tp_pp_worker

    jobs = [{"tag": "tp_src", "cfg": {"dp": 2, "tp": 2, **TP_BASE}, "path": str(sources["tp_src"]),
             "mode": "record", "forward": True}]
    for name, (_, _, fields) in TP_CHAIN.items():
        jobs.append({"tag": name, "cfg": {**fields, **TP_BASE}, "path": str(converted[name]["dst"]),
                     "mode": "record", "forward": True})
    jobs.append({"tag": "pp2to1", "cfg": PP_CONVERSIONS["pp2to1"][2], "path": str(converted["pp2to1"]["dst"]),
                 "mode": "record"})
    for name in PP_TARGETS:  # the trainer's own resume path
        jobs.append({"tag": name, "cfg": PP_CONVERSIONS[name][2], "path": str(converted[name]["dst"]), "mode": "resume"})
    runnable = []
    for job in jobs:
        c = TrainConfig(**job["cfg"])
        job["n"], job["port"] = c.world_size, free_port()
        if job["tag"] == "tp_src" or converted[job["tag"]]["code"] == 0:
            runnable.append(job)
    out_dir = root / "loaded"
    out_dir.mkdir()
    t = time.perf_counter()
    start_ranks(_tp_pp_worker.load_worker, (runnable, str(out_dir)), 4)
    TIMINGS["spawn: load outputs"] = time.perf_counter() - t
    return {job["tag"]: [torch.load(out_dir / f"{job['tag']}_rank{r}.pt", weights_only=False) for r in range(job["n"])]
            for job in runnable}


def _loaded_ok(loaded, tag: str) -> list[dict]:
    assert tag in loaded, f"{tag}: not loaded (its conversion failed)"
    for r in loaded[tag]:
        assert r["error"] is None, f"{tag} rank {r['rank']} failed:\n{r['error']}"
    return loaded[tag]


# ------------------------------------------------------------------------------ item 1: TP round trip
@pytest.mark.parametrize("name", list(TP_CHAIN))
def test_tp_conversion_exits_0(converted, name):
    c = converted[name]
    assert c["code"] == 0, c["out"] + c["err"]
    ix = CheckpointIndex.open(c["dst"])
    fields = TP_CHAIN[name][2]
    assert ix.complete and ix.writer_ranks() == list(range(fields["dp"] * fields["tp"]))
    m = mf.read_manifest(c["dst"])
    assert (m.topology.dims["dp_shard"], m.topology.dims["tp"]) == (fields["dp"], fields["tp"])


def test_tp_round_trip_is_byte_identical(sources, converted):
    for name in TP_CHAIN:
        assert converted[name]["code"] == 0, name
    a, b = CheckpointIndex.open(sources["tp_src"]), CheckpointIndex.open(converted["tp2"]["dst"])
    keys = {k for k in a.entries if is_state_tensor(k)}
    assert keys == {k for k in b.entries if is_state_tensor(k)}
    assert len(keys) == 37 + 3 * 36  # parameters (tok_emb and lm_head both), exp_avg/exp_avg_sq/step per trainable one
    for k in sorted(keys):
        ea, eb = a.entries[k], b.entries[k]
        assert ea.is_tensor and eb.is_tensor, k
        assert bits_equal(a.read_tensor(k), b.read_tensor(k)), f"{k} changed over tp 2 -> 1 -> 4 -> 2"


@pytest.mark.parametrize("name", list(TP_CHAIN))
def test_each_tp_hop_verifies(converted, capsys, name):
    c = converted[name]
    code, out, err = run_cli(["verify", c["src"], c["dst"]], capsys)
    assert code == 0, out + err


def test_verify_round_trip_only_differs_in_recorded_rng_rewrites(sources, converted, capsys):
    """What `verify SRC FINAL` does report: only per-rank RNG streams, each reseeded, dropped or
    added on purpose by one of the three hops (their reports say so)."""
    code, out, err = run_cli(["verify", sources["tp_src"], converted["tp2"]["dst"], "--json"], capsys)
    r = json.loads(out)
    recorded = {k["key"] for name in TP_CHAIN for k in report_plan(converted[name]["dst"])["keys"]
                if k["action"] in ("rewritten", "dropped", "added")}
    diff = {d["key"] for d in r["differences"]}
    assert all(k.startswith("rng.rank_") for k in diff), sorted(diff)
    assert diff <= recorded, sorted(diff - recorded)
    assert r["compared"]["tensors"] >= 37 + 3 * 36


def test_verify_src_final_exits_0(sources, converted, capsys):
    code, out, err = run_cli(["verify", sources["tp_src"], converted["tp2"]["dst"]], capsys)
    assert code == 0, out + err


@pytest.mark.parametrize("name", list(TP_CHAIN))
def test_tp_output_forward_matches_source_layout(loaded, name):
    src, per_rank = _loaded_ok(loaded, "tp_src"), _loaded_ok(loaded, name)
    ref = src[0]
    for r in per_rank:  # the same batch on every rank: every rank computes the same loss
        torch.testing.assert_close(r["loss"], ref["loss"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(per_rank[0]["logits"], ref["logits"], rtol=RTOL, atol=ATOL)
    print(f"\n{name}: loss {float(per_rank[0]['loss']):.7f} vs source layout {float(ref['loss']):.7f}; "
          f"max |logit diff| {float((per_rank[0]['logits'] - ref['logits']).abs().max()):.2e}")


@pytest.mark.parametrize("name", ["tp_src"] + list(TP_CHAIN))
def test_tp_loaded_shards_equal_the_source(sources, loaded, name):
    """What each rank holds after loading (live parameters and optimizer state) is its box of the source."""
    per_rank = _loaded_ok(loaded, name)
    src = CheckpointIndex.open(sources["tp_src"])
    cache: dict[str, torch.Tensor] = {}
    n = 0
    for r in per_rank:
        assert r["step"] == STEPS
        for fqn, rec in r["params"].items():
            for key, local in [(f"model.{fqn}", rec["local"])] + [
                    (f"optim.state.{fqn}.{m}", r["optim_sd"][f"optim.state.{fqn}.{m}"]) for m in ("exp_avg", "exp_avg_sq")]:
                g = cache.setdefault(key, src.read_tensor(key))
                assert tuple(g.shape) == rec["global_shape"], key
                expect = g[tuple(slice(o, o + s) for o, s in zip(rec["offsets"], local.shape))]
                assert bits_equal(local, expect), f"{name} rank {r['rank']}: {key} differs from the source"
                n += 1
            assert bits_equal(r["optim_sd"][f"optim.state.{fqn}.step"], src.read_tensor(f"optim.state.{fqn}.step"))
    assert n == 3 * sum(len(r["params"]) for r in per_rank)


@pytest.mark.parametrize("name", list(TP_CHAIN))
def test_tp_rank_files_hold_their_chunks(converted, loaded, name):
    """The box rank (dp i, tp j) holds is stored in `__{i*tp+j}_0.distcp` (TP-replicated tensors:
    tp index 0 writes, i.e. `__{i*tp}_0.distcp`), as one chunk, for parameters and both moments."""
    per_rank = _loaded_ok(loaded, name)
    fields = TP_CHAIN[name][2]
    tp = fields["tp"]
    ix = CheckpointIndex.open(converted[name]["dst"])
    checked = 0
    tp_sharded_seen = 0
    for r in per_rank:
        rank, dp_rank, tp_rank = r["rank"], r["dp_rank"], r["tp_rank"]
        assert rank == dp_rank * tp + tp_rank
        for fqn, rec in r["params"].items():
            if rec["local"].numel() == 0:
                continue
            sizes = tuple(rec["local"].shape)
            writer = rank if rec["tp_sharded"] else dp_rank * tp
            tp_sharded_seen += rec["tp_sharded"]
            keys = [f"model.{fqn}", f"optim.state.{fqn}.exp_avg", f"optim.state.{fqn}.exp_avg_sq"]
            keys += [f"model.{a}" for a, b in TIED_ALIAS.items() if b == fqn]
            for key in keys:
                chunks = [c for c in ix.entries[key].chunks if c.box.offsets == rec["offsets"] and c.box.sizes == sizes]
                assert len(chunks) == 1, (f"{name}: rank {rank}'s box {rec['offsets']}+{sizes} of {key} is not one stored "
                                          f"chunk: {[(c.box.offsets, c.box.sizes) for c in ix.entries[key].chunks]}")
                assert chunks[0].location.file == f"__{writer}_0.distcp", (name, key, rank, chunks[0].location.file)
                checked += 1
        # nothing else in a rank's file but its own boxes (replicas read from the writer)
    if tp > 1:
        assert tp_sharded_seen > 0
    # and nothing else: every stored chunk is exactly the box its file's rank holds
    for e in ix.tensors():
        if not (e.key.startswith("model.") or re.match(r"^optim\.state\..+\.exp_avg(_sq)?$", e.key)):
            continue
        for c in e.chunks:
            m = RANK_FILE.match(c.location.file)
            owner = int(m.group(1))
            rec = next(rr for rr in per_rank if rr["rank"] == owner)
            fqn = e.key.removeprefix("model.") if e.key.startswith("model.") else e.key[len("optim.state."):].rsplit(".", 1)[0]
            p = rec["params"][TIED_ALIAS.get(fqn, fqn)]  # pp=1: lm_head.weight is tok_emb.weight
            assert (c.box.offsets, c.box.sizes) == (p["offsets"], tuple(p["local"].shape)), (name, e.key, owner)
    assert checked > 0


# ------------------------------------------------------------------------------ item 2: PP
@pytest.mark.parametrize("name", list(PP_CONVERSIONS))
def test_pp_conversion_exits_0(converted, name):
    c = converted[name]
    assert c["code"] == 0, c["out"] + c["err"]
    fields = PP_CONVERSIONS[name][2]
    m = mf.read_manifest(c["dst"])
    assert m.topology.dims["pp"] == fields["pp"] and m.topology.dims["dp_shard"] == 1
    assert CheckpointIndex.open(c["dst"]).writer_ranks() == list(range(fields["pp"]))


def test_pp2_to_pp1_drops_the_lm_head_copys_optimizer_state(converted):
    c = converted["pp2to1"]
    assert c["code"] == 0, c["out"] + c["err"]
    actions = {k["key"]: k for k in report_plan(c["dst"])["keys"]}
    out = CheckpointIndex.open(c["dst"])
    for m in ("exp_avg", "exp_avg_sq", "step"):
        key = f"optim.state.lm_head.weight.{m}"
        assert actions[key]["action"] == "dropped", actions[key]
        assert "tied copy of tok_emb.weight" in actions[key]["reason"], actions[key]
        assert key not in out.entries
        assert f"optim.state.tok_emb.weight.{m}" in out.entries
    assert actions["model.lm_head.weight"]["action"] in ("carried", "resharded")


def test_pp1_load_has_nothing_missing(converted, loaded):
    """torch's DefaultLoadPlanner (no partial load) found every key the pp=1 job asked for."""
    (r,) = _loaded_ok(loaded, "pp2to1")
    keys = set(CheckpointIndex.open(converted["pp2to1"]["dst"]).entries)
    assert set(r["requested"]) <= keys
    assert r["step"] == STEPS


def test_pp1_load_leaves_no_checkpoint_key_unused(converted, loaded):
    (r,) = _loaded_ok(loaded, "pp2to1")
    keys = set(CheckpointIndex.open(converted["pp2to1"]["dst"]).entries)
    unused = sorted(keys - set(r["requested"]))
    assert unused == [], f"{len(unused)} unused: {unused[:12]}"


def test_pp1_loaded_values_equal_the_source_bitwise(sources, loaded):
    (r,) = _loaded_ok(loaded, "pp2to1")
    src = CheckpointIndex.open(sources["pp2_n2"])
    values = {**r["model_sd"], **r["optim_sd"]}
    # the model state dict has both names of the tied tensor; the optimizer keeps one entry
    assert {"model.tok_emb.weight", "model.lm_head.weight"} <= set(r["model_sd"])
    assert not any(k.startswith("optim.state.lm_head.") for k in r["optim_sd"])
    expected = {k for k in src.entries if is_state_tensor(k) and not k.startswith("optim.state.lm_head.")}
    assert set(values) == expected
    for k, v in values.items():
        assert bits_equal(v, src.read_tensor(k)), f"{k} differs from the pp=2 source"


@pytest.mark.parametrize("name", PP_TARGETS)
def test_pp_resume_loads_everything(converted, loaded, name):
    """The trainer's resume path (load_checkpoint: dcp.load with no partial load) at pp=N."""
    per_rank = _loaded_ok(loaded, name)
    fields = PP_CONVERSIONS[name][2]
    assert [r["stage"] for r in per_rank] == list(range(fields["pp"]))
    src = CheckpointIndex.open(converted[name]["src"])
    for r in per_rank:
        assert r["step"] == STEPS
        for k, v in {**r["model_sd"], **r["optim_sd"]}.items():
            # pp=1 -> pp=2: the last stage's lm_head copy (and its new optimizer state) is tok_emb's
            sk = k if k in src.entries else k.replace("lm_head.weight", "tok_emb.weight")
            assert bits_equal(v, src.read_tensor(sk)), f"{name} rank {r['rank']}: {k} differs from {sk} in the source"
    last = per_rank[-1]
    assert {f"optim.state.lm_head.weight.{m}" for m in ("exp_avg", "exp_avg_sq", "step")} <= set(last["optim_sd"])


@pytest.mark.parametrize("name", PP_TARGETS)
def test_stage_map_matches_the_target_model(converted, loaded, name):
    per_rank = _loaded_ok(loaded, name)
    fields = PP_CONVERSIONS[name][2]
    sm = report_plan(converted[name]["dst"])["stage_map"]
    assert sm["num_layers"] == fields["n_layers"]
    expected_layers = stage_layers(fields["n_layers"], fields["pp"])
    assert [s["stage"] for s in sm["stages"]] == list(range(fields["pp"]))
    for s, r in zip(sm["stages"], per_rank):
        names = set(r["params"])
        blocks = sorted({int(m.group(1)) for n in names if (m := re.match(r"blocks\.(\d+)\.", n))})
        lo, hi = expected_layers[r["stage"]]
        assert s["layers"] == [lo, hi] and blocks == list(range(lo, hi)), (s, blocks)
        assert sorted(s["holds"]) == sorted(n for n in names if not n.startswith("blocks.")), (s["holds"], sorted(names))


@pytest.mark.parametrize("name", PP_TARGETS)
def test_plan_memory_matches_what_each_rank_holds(converted, loaded, name):
    per_rank = _loaded_ok(loaded, name)
    mem = report_plan(converted[name]["dst"])["memory"]["per_rank"]
    assert [m["rank"] for m in mem] == [r["rank"] for r in per_rank]
    for m, r in zip(mem, per_rank):
        assert r["optim_state_names"] == ["exp_avg", "exp_avg_sq", "step"]
        assert m["parameters"] == r["param_bytes"], (name, r["rank"], m, r["param_bytes"])
        assert m["optimizer"] == r["optim_bytes"], (name, r["rank"], m, r["optim_bytes"])


def test_plan_gradient_memory_pp1_to_pp2(converted, loaded):
    per_rank = _loaded_ok(loaded, "pp1to2")
    mem = report_plan(converted["pp1to2"]["dst"])["memory"]["per_rank"]
    for m, r in zip(mem, per_rank):
        assert m["gradients"] == r["grad_bytes"], (r["rank"], m, r["grad_bytes"])


def test_plan_memory_pp2_to_pp1(converted, loaded):
    (r,) = _loaded_ok(loaded, "pp2to1")
    (m,) = report_plan(converted["pp2to1"]["dst"])["memory"]["per_rank"]
    assert m["optimizer"] == r["optim_bytes"]
    assert m["parameters"] == r["param_bytes"]


# ------------------------------------------------------------------------------ item 3: no rule
@pytest.fixture(scope="module")
def unruled(root, converted) -> Path:
    """The tp=1 output with one extra parameter (and its Adam state) no reference-gpt rule covers."""
    def edit(sd):
        w = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
        sd["model.blocks.0.attn.extra.weight"] = w
        sd["optim.state.blocks.0.attn.extra.weight.exp_avg"] = w * 0.1
        sd["optim.state.blocks.0.attn.extra.weight.exp_avg_sq"] = w * w
        sd["optim.state.blocks.0.attn.extra.weight.step"] = torch.tensor(float(STEPS))
        sd["optim.param_groups.0.params"] = list(sd["optim.param_groups.0.params"]) + ["blocks.0.attn.extra.weight"]

    assert converted["tp1"]["code"] == 0
    return resave(converted["tp1"]["dst"], root / "unruled", edit, family="reference-gpt")


def test_parameter_without_rule_stops_the_plan(unruled, root, capsys):
    assert mf.read_manifest(unruled).model.family == "reference-gpt"
    code, out, err = run_cli(["plan", unruled, "--to", "dp=1,tp=2"], capsys)
    assert code == 2, out + err
    assert "blocks.0.attn.extra.weight" in err, err
    code, out, err = run_cli(["convert", unruled, root / "unruled_out", "--to", "dp=1,tp=2"], capsys)
    assert code == 2 and "blocks.0.attn.extra.weight" in err, out + err
    assert not (root / "unruled_out").exists()


# ------------------------------------------------------------------------------ item 4: tied copies differ
def _perturb(key: str):
    def edit(sd):
        sd[key] = sd[key].clone()
        sd[key][3, 5] += 0.5
    return edit


@pytest.fixture(scope="module")
def tied_differ(root, sources, converted) -> dict[str, Path]:
    """pp1: the tp=1 output (pp=1) with lm_head.weight != tok_emb.weight; pp2: the pp=2 source with
    the weights differing; pp2_moment: the pp=2 source with lm_head's exp_avg differing from tok_emb's."""
    assert converted["tp1"]["code"] == 0
    d = root / "tied"
    d.mkdir()
    return {"pp1": resave(converted["tp1"]["dst"], d / "pp1", _perturb("model.lm_head.weight")),
            "pp2": resave(sources["pp2_n2"], d / "pp2", _perturb("model.lm_head.weight")),
            "pp2_moment": resave(sources["pp2_n2"], d / "pp2_moment", _perturb("optim.state.lm_head.weight.exp_avg"))}


@pytest.mark.parametrize("which", ["pp1", "pp2"])
def test_inspect_names_differing_tied_copies(tied_differ, capsys, which):
    assert ["tok_emb.weight", "lm_head.weight"] in mf.read_manifest(tied_differ[which]).model.tied
    code, out, err = run_cli(["inspect", tied_differ[which]], capsys)
    assert code == 1, out + err
    assert re.search(r"tied copies tok_emb\.weight and lm_head\.weight differ", out), out


def _refuses(src: Path, to: str, capsys) -> None:
    parent = src.parent / f"{src.name}_to_{to.replace('=', '').replace(',', '_')}"
    parent.mkdir()
    before = listing(parent)
    dst = parent / "out"
    code, out, err = run_cli(["convert", src, dst, "--to", to], capsys)
    assert code != 0, f"convert exited 0 on differing tied copies:\n{out}{err}"
    assert not dst.exists() and listing(parent) == before  # nothing committed, no leftovers beside it
    assert "differ" in out + err


def test_convert_refuses_differing_tied_moments_pp2_to_pp1(tied_differ, capsys):
    _refuses(tied_differ["pp2_moment"], "dp=1", capsys)


@pytest.mark.parametrize("which,to", [("pp1", "dp=2"), ("pp1", "dp=2,tp=2"), ("pp2", "dp=1")])
def test_convert_refuses_differing_tied_weights(tied_differ, capsys, which, to):
    _refuses(tied_differ[which], to, capsys)

