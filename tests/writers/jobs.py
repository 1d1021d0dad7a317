"""The rank side of the writer scripts in this folder: fork the ranks once, run every job in a gloo group.

A writer script defines ``write_job(rank, job)`` and ``load_job(rank, job)`` (each returns what
rank 0 reports, e.g. the full state it saved or loaded) and ends with
``sys.exit(jobs.main(write_job, load_job))``. It runs as a plain script
(``python tests/writers/X.py write|load JOBS.json``, this folder first on ``sys.path``); each
job names its ``world``, ``port`` and ``result`` path, ranks past a job's world sit it out, and
`tests/rank_jobs.py` reads the results.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

Job = Callable[[int, dict[str, Any]], Any]


def save_state(model: torch.nn.Module, optim: Any, where: str) -> None:
    """torch's own recipe: ``get_state_dict`` of the model and its optimizer(s), ``dcp.save`` under ``model``/``optim``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)


def load_state(model: torch.nn.Module, optim: Any, where: str) -> None:
    """The recipe's load: ``dcp.load`` into this layout's state dict, then a strict ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=where)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def run_job(rank: int, job: dict[str, Any], fn: Job) -> None:
    """One job on this rank: rank 0 ``torch.save``s its result, a failing rank its traceback beside it."""
    world = job["world"]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(job["port"]), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    result: dict[str, Any]
    try:
        state = fn(rank, job)
        dist.barrier()
        result = {"error": None, "state": state}
    except BaseException:  # noqa: BLE001 - the test reports the traceback
        result = {"error": f"rank {rank}: {traceback.format_exc()}"}
    finally:
        dist.destroy_process_group()
    if rank == 0 or result["error"]:
        torch.save(result, job["result"] if rank == 0 else f"{job['result']}.rank{rank}.err")


def worker(rank: int, fn: Job, jobs: list[dict[str, Any]]) -> None:
    """Entry point of each forked rank: every job this rank takes part in."""
    torch.set_num_threads(1)
    for job in jobs:
        if rank < job["world"]:
            run_job(rank, job, fn)


def main(write_job: Job, load_job: Job, argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("write", "load"):
        print(f"usage: {Path(sys.argv[0]).name} write|load JOBS.json", file=sys.stderr)
        return 2
    mode, jobs = args[0], json.loads(Path(args[1]).read_text())
    import torch.multiprocessing as mp

    # fork: the children share the parent's imported torch instead of importing it again each
    # (start-up dominates on a small box); the parent has run no torch op, so no thread pool is forked
    mp.start_processes(worker, args=(write_job if mode == "write" else load_job, jobs),
                       nprocs=max(j["world"] for j in jobs), join=True, start_method="fork")
    return 0
