"""torchtitan 0.3.0's own tied-embedding Llama (its Llama 3.2 1B/3B flavours' ``enable_weight_tying``),
trained and saved by its own ``CheckpointManager`` on CPU gloo, with torchtitan's logits beside it.

Run under ``python -m torch.distributed.run --standalone --nproc-per-node N torchtitan_tied.py SPEC``.
SPEC is a JSON list of jobs ``{"dump", "model": {...}, "steps", "tokens": [[...]]}`` (``model`` as in
``tests/writers/torchtitan_hf.py``: dim, n_layers, n_heads, n_kv_heads, vocab, hidden, theta,
scaling, fuse_qkv), each run in this launch:

    DUMP/checkpoint/step-<steps>/      CheckpointManager.save(curr_step=steps): the full training
                                       state (model, optimizer, lr_scheduler, train_state, dataloader)
    DUMP/checkpoint/step-<steps + 1>/  one more step, then CheckpointManager.save(curr_step, last_step=True)
                                       with torchtitan's default ``last_save_model_only = True``: the
                                       model only, as torchtitan leaves a finished run
    DUMP/reference/step-<n>.pt         rank 0: the model state at that save, full values
    DUMP/reference/logits-<n>.pt       rank 0: torchtitan's forward of those weights on ``tokens``
                                       (float32), the logits a Hugging Face export must give

The tie is torchtitan's own: the model config is assembled as ``models/llama3/__init__.py``'s
``_1b``/``_3b`` flavours are (``enable_weight_tying=True``, the embedding's init skipped by
``skip_param_init`` because ``Decoder`` points ``tok_embeddings.weight`` at ``lm_head.weight``), and
``parallelize_llama``'s FSDP2 puts embedding, norm and head in one unit as it does for a tied model.
``model.state_dict()`` (what ``CheckpointManager`` saves) holds the one parameter under both names,
so DCP stores ``tok_embeddings.weight`` and ``lm_head.weight`` with equal bytes, and the optimizer
keeps its moments under the name ``named_parameters`` gives first (``tok_embeddings.weight``).

The reference forward (rank 0) builds the same tied config without parallelism, loads the saved
full state with ``load_state_dict(strict=True)`` and runs torchtitan's ``Decoder.forward``.

The job is built in torchtitan's Trainer order as ``tests/writers/torchtitan_run.py`` builds it,
with its CPU substitutions (documented there: gloo and a "cpu" mesh, SDPA instead of compiled
FlexAttention, float32 parameters, the for-loop AdamW, force-sum FSDP reductions, the
``partial_dtensor`` SPMD backend, an in-memory Stateful token stream); none changes what is saved.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchtitan_hf import model_config as untied_config  # noqa: E402
from torchtitan_run import Job, cpu_mesh, full, train  # noqa: E402
from torchtitan_run import build as build_job  # noqa: E402


def tied_config(m: dict[str, Any]):
    """``model``'s Llama3Model.Config with the tie the 1B/3B flavours declare (models/llama3/__init__.py)."""
    from torchtitan.models.common.param_init import skip_param_init

    cfg = untied_config(m)
    cfg.enable_weight_tying = True
    cfg.tok_embeddings.param_init = {"weight": skip_param_init}  # the flavours' _EMBEDDING_SKIP_INIT
    return cfg


def build(dump: Path, m: dict[str, Any], steps: int) -> Job:
    """torchtitan's job at dp_shard = world (`torchtitan_run.build`) with the tied model and torchtitan's
    default ``last_save_model_only``."""
    job = build_job(dump, False, [], model_cfg=tied_config(m), seq=16, batch=2, steps=steps, last_save_model_only=True)
    assert job.model.tok_embeddings.weight is job.model.lm_head.weight, "torchtitan did not tie the weights"
    return job


def reference(job: Job, m: dict[str, Any], tokens: list[list[int]], ref: Path, step: int) -> None:
    """Rank 0: the saved model state (full values) and torchtitan's forward of it on ``tokens``."""
    state = {k: full(v) for k, v in job.checkpointer.states["model"].state_dict().items()}  # collective
    if dist.get_rank() == 0:
        torch.save(state, ref / f"step-{step}.pt")
        torch.manual_seed(0)
        with torch.device("meta"):
            model = tied_config(m).build()
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.load_state_dict(state, strict=True)
        assert model.tok_embeddings.weight is model.lm_head.weight
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor(tokens)).float()
        torch.save(logits, ref / f"logits-{step}.pt")
    dist.barrier()


def write(spec: dict[str, Any]) -> None:
    dump, m, steps = Path(spec["dump"]), spec["model"], int(spec.get("steps", 2))
    ref = dump / "reference"
    ref.mkdir(parents=True, exist_ok=True)
    job = build(dump, m, 10)  # the schedule of a 10-step run, as torchtitan_run.py
    train(job, steps)
    job.checkpointer.save(curr_step=steps)  # an interval save: the full training state
    reference(job, m, spec["tokens"], ref, steps)
    train(job, 1)
    job.checkpointer.save(curr_step=steps + 1, last_step=True)  # torchtitan's last save: model only
    reference(job, m, spec["tokens"], ref, steps + 1)
    job.checkpointer.close()


def main(argv: list[str]) -> int:
    jobs = json.loads(Path(argv[0]).read_text())
    dist.init_process_group("gloo")
    cpu_mesh()
    for spec in jobs:
        write(spec)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a gloo thread can abort interpreter teardown ("terminate called without an active exception")
