"""torchtitan 0.3.0, as its users write it: inspect, plan and convert its CheckpointManager output,
and load the converted checkpoint back with torchtitan's own CheckpointManager at the new world size.

The source checkpoints are written ONCE per module by ``tests/writers/torchtitan_run.py`` under
``python -m torch.distributed.run --nproc-per-node 2`` (gloo, CPU): torchtitan's own
``Llama3Model`` (dim 64, 2 layers, 4 heads, 2 kv heads, vocab 256), its ``parallelize_llama``
(FSDP2, data_parallel_shard=2), ``OptimizersContainer`` (AdamW), ``LRSchedulersContainer``,
``ParallelAwareDataloader``, 2 real training steps, ``CheckpointManager.save`` ->
``checkpoint/step-2``. Two variants in the same launch: fused QKV (``fuse_qkv=True``, what every
shipped llama3 flavor uses) and separate q/k/v (``fuse_qkv=False``).

CPU substitutions (each documented in the writer's docstring with why nothing written to disk
changes): gloo process group and a "cpu" device mesh; ``ScaledDotProductAttention`` instead of
compiled ``FlexAttention`` (no parameters); ``mixed_precision_param=float32``; optimizer
``implementation="for-loop"`` instead of the CUDA-fused kernel; FSDP
``set_force_sum_reduction_for_comms(True)`` (gloo has no PREMUL_SUM); ``spmd_backend =
"partial_dtensor"`` (with the default ``spmd_types`` and FSDP only, torch 2.13's fully_shard
refuses the plain parameters); no activation checkpointing / compile / float8; a tiny
in-memory Stateful token dataset instead of a Hugging Face dataset and tokenizer;
``F.cross_entropy`` instead of the chunked loss wrapper.

What torchtitan 0.3.0 writes (read from the checkpoints, asserted below):
- model keys at the top level: ``tok_embeddings.weight``, ``layers.N.attention.qkv_linear.{wq,wk,wv}.weight``,
  ``layers.N.attention.wo.weight``, ``layers.N.feed_forward.{w1,w2,w3}.weight``, norms, ``lm_head.weight``;
- with fused QKV the parameter is ``qkv_linear.wqkv.weight``: its state_dict hook splits it into
  wq/wk/wv, each saved *Replicate* (one chunk, written by one rank), while the optimizer state is
  keyed ``optimizer.state.layers.N.attention.qkv_linear.wqkv.weight.{step,exp_avg,exp_avg_sq}``,
  Shard(0) over dp, rows interleaved per kv group (q heads of the group, its k head, its v head);
- ``optimizer.param_groups.<fqn>.<hyperparameter>`` per parameter; ``lr_scheduler.last_epoch``;
  ``train_state.{step,ntokens_seen}``; ``dataloader.dp_rank_<k>`` (pickled StatefulDataLoader
  state per dp rank) and ``dataloader.world_size``.

Data position on a DP change: torchtitan's loader state cannot be translated (it asserts the same
dp degree on load, and DCP fails on a missing ``dataloader.dp_rank_<k>``). ``plan`` without a
policy refuses and names the only choice (``--data-policy drop``) and what torchtitan must be
told: ``checkpoint.exclude_from_loading = ["dataloader"]``; ``restart-epoch`` is not offered.
The test loads the dropped output both ways: with the setting (works, bitwise) and without
(torchtitan's load fails, which is why the setting is named).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import require_packages  # noqa: E402

require_packages("torchtitan", "torchdata", "triton")  # found, not imported: see conftest

from tests.conftest import cli  # noqa: E402

WRITER = Path(__file__).parent / "writers" / "torchtitan_run.py"
EXCLUDE = 'checkpoint.exclude_from_loading = ["dataloader"]'


def _launch(mode: str, jobs: list[dict[str, Any]], nproc: int, work: Path, tag: str) -> dict[str, Any] | None:
    """One torchrun launch of the writer for a list of jobs; the load result JSON (load mode)."""
    spec = work / f"{tag}.json"
    spec.write_text(json.dumps(jobs))
    result = work / f"{tag}-result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WRITER),
           mode, str(spec)] + ([str(result)] if mode == "load" else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(result.read_text()) if mode == "load" else None


@pytest.fixture(scope="module")
def titan(torchtitan_sources, tmp_path_factory) -> dict[str, Path]:
    """Both source checkpoints (fused / separate QKV) from one 2-rank launch of torchtitan's own save
    (`conftest.torchtitan_sources`, written once per run), and this module's own work directory."""
    return {"work": tmp_path_factory.mktemp("torchtitan"), **torchtitan_sources}


def _step(dump: Path) -> Path:
    return dump / "checkpoint" / "step-2"


def _inspect(path: Path) -> tuple[int, dict[str, Any], str]:
    code, out, err = cli(["inspect", path, "--json"])
    return code, (json.loads(out) if out.strip().startswith("{") else {}), out + err


# ---------------------------------------------------------------------------- what is on disk

def test_torchtitan_writes_its_03_key_layout(titan):
    """The on-disk keys of torchtitan 0.3.0 (the facts the conventions are written from)."""
    from torch.distributed.checkpoint import FileSystemReader

    for variant in ("fused", "unfused"):
        md = FileSystemReader(str(_step(titan[variant]))).read_metadata().state_dict_metadata
        keys = set(md)
        for n in range(2):
            for w in ("wq", "wk", "wv"):
                assert f"layers.{n}.attention.qkv_linear.{w}.weight" in keys
        assert "lm_head.weight" in keys and "output.weight" not in keys
        assert {"lr_scheduler.last_epoch", "train_state.step", "train_state.ntokens_seen",
                "dataloader.dp_rank_0", "dataloader.dp_rank_1", "dataloader.world_size"} <= keys
        assert any(k.startswith("optimizer.param_groups.lm_head.weight.") for k in keys)
        moments = {k for k in keys if k.startswith("optimizer.state.")}
        if variant == "fused":
            assert "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg" in moments
            assert not any(".qkv_linear.wq.weight" in k for k in moments)
            # wq/wk/wv come from the split hook as Replicate DTensors: one chunk covering the tensor
            wq = md["layers.0.attention.qkv_linear.wq.weight"]
            assert len(wq.chunks) == 1 and list(wq.chunks[0].sizes) == list(wq.size)
            wqkv = md["optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"]
            assert list(wqkv.size) == [(4 + 2 * 2) * 16, 64] and len(wqkv.chunks) == 2
        else:
            assert "optimizer.state.layers.0.attention.qkv_linear.wq.weight.exp_avg" in moments
            assert not any("wqkv" in k for k in keys)


# ---------------------------------------------------------------------------- inspect

@pytest.mark.parametrize("variant", ["unfused", "fused"])
def test_inspect_torchtitan_03(titan, variant):
    """Exit 0, consistent, dp_shard=2 on 2 writers, and every key in its role (counted per role).

    inspect --json gives counts per role: 21 model tensors (wq/wk/wv under qkv_linear, lm_head) are
    parameters, the scheduler's last_epoch is scheduler state, train_state.{step,ntokens_seen}
    counters, dataloader.dp_rank_{0,1} + world_size data, the moments 2 per trainable parameter
    (19 + 2 fused wqkv entries that stand for 6 model entries with fused QKV).
    """
    code, report, text = _inspect(_step(titan[variant]))
    assert code == 0, text
    assert report["consistent"] is True, report.get("problems")
    topo = report["topology"]
    assert (topo["dp_shard"], topo["dp_replicate"], topo["tp"], topo["pp"], topo["world_size"]) == (2, 1, 1, 1, 2), topo
    assert report["convention"]["name"] == "torchtitan"
    by_role = {k: v["count"] for k, v in report["by_role"].items()}
    moments = 2 * (21 if variant == "unfused" else 17)
    assert by_role == {"parameter": 21, "optimizer_moment": moments, "optimizer_step": moments // 2,
                       "param_group": 12 * (moments // 2), "scheduler": 1, "counter": 2, "data": 3}, by_role
    assert report["counters"] == {"step": 2, "tokens_seen": 64}
    assert report["per_rank_state"]["data"]["ranks"] == [0, 1]
    assert report["unknown_keys"] in ([], {}, None, 0), report["unknown_keys"]


# ---------------------------------------------------------------------------- plan / data position

def test_plan_refuses_per_rank_data_and_names_the_setting(titan):
    """No policy: refused (exit 2), only drop offered, and torchtitan's setting named."""
    code, out, err = cli(["plan", _step(titan["unfused"]), "--to", "dp=1"])
    assert code == 2, out + err
    assert "dataloader.dp_rank_0" in out + err
    assert EXCLUDE in out + err
    assert "--data-policy drop" in out + err


@pytest.mark.parametrize("policy", ["restart-epoch", "translate"])
def test_restart_epoch_and_translate_are_not_offered(titan, policy):
    """Refused with the setting named. The real state (StatefulDataLoader over a Stateful dataset:
    ``_num_yielded``/``samples_yielded`` counters, equal on both ranks, plus ``dataset_state.sample_idx``)
    once matched the ``strided-count`` form on its counters and "translated" 2 -> 1 with continuity
    claimed, while torchtitan resumes from ``dataset_state`` and would have repeated samples."""
    code, out, err = cli(["plan", _step(titan["unfused"]), "--to", "dp=1", "--data-policy", policy])
    assert code == 2, out + err
    assert "not available" in out + err and EXCLUDE in out + err


def test_plan_drop_says_what_torchtitan_must_be_told(titan):
    code, out, err = cli(["plan", _step(titan["unfused"]), "--to", "dp=1", "--data-policy", "drop", "--json"])
    assert code == 0, out + err
    plan = json.loads(out)
    assert plan["data"]["policy"] == "drop" and plan["data"]["continuity"] is False
    assert EXCLUDE in plan["data"]["trainer_must"] and EXCLUDE in plan["data"]["note"], plan["data"]
    kept = plan["verdict"]["kept"]["data_position"]
    assert kept["status"] == "lost" and EXCLUDE in kept["note"], kept


# ---------------------------------------------------------------------------- convert, then torchtitan loads it

@pytest.fixture(scope="module")
def converted(titan) -> dict[str, Any]:
    """Convert each variant to dp=1 (--data-policy drop) and load each output with torchtitan at world size 1.

    One 1-rank launch serves every load job. Each job's result is kept: the tests assert on them,
    so a conversion that fails is reported by the test that needs it.
    """
    work = titan["work"]
    outcome: dict[str, Any] = {"convert": {}}
    jobs = []
    for variant in ("unfused", "fused"):
        out_base = work / f"{variant}-dp1"
        code, out, err = cli(["convert", _step(titan[variant]), out_base / "checkpoint" / "step-2", "--to", "dp=1",
                              "--data-policy", "drop"])
        outcome["convert"][variant] = (code, out + err)
        if code != 0:
            continue
        ref = str(titan[variant] / "reference")
        jobs.append({"name": f"{variant}-excluded", "dump": str(out_base), "step": 2, "ref": ref,
                     "exclude": ["dataloader"], "fuse_qkv": variant == "fused"})
        jobs.append({"name": f"{variant}-not-excluded", "dump": str(out_base), "step": 2, "ref": ref,
                     "exclude": [], "fuse_qkv": variant == "fused"})
    # torchtitan's own resharding load of the source, as the baseline the conversion must match
    jobs.append({"name": "source-excluded", "dump": str(titan["unfused"]), "step": 2,
                 "ref": str(titan["unfused"] / "reference"), "exclude": ["dataloader"], "fuse_qkv": False})
    res = _launch("load", jobs, 1, work, "load-dp1")
    outcome["load"] = {j["name"]: j for j in res["jobs"]}
    return outcome


def test_torchtitan_itself_loads_the_source_at_dp1(converted):
    job = converted["load"]["source-excluded"]
    assert job["loaded"] and job["differences"] == [], job


@pytest.mark.parametrize("variant", ["unfused", "fused"])
def test_convert_to_dp1_loads_bitwise_in_torchtitan(converted, variant):
    code, text = converted["convert"][variant]
    assert code == 0, text
    job = converted["load"][f"{variant}-excluded"]
    assert job["loaded"] and job["error"] is None, job
    assert job["differences"] == [], job["differences"]
    assert job["compared"]["model"] == 21 and job["compared"]["optimizer"] > 200


@pytest.mark.parametrize("variant", ["unfused", "fused"])
def test_without_the_setting_torchtitan_refuses_the_dropped_output(converted, variant):
    """Why the setting is named: torchtitan's load asks DCP for dataloader.dp_rank_0, which drop removed."""
    code, text = converted["convert"][variant]
    assert code == 0, text
    job = converted["load"][f"{variant}-not-excluded"]
    assert not job["loaded"] and "dataloader" in (job["error"] or ""), job
