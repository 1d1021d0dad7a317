"""HF Accelerate writer and loader (issue 15): its FSDP folder layout, written and read by accelerate.

Run under torchrun, one process per rank:

    python -m torch.distributed.run --nproc-per-node N tests/writers/accelerate_run.py write OUTDIR REF
    python -m torch.distributed.run --nproc-per-node N tests/writers/accelerate_run.py load MODEL_DIR OPTIM_DIR OUT

* ``write``: an ``Accelerator(cpu=True)`` (gloo) and a tiny model put under FSDP2
  ``fully_shard`` (see SUBSTITUTION), Adam and a LambdaLR scheduler prepared by it; a few
  steps on rank-dependent data (``accelerator.backward``); then accelerate's own FSDP save
  functions with a ``FullyShardedDataParallelPlugin(fsdp_version=2,
  state_dict_type="SHARDED_STATE_DICT")``: ``save_fsdp_model`` writes
  ``OUTDIR/pytorch_model_fsdp_0/`` and ``save_fsdp_optimizer`` writes ``OUTDIR/optimizer_0/``
  (each its own DCP checkpoint, keys ``model.<fqn>`` and ``optimizer.state.<fqn>.<moment>``),
  exactly the folders ``accelerator.save_state`` makes under FSDP; the scheduler and RNG files
  ``save_state`` adds beside them are written by accelerate's ``save_accelerator_state``.
  Rank 0 saves REF: the full state gathered by torch's ``get_model_state_dict`` /
  ``get_optimizer_state_dict(full_state_dict=True)``.
* ``load``: the same model and optimizer at N ranks, ``load_fsdp_model(MODEL_DIR)`` and
  ``load_fsdp_optimizer(OPTIM_DIR)`` (accelerate's own loaders, which accept the folder
  itself), then the full state gathered the same way to OUT (rank 0).

SUBSTITUTION: accelerate 1.15.0 enables FSDP only for device-backed distributed types
(``AcceleratorState``: ``DistributedType.FSDP`` is set for MULTI_GPU/NPU/XPU/..., not for
MULTI_CPU); with ``Accelerator(cpu=True, fsdp_plugin=...)`` under torchrun it silently
prepares the model as DDP, and without ``cpu=True`` on a CPU-only machine it is not
distributed at all. So ``accelerator.prepare`` cannot apply FSDP here, and ``save_state``
would write a DDP checkpoint. The model is sharded with torch's ``fully_shard`` directly
(what accelerate's ``fsdp2_prepare_model`` calls), and the save/load go through the
``accelerate.utils.fsdp_utils`` functions that ``save_state``/``load_state`` call under FSDP,
with the plugin they take; the bytes on disk are those functions' ``dist_cp.save`` of
``get_model_state_dict``/``get_optimizer_state_dict``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from accelerate import Accelerator
from accelerate.checkpointing import save_accelerator_state
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer

from torch_variants import MLP  # a sibling script: run as a script, tests/writers is on sys.path

STEPS = 3
LR = 1e-2
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


# The model of the torch variants (same parameter names and shapes): one tiny model for both writers.
Net = MLP


def plugin() -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")


def build() -> tuple[Accelerator, nn.Module, torch.optim.Optimizer, Any]:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = Net()
    fully_shard(model.inp)
    fully_shard(model.out)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda s: 1.0 / (1 + s))
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    raw = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
    return {"model": get_model_state_dict(model, options=FULL),
            "optimizer": get_optimizer_state_dict(model, raw, options=FULL)}


def write(outdir: Path, ref: Path) -> None:
    accelerator, model, optimizer, scheduler = build()
    gen = torch.Generator().manual_seed(100 + accelerator.process_index)
    for _ in range(STEPS):
        loss = model(torch.randn(4, 6, generator=gen)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    fsdp = plugin()
    outdir.mkdir(parents=True, exist_ok=True)
    save_fsdp_model(fsdp, accelerator, model, str(outdir))
    save_fsdp_optimizer(fsdp, accelerator, getattr(optimizer, "optimizer", optimizer), model, str(outdir))
    save_accelerator_state(str(outdir), [], [], [scheduler], [], accelerator.process_index, step=STEPS)
    reference = full_state(model, optimizer)
    if accelerator.is_main_process:
        torch.save(reference, ref)
    accelerator.wait_for_everyone()


def load(model_dir: Path, optim_dir: Path, out: Path) -> None:
    accelerator, model, optimizer, _ = build()
    fsdp = plugin()
    load_fsdp_model(fsdp, accelerator, model, str(model_dir))
    load_fsdp_optimizer(fsdp, accelerator, getattr(optimizer, "optimizer", optimizer), model, str(optim_dir))
    loaded = full_state(model, optimizer)
    if accelerator.is_main_process:
        torch.save(loaded, out)
    accelerator.wait_for_everyone()


def main() -> None:
    mode = sys.argv[1]
    if mode == "write":
        write(Path(sys.argv[2]), Path(sys.argv[3]))
    elif mode == "load":
        load(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's teardown: a gloo thread left by accelerate can abort the
    # process there ("terminate called without an active exception") after the work is done,
    # as Lightning Fabric's did (tests/writers/lightning_run.py).
    os._exit(0)


if __name__ == "__main__":
    main()
