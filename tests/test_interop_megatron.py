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
(``replica_id`` 0) of each ShardedTensor is stored, so 4 ranks leave 4 data files, two (one per
writer thread) from each TP rank, and none from the replicas.

The layout is what the checkpoint records: `all_local_plans` holds 4 plans (world size 4), the
replicas' (ranks 2, 3) empty, and the plans agree item for item with the stored chunks; with
Megatron's rank order that is tp=2 x dp_replicate=2 (reshard.semantics.megatron). So no
``--from`` is needed, and one that contradicts it is exit 2 naming both. The output converted
without ``--from`` (``--to tp=2``: dp 2 -> 1, same TP) is loaded back by
``dist_checkpointing.load`` at world size 2 (tp 2, dp 1) and every tensor Megatron hands back
(parameters and both Adam moments, each TP cut and each stacked layer) is compared bitwise
with what each rank held when it saved (``REF/rank_<r>.pt``, written by the writer beside the
save); the output converted with the explicit ``--from dp_replicate=2,tp=2`` has the same
data files and `.metadata`, byte for byte.

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
    """(output, exit code, stdout, stderr) of ``convert --to tp=2`` without ``--from``: the layout the plans record."""
    out = tmp_path_factory.mktemp("megatron-out") / "dp1"
    code, stdout, stderr = cli(["convert", megatron_ckpt[0], out, "--to", TARGET])
    return out, code, stdout, stderr


def _inspect(ckpt: Path) -> tuple[int, dict, str]:
    code, out, err = cli(["inspect", ckpt, "--json"])
    return code, (json.loads(out) if out.strip().startswith("{") else {}), err


def _inspect_from(ckpt: Path, spec: str) -> tuple[int, dict, str]:
    code, out, err = cli(["inspect", ckpt, "--from", spec, "--json"])
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
    from reshard.storage.checkpoints.dcp import read_raw_metadata
    from reshard.storage.pickles.safe_pickle import Record, load_metadata_pickle

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


def _one_empty_plan(md) -> None:
    md.all_local_plans = [type(md.all_local_plans[0])(items=[])]


def _plans_swapped(md) -> None:
    md.all_local_plans[0], md.all_local_plans[1] = md.all_local_plans[1], md.all_local_plans[0]


def _extra_idle_ranks(md) -> None:
    plan = type(md.all_local_plans[0])
    md.all_local_plans = md.all_local_plans + [plan(items=[]) for _ in range(4)]  # 8 ranks, 6 of them idle


@pytest.mark.parametrize("lie, why", [(_one_empty_plan, "written by rank 1 but the plans record 1 rank(s)"), (_plans_swapped, "rank 0's plan does not hold it")],
                         ids=["one-empty-plan", "ranks-swapped"])
def test_plans_that_disagree_with_the_chunks_are_not_evidence(megatron_ckpt, tmp_path, lie, why):
    """Plans that do not match what was stored (who wrote which item) are named and used for nothing: the
    chunks alone decide, as for a checkpoint without plans, and they do not pin down the DP degree."""
    code0, honest, _ = _inspect(megatron_ckpt[0])
    lying = _forged(megatron_ckpt[0], tmp_path / "lying", lie)
    code1, lied, err = _inspect(lying)
    assert code1 == code0 == 0, err
    for field in ("entries", "items", "by_role", "optimizer", "unknown_keys", "complete"):
        assert lied[field] == honest[field], field
    unused = next(p for p in lied["problems"] if p["code"] == "save_plans_unused")
    assert why in unused["message"] and unused["file"] == ".metadata", unused
    topo = lied["topology"]
    assert topo["source"] == "inferred" and topo.get("ambiguous") and topo["tp"] == 2, topo
    code, _, err = cli(["plan", lying, "--to", TARGET])
    assert code == 2 and "ambiguous" in err and "--from" in err and "Traceback" not in err, err


def test_the_world_size_is_the_number_of_plans(megatron_ckpt, tmp_path):
    """Plans that match the stored items with four more idle ranks (8, writers 0 and 1): with Megatron's rank order
    that is tp=2 x dp=4, so it is what the checkpoint records; the report says which evidence gave it."""
    code, rep, err = _inspect(_forged(megatron_ckpt[0], tmp_path / "idle", _extra_idle_ranks))
    assert code == 0, err
    topo = rep["topology"]
    assert (topo["dp_replicate"], topo["tp"], topo["world_size"], topo["source"]) == (4, 2, 8, "checkpoint"), topo
    assert any("ranks 2, 3, 4, 5, 6, 7 planned none" in e for e in topo["evidence"]), topo


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
    """Without --from: TP cuts are TP (tp=2, the dim-0 vocab cuts and the stacked layer axis are not FSDP
    shards), and the replicas, which store nothing, are read from the save plans: dp_replicate=2, world 4,
    source "checkpoint", the evidence named, nothing ambiguous and nothing asked."""
    code, rep, err = _inspect(megatron_ckpt[0])
    assert code == 0, err
    topo = rep["topology"]
    assert {d: topo[d] for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "world_size")} == \
        {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 2, "world_size": 4}, topo
    assert topo["source"] == "checkpoint" and not topo.get("ambiguous"), topo
    evidence = " | ".join(topo["evidence"])
    assert "all_local_plans" in evidence and "record 4 ranks" in evidence, evidence
    assert "ranks 2, 3 planned none" in evidence and "tensor parallel 2" in evidence, evidence
    assert not [p for p in rep["problems"] if p["code"] in ("topology_ambiguous", "save_plans_unused")], rep["problems"]
    assert rep["writer_ranks"] == 2  # the data files alone name two writers: the plans say there were four ranks


@pytest.mark.parametrize("given, wrong", [("dp_shard=2,tp=2", "dp_shard 2 where the checkpoint shows 1"),
                                          ("tp=4", "tp 4 where the checkpoint shows 2"),
                                          ("tp=2", "world size 2 where the checkpoint shows 4")])
def test_from_that_contradicts_the_checkpoint_is_exit_2(megatron_ckpt, tmp_path, given, wrong):
    """A --from the plans contradict: exit 2 on inspect, plan and convert, naming both layouts, what differs,
    the file, and the way out; convert writes nothing."""
    out = tmp_path / "out"
    for args in (["inspect", megatron_ckpt[0]], ["plan", megatron_ckpt[0], "--to", TARGET],
                 ["convert", megatron_ckpt[0], out, "--to", TARGET]):
        code, _, err = cli(args + ["--from", given])
        assert code == 2, (args[0], err)
        assert f"--from {given}" in err and f"says the source layout is {given}, but the checkpoint records " \
            "dp_replicate=2,tp=2 (world size 4)" in err, err
        assert wrong in err and ".metadata" in err and "--from dp_replicate=2,tp=2" in err, err
        assert "Traceback" not in err
    assert not out.exists()


def test_profile_from_that_contradicts_the_checkpoint_is_exit_2(megatron_ckpt, tmp_path):
    """The same check for a profile's ``from``: the profile file is named, and the way out is to correct it."""
    profile = tmp_path / "reshard.toml"
    profile.write_text('from = "tp=4"\n')
    code, _, err = cli(["plan", megatron_ckpt[0], "--to", TARGET, "--profile", profile])
    assert code == 2 and "Traceback" not in err, err
    assert f"in the profile {profile}" in err and "records dp_replicate=2,tp=2" in err, err
    assert f"Correct from = \"tp=4\" in the profile {profile}" in err, err


@pytest.mark.parametrize("given", ["dp_replicate=2,tp=2", "cp=2,tp=2"])
def test_from_that_fits_the_checkpoint_is_taken(megatron_ckpt, given):
    """Where the checkpoint cannot tell (DP or CP replicas hold the same pieces), the user's word decides."""
    code, rep, err = _inspect_from(megatron_ckpt[0], given)
    assert code == 0, err
    assert rep["topology"]["source"] == "given" and rep["topology"]["world_size"] == 4, rep["topology"]


def test_inspect_accounts_for_sidecars(megatron_ckpt):
    """common.pt and metadata.json are named in inspect's report (issue 15: sidecars are data)."""
    code, rep, err = _inspect(megatron_ckpt[0])
    text = json.dumps(rep)
    for name in SIDECARS:
        assert name in text, f"{name} not accounted for in inspect --json"


# --------------------------------------------------------------------------- plan / convert

@pytest.mark.parametrize("given", [[], ["--from", SOURCE]], ids=["recorded", "explicit-from"])
def test_plan_to_another_dp_degree(megatron_ckpt, given):
    """Feasible with the recorded layout and with the same layout given: same source, same placements."""
    code, out, err = cli(["plan", megatron_ckpt[0], *given, "--to", TARGET, "--json"])
    assert code == 0, err or out
    plan = json.loads(out)
    assert plan["feasible"], plan["reasons"]
    actions = {k["key"]: k["action"] for k in plan["keys"]}
    assert not [k for k, a in actions.items() if a.startswith("drop")], actions
    assert plan["target"]["world_size"] == 2
    src = plan["source"]["topology"]
    assert (src["dp_replicate"], src["tp"], src["world_size"]) == (2, 2, 4), src
    assert src["source"] == ("given" if given else "checkpoint"), src


def test_convert_exit_0(converted):
    """Converted without --from; the output's lineage records the layout the checkpoint gave."""
    out, code, stdout, stderr = converted
    assert code == 0, stderr or stdout
    assert (out / ".metadata").exists()
    lineage = json.loads((out / "manifest.json").read_text())["lineage"][-1]
    assert lineage["from"]["dims"]["dp_replicate"] == 2 and lineage["from"]["dims"]["tp"] == 2, lineage["from"]
    assert lineage["from"]["world_size"] == 4


def test_convert_with_explicit_from_writes_the_same_bytes(megatron_ckpt, converted, tmp_path):
    """``--from dp_replicate=2,tp=2`` and no --from give the same data files and `.metadata`, byte for byte
    (so Megatron's bitwise load of the one below holds for the other)."""
    out, code, stdout, stderr = converted
    assert code == 0, stderr or stdout
    explicit = tmp_path / "explicit"
    c, o, e = cli(["convert", megatron_ckpt[0], explicit, "--from", SOURCE, "--to", TARGET])
    assert c == 0, e or o
    data = sorted(p.name for p in out.iterdir() if p.suffix == ".distcp" or p.name == ".metadata")
    assert data == sorted(p.name for p in explicit.iterdir() if p.suffix == ".distcp" or p.name == ".metadata")
    assert ".metadata" in data and len(data) > 1
    for name in data:
        assert (out / name).read_bytes() == (explicit / name).read_bytes(), name


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
    """Megatron's own dist_checkpointing.load at world size 2 (tp 2, dp 1) of the output converted without
    --from: every tensor bitwise equal."""
    out, code, stdout, stderr = converted
    assert code == 0, stderr or stdout
    r = _ranks("load", out, megatron_ckpt[1], nproc=2)
    assert r.returncode == 0, _tail(r)
    assert r.stdout.count("bitwise equal") == 2, r.stdout
