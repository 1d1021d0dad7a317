"""torchtune 0.6.1, as its distributed recipe saves and resumes (issue 43 item 3): inspect, plan, convert
and verify its DistributedCheckpointer output, then resume from the converted checkpoint with
torchtune's own loader at the new world size, strict and bitwise.

The source is written ONCE per run by ``tests/writers/torchtune_run.py`` on 2 forked gloo ranks:
the ``full_finetune_distributed`` recipe's setup and one epoch of its train loop with torchtune's own
pieces (a tiny ``llama3`` from its component builder, ``training.shard_model`` FSDP2,
``config.instantiate`` AdamW, StatefulDataLoader + ``padded_collate_sft``, 2 optimizer steps), then
its end-of-epoch ``CheckpointClient.save_checkpoint`` with ``enable_async_checkpointing``: an
intermediate checkpoint (epoch 1 of 2) that torchtune writes with ``DistributedCheckpointer``
(``dcp.async_save``) to ``<output>/dist_epoch_0``. The writer's docstring lists its CPU substitutions.

What torchtune writes (asserted in the first test): ``model.<fqn>``; the RAW ``optimizer.state_dict()``,
its state keyed by parameter position (``optimizer.state.<i>.{step,exp_avg,exp_avg_sq}``,
``optimizer.param_groups.0.params`` the positions); the recipe's ``seed``, ``epochs_run``,
``total_epochs``, ``max_steps_per_epoch`` and ``dataloader.*``. Read by name the moments were
orphans (issue 43: "names that are not parameters", convention ``lightning``); the ``torchtune``
convention (formats/conventions/torchtune.toml, ``keyed_by = "index"``) maps position i to the
i-th parameter in the model's order, keeping the keys, since torchtune's loader asks for them by
position. Resume: the recipe's ``CheckpointClient.load_distributed_checkpoint`` at dp=1 and dp=4,
compared with what the writer held: every model tensor, every moment and step, the four recipe
values, and the loader state (which 0.6.1's resume does not read; read by the same checkpointer).

A second source uses the recipe's ``optimizer_in_bwd: True``: its ``OptimizerInBackwardWrapper`` keys
each parameter's own optimizer by name (``optimizer.<fqn>.state.0.*``), which the convention's rules
also read. It converts and verifies; torchtune 0.6.1's resume of that layout restores the model and
recipe state but no optimizer state, unconverted as converted (a limit of its loader, asserted as such).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import require_packages  # noqa: E402

require_packages("torchtune", "torchao", "torchdata")  # found, not imported: see conftest

from conftest import assert_bitwise_equal, cli, once_per_run, writer_key  # noqa: E402
from rank_jobs import free_port, result, spawn  # noqa: E402

WRITER = Path(__file__).parent / "writers" / "torchtune_run.py"
SOURCE_WORLD = 2
TARGET_WORLDS = (1, 4)
EPOCH_DIR = "dist_epoch_0"  # DistributedCheckpointer's name for the checkpoint at the end of epoch 0
VARIANTS = ("index", "in_bwd")
PARAMS = 21  # tok_embeddings, 2 layers x (q, k, v, output_proj, w1, w2, w3, sa_norm, mlp_norm), norm, output


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """torchtune's own saves at dp=2 (one fork for both variants), written once per run; the full state each
    writer held when saving. ``index``: the recipe's default optimizer; ``in_bwd``: ``optimizer_in_bwd``."""

    def make(work: Path) -> dict[str, dict[str, str]]:
        jobs = [{"world": SOURCE_WORLD, "port": free_port(), "result": str(work / f"{v}-reference.pt"),
                 "base": str(work / v / "base"), "output": str(work / v / "output"), "optimizer_in_bwd": v == "in_bwd"}
                for v in VARIANTS]
        spawn(WRITER, "write", jobs, work)
        return {v: {"base": j["base"], "output": j["output"], "reference": j["result"]} for v, j in zip(VARIANTS, jobs)}

    made = once_per_run(tmp_path_factory, writer_key(WRITER, "torchtune", "torchao"), make)
    work = tmp_path_factory.mktemp("torchtune")
    return {v: {"base": Path(m["base"]), "output": Path(m["output"]), "ckpt": Path(m["output"]) / EPOCH_DIR,
                "reference": result(m["reference"]), "work": work} for v, m in made.items()}


@pytest.fixture(scope="module")
def source(written) -> dict[str, Any]:
    """The recipe's default (one AdamW over model.parameters(), its state keyed by position)."""
    return written["index"]


def _json(args: list) -> tuple[int, dict[str, Any], str]:
    code, out, err = cli(args)
    return code, (json.loads(out) if out.strip().startswith("{") else {}), out + err


@pytest.fixture(scope="module")
def resumed(written) -> dict[tuple[str, Any], dict[str, Any]]:
    """``reshard convert --to dp=<w>`` into ``<out>/dist_epoch_0`` (where torchtune's resume looks), then one
    fork of 4 ranks resuming every output with torchtune's loader at its world size; for ``in_bwd`` also
    the unconverted source at its own world size (what torchtune itself restores from that layout).
    Keyed (variant, world), the source's as (variant, "source")."""
    work: Path = written["index"]["work"]
    out: dict[tuple[str, Any], dict[str, Any]] = {}
    jobs = []
    targets = [("index", w) for w in TARGET_WORLDS] + [("in_bwd", 4)]
    for variant, world in targets:
        src = written[variant]
        output = work / f"{variant}-dp{world}"
        code, stdout, err = cli(["convert", src["ckpt"], output / EPOCH_DIR, "--to", f"dp={world}", "--quiet"])
        out[(variant, world)] = {"code": code, "text": stdout + err, "dst": output / EPOCH_DIR, "loaded": None}
        if code == 0:
            jobs.append({"key": [variant, world], "world": world, "port": free_port(),
                         "result": str(work / f"loaded-{variant}-dp{world}.pt"), "base": str(src["base"]),
                         "output": str(output), "optimizer_in_bwd": variant == "in_bwd"})
    src = written["in_bwd"]
    out[("in_bwd", "source")] = {"code": 0, "text": "", "dst": src["ckpt"], "loaded": None}
    jobs.append({"key": ["in_bwd", "source"], "world": SOURCE_WORLD, "port": free_port(),
                 "result": str(work / "loaded-in_bwd-source.pt"), "base": str(src["base"]), "output": str(src["output"]),
                 "optimizer_in_bwd": True})
    spawn(WRITER, "load", jobs, work)
    for j in jobs:
        out[tuple(j["key"])]["loaded"] = result(j["result"])
    return out


@pytest.fixture(scope="module")
def converted(resumed) -> dict[int, dict[str, Any]]:
    return {w: resumed[("index", w)] for w in TARGET_WORLDS}


# ---------------------------------------------------------------------------- what torchtune writes

def test_torchtune_writes_index_keyed_optimizer_state(source):
    """The facts the convention is written from: moments keyed by position, positions in model order."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(source["ckpt"])).read_metadata().state_dict_metadata
    names = source["reference"]["param_names"]  # model.named_parameters() order, which torch.optim numbers
    assert len(names) == PARAMS
    assert [k.removeprefix("model.") for k in md if k.startswith("model.")] == names  # .metadata keeps that order
    for i, name in enumerate(names):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert list(md[f"optimizer.state.{i}.{moment}"].size) == list(md[f"model.{name}"].size), (i, name)
        assert f"optimizer.state.{i}.step" in md
    assert f"optimizer.state.{PARAMS}.exp_avg" not in md
    assert not any(k.startswith(f"optimizer.state.{n}.") for n in names for k in md)  # no name-keyed state
    assert "optimizer.param_groups.0.params" in md and "optimizer.param_groups.1.params" not in md
    assert {"seed", "epochs_run", "total_epochs", "max_steps_per_epoch"} <= set(md)
    assert any(k.startswith("dataloader.") for k in md)


# ---------------------------------------------------------------------------- inspect / plan

def test_inspect_torchtune_is_complete_consistent_and_maps_the_moments(source):
    code, r, text = _json(["inspect", source["ckpt"], "--json"])
    assert code == 0, text
    assert r["complete"] is True and r["consistent"] is True, r["problems"]
    assert r["problems"] == [], r["problems"]
    assert r["convention"]["name"] == "torchtune"
    topo = r["topology"]
    assert (topo["dp_shard"], topo["tp"], topo["world_size"]) == (SOURCE_WORLD, 1, SOURCE_WORLD), topo
    opt = r["optimizer"]
    assert opt["parameters"] == opt["with_moments"] == PARAMS, opt
    assert opt["moment_names"] == ["exp_avg", "exp_avg_sq"]
    assert opt["missing_moments"] == [] and opt["shape_mismatches"] == []
    assert opt["step_counters"]["values"] == [2]
    by_role = {k: v["count"] for k, v in r["by_role"].items()}
    assert by_role == {"parameter": PARAMS, "optimizer_moment": 2 * PARAMS, "optimizer_step": PARAMS,
                       "param_group": 12, "counter": 1, "config": 3, "data": 10}, by_role
    assert r["counters"] == {"epoch": 1}
    assert r["unknown_keys"] == []


def test_index_keyed_moments_map_to_their_parameters(source):
    """Position i is the i-th model parameter: the key stays ``optimizer.state.<i>.*``, its parameter is named."""
    from reshard.planning.describe import inspect_checkpoint

    names = source["reference"]["param_names"]
    roles = inspect_checkpoint(source["ckpt"]).classification.roles
    for i, name in enumerate(names):
        for leaf in ("exp_avg", "exp_avg_sq", "step"):
            r = roles[f"optimizer.state.{i}.{leaf}"]
            assert (r.param, r.index, r.convention) == (name, i, "torchtune"), r


@pytest.mark.parametrize("world", TARGET_WORLDS)
def test_plan_carries_the_moments(source, world):
    code, p, text = _json(["plan", source["ckpt"], "--to", f"dp={world}", "--json"])
    assert code == 0, text
    assert p["feasible"], p.get("reasons")
    kept = p["verdict"]["kept"]["optimizer_state"]
    assert kept["status"] == "carried" and f"for {PARAMS} parameters" in kept["note"], kept


# ---------------------------------------------------------------------------- convert, verify, resume

@pytest.mark.parametrize("world", TARGET_WORLDS)
def test_convert_keeps_torchtunes_keys_and_verifies(source, converted, world):
    from torch.distributed.checkpoint import FileSystemReader

    c = converted[world]
    assert c["code"] == 0, c["text"]
    before = list(FileSystemReader(str(source["ckpt"])).read_metadata().state_dict_metadata)
    after = list(FileSystemReader(str(c["dst"])).read_metadata().state_dict_metadata)
    assert after == before  # the writer's keys, in its order: torchtune's loader asks for them by position
    code, out, err = cli(["verify", source["ckpt"], c["dst"]])
    assert code == 0, out + err
    code, r, text = _json(["inspect", c["dst"], "--json"])
    assert code == 0, text
    assert r["consistent"] and r["convention"]["name"] == "torchtune" and r["topology"]["world_size"] == world
    assert r["optimizer"]["with_moments"] == PARAMS


@pytest.mark.parametrize("world", TARGET_WORLDS)
def test_torchtune_resumes_the_converted_checkpoint_bitwise(source, converted, world):
    """The recipe's load_distributed_checkpoint at the new world size: model, moments, steps, recipe state, loader state."""
    c = converted[world]
    assert c["code"] == 0, c["text"]
    loaded, ref = c["loaded"], source["reference"]
    assert loaded["recipe"] == {"seed": 1234, "epochs_run": 1, "total_epochs": 2, "max_steps_per_epoch": 2}
    assert loaded.pop("restored_states") == PARAMS  # restored by the load itself, before the consolidation
    assert len(loaded["optimizer"]["state"]) == PARAMS
    assert_bitwise_equal(ref, loaded, f"dp={world}")


# ---------------------------------------------------------------------------- optimizer_in_bwd

def test_inspect_optimizer_in_bwd_names_every_moment(written):
    """The in-backward wrapper keys each parameter's own optimizer by name: ``optimizer.<fqn>.state.0.*``."""
    code, r, text = _json(["inspect", written["in_bwd"]["ckpt"], "--json"])
    assert code == 0, text
    assert r["consistent"] is True and r["problems"] == [], r["problems"]
    assert r["convention"]["name"] == "torchtune" and r["unknown_keys"] == []
    assert r["optimizer"]["parameters"] == r["optimizer"]["with_moments"] == PARAMS, r["optimizer"]
    assert r["optimizer"]["step_counters"]["values"] == [2]


def test_optimizer_in_bwd_converts_and_verifies(written, resumed):
    c = resumed[("in_bwd", 4)]
    assert c["code"] == 0, c["text"]
    code, out, err = cli(["verify", written["in_bwd"]["ckpt"], c["dst"]])
    assert code == 0, out + err


@pytest.mark.parametrize("which", ["source", 4])
def test_torchtune_resumes_no_in_bwd_optimizer_state_even_unconverted(written, resumed, which):
    """torchtune 0.6.1's resume of its own optimizer_in_bwd checkpoint, unconverted at dp=2 as converted at
    dp=4: the model and recipe state bitwise, and NO optimizer state, because its load asks DCP for the state
    of freshly built optimizers (which hold none: no ``_init_optim_state`` on that path). A limit of
    torchtune's loader, the same with or without reshard; the moments are in the converted files (verify)."""
    loaded, ref = resumed[("in_bwd", which)]["loaded"], written["in_bwd"]["reference"]
    assert loaded["recipe"] == ref["recipe"]
    assert_bitwise_equal(ref["model"], loaded["model"], f"in_bwd {which}")
    assert sorted(ref["optimizer"]) == sorted(ref["param_names"])
    assert all(len(ref["optimizer"][p]["state"]) == 1 for p in ref["optimizer"])  # the writer held every moment
    assert loaded["restored_states"] == 0  # torchtune's load put none of them back
