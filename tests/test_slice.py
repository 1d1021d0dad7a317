"""`convert --layers`: a layer slice of a real checkpoint, loaded by a model built with that many layers.

A slice keeps the embeddings, some transformer layers (renumbered densely), the final norm
and head, with those parameters' real optimizer state and every other trainer state carried
as for any transition. What a layer is comes from the model family's ``[pipeline]``
description (formats/models/*.toml).

1. The reference GPT (reshard/reference/model.py): 4 layers trained at dp=2 by the reference
   trainer, sliced to layers 0-1 and to the non-contiguous 0,3 at dp=2, each loaded strictly
   (``dcp.load`` with torch's DefaultLoadPlanner, every key it asks for present, every key of
   the checkpoint asked for) into the trainer's own 2-layer model under FSDP2 at dp=2 in
   spawned gloo processes (tests/_dcp_load_worker.py); every kept tensor and Adam moment is
   bitwise the source's renumbered one, the step, schedule, data cursor and LR carried.
2. torchtitan 0.3.0 (its own Llama3Model, parallelize_llama, optimizers, schedulers, loader
   and CheckpointManager, tests/writers/torchtitan_slice.py): 4 layers at dp=2, fused QKV
   sliced 0,3 and separate q/k/v sliced 0-1, loaded by torchtitan's CheckpointManager into a
   2-layer model at dp=2 and compared bitwise with the renumbered reference; the slice holds
   exactly the keys and shapes of a run made with 2 layers.
3. What the plan says before anything is written (the slice's size, per-rank memory), the
   verdict (a warm start of a different model, saying what was kept), the manifest
   (n_layers) and lineage (source and slice), and the refusals: a family that does not say
   what a layer is, bad layer lists, ``--experts`` where no expert dimension is declared.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import cli
from reshard.train.launch import start_ranks
from reshard.reference import TrainConfig, run_reference
from reshard.reference.trainer import free_port
from reshard.semantics.manifest import read_manifest
from reshard.storage.checkpoints.index import CheckpointIndex

LAYERS = 4
SLICES = {"first2": ("0-1", [0, 1]), "ends": ("0,3", [0, 3])}  # name -> (--layers, source layers kept)
TITAN_WRITER = Path(__file__).parent / "writers" / "torchtitan_slice.py"


def renumber(key: str, kept: list[int], layer: str = "blocks") -> str | None:
    """The slice's name for a source key (``blocks.3.x`` -> ``blocks.1.x`` for kept 0,3); None: left out."""
    import re

    m = re.search(rf"(?<![A-Za-z0-9_]){layer}\.(\d+)\.", key)
    if m is None:
        return key
    old = int(m.group(1))
    return None if old not in kept else key[:m.start(1)] + str(kept.index(old)) + key[m.end(1):]


def rules_toml(family: str, layer: str, ends: list[str], extra: str = "") -> str:
    """A test-only partition rules file: a [pipeline] table (first and last stage both ``ends``), every
    parameter replicated, and ``extra`` tables."""
    quoted = ", ".join(f"'{e}'" for e in ends)
    return (f'family = "{family}"\ndescription = "a test family"\n\n[pipeline]\nlayer = \'{layer}\'\n'
            f'num_layers = "n_layers"\nfirst = [{quoted}]\nlast = [{quoted}]\n{extra}\n'
            '[[param]]\nmatch = \'.*\'\ntp = "replicate"\n')


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


# ------------------------------------------------------------------------------ the reference GPT

@pytest.fixture(scope="module")
def ref4(tmp_path_factory) -> Path:
    """A 4-layer reference GPT trained 2 steps at dp=2 (FSDP2, spawned gloo ranks), with its manifest."""
    out = tmp_path_factory.mktemp("slice_ref")
    cfg = TrainConfig(dp=2, tp=1, steps=2, save_at=[2], n_layers=LAYERS, out=str(out), log=str(out / "steps.jsonl"),
                      experiment_id="slice-src")
    return run_reference(cfg)[-1]


@pytest.fixture(scope="module")
def ref_slices(ref4, tmp_path_factory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("slice_out")
    out = {}
    for name, (spec, kept) in SLICES.items():
        dst = root / name
        code, text, err = cli(["convert", ref4, dst, "--to", "dp=2", "--layers", spec])
        out[name] = {"code": code, "out": text, "err": err, "dst": dst, "kept": kept}
    return out


@pytest.fixture(scope="module")
def ref_loaded(ref_slices, tmp_path_factory) -> dict[str, list[dict]]:
    """One spawn of 2 processes: the trainer's 2-layer model at dp=2 `dcp.load`s each slice (strict planner)."""
    import _dcp_load_worker

    for name, c in ref_slices.items():
        assert c["code"] == 0, f"{name}: convert exited {c['code']}: {c['out']}{c['err']}"
    jobs = [{"tag": name, "n": 2, "dst": str(c["dst"]), "port": free_port(),
             "cfg": {"dp": 2, "n_layers": 2, "micro_batch": 2, "grad_accum": 2}} for name, c in ref_slices.items()]
    out_dir = tmp_path_factory.mktemp("slice_loaded")
    start_ranks(_dcp_load_worker.worker, (jobs, str(out_dir)), 2)
    results = {}
    for job in jobs:
        per_rank = [torch.load(out_dir / f"{job['tag']}_rank{r}.pt", weights_only=False) for r in range(2)]
        for r in per_rank:
            assert r["error"] is None, f"{job['tag']} rank {r['rank']} failed to load:\n{r['error']}"
        results[job["tag"]] = per_rank
    return results


@pytest.mark.parametrize("name", list(SLICES))
def test_reference_slice_converts_and_verifies(ref_slices, name):
    c = ref_slices[name]
    assert c["code"] == 0, c["out"] + c["err"]
    assert "equal to the source" in c["out"] and "warm start" in c["out"], c["out"]
    ix = CheckpointIndex.open(c["dst"])
    assert ix.complete and ix.writer_ranks() == [0, 1]
    layers = {k.split(".")[2] for k in ix.entries if k.startswith("model.blocks.")}
    assert layers == {"0", "1"}, layers  # renumbered densely, whichever source layers were kept


@pytest.mark.parametrize("name", list(SLICES))
def test_reference_slice_loads_strictly_every_value_bitwise(ref4, ref_slices, ref_loaded, name):
    """Every key the 2-layer job asks for is there and every key of the slice is asked for; each
    rank's piece of every parameter, Adam moment and step counter is bitwise the source's tensor
    of the renumbered name; step, schedule, data cursor and hyper-parameters carried."""
    c, per_rank, kept = ref_slices[name], ref_loaded[name], ref_slices[name]["kept"]
    keys = set(CheckpointIndex.open(c["dst"]).entries)
    assert set().union(*(set(r["requested"]) for r in per_rank)) == keys
    src = CheckpointIndex.open(ref4)
    back = {renumber(k, kept): k for k in src.entries if renumber(k, kept) is not None}
    moments = 0
    for r in per_rank:
        assert {k.split("blocks.")[1].split(".")[0] for k in r["tensors"] if "blocks." in k} == {"0", "1"}
        for key, rec in r["tensors"].items():
            src_key = back[key]
            g = src.read_tensor(src_key)
            assert rec["global_shape"] == tuple(g.shape), key
            expect = g[tuple(slice(o, o + s) for o, s in zip(rec["offsets"], rec["local"].shape))]
            assert bits_equal(rec["local"], expect), f"rank {r['rank']}: {key} is not {src_key} of the source"
            assert bits_equal(r["applied"][key], rec["local"]), f"{key} changed when applied"
            moments += key.endswith((".exp_avg", ".exp_avg_sq"))
        obj = r["objects"]
        assert obj["trainer"]["step"] == src.read_object("trainer.step") == 2
        assert obj["trainer"]["tokens_seen"] == src.read_object("trainer.tokens_seen")
        for k, v in obj["scheduler"].items():
            assert v == src.read_object(f"scheduler.{k}"), k
        assert obj["data"]["sampler"] == {k: src.read_object(f"data.sampler.{k}") for k in obj["data"]["sampler"]}
        group = obj["param_groups"][0]
        for h, v in group.items():
            want = src.read_object(f"optim.param_groups.0.{h}")
            if h == "params":  # the slice's parameters, in the source's order, renumbered
                want = [renumber(p, kept) for p in want if renumber(p, kept) is not None]
            assert v == want, h
        assert group["lr"] == src.read_object("optim.param_groups.0.lr")
    assert moments == 2 * 2 * 36  # both moments of the 36 trainable parameters of a 2-layer GPT, on each rank


def test_noncontiguous_slice_takes_the_source_layers_by_name(ref4, ref_slices):
    """``0,3``: layer 1 of the slice is layer 3 of the source (not layer 1), model and moments alike."""
    c = ref_slices["ends"]
    src, out = CheckpointIndex.open(ref4), CheckpointIndex.open(c["dst"])
    for suffix in ("model.blocks.{}.mlp.fc1.weight", "optim.state.blocks.{}.mlp.fc1.weight.exp_avg_sq",
                   "optim.state.blocks.{}.attn.wq.bias.exp_avg"):
        got = out.read_tensor(suffix.format(1))
        assert bits_equal(got, src.read_tensor(suffix.format(3)))
        assert not torch.equal(got, src.read_tensor(suffix.format(1)))
    assert bits_equal(out.read_tensor("model.blocks.0.attn.wo.weight"), src.read_tensor("model.blocks.0.attn.wo.weight"))
    plan = json.loads((c["dst"] / "reshard-report.json").read_text())["plan"]
    assert plan["slice"]["layers"]["renumbered"] == {"3": 1}
    assert ["model.blocks.3.ln1.weight", "model.blocks.1.ln1.weight"] in plan["slice"]["renamed"]["from_to"]


@pytest.mark.parametrize("name", list(SLICES))
def test_slice_verdict_manifest_lineage_and_report(ref4, ref_slices, name):
    """A warm start of a different model that says what it kept; n_layers 2; lineage names source and slice;
    the layers left out counted in the report with their bytes."""
    c = ref_slices[name]
    report = json.loads((c["dst"] / "reshard-report.json").read_text())
    v = report["plan"]["verdict"]
    assert v["kind"] == "warm_start" and v["warm_start_of"][0] == "model"
    model = v["kept"]["model"]
    assert model["status"] == "sliced" and f"layers {SLICES[name][0]} of 4" in model["note"]
    assert "tok_emb.weight" in model["note"] and "ln_f.weight" in model["note"] and "lm_head.weight" in model["note"]
    assert v["kept"]["optimizer_state"]["status"] == "carried" and "36 parameters of the slice" in v["kept"]["optimizer_state"]["note"]
    assert v["warm_start_reasons"][0].startswith("a different model: a slice of the source")
    sl = report["plan"]["slice"]
    src_bytes = CheckpointIndex.open(ref4).entries
    per_layer = sum(e.nbytes for k, e in src_bytes.items() if e.is_tensor and ".blocks.2." in k)
    assert sl["dropped"]["keys"] == 2 * 64 and sl["dropped"]["bytes"] == 2 * per_layer
    assert set(sl["dropped"]["by_reason"]) == {f"layer {i} not in the slice (--layers)" for i in range(4)
                                               if i not in c["kept"]}
    md = (c["dst"] / "reshard-report.md").read_text()
    assert "## Slice of the model" in md and all(f"| {why} | 64 | {per_layer} |" in md for why in sl["dropped"]["by_reason"])
    drops = [k for k in report["plan"]["keys"] if k["action"] == "dropped" and "not in the slice" in k["reason"]]
    assert drops and all(k["key"].split(".")[2] not in map(str, c["kept"]) for k in drops)
    m = read_manifest(c["dst"])
    assert m.model.config["n_layers"] == 2 and m.continuity == "warm_start"
    assert m.experiment_id.startswith("slice-src-warm-slice-")
    last = m.lineage[-1]
    assert last.policies["source_path"] == str(ref4.resolve())
    assert last.policies["slice"]["layers"]["kept"] == c["kept"] and last.policies["slice"]["config"] == {"n_layers": 2}
    assert "slice of the source" in last.reason


def test_verify_accepts_the_slice(ref4, ref_slices):
    code, out, err = cli(["verify", ref4, ref_slices["ends"]["dst"]])
    assert code == 0, out + err


def test_plan_shows_the_slice_size_and_memory_before_writing(ref4, tmp_path):
    dst = tmp_path / "never"
    code, out, err = cli(["plan", ref4, "--to", "dp=2", "--layers", "0,3", "--dst", dst])
    assert code == 0, out + err
    assert not dst.exists()
    line = next(ln for ln in out.splitlines() if ln.startswith("slice "))
    assert "layers 0,3 of 4" in line and "left out 128 keys" in line, line
    assert "memory      per rank max" in out and "WARM START of a different model" in out
    code, out, err = cli(["plan", ref4, "--to", "dp=2", "--layers", "0,3", "--json"])
    p = json.loads(out)
    whole = json.loads(cli(["plan", ref4, "--to", "dp=2", "--json"])[1])
    assert 0 < p["slice"]["kept"]["bytes"] < whole["source"]["bytes"]
    assert len(p["memory"]["per_rank"]) == 2 and 0 < p["memory"]["max"] < whole["memory"]["max"]
    assert p["fingerprint"] != whole["fingerprint"] and "layers" not in whole["options"]


NO_PIPELINE = r"""family = "no-layers"
description = "a family that does not say what a layer is"
match_params = ['^tok_emb\.weight$']

[[param]]
match = '.*'
tp = "replicate"
"""


def test_a_family_without_pipeline_is_refused(ref4, tmp_path):
    rules = tmp_path / "no_layers.toml"
    rules.write_text(NO_PIPELINE)
    dst = tmp_path / "out"
    code, out, err = cli(["convert", ref4, dst, "--to", "dp=2", "--layers", "0-1", "--rules", rules])
    assert code == 2, out + err
    assert "no-layers" in err and "declares no [pipeline] table" in err, err
    assert "--rules FILE" in err and "(?P<layer>" in err, err  # the way out
    assert not dst.exists()


def test_a_stacked_family_is_refused(ref4, tmp_path):
    """megatron-gpt has a [pipeline] table but its layers are stacked in one tensor: no per-layer names."""
    code, out, err = cli(["plan", ref4, "--to", "dp=2", "--layers", "0-1", "--rules", "megatron-gpt"])
    assert code == 2 and "without a per-layer name pattern" in err, out + err


@pytest.mark.parametrize("spec,words", [("0,9", "the source has 4 layers"), ("3,0", "increasing order"),
                                        ("0-3", "keeps every layer"), ("a-b", "not a list of layer indices")])
def test_bad_layer_lists_are_refused(ref4, spec, words):
    code, out, err = cli(["plan", ref4, "--to", "dp=2", "--layers", spec])
    assert code == 2 and words in err, out + err


def test_pipeline_target_is_refused_with_the_way_out(ref4):
    code, out, err = cli(["plan", ref4, "--to", "dp=1,pp=2", "--layers", "0-1"])
    assert code == 2 and "pp=1" in err and "then convert the slice" in err, out + err


def test_experts_need_a_declared_expert_dimension(ref4):
    code, out, err = cli(["plan", ref4, "--to", "dp=2", "--layers", "0-1", "--experts", "0"])
    assert code == 2 and "declares no [experts] table" in err, out + err


# ------------------------------------------------------------------------------ torchtitan 0.3.0

def _titan_launch(mode: str, jobs: list[dict[str, Any]], work: Path, tag: str) -> dict[str, Any] | None:
    spec = work / f"{tag}.json"
    spec.write_text(json.dumps(jobs))
    result = work / f"{tag}-result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(TITAN_WRITER),
           mode, str(spec)] + ([str(result)] if mode == "load" else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(result.read_text()) if mode == "load" else None


TITAN = {"fused": ("0,3", [0, 3]), "unfused": ("0-1", [0, 1])}  # variant -> (--layers, kept)


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> dict[str, Any]:
    """torchtitan's own save of a 4-layer run at dp=2 (fused and separate QKV), one launch; each
    sliced to 2 layers; one launch loads both slices at dp=2."""
    from conftest import require_packages

    require_packages("torchtitan", "torchdata", "triton")
    work = tmp_path_factory.mktemp("slice_titan")
    _titan_launch("write", [{"dump": str(work / "fused"), "fuse_qkv": True, "steps": 2, "layers": 4},
                            {"dump": str(work / "unfused"), "fuse_qkv": False, "steps": 2, "layers": 4}], work, "write")
    out: dict[str, Any] = {"work": work, "convert": {}}
    jobs = []
    for variant, (spec, kept) in TITAN.items():
        dst = work / f"{variant}-slice"
        code, text, err = cli(["convert", work / variant / "checkpoint" / "step-2", dst / "checkpoint" / "step-2",
                               "--to", "dp=2", "--layers", spec])
        out["convert"][variant] = (code, text + err)
        if code == 0:
            jobs.append({"name": variant, "dump": str(dst), "step": 2, "ref": str(work / variant / "reference"),
                         "fuse_qkv": variant == "fused", "layers": 2, "kept": kept})
    res = _titan_launch("load", jobs, work, "load") if jobs else {"jobs": []}
    out["load"] = {j["name"]: j for j in res["jobs"]}
    return out


@pytest.mark.parametrize("variant", list(TITAN))
def test_torchtitan_loads_the_slice_bitwise(titan, variant):
    """torchtitan's CheckpointManager loads the slice into a 2-layer Llama at dp=2: model, optimizer
    (fused wqkv moments included), lr_scheduler and train_state bitwise the renumbered source's,
    and each rank's loader state its own."""
    code, text = titan["convert"][variant]
    assert code == 0, text
    assert "equal to the source" in text and "warm start" in text, text
    job = titan["load"][variant]
    assert job["loaded"] and job["error"] is None, job
    assert job["differences"] == [], job["differences"][:10]
    assert job["compared"]["model"] == 21 and job["compared"]["layers_in_model"] == 2
    assert job["compared"]["optimizer"] > 200 and job["compared"]["train_state"] == 2


def test_torchtitan_slice_has_the_keys_of_a_two_layer_run(titan, torchtitan_sources):
    """Exactly the keys, shapes and dtypes torchtitan itself saves for a 2-layer model (nothing extra, nothing missing):
    its fused 2-layer save at dp=2 (`conftest.torchtitan_sources`, written once per run by the writer this one wraps)."""
    from torch.distributed.checkpoint import FileSystemReader

    def md(path: Path) -> dict[str, Any]:
        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k: (tuple(v.size), str(v.properties.dtype)) if hasattr(v, "size") else "object" for k, v in meta.items()}

    work = titan["work"]
    assert titan["convert"]["fused"][0] == 0, titan["convert"]["fused"][1]
    native, sliced = md(torchtitan_sources["fused"] / "checkpoint" / "step-2"), md(work / "fused-slice" / "checkpoint" / "step-2")
    assert sorted(set(native) ^ set(sliced)) == []
    assert native == sliced


# ------------------------------------------------------------------------------ experts (a declared [experts] table)

MOE_WRITER = Path(__file__).parent / "writers" / "moe_toy.py"
MOE_RULES = rules_toml("toy-moe", r"^layers\.(?P<layer>\d+)\.", [r"^emb\.", r"^norm\.", r"^head\."], r"""
[experts]
match = '^layers\.\d+\.moe\.experts\.(?P<expert>\d+)\.'
num_experts = "n_experts"
router = [{ match = '^layers\.\d+\.moe\.router\.weight$', dim = 0 }]
""")
MOE_LAYERS, MOE_EXPERTS = [0, 2], [1, 3]  # of 3 layers, of 4 experts


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, Any]:
    """A 3-layer, 4-expert MoE trained at dp=2 (FSDP2, torchrun), sliced to layers 0,2 and experts 1,3,
    then loaded (dcp.load, strict planner) into a 2-layer, 2-expert model at dp=2."""
    from conftest import run_torchrun

    work = tmp_path_factory.mktemp("slice_moe")
    run_torchrun(MOE_WRITER, 2, "write", work, 3, 4)
    rules = work / "toy_moe.toml"
    rules.write_text(MOE_RULES)
    dst = work / "slice"
    code, text, err = cli(["convert", work / "ckpt", dst, "--to", "dp=2", "--layers", "0,2", "--experts", "1,3",
                           "--rules", rules])
    assert code == 0, text + err
    run_torchrun(MOE_WRITER, 2, "load", dst, 2, 2, work / "loaded.pt")
    return {"work": work, "dst": dst, "out": text, "loaded": torch.load(work / "loaded.pt", weights_only=False),
            "reference": torch.load(work / "reference.pt", weights_only=False)}


def _moe_source_name(key: str) -> str:
    """The source name of a slice key: layer i is MOE_LAYERS[i], expert j is MOE_EXPERTS[j]."""
    import re

    key = re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{MOE_LAYERS[int(m.group(1))]}.", key, count=1)
    return re.sub(r"experts\.(\d+)\.", lambda m: f"experts.{MOE_EXPERTS[int(m.group(1))]}.", key, count=1)


def test_expert_slice_loads_strictly_with_the_kept_experts_and_router_rows(moe):
    """Every key the 2x2 model asks for is in the slice and every slice key is asked for; each expert's
    weights and moments are the kept source expert's, each router (and its moments) holds the kept
    experts' rows, bitwise."""
    got, ref = moe["loaded"]["values"], moe["reference"]
    keys = set(CheckpointIndex.open(moe["dst"]).entries)
    assert set().union(*map(set, moe["loaded"]["requested"])) == keys
    routers = 0
    for key, v in got.items():
        if key == "param_groups":
            continue
        want = ref[_moe_source_name(key)]
        if ".moe.router.weight" in key and not key.endswith(".step"):
            want = want[MOE_EXPERTS]
            routers += 1
        assert bits_equal(v, want), key
    assert routers == 2 * 3  # the router of each kept layer, and its two moments
    assert {k.split("experts.")[1].split(".")[0] for k in got if "experts." in k} == {"0", "1"}
    group = got["param_groups"][0]
    src_group = ref["param_groups"][0]
    assert group["lr"] == src_group["lr"] and group["params"] == [
        p for p in (renumber(renumber(q, MOE_LAYERS, "layers") or "", MOE_EXPERTS, "experts") for q in src_group["params"]) if p]
    m = read_manifest(moe["dst"])
    assert m.model.config == {"n_layers": 2, "n_experts": 2}


# ------------------------------------------------------------------------------ rehearse your trainer on a slice

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_trainer.py"
DEEPER = Path(__file__).parent / "writers" / "fsdp2_layers.py"
TRAINER_ARGS = (" --layout {layout} --resume {ckpt_in} --save-at {save_at} --save {ckpt_out} --steps {steps} "
                "--step-log {log} --micro-batch {micro_batch} --grad-accum {grad_accum} --seed {seed} "
                "--dataset-len {dataset_len}")
TINY_RULES = rules_toml("tiny-lm", r"^blocks\.(?P<layer>\d+)\.", [r"^tok\.", r"^pos\.", r"^ln_f\.", r"^head\."])


@pytest.fixture(scope="module")
def trainer_slice(tmp_path_factory) -> dict[str, Any]:
    """examples/fsdp2_trainer.py trained with 4 blocks at dp=2 to step 2, sliced to blocks 0,3; then
    `rehearse --trainer` (the example as it is: 2 blocks) dp=2 -> dp=1 starting from the slice."""
    from reshard.rehearsal import rehearse

    work = tmp_path_factory.mktemp("slice_trainer")
    res = subprocess.run([sys.executable, str(DEEPER), "4", "--nproc", "2", "--layout", "dp=2", "--steps", "2",
                          "--save-at", "2", "--save", str(work / "run"), "--micro-batch", "2", "--grad-accum", "2",
                          "--seed", "0", "--dataset-len", "512"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    rules = work / "tiny.toml"
    rules.write_text(TINY_RULES)
    slice_dir = work / "slice"
    code, out, err = cli(["convert", work / "run" / "step_2", slice_dir, "--to", "dp=2", "--layers", "0,3",
                          "--rules", rules, "--source-micro-batch", "2", "--source-grad-accum", "2"])
    assert code == 0, out + err
    forked = "{python} " + str(EXAMPLE) + " --nproc {world}" + TRAINER_ARGS
    report = rehearse(from_spec="dp=2", to_spec="dp=1", trainer=forked, like=slice_dir, out=work / "rehearsal",
                      steps=8, switch_at=4, window=4, control="none")
    return {"report": report, "slice": slice_dir, "work": work}


def test_rehearse_your_trainer_on_a_slice(trainer_slice):
    """The baseline resumes the slice (step 2: its real weights, moments, schedule, data cursor) on dp=2; the
    transition dp=2 -> dp=1 at step 4 passes with exact coverage, and the report names the slice."""
    r, slice_dir = trainer_slice["report"], trainer_slice["slice"]
    assert r["exit_code"] == 0, (r["diverged"], r["errors"])
    cov = r["coverage"]["resumed"]
    assert (cov["repeated"], cov["skipped"], cov["exact"]) == (0, 0, True)
    assert f"--resume {slice_dir}" in r["trainer"]["runs"]["baseline"]["command"]
    base = [json.loads(ln) for ln in (trainer_slice["work"] / "rehearsal" / "baseline.jsonl").read_text().splitlines()]
    assert base[0]["step"] == 3  # resumed after the slice's step 2, not from scratch
    ss = r["setup"]["like"]["slice_start"]
    assert ss["step"] == 2 and ss["slice"]["layers"]["kept"] == [0, 3] and ss["dataset_len"] == 512
    md = (trainer_slice["work"] / "rehearsal" / "rehearsal.md").read_text()
    assert "started from a slice of the real checkpoint" in md and "layers 0,3 of 4" in md


def test_rehearse_trainer_like_refuses_a_checkpoint_that_is_no_slice(ref4, tmp_path):
    from reshard.rehearsal import rehearse
    from reshard.errors import BadInput

    with pytest.raises(BadInput, match="takes a slice of the real checkpoint"):
        rehearse(from_spec="dp=2", to_spec="dp=1", trainer="{python} x.py --layout {layout}", like=ref4,
                 out=tmp_path / "r", steps=8, switch_at=4, window=4, control="none")


def test_convert_executes_a_printed_slice_plan(ref4, tmp_path):
    """`plan --layers --json` then `convert --plan`: the options (the slice) are in the plan, its fingerprint matches."""
    code, out, err = cli(["plan", ref4, "--to", "dp=2", "--layers", "0,3", "--json"])
    assert code == 0, err
    plan = tmp_path / "plan.json"
    plan.write_text(out)
    assert json.loads(out)["options"]["layers"] == "0,3"
    code, out, err = cli(["convert", ref4, tmp_path / "out", "--plan", plan])
    assert code == 0 and "equal to the source" in out, out + err
    assert read_manifest(tmp_path / "out").model.config["n_layers"] == 2
    code, out, err = cli(["convert", ref4, tmp_path / "out2", "--plan", plan, "--layers", "0-1"])
    assert code == 2 and "--layers has no effect beside --plan" in err, out + err
