"""Write or load a torchtitan 0.3.0 MoE checkpoint (its qwen3 MoE model) with torchtitan's own code, on CPU gloo.

Run under ``python -m torch.distributed.run --standalone --nproc-per-node N``; SPEC is a JSON list
of jobs run one after the other in the same processes:

    torchtitan_moe_run.py write SPEC          jobs {"dump", "ep", "steps"}:
        DUMP/checkpoint/step-<steps>/ : torchtitan's CheckpointManager.save (DCP)
        DUMP/reference/               : full values at save time (rank 0) + each rank's loader state
    torchtitan_moe_run.py load SPEC RESULT    jobs {"name", "dump", "step", "ref", "ep", "exclude", "experts"}:
        builds the same job at THIS world size (dp_shard = world size, expert_parallel_degree = ep),
        CheckpointManager.load(step) from DUMP/checkpoint/step-N, compares every model,
        optimizer, lr_scheduler and train_state value bitwise with REF; RESULT (JSON) lists per job:
        loaded, torchtitan's error if its load raised, the differences. ``"experts": [i, ...]``:
        the model has ``len(experts)`` experts and the reference is REF's values at those expert
        rows (stacked expert tensors, router gate rows, the expert bias), which is what
        ``reshard convert --experts`` must write.

The model is torchtitan 0.3.0's qwen3 MoE as its ``debugmodel_moe`` flavour is assembled
(``models/qwen3/__init__.py``: ``Qwen3Model.Config`` with ``_build_qwen3_moe_layers``, i.e. its
``make_gqa_config`` with qk-norm and fused QKV, ``make_moe_config`` / ``make_router_config`` (softmax,
route_norm) / ``make_routed_experts_config`` (``GroupedExperts``: experts stacked in one tensor per
weight, ``w1_EFD`` / ``w2_EDF`` / ``w3_EFD`` of shape (experts, ., .)), the ``standard`` all-to-all
token dispatcher, auxiliary-loss-free load balancing (``expert_bias_E`` buffer)), made tiny: dim 64,
2 layers, 4 heads of 16 (2 kv heads), vocab 256, 4 experts of hidden 32, top-2.

Expert parallelism as torchtitan 0.3.0 builds it (``ParallelDims.build_mesh``): EP borrows ranks
from dp_shard; the sparse mesh is ``(pp, dp_replicate, efsdp, ep)`` with ``efsdp = dp_shard * cp *
tp / ep``. ``Qwen3Model.Config.update_from_config`` sets the EP sharding configs,
``parallelize_qwen3`` calls ``model.parallelize`` (``distribute_tensor`` of each stacked expert
tensor ``Shard(0)`` over ``ep``) and ``apply_fsdp_to_decoder`` with ``ep_degree``/``edp_mesh`` (experts
FSDP-sharded over ``efsdp``, everything else over ``fsdp``). The optimizer build is followed by
the model spec's ``post_optimizer_build_fn`` (``register_moe_load_balancing_hook``), as in
``Trainer.__init__``.

What is torchtitan's own code, and the CPU substitutions, are those of
``tests/writers/torchtitan_run.py`` (this writer imports its data set, train state, snapshot and
comparison helpers), plus:

- the grouped matmul is torchtitan's own ``GroupedExperts.forward`` (``torch._grouped_mm`` on
  bfloat16 copies of the experts, as on a GPU): torch 2.13 runs it on CPU, forward and
  backward, when every stride is a multiple of 16 bytes, which the tiny sizes keep (dims of 8s).
- attention: ``ScaledDotProductAttention`` in place of the flavour's ``FlexAttention`` (no
  parameters; the saved keys, shapes and shards are the same).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from torchtitan_run import (  # noqa: E402  the llama3 writer's data set, state and comparisons
    BATCH, SEQ, TOTAL_STEPS, Job, assemble, compare, load_on_every_rank, materialise, run_and_exit,
    snapshot, train,
)

DIM = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
VOCAB = 256
MOE_HIDDEN = 32
EXPERTS = 4
TOP_K = 2
SPMD_BACKEND = "partial_dtensor"


def model_config(n_experts: int = EXPERTS):
    """A tiny qwen3 MoE ``Qwen3Model.Config`` built by torchtitan's own ``debugmodel_moe`` assembly."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm
    from torchtitan.models.qwen3.model import Qwen3Model

    layers = _build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        moe_hidden_dim=MOE_HIDDEN, num_experts=n_experts, top_k=min(TOP_K, n_experts), attn_backend="flex",
        rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=64, theta=1000000.0), moe_comm_backend="standard")
    for layer in layers:  # FlexAttention compiles with inductor: far too slow on 2 CPU cores (docstring)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=layers,
    )


def build(dump: Path, ep: int, exclude: list[str], *, n_experts: int = EXPERTS, steps: int = TOTAL_STEPS) -> Job:
    """The job on this process's ranks, in torchtitan's Trainer order (see the module docstring)."""
    from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    world = dist.get_world_size()
    parallelism = ParallelismConfig(data_parallel_shard_degree=world, expert_parallel_degree=ep,
                                    spmd_backend=SPMD_BACKEND)
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, steps=steps, mixed_precision_param="float32")

    @dataclass
    class _JobConfig:  # update_from_config reads only `.parallelism` from a non-Trainer config
        parallelism: ParallelismConfig

    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    cfg = model_config(n_experts)
    cfg.update_from_config(config=_JobConfig(parallelism))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.build()
    model = parallelize_qwen3(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder=str(dump))
    materialise([model])
    return assemble([model], parallel_dims, dump, exclude, steps=steps, batch=BATCH,
                    after_optimizers=lambda opts: register_moe_load_balancing_hook(opts, [model], parallel_dims))


def layout(job: Job) -> dict[str, Any]:
    """How each stacked expert tensor is placed (mesh names, placements, local shape) on this rank."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in job.model.named_parameters():
        if "inner_experts" in name and isinstance(p, DTensor):
            out[name] = {"mesh": list(p.device_mesh.mesh_dim_names or ()), "mesh_shape": list(p.device_mesh.shape),
                         "placements": [str(x) for x in p.placements], "local": list(p.to_local().shape)}
    return out


def write(spec: dict[str, Any]) -> None:
    """Train ``steps`` steps and save with CheckpointManager; rank 0 keeps the full-value reference."""
    dump = Path(spec["dump"])
    rank = dist.get_rank()
    job = build(dump, spec["ep"], [])
    train(job, spec.get("steps", 2))
    job.checkpointer.save(curr_step=spec.get("steps", 2))
    snap = snapshot(job)
    ref = dump / "reference"
    ref.mkdir(parents=True, exist_ok=True)
    torch.save(job.dataloader.state_dict(), ref / f"dataloader_rank_{rank}.pt")
    lay = layout(job)
    if rank == 0:
        torch.save(snap, ref / "state.pt")
        (ref / "layout.json").write_text(json.dumps(lay, indent=1))
    job.checkpointer.close()


def expert_rows(ref: dict[str, Any], experts: list[int]) -> dict[str, Any]:
    """REF at the kept experts: what an ``--experts`` slice of the source must hold.

    Along the expert axis (dim 0) of the stacked expert tensors and their moments
    (``inner_experts.w*``), of the router gate's rows and of the ``expert_bias_E`` buffer; every
    other value as it is."""
    idx = torch.tensor(experts)

    def cut(key: str, v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return v
        if ".moe.routed_experts.inner_experts." in key or ".moe.router.gate.weight" in key or key.endswith(
                ".moe.expert_bias_E"):
            return v.index_select(0, idx).clone()
        return v

    out = dict(ref)
    out["model"] = {k: cut(k, v) for k, v in ref["model"].items()}
    out["optimizer"] = {k: cut(k, v) for k, v in ref["optimizer"].items()}
    return out


def load(spec: dict[str, Any]) -> dict[str, Any]:
    """CheckpointManager.load(step) at this world size and ``ep``; every value compared bitwise."""
    rank = dist.get_rank()
    exclude = spec.get("exclude", [])
    experts = spec.get("experts")
    job = build(Path(spec["dump"]), spec["ep"], exclude, n_experts=len(experts) if experts else EXPERTS)
    ref_dir = Path(spec["ref"])
    loaded, error = load_on_every_rank(job, spec["step"])
    if error:
        return {"name": spec["name"], "loaded": False, "error": error, "differences": []}
    got = snapshot(job)
    diffs = [] if loaded else ["CheckpointManager.load returned False"]
    compared: dict[str, int] = {}
    if rank == 0:
        ref = torch.load(ref_dir / "state.pt", weights_only=False)
        if experts:
            ref = expert_rows(ref, experts)
        diffs += compare(ref, got)
        compared = {p: len(ref[p]) for p in ref}
    lay = layout(job)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, diffs)
    job.checkpointer.close()
    return {"name": spec["name"], "loaded": True, "error": None, "compared": compared, "layout": lay,
            "differences": [d for part in gathered for d in part]}


if __name__ == "__main__":
    run_and_exit(write, load)  # torchtitan_run's launch: one gloo group, every job of SPEC, then os._exit
