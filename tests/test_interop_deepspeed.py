"""DeepSpeed 0.19.8 ZeRO-2 and ZeRO-3 checkpoints, written by DeepSpeed's own engine on CPU, imported into DCP
(`reshard import --format deepspeed`) at data- and tensor-parallel layouts, inspected, planned, converted,
verified, and loaded strictly by torch's own FSDP2 / TP model through get_state_dict/set_state_dict.

The sources are written ONCE per run by ``tests/writers/deepspeed_run.py`` under torchrun (2 gloo ranks,
``DS_ACCELERATOR=cpu``), one launch per ZeRO stage, with DeepSpeed's ``"optimizer": {"type": "AdamW"}``
(``torch_adam``), two steps, ``engine.save_checkpoint``; rank 0 then runs DeepSpeed's own converters on what was saved:
``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (``fp32.pt``, the reference
for the weights and buffers) and ``python -m deepspeed.checkpoint.ds_to_universal``
(``universal/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt``, the reference for the Adam moments).

* ZeRO-2: a tiny MLP with a persistent buffer, a model no shipped family describes. Imported at
  ``dp=2``: inspect says complete and consistent (the param groups list the parameters by FQN,
  so the buffer is known to expect no moments), planned and converted to ``dp=1`` and verified
  equal; FSDP2 at 2 ranks loads it. ``--to tp=2`` is refused (exit 2: DeepSpeed records no TP
  plan), and the way out it names (import at dp, ``reshard convert --to tp=2 --rules FILE``
  with the user's rules) is taken and loaded by the MLP under torch's TP plan.
* ZeRO-3: a two-layer Llama-style model with torchtitan's names, which the shipped
  ``llama-torchtitan`` rules describe. Imported at ``tp=2`` and at ``dp=2,tp=2`` (each inspected
  complete and consistent, the two verified equal); the ``tp=2`` import is loaded by the model under
  torchtitan's TP plan (``parallelize_module`` with Colwise/RowwiseParallel). The writer loads
  ``dp=2,tp=2`` too (FSDP2 over dp, at 4 ranks: passed by hand, 18 s), left out to keep the file cheap.

The three loads run in one 2-rank launch, the two DeepSpeed runs in another (start-up paid once).

Every load checks that the checkpoint's keys are exactly the ones ``get_state_dict`` asks for, that
every tensor key is stored exactly as the model's own shards (DCP's save planner says which: the
import wrote that layout, nothing was resharded on load), that every parameter and buffer equals
zero_to_fp32's bitwise, every ``exp_avg``/``exp_avg_sq`` the universal checkpoint's bitwise, every
``step`` 2, and the optimizer's lr/betas/eps/weight_decay DeepSpeed's (the loader's AdamW is made
with other values).

The universal checkpoint folders themselves are imported too (ZeRO-2 at ``dp=2``, ZeRO-3 at
``tp=2``), inspected complete and consistent and verified equal to the ZeRO imports (same keys,
placements and bytes); a file in one that torch's weights-only unpickler refuses is refused by name.

Not covered: loading back into DeepSpeed itself; tensor or pipeline parallel DeepSpeed runs
(``mp_rank_01``, ``layer_*`` files are refused by name).

CPU substitutions: ``DS_ACCELERATOR=cpu`` and gloo, DeepSpeed's engine stepping ``torch.optim.AdamW``
(``torch_adam``) and its shm collectives op marked not compatible: nothing is compiled, also on a
fresh machine (see the writer's docstring).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_packages  # noqa: E402

require_packages("deepspeed")

from conftest import assert_bitwise_equal, cli, once_per_run, writer_key  # noqa: E402

WRITER = Path(__file__).parent / "writers" / "deepspeed_run.py"
MODELS = {2: "mlp", 3: "llama"}  # ZeRO stage -> the writer's model
PARAMS = {2: 5, 3: 21}
MLP_RULES = """\
family = "tiny-mlp"
description = "the writer's MLP: a column-wise, b row-wise, the LayerNorm and the buffer replicated"
match_params = ['^a\\.weight$']

[[param]]
match = '^a\\.(weight|bias)$'
tp = "shard"
dim = 0

[[param]]
match = '^b\\.weight$'
tp = "shard"
dim = 1

[[param]]
match = '^(ln\\.(weight|bias)|scale)$'
tp = "replicate"
"""


def _torchrun(nproc: int, *args) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WRITER),
           *map(str, args)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[int, Path]:
    """Both DeepSpeed runs in one launch (torch's and DeepSpeed's start-up paid once)."""
    def make(work: Path) -> dict[str, str]:
        _torchrun(2, "save", work, *(f"{stage}:{model}" for stage, model in MODELS.items()))
        return {str(s): str(work / f"zero{s}") for s in MODELS}

    made = once_per_run(tmp_path_factory, writer_key(WRITER, "deepspeed"), make)
    return {int(k): Path(v) for k, v in made.items()}


def _import(src: Path, dst: Path, to: str, folder: str = "ckpt") -> Path:
    code, o, e = cli(["import", src / folder, dst, "--to", to, "--format", "deepspeed", "--quiet"])
    assert code == 0, o + e
    return dst


@pytest.fixture(scope="module")
def outputs(written, tmp_path_factory) -> dict[str, Path]:
    """The imports (and conversions) the tests inspect and load, made once (the CLI in-process)."""
    base = tmp_path_factory.mktemp("ds-import")
    out = {"z2-dp2": _import(written[2], base / "z2-dp2", "dp=2"),
           "z3-tp2": _import(written[3], base / "z3-tp2", "tp=2"),
           "z3-dp2tp2": _import(written[3], base / "z3-dp2tp2", "dp=2,tp=2"),
           "u2-dp2": _import(written[2], base / "u2-dp2", "dp=2", "universal"),   # ds_to_universal's folders
           "u3-tp2": _import(written[3], base / "u3-tp2", "tp=2", "universal")}
    (base / "mlp.toml").write_text(MLP_RULES)  # the user's rules for their model: the way out of the tp refusal
    code, o, e = cli(["convert", out["z2-dp2"], base / "z2-tp2", "--to", "tp=2", "--rules", base / "mlp.toml", "--quiet"])
    assert code == 0, o + e
    out["z2-tp2"] = base / "z2-tp2"
    return out


LOADS = {"z2-dp2": (2, "mlp", 1), "z2-tp2": (2, "mlp", 2), "z3-tp2": (3, "llama", 2)}
"""What torch's model loads, at 2 ranks in one launch: output -> (ZeRO stage, model, tp)."""


@pytest.fixture(scope="module")
def loaded(written, outputs, tmp_path_factory) -> dict[str, dict]:
    res = tmp_path_factory.mktemp("ds-load") / "loaded.json"
    jobs = [{"dcp": str(outputs[name]), "src": str(written[stage]), "model": model, "tp": tp}
            for name, (stage, model, tp) in LOADS.items()]
    _torchrun(2, "load", res, json.dumps(jobs))
    return dict(zip(LOADS, json.loads(res.read_text())))


def _inspect_consistent(ckpt: Path, params: int) -> str:
    code, o, e = cli(["inspect", ckpt])
    assert code == 0 and "verdict     complete and consistent" in o, o + e
    assert "step        2 (from manifest)" in o, o
    assert f"for {params} of " in o and "every trainable parameter covered" in o, o
    return o


@pytest.mark.parametrize("stage", sorted(MODELS))
def test_deepspeed_wrote_its_checkpoint_and_converters_ran(written, stage):
    d = written[stage]
    tag = (d / "ckpt" / "latest").read_text().strip()
    files = sorted(p.name for p in (d / "ckpt" / tag).iterdir())
    expect = (["mp_rank_00_model_states.pt"] if stage == 2 else
              [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)])
    assert set(expect + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]) == set(files), files
    assert json.loads((d / "universal.json").read_text())["returncode"] == 0, (d / "universal.json").read_text()
    first = "a.weight" if stage == 2 else "tok_embeddings.weight"
    assert (d / "universal" / "zero" / first / "exp_avg.pt").is_file()


@pytest.mark.parametrize("stage", sorted(MODELS))
def test_consolidation_equals_zero_to_fp32_and_universal(written, stage):
    """reshard's own mapping of the flat partitions, against DeepSpeed's consolidation and universal checkpoint;
    the param groups name every trainable parameter, in DeepSpeed's order, with the run's hyper-parameters."""
    import torch

    from reshard.engine.deepspeed_import import consolidate, find_checkpoint

    d = written[stage]
    c = consolidate(find_checkpoint(d / "ckpt"))
    assert (c.stage, c.world, c.step, c.optimizer) == (stage, 2, 2.0, "AdamW")
    ref = torch.load(d / "fp32.pt", weights_only=True)
    assert_bitwise_equal({**c.params, **c.buffers}, dict(ref), "zero_to_fp32")
    for fqn, mom in c.moments.items():
        for m, t in mom.items():
            u = torch.load(d / "universal" / "zero" / fqn / f"{m}.pt", weights_only=True)
            u = u["param"] if isinstance(u, dict) else u
            assert_bitwise_equal(t, u.reshape(t.shape), f"{fqn}.{m}")
    [group] = c.groups
    assert group["params"] == [k for k in ref if k not in c.buffers] and len(group["params"]) == PARAMS[stage]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-2, (0.9, 0.999), 1e-8, 0.01)


def test_zero2_at_dp2_inspects_consistent_converts_and_fsdp2_loads(written, outputs, loaded, tmp_path):
    dp2 = outputs["z2-dp2"]
    o = _inspect_consistent(dp2, 5)
    assert "buffers     1 entries expect no moments: scale (not listed in the optimizer's param groups)" in o, o
    code, o, e = cli(["plan", dp2, "--to", "dp=1"])
    assert code == 0, o + e
    code, o, e = cli(["convert", dp2, tmp_path / "dp1", "--to", "dp=1", "--quiet"])
    assert code == 0, o + e
    _inspect_consistent(tmp_path / "dp1", 5)
    code, o, e = cli(["verify", dp2, tmp_path / "dp1"])
    assert code == 0 and "verdict     equal" in o, o + e
    assert loaded["z2-dp2"] == {"params": 5, "moments": 10, "buffers": 1, "own_chunks": 21}, loaded


def test_zero2_mlp_to_tp2_refused_and_the_way_out_loads_in_torch_tp(written, outputs, loaded, tmp_path):
    """No shipped family describes the MLP and DeepSpeed records no TP plan: refused naming the way out,
    which (import at dp, convert with the user's rules) gives what torch's TP plan for the MLP loads."""
    code, o, e = cli(["import", written[2] / "ckpt", tmp_path / "no", "--to", "tp=2", "--format", "deepspeed"])
    assert code == 2 and not (tmp_path / "no").exists(), o + e
    assert "DeepSpeed records no tensor-parallel plan" in o + e and "--rules FILE" in o + e, o + e
    _inspect_consistent(outputs["z2-tp2"], 5)
    assert loaded["z2-tp2"] == {"params": 5, "moments": 10, "buffers": 1, "own_chunks": 21}, loaded


def test_zero3_llama_imports_at_tp2_and_loads_in_torchtitan_tp_plan(outputs, loaded):
    """The shipped llama-torchtitan rules place each parameter (and its moments) on TP; the model under
    torchtitan's TP plan finds every key stored as its own shards."""
    out = outputs["z3-tp2"]
    o = _inspect_consistent(out, 21)
    assert "tp=2 (world size 2, manifest)" in o, o
    report = json.loads((out / "import-report.json").read_text())
    placed = {k["key"]: k["placement"] for k in report["keys"]}
    assert placed["model.layers.0.attention.wo.weight"].endswith("TP Shard(1)"), placed
    assert placed["optim.state.layers.0.attention.wq.weight.exp_avg"].endswith("TP Shard(0)"), placed
    assert loaded["z3-tp2"] == {"params": 21, "moments": 42, "buffers": 0, "own_chunks": 84}, loaded


def test_zero3_llama_imports_at_dp2_tp2(outputs):
    """dp=2 x tp=2 (4 ranks): inspected complete and consistent, and equal to the tp=2 import in global terms
    (loading it would take a 4-rank launch; the tp=2 load above checks the same TP placements)."""
    o = _inspect_consistent(outputs["z3-dp2tp2"], 21)
    assert "dp_shard=2, tp=2 (world size 4, manifest)" in o, o
    code, o, e = cli(["verify", outputs["z3-tp2"], outputs["z3-dp2tp2"]])
    assert code == 0 and "verdict     equal" in o, o + e


def test_refuses_a_global_it_does_not_admit(written, tmp_path):
    """A ZeRO file naming any other global is refused by name (exit 2); nothing of it runs."""
    import argparse
    import shutil

    import torch

    src = tmp_path / "ckpt"
    shutil.copytree(written[2] / "ckpt", src)
    tag = (src / "latest").read_text().strip()
    victim = src / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "x": argparse.Namespace(a=1)}}, victim)
    code, o, e = cli(["import", src, tmp_path / "out", "--to", "dp=1", "--format", "deepspeed"])
    assert code == 2, o + e
    assert "argparse.Namespace" in o + e and "zero_pp_rank_1" in o + e, o + e
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("universal", "zero", "params"), [("u2-dp2", "z2-dp2", 5), ("u3-tp2", "z3-tp2", 21)])
def test_universal_checkpoint_imports_equal_to_the_zero_import(outputs, universal, zero, params):
    """ds_to_universal's folder (zero/<fqn>/{fp32,exp_avg,exp_avg_sq,step}.pt, zero/optimizer_state.pt, the
    model states) imported with moments, step and param groups: complete and consistent, and equal to the
    import of the ZeRO checkpoint it was made from (which the loads above check against DeepSpeed's own)."""
    _inspect_consistent(outputs[universal], params)
    code, o, e = cli(["verify", outputs[zero], outputs[universal]])
    assert code == 0 and "verdict     equal" in o, o + e
    a, b = (json.loads((outputs[n] / "import-report.json").read_text()) for n in (zero, universal))
    assert [(k["key"], k["placement"]) for k in a["keys"]] == [(k["key"], k["placement"]) for k in b["keys"]]


def test_universal_refuses_a_file_weights_only_cannot_load(written, tmp_path):
    """A universal folder's tensor file that needs a global torch's weights-only unpickler refuses: exit 2,
    naming the file and the global; nothing of it runs and nothing is written."""
    import argparse
    import shutil

    import torch

    src = tmp_path / "universal"
    shutil.copytree(written[2] / "universal", src)
    torch.save({"param": argparse.Namespace(a=1)}, src / "zero" / "a.weight" / "exp_avg.pt")
    code, o, e = cli(["import", src, tmp_path / "out", "--to", "dp=1", "--format", "deepspeed"])
    assert code == 2, o + e
    assert "argparse.Namespace" in o + e and "a.weight/exp_avg.pt" in o + e, o + e
    assert not (tmp_path / "out").exists()
