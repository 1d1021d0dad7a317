"""Megatron-Core ``dist_checkpointing`` (torch_dist backend, megatron-core 0.16.1): inspect, plan,
convert to another DP degree, and Megatron's own ``dist_checkpointing.load`` of the output.

The source is written ONCE per module by ``tests/writers/megatron_run.py`` on 4 gloo ranks
(forked by ``torch.multiprocessing`` after importing megatron.core once, which costs 15-30 s of
CPU per interpreter; the writer runs the same under ``torch.distributed.run --nproc-per-node 4``):
``parallel_state.initialize_model_parallel`` with
tensor parallel 2 and data parallel 2, a tiny ``GPTModel`` from ``get_gpt_layer_local_spec``
(2 layers, hidden 32, 4 heads, vocab 64), two steps of Adam, and
``dist_checkpointing.save(model.sharded_state_dict() + optimizer, sharded_strategy=torch_dist)``,
Megatron's own save path. Its `.metadata` carries ``all_local_plans`` (the per-rank DCP
``SavePlan``s, stored by megatron/core/dist_checkpointing/strategies/state_dict_saver.py),
and beside it Megatron writes ``common.pt`` (iteration, optimizer param groups and common step)
and ``metadata.json`` (the backends). DP replicas write nothing: only Megatron's main replica
(``replica_id`` 0) of each ShardedTensor is stored, so 4 ranks leave 2 data files, one per TP rank.

The converted output (``--from dp_replicate=2,tp=2 --to tp=2``: dp 2 -> 1, same TP) is loaded
back by ``dist_checkpointing.load`` at world size 2 (tp 2, dp 1) and every tensor Megatron hands
back (parameters and both Adam moments, each TP cut and each stacked layer) is compared bitwise
with what each rank held when it saved (``REF/rank_<r>.pt``, written by the writer beside the save).

CPU substitutions (all in tests/writers/megatron_run.py; none changes a byte written):

- gloo instead of nccl: the collectives exchange the same save plans and metadata objects; each
  rank's data file holds its own tensors' bytes.
- ``torch.cuda.synchronize`` is a no-op and ``torch.cuda.current_device()`` is ``"cpu"``, set in the
  writer process only (the installed packages are untouched): Megatron's torch_dist save path calls
  them unconditionally (filesystem_async.py:230 after its device-to-host copies, which on the CPU
  copy nothing; state_dict_saver.py:252 for a one-int failure flag it broadcasts). Without them the
  save fails with "AssertionError: Torch not compiled with CUDA enabled".
- ``TransformerConfig(use_cpu_initialization=True)``: weights made on the CPU, Megatron's own path
  for that; dropout 0 and no CUDA RNG tracker (``model_parallel_cuda_manual_seed`` needs CUDA; no
  RNG state is saved).
- The optimizer state is a plain ``torch.optim.Adam`` put into Megatron's sharded form with the
  exact calls of ``FP32Optimizer.sharded_state_dict`` (``get_param_id_to_sharded_param_map``,
  ``optim_state_to_sharding_state(exclude_keys="step")``, ``state["common_step"]``):
  ``FP32Optimizer.__init__`` itself allocates ``torch.tensor([1.0], device='cuda')``
  (megatron/core/optimizer/optimizer.py:907) and ``get_megatron_optimizer`` needs Megatron's DDP,
  whose grad buffers live on ``torch.cuda.current_device()``. The distributed optimizer is not
  covered for that reason.
- megatron-core has no ``megatron.training``: the top-level state dict mirrors Megatron-LM's
  (``model``, ``optimizer``, ``iteration``, ``checkpoint_version``) without ``args``/``rng_state``.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_packages  # noqa: E402

require_packages("megatron")  # found, not imported: see conftest

from conftest import cli  # noqa: E402

WRITER = Path(__file__).parent / "writers" / "megatron_run.py"
TIMEOUT = 600
SOURCE = "dp_replicate=2,tp=2"   # what the writer ran: Megatron's DP ranks are replicas
TARGET = "tp=2"                  # dp 2 -> 1, same TP: world size 2
SIDECARS = ("common.pt", "metadata.json")


def _ranks(mode: str, ckpt: Path, ref: Path, nproc: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", SOURCE_DATE_EPOCH="1700000000")
    cmd = [sys.executable, str(WRITER), mode, str(ckpt), str(ref), "--tp", "2", "--nproc", str(nproc)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def _tail(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("[rank0]") or "rank 0:" in ln]
    return "\n".join(lines[-8:]) or (r.stdout + r.stderr)[-3000:]


@pytest.fixture(scope="module")
def megatron_ckpt(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, reference) written by Megatron at tp 2 x dp 2 on 4 gloo ranks."""
    base = tmp_path_factory.mktemp("megatron")
    ckpt, ref = base / "ckpt", base / "ref"
    r = _ranks("save", ckpt, ref, nproc=4)
    assert r.returncode == 0, _tail(r)
    return ckpt, ref


@pytest.fixture(scope="module")
def converted(megatron_ckpt, tmp_path_factory) -> tuple[Path, int, str, str]:
    """(output, exit code, stdout, stderr) of ``convert --from dp_replicate=2,tp=2 --to tp=2``."""
    out = tmp_path_factory.mktemp("megatron-out") / "dp1"
    code, stdout, stderr = cli(["convert", megatron_ckpt[0], out, "--from", SOURCE, "--to", TARGET])
    return out, code, stdout, stderr


def _inspect(ckpt: Path) -> tuple[int, dict, str]:
    code, out, err = cli(["inspect", ckpt, "--json"])
    return code, (json.loads(out) if out.strip().startswith("{") else {}), err


# --------------------------------------------------------------------------- .metadata

def test_writer_wrote_what_megatron_writes(megatron_ckpt):
    """The fixture is a real torch_dist checkpoint: one data file per TP rank (replicas write nothing), sidecars."""
    ckpt, _ = megatron_ckpt
    names = sorted(p.name for p in ckpt.iterdir())
    assert ".metadata" in names and set(SIDECARS) <= set(names)
    assert sorted(n for n in names if n.endswith(".distcp")) == ["__0_0.distcp", "__0_1.distcp",
                                                                  "__1_0.distcp", "__1_1.distcp"]
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "torch_dist"


def test_all_local_plans_read_as_inert_records(megatron_ckpt):
    """`all_local_plans` unpickles into reshard's stand-ins, never into torch's planner classes."""
    from reshard.storage.dcp import read_raw_metadata
    from reshard.storage.safe_pickle import Record, load_metadata_pickle

    ckpt, _ = megatron_ckpt
    md = load_metadata_pickle((ckpt / ".metadata").read_bytes(), str(ckpt / ".metadata"))
    plans = md.get("all_local_plans")
    assert isinstance(plans, list) and len(plans) == 4  # one SavePlan per writer rank
    assert all(isinstance(p, Record) and type(p).__name__ == "SavePlan" for p in plans)
    items = [i for p in plans for i in p.get("items")]
    assert items and all(isinstance(i, Record) and type(i).__name__ == "WriteItem" for i in items)
    assert not any(type(i).__module__.startswith("torch") for i in items)
    raw = read_raw_metadata(ckpt)
    assert raw.entries and raw.locations


def _forged(ckpt: Path, dst: Path, change) -> Path:
    """A copy of ``ckpt`` whose `.metadata` (unpickled by stock pickle: this test wrote it) is changed by ``change``."""
    shutil.copytree(ckpt, dst)
    with open(dst / ".metadata", "rb") as f:
        md = pickle.load(f)  # noqa: S301 - the checkpoint was written by this module's own writer
    change(md)
    with open(dst / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return dst


class _Runs:
    """Pickles as a call of ``os.system``: what a hostile `all_local_plans` would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_code_in_all_local_plans_is_refused(megatron_ckpt, tmp_path):
    """The allow-list admits SavePlan's own classes only: a callable hidden in a plan is refused, never run."""
    marker = tmp_path / "ran"

    def hostile(md) -> None:
        md.all_local_plans[0] = type(md.all_local_plans[0])(items=md.all_local_plans[0].items,
                                                           planner_data=_Runs(marker))

    bad = _forged(megatron_ckpt[0], tmp_path / "hostile", hostile)
    code, _, err = _inspect(bad)
    assert code == 2, err
    assert "refusing to unpickle global" in err and "system" in err
    assert not marker.exists()


def test_all_local_plans_are_not_evidence(megatron_ckpt, tmp_path):
    """Plans that lie (one rank's, with its items emptied) change nothing inspect reports."""
    def lie(md) -> None:
        md.all_local_plans = [type(md.all_local_plans[0])(items=[])]

    code0, honest, _ = _inspect(megatron_ckpt[0])
    code1, lied, err = _inspect(_forged(megatron_ckpt[0], tmp_path / "lying", lie))
    assert code1 == code0, err
    for field in ("topology", "entries", "items", "by_role", "optimizer", "unknown_keys", "complete"):
        assert lied[field] == honest[field], field


# --------------------------------------------------------------------------- inspect

def test_inspect_roles(megatron_ckpt):
    """Exit 0; Megatron's keys: 17 parameters, exp_avg/exp_avg_sq for each, `_extra_state` shards as blobs."""
    code, rep, err = _inspect(megatron_ckpt[0])
    assert code == 0, (err, [p for p in rep.get("problems", [])])
    assert rep["convention"]["name"] == "megatron-core"
    assert rep["unknown_keys"] == []
    roles = rep["by_role"]
    assert roles["parameter"]["count"] == 17
    assert roles["optimizer_moment"]["count"] == 34
    assert roles["blob"]["count"] == 8  # <module>._extra_state/shard_<layer>_<layers>, one per stacked layer
    opt = rep["optimizer"]
    assert sorted(opt["moment_names"]) == ["exp_avg", "exp_avg_sq"]
    assert opt["with_moments"] == 17 and opt["missing_moments"] == [] and opt["shape_mismatches"] == []


def test_inspect_topology_tells_tp_cuts_from_dp_replicas(megatron_ckpt):
    """TP cuts show in chunk offsets (tp=2); the stacked layer axis is not a DP cut; DP replicas are not
    stored (Megatron keeps replica_id 0 only), so dp is either known as replicate=2 or said to be unknown."""
    code, rep, err = _inspect(megatron_ckpt[0])
    topo = rep["topology"]
    assert topo["tp"] == 2, topo
    assert topo["dp_shard"] == 1, topo  # the per-layer chunks of decoder.layers.* are not FSDP shards
    assert topo["pp"] == 1, topo
    said = json.dumps([topo.get("evidence"), rep.get("notes"), rep.get("problems")]).lower()
    assert topo["dp_replicate"] == 2 or ("replica" in said and "--from" in said), topo


def test_inspect_accounts_for_sidecars(megatron_ckpt):
    """common.pt and metadata.json are named in inspect's report (issue 15: sidecars are data)."""
    code, rep, err = _inspect(megatron_ckpt[0])
    text = json.dumps(rep)
    for name in SIDECARS:
        assert name in text, f"{name} not accounted for in inspect --json"


# --------------------------------------------------------------------------- plan / convert

def test_plan_to_another_dp_degree(megatron_ckpt):
    code, out, err = cli(["plan", megatron_ckpt[0], "--from", SOURCE, "--to", TARGET, "--json"])
    assert code == 0, err or out
    plan = json.loads(out)
    assert plan["feasible"], plan["reasons"]
    actions = {k["key"]: k["action"] for k in plan["keys"]}
    assert not [k for k, a in actions.items() if a.startswith("drop")], actions
    assert plan["target"]["world_size"] == 2


def test_convert_exit_0(converted):
    out, code, stdout, stderr = converted
    assert code == 0, stderr or stdout
    assert (out / ".metadata").exists()


def test_convert_keeps_sidecars_byte_identical(megatron_ckpt, converted):
    out, code, stdout, stderr = converted
    assert code == 0, stderr or stdout
    for name in SIDECARS:
        assert (out / name).exists(), f"{name} missing from the output"
        assert (out / name).read_bytes() == (megatron_ckpt[0] / name).read_bytes(), name


def test_converted_output_inspects_clean(converted):
    out, code, stdout, stderr = converted
    assert code == 0, stderr or stdout
    c, rep, err = _inspect(out)
    assert c == 0, (err, rep.get("problems"))
    assert rep["topology"]["tp"] == 2 and rep["topology"]["world_size"] == 2


def test_megatron_loads_output_at_new_dp_bitwise(megatron_ckpt, converted):
    """Megatron's own dist_checkpointing.load at world size 2 (tp 2, dp 1): every tensor bitwise equal."""
    out, code, stdout, stderr = converted
    assert code == 0, stderr or stdout
    r = _ranks("load", out, megatron_ckpt[1], nproc=2)
    assert r.returncode == 0, _tail(r)
    assert r.stdout.count("bitwise equal") == 2, r.stdout
