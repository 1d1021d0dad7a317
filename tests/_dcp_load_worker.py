"""Spawned-process side of tests/test_convert.py: load a converted checkpoint in a real FSDP2 job.

One spawn of ``nprocs`` processes serves several targets (process start-up dominates on a
small CPU box): for each job, ranks ``0..n-1`` form a fresh gloo group of world size ``n``
(MASTER_ADDR=127.0.0.1, the job's free port), build the reference model and optimizer at
that size exactly as the trainer does (``build`` + ``state_for_save``), call
``dcp.load(state_dict, checkpoint_id=dst)`` and write what they got to
``<out_dir>/<tag>_rank<r>.pt``; the other ranks sit the job out. The comparison against the
source is done by the test, in the main process.

The planner is torch's ``DefaultLoadPlanner`` (``allow_partial_load=False``: a key the
state dict asks for that the checkpoint lacks raises) with one addition: it records the
flat keys this rank's local plan reads, so the test can check that no checkpoint key is
left unused.
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
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.tensor import DTensor


class RecordingLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that remembers which flat keys this rank's plan reads."""

    requested: set[str]

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.requested = {item.dest_index.fqn for item in plan.items}
        return plan


def _tensor_record(v: torch.Tensor) -> dict[str, Any]:
    """The local piece a rank holds and where it sits in the global tensor (torch's own view)."""
    if isinstance(v, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
        local = v.to_local().detach().clone()
        assert tuple(local.shape) == tuple(shape), (tuple(local.shape), tuple(shape))
        return {"dtensor": True, "local": local, "offsets": tuple(int(o) for o in offset),
                "global_shape": tuple(v.shape), "placements": [str(p) for p in v.placements]}
    return {"dtensor": False, "local": v.detach().clone(), "offsets": tuple(0 for _ in v.shape),
            "global_shape": tuple(v.shape), "placements": []}


def _plain(obj: Any) -> Any:
    """Objects as loaded (ints, floats, lists, tensors), detached from any live structure."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    return obj


def _one_job(rank: int, job: dict[str, Any], out_dir: Path) -> None:
    from reshard.reference.trainer import TrainConfig, build, state_for_save

    n = job["n"]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(job["port"]), "RANK": str(rank),
                       "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank)})
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=60))
    try:
        cfg = TrainConfig(**job["cfg"])
        run = build(cfg)
        sd = state_for_save(run)  # exactly the nested dict the trainer saves / fills on load
        planner = RecordingLoadPlanner()
        dcp.load(sd, checkpoint_id=job["dst"], planner=planner)

        tensors: dict[str, dict[str, Any]] = {}
        for fqn, v in sd["model"].items():
            tensors[f"model.{fqn}"] = _tensor_record(v)
        for fqn, st in sd["optim"]["state"].items():
            for name, v in st.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"optim.state.{fqn}.{name}"] = _tensor_record(v)
        objects = {"scheduler": _plain(sd["scheduler"]), "trainer": _plain(sd["trainer"]),
                   "data": _plain(sd["data"]), "param_groups": _plain(sd["optim"]["param_groups"]),
                   "rng": _plain(sd["rng"])}

        # hand the loaded state to the live modules as the trainer does, and read it back
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        set_model_state_dict(run.model, sd["model"])
        set_optimizer_state_dict(run.model, run.optim, sd["optim"])
        applied: dict[str, torch.Tensor] = {}
        for fqn, v in get_model_state_dict(run.model).items():
            applied[f"model.{fqn}"] = (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
        for fqn, st in get_optimizer_state_dict(run.model, run.optim)["state"].items():
            for name, v in st.items():
                if isinstance(v, torch.Tensor):
                    applied[f"optim.state.{fqn}.{name}"] = (v.to_local() if isinstance(v, DTensor) else v).detach().clone()

        result = {"rank": rank, "world": n, "requested": sorted(planner.requested), "tensors": tensors,
                  "objects": objects, "applied": applied, "error": None}
        dist.barrier()
    except BaseException:
        result = {"rank": rank, "world": n, "error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(result, out_dir / f"{job['tag']}_rank{rank}.pt")


def worker(rank: int, jobs: list[dict[str, Any]], out_dir: str) -> None:
    """Entry point for ``torch.multiprocessing.spawn``: run every job this rank takes part in."""
    torch.set_num_threads(1)
    for job in jobs:
        if rank < job["n"]:
            _one_job(rank, job, Path(out_dir))
