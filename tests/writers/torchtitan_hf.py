"""torchtitan 0.3.0's own model and CheckpointManager on the two ends of the Hugging Face round trip.

Run under ``python -m torch.distributed.run --standalone --nproc-per-node N torchtitan_hf.py SPEC RESULT``.
SPEC is a JSON list of jobs, run one after the other in the same processes (importing torchtitan
and starting the processes dominate, so one launch serves every job):

    {"kind": "forward", "name", "model": {...}, "weights": FILE, "tokens": [[...]], "out": FILE}
        rank 0 builds torchtitan's ``Llama3Model`` from ``model`` (no parallelism), loads
        ``weights`` (a torch.save dict of full tensors under torchtitan 0.3.0 names) with
        ``load_state_dict(strict=True)`` and saves its logits on ``tokens`` (float32) to ``out``:
        the source model's forward that the Hugging Face export is compared with.
    {"kind": "load", "name", "model": {...}, "checkpoint": DIR, "weights": FILE, "tp": T}
        every rank builds the job torchtitan's Trainer builds at dp_shard = world / T, tp = T
        (``parallelize_llama``: TP then FSDP2), and ``CheckpointManager.load()`` with an empty
        checkpoint folder and ``initial_load_path = DIR``, ``initial_load_model_only = True``:
        how a torchtitan run starts from weights it did not write (a warm start). Every model
        tensor, gathered to its full value, is compared bitwise with ``weights``.

RESULT (JSON, rank 0) lists per job: loaded, torchtitan's error if its load raised, differences.

The model is built exactly as ``tests/writers/torchtitan_run.py`` builds it (its CPU substitutions,
documented there, apply here too), with the sizes of ``model`` instead of fixed ones:
``{"dim", "n_layers", "n_heads", "n_kv_heads", "vocab", "hidden", "theta", "scaling", "fuse_qkv"}``.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchtitan_run import SPMD_BACKEND, TinyTokens, TrainState, cpu_mesh, full, same  # noqa: E402


def model_config(m: dict[str, Any]):
    """``Llama3Model.Config`` assembled as torchtitan's flavors are (models/llama3/__init__.py), sizes from ``m``."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock

    dim, vocab = m["dim"], m["vocab"]
    linear_init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm_init = {"weight": nn.init.ones_}
    s = dim ** -0.5
    out_init = {"weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s), "bias": nn.init.zeros_}
    layers = []
    for layer_id in range(m["n_layers"]):
        depth = {"weight": partial(nn.init.trunc_normal_, std=0.02 / (2 * (layer_id + 1)) ** 0.5),
                 "bias": nn.init.zeros_}
        layers.append(Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
            attention=make_gqa_config(
                dim=dim, n_heads=m["n_heads"], n_kv_heads=m["n_kv_heads"], wqkv_param_init=linear_init,
                wo_param_init=depth, inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=m["fuse_qkv"],
                rope=ComplexRoPE.Config(dim=dim // m["n_heads"], max_seq_len=64, theta=m["theta"],
                                        scaling=m["scaling"])),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=m["hidden"], w1_param_init=linear_init,
                                         w2w3_param_init=depth),
        ))
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=out_init),
        layers=layers,
    )


def forward(spec: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's forward of the source weights (rank 0; the others wait)."""
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = model_config(spec["model"]).build()
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        weights = torch.load(spec["weights"], weights_only=True)
        model.load_state_dict(weights, strict=True)
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor(spec["tokens"])).float()
        torch.save(logits, spec["out"])
    dist.barrier()
    return {"name": spec["name"], "loaded": True, "error": None, "differences": []}


def load(spec: dict[str, Any]) -> dict[str, Any]:
    """CheckpointManager.load() of an import through ``initial_load_path`` at dp x tp; bitwise against ``weights``."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3.parallelize import parallelize_llama

    world, tp = dist.get_world_size(), int(spec.get("tp", 1))
    dp = world // tp
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp, tensor_parallel_degree=tp,
                                    spmd_backend=SPMD_BACKEND)
    training = TrainingConfig(local_batch_size=2, seq_len=16, steps=10, mixed_precision_param="float32")

    @dataclass
    class _JobConfig:  # update_from_config reads only `.parallelism` from a non-Trainer config
        parallelism: ParallelismConfig

    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    cfg = model_config(spec["model"])
    cfg.update_from_config(config=_JobConfig(parallelism))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.build()
    work = Path(spec["work"])
    model = parallelize_llama(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder=str(work))
    for module in model.modules():  # gloo has no PREMUL_SUM (torchtitan_run.py's docstring)
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    opt_cfg = default_adamw(lr=8e-4)
    opt_cfg.implementation = "for-loop"
    optimizers = opt_cfg.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                 min_lr_factor=0.0).build(optimizers=optimizers, training_steps=10)
    batch_mesh = parallel_dims.get_mesh("batch") if parallel_dims.dp_enabled else None
    dp_world, dp_rank = (batch_mesh.size(), batch_mesh.get_local_rank()) if batch_mesh is not None else (1, 0)
    dataloader = ParallelAwareDataloader(TinyTokens(dp_rank, dp_world), dp_rank=dp_rank, dp_world_size=dp_world,
                                         batch_size=2)
    # an empty checkpoint folder: the run starts from initial_load_path, model only (torchtitan's warm start)
    ck_cfg = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0,
                                      initial_load_path=str(spec["checkpoint"]), initial_load_model_only=True)
    checkpointer = ck_cfg.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": TrainState()},
                                sd_adapter=None, base_folder=str(work))
    try:
        loaded = checkpointer.load()
        error = None
    except (Exception, CheckpointException) as exc:  # the job's answer: what torchtitan says about this checkpoint
        text = str(exc)
        cause = [ln.strip() for ln in text.splitlines() if "Error:" in ln]
        loaded, error = False, f"{type(exc).__name__}: {cause[-1] if cause else text[:300]}"
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error)
    if any(errors):
        checkpointer.close()
        return {"name": spec["name"], "loaded": False, "error": next(e for e in errors if e), "differences": []}
    got = {k: full(v) for k, v in checkpointer.states["model"].state_dict().items()}
    placements = {}
    from torch.distributed.tensor import DTensor

    for k, v in checkpointer.states["model"].state_dict().items():
        if isinstance(v, DTensor):
            placements[k] = [str(p) for p in v.placements]
    diffs = [] if loaded else ["CheckpointManager.load returned False"]
    if dist.get_rank() == 0:
        ref = torch.load(spec["weights"], weights_only=True)
        for k in sorted(set(ref) | set(got)):
            if k not in got:
                diffs.append(f"{k} missing after load")
            elif k not in ref:
                diffs.append(f"{k} not in the reference")
            elif not same(ref[k], got[k]):
                diffs.append(f"{k} differs")
    checkpointer.close()
    return {"name": spec["name"], "loaded": True, "error": None, "differences": diffs, "compared": len(got),
            "mesh": {"dp_shard": dp, "tp": tp}, "placements": placements}


def main(argv: list[str]) -> int:
    jobs = json.loads(Path(argv[0]).read_text())
    dist.init_process_group("gloo")
    cpu_mesh()
    results = [forward(j) if j["kind"] == "forward" else load(j) for j in jobs]
    if dist.get_rank() == 0:
        Path(argv[1]).write_text(json.dumps({"world_size": dist.get_world_size(), "jobs": results}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a gloo thread can abort interpreter teardown ("terminate called without an active exception")
