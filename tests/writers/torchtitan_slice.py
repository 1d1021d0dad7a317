"""torchtitan 0.3.0 for the layer-slice tests: a 4-layer run written, a 2-layer model loading its slice.

Run under ``python -m torch.distributed.run --standalone --nproc-per-node N``, like
``torchtitan_run.py``, whose job (torchtitan's own model, parallelize_llama, optimizers,
schedulers, dataloader, CheckpointManager, the CPU substitutions its docstring lists) this
reuses with another layer count:

    torchtitan_slice.py write SPEC          jobs {"dump", "fuse_qkv", "steps", "layers"}: as
        torchtitan_run.py write, with a model of ``layers`` transformer blocks
    torchtitan_slice.py load SPEC RESULT    jobs {"name", "dump", "step", "ref", "fuse_qkv",
        "layers", "kept"}: builds the job with ``layers`` blocks at THIS world size,
        CheckpointManager.load(step) from DUMP/checkpoint/step-N (nothing excluded: the
        slice is at the source's dp degree, so each rank's loader state is its own), and
        compares every model, optimizer, lr_scheduler and train_state value bitwise with the
        4-layer reference REF renumbered: source layer ``kept[i]`` is layer i, the others
        are left out. The loader state is compared with the source rank's.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import torchtitan_run as tr  # noqa: E402

LAYER = re.compile(r"(?<![A-Za-z0-9_])layers\.(\d+)\.")


def renumber(name: str, kept: list[int]) -> str | None:
    """``layers.3.x`` -> ``layers.1.x`` when 3 is the second kept layer; None when its layer is left out."""
    m = LAYER.search(name)
    if m is None:
        return name
    old = int(m.group(1))
    if old not in kept:
        return None
    return name[:m.start(1)] + str(kept.index(old)) + name[m.end(1):]


def renumber_value(v: Any, kept: list[int]) -> Any:
    """Lists of parameter names inside optimizer state (a group's ``params``), renumbered the same way."""
    if isinstance(v, str):
        return renumber(v, kept) or v
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return [n for n in (renumber(x, kept) for x in v) if n is not None]
    if isinstance(v, dict):
        return {k: renumber_value(x, kept) for k, x in v.items()}
    return v


def sliced_reference(ref: dict[str, Any], kept: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in ("model", "optimizer"):
        out[part] = {}
        for k, v in ref[part].items():
            nk = renumber(k, kept)
            if nk is not None:
                out[part][nk] = renumber_value(v, kept)
    out["lr_scheduler"], out["train_state"] = ref["lr_scheduler"], ref["train_state"]
    return out


def load(spec: dict[str, Any]) -> dict[str, Any]:
    """CheckpointManager.load(step) of the slice into a ``layers``-block model; compared with the renumbered reference."""
    rank = dist.get_rank()
    tr.LAYERS = spec["layers"]
    job = tr.build(Path(spec["dump"]), spec.get("fuse_qkv", True), [])
    ref_dir = Path(spec["ref"])
    loaded, error = tr.load_on_every_rank(job, spec["step"])
    if error:
        return {"name": spec["name"], "loaded": False, "error": error, "differences": []}
    got = tr.snapshot(job)
    diffs = [] if loaded else ["CheckpointManager.load returned False"]
    compared: dict[str, int] = {}
    if rank == 0:
        ref = sliced_reference(torch.load(ref_dir / "state.pt", weights_only=False), spec["kept"])
        diffs += tr.compare(ref, got)
        compared = {p: len(ref[p]) for p in ref}
        compared["layers_in_model"] = len({m.group(1) for k in got["model"] if (m := LAYER.match(k))})
    ref_loader = ref_dir / f"dataloader_rank_{rank}.pt"
    if not (ref_loader.exists() and job.dataloader.state_dict() == torch.load(ref_loader, weights_only=False)):
        diffs.append(f"dataloader state of rank {rank} is not the source rank's")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, diffs)
    job.checkpointer.close()
    return {"name": spec["name"], "loaded": True, "error": None, "compared": compared,
            "differences": [d for part in gathered for d in part]}


_WRITE = tr.write


def write(spec: dict[str, Any]) -> None:
    """torchtitan_run's write with a model of ``layers`` blocks."""
    tr.LAYERS = spec["layers"]
    _WRITE(spec)


if __name__ == "__main__":
    tr.write, tr.load = write, load  # torchtitan_run's launcher, its jobs run by these two
    sys.exit(tr.main(sys.argv[1:]))
