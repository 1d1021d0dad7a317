"""torchtitan 0.3.0 pipeline parallelism: its own ``pipeline_llm`` checkpoint inspected, planned,
converted and verified by reshard, then loaded by torchtitan's own ``CheckpointManager`` at the new
layout, strict and bitwise.

Sources (``tests/writers/torchtitan_run.py`` with the ``"pp"`` job option, each written once per run):
- ``pp2``: 2 ranks, ``ParallelDims(pp=2, dp_shard=1)``, torchtitan's ``pipeline_llm`` split (stage 0:
  ``tok_embeddings`` + layer 0, stage 1: layer 1 + ``norm`` + ``lm_head``), its 1F1B schedule over 2
  micro-batches, 2 training steps, ``CheckpointManager.save`` with both stages' model parts;
- ``pp1``: the same job on 1 rank without pipelining.

What torchtitan writes for PP (asserted below): each stage's parameters and moments in its own
rank's file (the stages' keys are disjoint), one ``dataloader.dp_rank_0`` for the one dp rank
both stages share (``dataloader.world_size`` = 1), and ``train_state.*`` / ``lr_scheduler.*``
saved once. A PP change moves no tensor's cut: torchtitan's DCP load reads the keys each rank
needs from any file; what reshard must get right is the layout it reads (pp=2, not two DDP
replicas, which once made inspect exit 1 for a "missing" loader state of rank 1 and the
conversion's own check refuse its output), the per-dp-rank loader state (carried where the dp
degree stays, dropped by ``--data-policy drop`` where it changes: torchtitan then loads with
``checkpoint.exclude_from_loading = ["dataloader"]``), and the plan verdict.

Conversions, each loaded by torchtitan at the new layout: PP=2 -> dp=1 (1 rank, loader state
carried and compared), PP=2 -> dp=2 (2 ranks, FSDP2, loader dropped), PP=2 -> pp=2,dp=2 (4 ranks,
loader dropped), PP=1 -> pp=2 (2 ranks, both stages load dp rank 0's loader state, compared).
torchtitan's own load of each source at the other PP degree is the baseline.

CPU substitutions: those of the writer's docstring, plus one for PP: torch 2.13's schedule
``step`` takes the whole batch (torchtitan 0.3.0 passes micro-batch lists, an argument of a newer
torch), split into the same micro-batches. Measured cost on the 2-core machine: 60-100 s
(5 torchrun launches: two writes, loads at 1, 2 and 4 ranks).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import require_packages  # noqa: E402

require_packages("torchtitan", "torchdata", "triton")

from tests.conftest import TORCHTITAN_WRITER, cli, once_per_run, run_torchrun, writer_key  # noqa: E402

EXCLUDE = 'checkpoint.exclude_from_loading = ["dataloader"]'


def _step(dump: Path | str) -> Path:
    return Path(dump) / "checkpoint" / "step-2"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """torchtitan's own PP=2 (2 ranks) and PP=1 (1 rank) saves, written once per run."""

    def make(work: Path) -> dict[str, str]:
        (work / "pp2.json").write_text(json.dumps([{"dump": str(work / "pp2"), "fuse_qkv": True, "steps": 2, "pp": 2}]))
        (work / "pp1.json").write_text(json.dumps([{"dump": str(work / "pp1"), "fuse_qkv": True, "steps": 2, "pp": 1}]))
        run_torchrun(TORCHTITAN_WRITER, 2, "write", work / "pp2.json")
        run_torchrun(TORCHTITAN_WRITER, 1, "write", work / "pp1.json")
        return {"pp2": str(work / "pp2"), "pp1": str(work / "pp1")}

    made = once_per_run(tmp_path_factory, writer_key(TORCHTITAN_WRITER, "torchtitan") + "-pp", make)
    return {k: Path(v) for k, v in made.items()}


def _inspect(path: Path) -> tuple[int, dict[str, Any], str]:
    code, out, err = cli(["inspect", path, "--json"])
    return code, (json.loads(out) if out.strip().startswith("{") else {}), out + err


# ---------------------------------------------------------------------------- what is on disk, inspect

def test_stages_write_disjoint_keys(sources):
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(_step(sources["pp2"]))).read_metadata()
    by_file: dict[str, set[str]] = {}
    for idx, loc in md.storage_data.items():
        by_file.setdefault(loc.relative_path, set()).add(idx.fqn)
    tensors = {k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
    held = {f: ks & tensors for f, ks in by_file.items()}
    assert sorted(held) == ["__0_0.distcp", "__1_0.distcp"]
    assert not held["__0_0.distcp"] & held["__1_0.distcp"]
    assert "tok_embeddings.weight" in held["__0_0.distcp"] and "lm_head.weight" in held["__1_0.distcp"]
    assert {k for k in md.state_dict_metadata if k.startswith("dataloader.")} == {"dataloader.dp_rank_0",
                                                                                   "dataloader.world_size"}


def test_inspect_reads_pipeline_stages_not_replicas(sources):
    code, report, text = _inspect(_step(sources["pp2"]))
    assert code == 0, text
    assert report["consistent"] is True, report.get("problems")
    topo = report["topology"]
    assert (topo["pp"], topo["dp_replicate"], topo["dp_shard"], topo["tp"], topo["world_size"]) == (2, 1, 1, 1, 2), topo
    assert not topo.get("ambiguous"), topo
    assert any("stage 0 (rank 0): tok_embeddings, layer 0" in e for e in topo["evidence"]), topo["evidence"]
    assert report["per_rank_state"]["data"]["ranks"] == [0]
    assert report["convention"]["name"] == "torchtitan"


def test_plan_keeps_the_loader_state_when_the_dp_degree_stays(sources):
    code, out, err = cli(["plan", _step(sources["pp2"]), "--to", "dp=1", "--json"])
    assert code == 0, out + err
    plan = json.loads(out)
    assert plan["data"]["policy"] == "carry" and plan["data"]["continuity"] is True, plan["data"]
    assert plan["verdict"]["kept"]["data_position"]["status"] == "carried"
    # a dp change still needs the explicit drop, with torchtitan's setting named
    code, out, err = cli(["plan", _step(sources["pp2"]), "--to", "dp=2"])
    assert code == 2 and EXCLUDE in out + err, out + err


def test_pre_commit_check_uses_the_plans_source_layout(sources):
    """The conversion's own comparison takes the layout the plan used (here ``--from``), not a new guess."""
    from reshard.planning.options import Given, build_options
    from reshard.planning.plan import make_plan, source_inspection
    from reshard.storage.source import Source

    src = Source.local(_step(sources["pp2"]))
    plan = make_plan(src, build_options(Given(to="dp=1", from_spec="pp=2"), src.root))
    ins = source_inspection(plan, src)
    assert ins is plan.inspection and ins.topology.pp == 2 and ins.topology.source == "given"


# ---------------------------------------------------------------------------- convert, verify, torchtitan loads

CASES = {  # name: (source, --to, extra flags, ranks, pp of the load, torchtitan's exclude)
    "pp2-to-dp1": ("pp2", "dp=1", [], 1, 1, []),
    "pp2-to-dp1-from": ("pp2", "dp=1", ["--from", "pp=2"], 1, 1, []),
    "pp2-to-dp2": ("pp2", "dp=2", ["--data-policy", "drop"], 2, 1, ["dataloader"]),
    "pp2-to-pp2-dp2": ("pp2", "pp=2,dp=2", ["--data-policy", "drop"], 4, 2, ["dataloader"]),
    "pp1-to-pp2": ("pp1", "pp=2", [], 2, 2, []),
}


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[str, Any]:
    """Every case converted and verified, then loaded by torchtitan: one launch per world size."""
    work = tmp_path_factory.mktemp("torchtitan-pp")
    outcome: dict[str, Any] = {"convert": {}, "verify": {}, "load": {}, "out": {}}
    jobs: dict[int, list[dict[str, Any]]] = {1: [], 2: [], 4: []}
    for name, (src, to, flags, ranks, pp, exclude) in CASES.items():
        out = work / name
        code, o, e = cli(["convert", _step(sources[src]), _step(out), "--to", to, *flags])
        outcome["convert"][name] = (code, o + e)
        outcome["out"][name] = _step(out)
        if code != 0:
            continue
        outcome["verify"][name] = cli(["verify", _step(sources[src]), _step(out), "--json"])
        jobs[ranks].append({"name": name, "dump": str(out), "step": 2, "ref": str(sources[src] / "reference"),
                            "pp": pp, "exclude": exclude})
    # torchtitan's own load of each source at the other PP degree: the baseline
    jobs[1].append({"name": "source-pp2-at-pp1", "dump": str(sources["pp2"]), "step": 2,
                    "ref": str(sources["pp2"] / "reference"), "pp": 1})
    jobs[2].append({"name": "source-pp1-at-pp2", "dump": str(sources["pp1"]), "step": 2,
                    "ref": str(sources["pp1"] / "reference"), "pp": 2})
    for ranks, js in jobs.items():
        if not js:
            continue
        spec, result = work / f"load-{ranks}.json", work / f"load-{ranks}-result.json"
        spec.write_text(json.dumps(js))
        run_torchrun(TORCHTITAN_WRITER, ranks, "load", spec, result)
        outcome["load"].update({j["name"]: j for j in json.loads(result.read_text())["jobs"]})
    return outcome


@pytest.mark.parametrize("source", ["source-pp2-at-pp1", "source-pp1-at-pp2"])
def test_torchtitan_itself_loads_the_source_at_the_other_pp(converted, source):
    job = converted["load"][source]
    assert job["loaded"] and job["differences"] == [], job


@pytest.mark.parametrize("case", list(CASES))
def test_convert_verify_and_torchtitan_loads_bitwise(converted, case):
    code, text = converted["convert"][case]
    assert code == 0, text
    vcode, vout, verr = converted["verify"][case]
    assert vcode == 0, vout + verr
    assert json.loads(vout)["equal"] is True
    job = converted["load"][case]
    assert job["loaded"] and job["error"] is None, job
    assert job["differences"] == [], job["differences"]  # model, optimizer, schedule, train state, loader (if kept)
    assert job["compared"]["model"] == 21 and job["compared"]["optimizer"] > 200


@pytest.mark.parametrize("case", ["pp2-to-dp1", "pp1-to-pp2", "pp2-to-pp2-dp2"])
def test_output_records_the_new_layout(converted, case):
    code, text = converted["convert"][case]
    assert code == 0, text
    from reshard.model.topology import parse_spec

    _, report, out = _inspect(converted["out"][case])
    want = parse_spec(CASES[case][1])
    topo = report["topology"]
    assert (topo["pp"], topo["dp_shard"]) == (want.pp, want.dp_shard) and topo["source"] == "manifest", topo
