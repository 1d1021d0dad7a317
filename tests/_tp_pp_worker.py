"""Spawned-process side of tests/test_tp_pp.py: train TP/PP sources, then load converted outputs.

One ``torch.multiprocessing`` spawn of ``nprocs`` processes serves several jobs of different
world sizes (process start-up dominates on a small CPU box): for each job, ranks ``0..n-1``
form a fresh gloo group of world size ``n`` on the job's own port; the other ranks sit it out.

``train_worker``: each job runs the reference trainer's ``train(cfg)`` for its configs in turn.

``load_worker``: each job builds the reference trainer's model at the target layout
(``build(cfg)``) and loads a checkpoint into it, then records what the rank holds:

- ``mode="resume"``: the trainer's own resume path, ``load_checkpoint(run, path)``;
- ``mode="record"``: the same dcp.load + set_state_dict as ``load_checkpoint`` (flattened
  optimizer param groups when the checkpoint has them), but it also asks for this rank's
  RNG entry whenever the checkpoint has one, and a planner records the flat keys the rank's
  load plan reads (so the test can check that no checkpoint key is left unused).

Recorded per rank: each parameter's local shard with its global offsets, the bytes of the
local parameter shards and of the optimizer state tensors, the stage's parameter names,
the loaded model / optimizer state read back from the live modules (``get_*_state_dict``),
and, with ``forward=True`` (pp == 1), one eval-mode forward on a fixed batch (same token ids
on every rank): the loss and the logits.
"""
from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.tensor import DTensor

FIXED_IDS = [0, 1, 2, 3, 4, 5]  # the forward batch: the same samples on every rank


class RecordingLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that remembers which flat keys this rank's plan reads."""

    requested: set[str]

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.requested = {item.dest_index.fqn for item in plan.items}
        return plan


def _init(rank: int, n: int, port: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank)})
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=120))


def _local_record(v: torch.Tensor) -> dict[str, Any]:
    if isinstance(v, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
        local = v.to_local().detach().clone()
        assert tuple(local.shape) == tuple(shape), (tuple(local.shape), tuple(shape))
        names = v.device_mesh.mesh_dim_names or ()
        tp_sharded = any(n == "tp" and p.is_shard() for n, p in zip(names, v.placements))
        return {"local": local, "offsets": tuple(int(o) for o in offset), "global_shape": tuple(v.shape),
                "placements": [str(p) for p in v.placements], "mesh_dims": list(names), "tp_sharded": tp_sharded}
    return {"local": v.detach().clone(), "offsets": tuple(0 for _ in v.shape), "global_shape": tuple(v.shape),
            "placements": [], "mesh_dims": [], "tp_sharded": False}


def _flat(prefix: str, obj: Any) -> dict[str, Any]:
    """DCP's flattening of a nested state dict: dict keys joined with '.'."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(f"{prefix}.{k}", v))
        return out
    return {prefix: obj}


def _local(v: torch.Tensor) -> torch.Tensor:
    return v.to_local() if isinstance(v, DTensor) else v


def _record_load(run, path: str) -> tuple[set[str], Any]:
    """``load_checkpoint``'s dcp.load + set_state_dict, with a recording planner and this rank's RNG."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from reshard.reference.trainer import _load_scheduler_state, _scheduler_state, optim_options
    from reshard.train import rng as rngmod

    keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    opts = optim_options(run.cfg)
    if run.cfg.pp == 1 and "optim.param_groups.0.params" not in keys:
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
    sd = {
        "model": get_model_state_dict(run.model),
        "optim": get_optimizer_state_dict(run.model, run.optim, options=opts),
        "scheduler": _scheduler_state(run.sched),
        "trainer": {"step": 0, "tokens_seen": 0, "samples_seen": 0, "micro_step": 0},
        "data": {"sampler": run.sampler.state_dict()},
    }
    if any(k.startswith(rngmod.rng_key(run.rank) + ".") for k in keys):
        sd["rng"] = {rngmod.rank_entry(run.rank): rngmod.capture()}
    planner = RecordingLoadPlanner()
    dcp.load(sd, checkpoint_id=path, planner=planner)
    set_model_state_dict(run.model, sd["model"])
    set_optimizer_state_dict(run.model, run.optim, sd["optim"], options=opts)
    _load_scheduler_state(run.sched, sd["scheduler"])
    run.sampler.load_state_dict(sd["data"]["sampler"])
    run.step = int(sd["trainer"]["step"])
    return planner.requested, opts


def _one_load(rank: int, job: dict[str, Any], out_dir: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from reshard.reference.trainer import TrainConfig, build, load_checkpoint, optim_options

    n = job["n"]
    _init(rank, n, job["port"])
    try:
        cfg = TrainConfig(**job["cfg"])
        run = build(cfg)
        requested = None
        if job["mode"] == "resume":
            load_checkpoint(run, Path(job["path"]))
            opts = optim_options(cfg)
            keys = set(FileSystemReader(job["path"]).read_metadata().state_dict_metadata)
            if cfg.pp == 1 and "optim.param_groups.0.params" not in keys:
                from torch.distributed.checkpoint.state_dict import StateDictOptions

                opts = StateDictOptions(flatten_optimizer_state_dict=True)
        else:
            requested, opts = _record_load(run, job["path"])

        params = {fqn: _local_record(p) for fqn, p in run.model.named_parameters()}
        param_bytes = sum(_local(p).numel() * _local(p).element_size() for p in run.model.parameters())
        grad_bytes = sum(_local(p).numel() * _local(p).element_size() for p in run.model.parameters() if p.requires_grad)
        optim_bytes = 0
        optim_state_names = []
        for p, st in run.optim.state.items():
            for name, v in st.items():
                if isinstance(v, torch.Tensor):
                    optim_bytes += _local(v).numel() * _local(v).element_size()
                    optim_state_names.append(name)
        model_sd = {f"model.{k}": _local(v).detach().clone() for k, v in get_model_state_dict(run.model).items()}
        optim_sd = {k: _local(v).detach().clone()
                    for k, v in _flat("optim", get_optimizer_state_dict(run.model, run.optim, options=opts)).items()
                    if k.startswith("optim.state.") and isinstance(v, torch.Tensor)}
        result: dict[str, Any] = {
            "rank": rank, "world": n, "stage": run.stage, "dp_rank": run.dp_rank, "tp_rank": run.tp_rank,
            "requested": sorted(requested) if requested is not None else None,
            "params": params, "param_bytes": param_bytes, "grad_bytes": grad_bytes, "optim_bytes": optim_bytes,
            "optim_state_names": sorted(set(optim_state_names)), "model_sd": model_sd, "optim_sd": optim_sd,
            "step": run.step, "error": None,
        }
        if job.get("forward"):
            x, y = run.data.batch(FIXED_IDS)  # identical on every rank
            run.model.eval()
            with torch.no_grad():
                result["loss"] = run.model(x, y).detach().clone()
                result["logits"] = run.model(x).detach().clone()
        dist.barrier()
    except BaseException:
        result = {"rank": rank, "world": n, "error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(result, out_dir / f"{job['tag']}_rank{rank}.pt")


def load_worker(rank: int, jobs: list[dict[str, Any]], out_dir: str) -> None:
    """Entry point for ``torch.multiprocessing.start_processes``: every load job this rank takes part in."""
    torch.set_num_threads(1)
    for job in jobs:
        if rank < job["n"]:
            _one_load(rank, job, Path(out_dir))


def train_worker(rank: int, jobs: list[dict[str, Any]]) -> None:
    """Entry point: for each job this rank takes part in, train its configs one after the other."""
    from reshard.reference.trainer import TrainConfig, train

    torch.set_num_threads(1)
    for job in jobs:
        if rank >= job["n"]:
            continue
        _init(rank, job["n"], job["port"])
        try:
            for d in job["cfgs"]:
                train(TrainConfig(**d))
                dist.barrier()
        finally:
            dist.destroy_process_group()
