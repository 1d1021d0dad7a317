"""torchtitan 0.3.0's MoE (qwen3 MoE, ``GroupedExperts``) with expert parallelism: its own save, then
reshard's inspect / plan / convert / verify, then torchtitan's own ``CheckpointManager.load`` at the
new layout, strict and bitwise.

The source is written ONCE per run by ``tests/writers/torchtitan_moe_run.py`` under
``python -m torch.distributed.run --nproc-per-node 2`` (gloo, CPU): torchtitan's qwen3 MoE as its
``debugmodel_moe`` flavour is assembled, made tiny (dim 64, 2 layers, 4 experts stacked in
``w1_EFD``/``w2_EDF``/``w3_EFD``, top-2, the ``standard`` all-to-all dispatcher, the load-balancing
``expert_bias_E`` buffer), ``ParallelDims(dp_shard=2, ep=2)`` (EP borrows its ranks from dp_shard:
the sparse mesh is ``(efsdp=1, ep=2)``), ``parallelize_qwen3`` (experts ``Shard(0)`` over ``ep``,
FSDP2 over ``efsdp`` on top, everything else FSDP2 over ``fsdp``), AdamW + the MoE load-balancing
hook, 2 real training steps (torchtitan's own grouped matmul, ``torch._grouped_mm``, which
torch 2.13 runs on CPU), ``CheckpointManager.save``. CPU substitutions: those of
``tests/writers/torchtitan_run.py`` (gloo, "cpu" mesh, SDPA for FlexAttention, float32
params, for-loop AdamW, sum reduction, ``partial_dtensor``), each changing nothing written.

What this shows:
- the stacked experts are DTensor-cut chunks like any other (2 experts per EP rank along dim 0);
  the ``expert_bias_E`` buffer (no moments) is model state, not an inconsistency;
- ``convert --to dp=1`` loads in torchtitan at world 1 with ``expert_parallel_degree=1``
  (EP=2 -> EP=1 and a DP change), and ``convert --to dp=2`` loads at world 2 with EP=1
  (EP=2 -> EP=1 at the same world): every model, optimizer, schedule and train-state value
  bitwise;
- ``--experts 1,3`` slices the stacked expert tensors (and their moments, the router gate's rows,
  the expert bias) along the expert axis: it loads into a torchtitan MoE built with 2 experts,
  every value equal to the source's rows of experts 1 and 3.

- the plan says how the experts map to ranks, before and after (``experts``: experts 0-1 on
  rank 0 and 2-3 on rank 1 in the source; all 4 on rank 0 at dp=1, one per rank at dp=4), and that
  the source's EP degree is not in the chunks (EP and FSDP's dim-0 shard make the same pieces here:
  reshard reads the layout as dp_shard=2, and torchtitan cuts the experts over its own ``ep`` at load);
- the shipped family ``formats/models/qwen3-moe-torchtitan.toml`` declares the stacked experts: no
  ``--rules`` is needed for ``--experts``.

Measured cost on this 2-core machine: about 45 s (one 2-rank
write, one 1-rank and one 2-rank load launch).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import require_packages  # noqa: E402

require_packages("torchtitan", "torchdata", "triton")

from tests.conftest import cli, once_per_run, run_torchrun, writer_key  # noqa: E402

WRITER = Path(__file__).parent / "writers" / "torchtitan_moe_run.py"
LLAMA_WRITER = Path(__file__).parent / "writers" / "torchtitan_run.py"  # its helpers are imported by WRITER
KEPT = [1, 3]


def _step(dump: Path | str) -> Path:
    return Path(dump) / "checkpoint" / "step-2"


def _launch_load(jobs: list[dict[str, Any]], nproc: int, work: Path, tag: str) -> dict[str, Any]:
    spec, result = work / f"{tag}.json", work / f"{tag}-result.json"
    spec.write_text(json.dumps(jobs))
    run_torchrun(WRITER, nproc, "load", spec, result)
    return {j["name"]: j for j in json.loads(result.read_text())["jobs"]}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """torchtitan's own EP=2 save at world 2 (written once per run)."""

    def make(work: Path) -> str:
        (work / "write.json").write_text(json.dumps([{"dump": str(work / "ep2"), "ep": 2, "steps": 2}]))
        run_torchrun(WRITER, 2, "write", work / "write.json")
        return str(work / "ep2")

    key = writer_key(WRITER, "torchtitan") + "-" + writer_key(LLAMA_WRITER)[-12:]
    return Path(once_per_run(tmp_path_factory, key, make))


@pytest.fixture(scope="module")
def outcome(source, tmp_path_factory) -> dict[str, Any]:
    """The three conversions, then torchtitan's loads of them (one 1-rank and one 2-rank launch)."""
    work = tmp_path_factory.mktemp("titan_moe")
    ref = str(source / "reference")
    runs = {"dp1": ["--to", "dp=1", "--data-policy", "drop"], "dp2": ["--to", "dp=2"],
            "slice": ["--to", "dp=1", "--data-policy", "drop", "--experts", ",".join(map(str, KEPT))]}
    res: dict[str, Any] = {"convert": {}, "work": work}
    for name, args in runs.items():
        code, out, err = cli(["convert", _step(source), _step(work / name), *args])
        res["convert"][name] = (code, out + err)
    one = [{"name": "dp1-ep1", "dump": str(work / "dp1"), "step": 2, "ref": ref, "ep": 1, "exclude": ["dataloader"]},
           {"name": "slice", "dump": str(work / "slice"), "step": 2, "ref": ref, "ep": 1, "exclude": ["dataloader"],
            "experts": KEPT}]
    two = [{"name": "dp2-ep1", "dump": str(work / "dp2"), "step": 2, "ref": ref, "ep": 1}]
    res["load"] = {**_launch_load([j for j in one if res["convert"][Path(j["dump"]).name][0] == 0], 1, work, "w1"),
                   **_launch_load([j for j in two if res["convert"]["dp2"][0] == 0], 2, work, "w2")}
    return res


def test_torchtitan_stacks_experts_and_shards_them_over_ep(source):
    """What torchtitan 0.3.0 writes at EP=2: each stacked expert tensor a DTensor over the sparse mesh
    (efsdp, ep), Shard(0) on ep: 2 of the 4 experts per rank, two chunks along dim 0 on disk."""
    from torch.distributed.checkpoint import FileSystemReader

    layout = json.loads((source / "reference" / "layout.json").read_text())
    w1 = layout["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
    assert w1["mesh"] == ["efsdp", "ep"] and w1["mesh_shape"] == [1, 2] and w1["placements"][1] == "S(0)", w1
    assert w1["local"] == [2, 32, 64], w1
    md = FileSystemReader(str(_step(source))).read_metadata().state_dict_metadata
    for key in ("layers.0.moe.routed_experts.inner_experts.w1_EFD",
                "optimizer.state.layers.1.moe.routed_experts.inner_experts.w2_EDF.exp_avg"):
        chunks = sorted((list(c.offsets), list(c.sizes)) for c in md[key].chunks)
        assert [o[0] for o, _ in chunks] == [0, 2] and all(s[0] == 2 for _, s in chunks), (key, chunks)
    assert "layers.0.moe.expert_bias_E" in md
    assert not any(k.startswith("optimizer.state.") and "expert_bias_E" in k for k in md)


def test_inspect_reads_the_moe_checkpoint(source):
    """Consistent: the expert bias is a buffer (the torchtitan convention's ``[buffers]``), not a
    parameter missing its moments; counted 2 writer ranks."""
    code, out, err = cli(["inspect", _step(source), "--json"])
    assert code == 0, out + err
    report = json.loads(out)
    assert report["consistent"] is True, report.get("problems")
    assert report["convention"]["name"] == "torchtitan"
    assert report["topology"]["world_size"] == 2, report["topology"]


@pytest.mark.parametrize("name", ["dp1-ep1", "dp2-ep1"])
def test_ep2_to_ep1_loads_bitwise_in_torchtitan(outcome, name):
    code, text = outcome["convert"][name.split("-")[0]]
    assert code == 0, text
    job = outcome["load"][name]
    assert job["loaded"] and job["error"] is None, job
    assert job["differences"] == [], job["differences"]
    assert job["compared"]["model"] == 29 and job["compared"]["optimizer"] > 300, job["compared"]
    w1 = job["layout"]["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
    assert w1["local"][0] == (4 if name == "dp1-ep1" else 2), w1  # experts per rank at EP=1: FSDP's Shard(0)


def test_verify_finds_the_dp1_output_equal(outcome, source):
    code, out, err = cli(["verify", _step(source), _step(outcome["work"] / "dp1")])
    assert code == 0, out + err


def test_experts_slice_of_stacked_experts_loads_in_a_smaller_torchtitan_moe(outcome):
    """``--experts 1,3``: the stacked tensors keep their rows 1 and 3 (and so do their moments, the router
    gate and the expert bias); torchtitan built with 2 experts loads it, every value equal to the
    source's rows (the reference cut by the writer's ``expert_rows``)."""
    code, text = outcome["convert"]["slice"]
    assert code == 0, text
    job = outcome["load"]["slice"]
    assert job["loaded"] and job["error"] is None, job
    assert job["differences"] == [], job["differences"]
    assert job["layout"] == {} or all(v["local"][0] == 2 for v in job["layout"].values()), job["layout"]


def test_plan_names_the_expert_slice(source):
    code, out, err = cli(["plan", _step(source), "--to", "dp=1", "--data-policy", "drop", "--experts", "1,3", "--json"])
    assert code == 0, out + err
    plan = json.loads(out)
    sl = plan["slice"]
    assert sl["experts"]["source"] == 4 and sl["experts"]["kept"] == KEPT, sl
    assert sl["dropped"]["keys"] == 0  # stacked: no key is dropped, the rows are


@pytest.mark.parametrize("dp, target", [(1, [{"experts": [0, 3], "ranks": [0]}]),
                                        (4, [{"experts": [e, e], "ranks": [e]} for e in range(4)])])
def test_plan_says_which_rank_holds_which_experts(source, dp, target):
    """The plan's ``experts``: the source's pieces by writer rank (2 experts per EP rank), the target's by
    the plan's own chunks, and the note that the trainer cuts them over its own ``ep`` at load."""
    code, out, err = cli(["plan", _step(source), "--to", f"dp={dp}", "--data-policy", "drop", "--json"])
    assert code == 0, out + err
    ex = json.loads(out)["experts"]
    assert (ex["experts"], ex["target_experts"], ex["stacked_tensors"], ex["uniform"]) == (4, 4, 6, True), ex
    assert ex["source"] == [{"experts": [0, 1], "ranks": [0]}, {"experts": [2, 3], "ranks": [1]}], ex
    assert ex["target"] == target, ex
    assert "expert-parallel degree" in ex["note"]
    code, text, err = cli(["plan", _step(source), "--to", f"dp={dp}", "--data-policy", "drop"])
    assert "experts     4 per MoE layer" in text and "source experts 0-1 on rank 0; experts 2-3 on rank 1" in text, text
