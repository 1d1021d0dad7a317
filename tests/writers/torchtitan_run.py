"""Write or load a torchtitan 0.3.0 checkpoint with torchtitan's own components, on CPU gloo.

Run under ``python -m torch.distributed.run --standalone --nproc-per-node N``; SPEC is a JSON
list of jobs run one after the other in the same processes (process start-up and importing
torchtitan dominate, so one launch serves several jobs):

    torchtitan_run.py write SPEC          jobs {"dump", "fuse_qkv", "steps"}:
        DUMP/checkpoint/step-<steps>/ : torchtitan's CheckpointManager.save (DCP)
        DUMP/reference/               : full values at save time (rank 0) + each rank's loader state
    torchtitan_run.py load SPEC RESULT    jobs {"name", "dump", "step", "ref", "exclude", "fuse_qkv"}:
        builds the same job at THIS world size (dp_shard = world size), CheckpointManager.load(step)
        from DUMP/checkpoint/step-N (with ``exclude_from_loading = exclude``), compares every
        model, optimizer, lr_scheduler and train_state value bitwise with REF; RESULT (JSON) lists
        per job: loaded, torchtitan's error if its load raised, the differences.

Optional ``"pp": P`` in a write or load job (default 1, what every other test uses): the job is
torchtitan's pipeline-parallel one, ``ParallelDims(pp=P, dp_shard=world // P)``, the model split
by torchtitan 0.3.0's own ``pipeline_llm`` (``pipeline_parallel_schedule = "1F1B"``, micro-batch
1 of a local batch 2, each stage then ``parallelize_llama``'d) and trained through the schedule
with torchtitan's ``CrossEntropyLoss`` divided by the global valid tokens, as
``Trainer.pp_forward_backward_step`` does (one substitution: torchtitan 0.3.0 hands the schedule the
micro-batch lists as ``step(arg_mbs=..., target_mbs=...)``, which torch 2.13's ``step`` does not take;
it gets the whole batch, which it splits into the same micro-batches). ``CheckpointManager`` gets the stages as
``model_parts`` (``ModelWrapper`` merges their state dicts; ``OptimizersContainer`` flattens the
optimizers' by parameter name), so each stage writes its own keys. The reference is then the
union of every rank's full values, and each rank's loader state is also kept by dp rank
(``dataloader_dp_rank_<k>.pt``: the PP stages of one dp rank read the same batches), which a
``"pp"`` load job compares against.

What is torchtitan's own code here (the trainer's build order, torchtitan/trainer.py):
``Llama3Model.Config`` (with ``Llama3TransformerBlock.Config``, ``make_gqa_config``,
``make_ffn_config`` as ``models/llama3/__init__.py`` uses them) built on the meta device,
``update_from_config`` (sharding config), ``ParallelDims`` (its mesh), ``parallelize_llama``
(FSDP2 via ``apply_fsdp_to_decoder``), ``to_empty`` + ``init_weights``,
``OptimizersContainer`` (``default_adamw``), ``LRSchedulersContainer`` (warmup + linear
decay), ``ParallelAwareDataloader``, ``CheckpointManager`` with ``states={"train_state": ...}``.

CPU substitutions, each changing nothing that is written to disk:

- process group: ``dist.init_process_group("gloo")`` instead of torchtitan's
  ``init_distributed`` (which asks for ``cuda:nccl``); and ``ParallelDims`` builds its mesh
  with device type ``"cpu"`` (``torchtitan.tools.utils.device_type`` falls back to "cuda"
  on a machine without an accelerator; the module-level name is set in this process only).
  The collectives carry the same values; each rank writes its own shards.
- inner attention: ``ScaledDotProductAttention`` (causal) instead of the compiled
  ``FlexAttention`` (inductor + block masks, far too slow on 2 CPU cores). Inner attention
  has no parameters or state; the checkpoint's keys, shapes and shards are the same.
- mixed precision ``param_dtype=float32`` (torchtitan's default is bf16 compute, a GPU
  choice): parameters and optimizer state are float32 either way.
- optimizer ``implementation="for-loop"`` (torchtitan's default "fused" is a CUDA kernel):
  the same AdamW math and the same state keys (step, exp_avg, exp_avg_sq).
- ``set_force_sum_reduction_for_comms(True)`` on the FSDP modules: torchtitan disables
  FSDP's gradient division (factor 1.0), which FSDP2 sends as ``ReduceOp.PREMUL_SUM(1.0)``,
  an op gloo does not have; with the flag FSDP reduce-scatters with SUM and scales by the
  same factor 1.0 locally. Gradients only; nothing saved changes.
- ``spmd_backend="partial_dtensor"`` instead of the default ``"spmd_types"``: with
  ``spmd_types`` and FSDP only (no TP), ``parallelize_llama`` leaves the parameters plain and
  torch 2.13's ``fully_shard`` then refuses them ("When dp_mesh_dims is provided, all
  parameters must be DTensors on the full SPMD mesh"). ``partial_dtensor`` is torchtitan's
  FSDP2 path: every parameter and moment a DTensor ``Shard(0)`` over the ``fsdp`` mesh.
- no activation checkpointing, no torch.compile, no float8: these wrap or compile modules
  without adding parameters; ``canonical_fqn`` strips the AC wrapper from the saved names.
- the dataset is a tiny in-memory token stream (``TinyTokens``: an ``IterableDataset``
  with ``state_dict``/``load_state_dict`` like torchtitan's ``HuggingFaceTextDataset``, split
  by dp rank) instead of a Hugging Face dataset and tokenizer; the loader around it is
  torchtitan's ``ParallelAwareDataloader``, which writes ``dataloader.dp_rank_<k>`` and
  ``dataloader.world_size`` as for any dataset.
- the loss is ``torch.nn.functional.cross_entropy`` over the logits (torchtitan's
  ``ChunkedLossWrapper`` is a memory optimisation of the same loss).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DIM = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
VOCAB = 256
HIDDEN = 128
SEQ = 16
BATCH = 2
TOTAL_STEPS = 10
SPMD_BACKEND = "partial_dtensor"


# ---------------------------------------------------------------------------- data

class TinyTokens(torch.utils.data.IterableDataset):
    """A deterministic token stream split by dp rank, Stateful like torchtitan's HF text dataset.

    Sample i (global) is a fixed pseudo-random sequence; rank r of W takes samples r, r+W, ...
    Its state is the number of samples this rank has taken (``sample_idx``), as in
    ``HuggingFaceTextDataset``.
    """

    def __init__(self, dp_rank: int, dp_world_size: int, n_samples: int = 64) -> None:
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.n_samples = n_samples
        self.sample_idx = 0

    def _sample(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + i)
        return torch.randint(0, VOCAB, (SEQ + 1,), generator=g)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            i = self.dp_rank + self.sample_idx * self.dp_world_size
            if i >= self.n_samples:
                return
            self.sample_idx += 1
            t = self._sample(i)
            yield {"input": t[:-1]}, t[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sample_idx = state["sample_idx"]


# ---------------------------------------------------------------------------- the job

def cpu_mesh() -> None:
    """ParallelDims builds its world mesh with ``device_type``; on this machine that is the CPU."""
    import torchtitan.distributed.parallel_dims as pd

    pd.device_type = "cpu"


def model_config(fuse_qkv: bool):
    """A tiny Llama3Model.Config assembled exactly as torchtitan's flavors are (models/llama3/__init__.py)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock

    linear_init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm_init = {"weight": nn.init.ones_}
    s = DIM ** -0.5
    out_init = {"weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s), "bias": nn.init.zeros_}
    layers = []
    for layer_id in range(LAYERS):
        depth = {"weight": partial(nn.init.trunc_normal_, std=0.02 / (2 * (layer_id + 1)) ** 0.5),
                 "bias": nn.init.zeros_}
        layers.append(Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm_init),
            ffn_norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm_init),
            attention=make_gqa_config(
                dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, wqkv_param_init=linear_init, wo_param_init=depth,
                inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=fuse_qkv,
                rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama")),
            feed_forward=make_ffn_config(dim=DIM, hidden_dim=HIDDEN, w1_param_init=linear_init,
                                         w2w3_param_init=depth),
        ))
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm_init),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=out_init),
        layers=layers,
    )


@dataclass
class Job:
    """The pieces torchtitan's Trainer holds, built in its order."""

    model: nn.Module
    optimizers: Any
    lr_schedulers: Any
    dataloader: Any
    checkpointer: Any
    train_state: Any
    dp_rank: int
    dp_world: int
    parallel_dims: Any
    train_context: Any
    pp_schedule: Any = None
    pp_first: bool = True
    pp_last: bool = True
    model_parts: list[nn.Module] | None = None


class TrainState:
    """torchtitan's ``Trainer`` is the ``train_state`` Stateful: ``{"step", "ntokens_seen"}`` (trainer.py)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


def materialise(parts: list[nn.Module]) -> None:
    """Each model part from the meta device to CPU as torchtitan's Trainer does it: ``to_empty``, then
    ``init_weights`` under seed 0, then train mode; FSDP's reductions as sums (gloo has no PREMUL_SUM)."""
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=None)
        part.train()


def assemble(parts: list[nn.Module], parallel_dims: Any, dump: Path, exclude: list[str], *, steps: int,
             batch: int, loader: Any = None, last_save_model_only: bool = False, after_optimizers: Any = None,
             **pp: Any) -> Job:
    """The rest of the Trainer's build over ``parts``: AdamW (for-loop), the LR schedule, the dataloader
    on the batch mesh (``loader(dp_rank, dp_world)``, default `TinyTokens` at ``batch``), the train
    state and ``CheckpointManager``. ``after_optimizers(optimizers)``: a model spec's
    ``post_optimizer_build_fn``; ``pp``: the pipeline fields of `Job`."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.distributed import utils as dist_utils

    opt_cfg = default_adamw(lr=8e-4)
    opt_cfg.implementation = "for-loop"
    optimizers = opt_cfg.build(model_parts=parts)
    if after_optimizers is not None:
        after_optimizers(optimizers)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                 min_lr_factor=0.0).build(optimizers=optimizers,
                                                                          training_steps=steps)
    batch_mesh = parallel_dims.get_mesh("batch") if parallel_dims.dp_enabled else None
    dp_world, dp_rank = (batch_mesh.size(), batch_mesh.get_local_rank()) if batch_mesh is not None else (1, 0)
    dataloader = (loader(dp_rank, dp_world) if loader is not None else
                  ParallelAwareDataloader(TinyTokens(dp_rank, dp_world), dp_rank=dp_rank, dp_world_size=dp_world,
                                          batch_size=batch))
    train_state = TrainState()
    ck_cfg = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, last_save_model_only=last_save_model_only,
                                      keep_latest_k=0, exclude_from_loading=list(exclude))
    checkpointer = ck_cfg.build(dataloader=dataloader, model_parts=parts, optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                sd_adapter=None, base_folder=str(dump))
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims, spmd_typechecking=False)
    return Job(parts[0], optimizers, lr_schedulers, dataloader, checkpointer, train_state, dp_rank, dp_world,
               parallel_dims, context, **pp)


def build(dump: Path, fuse_qkv: bool, exclude: list[str], *, loader: Any = None, seq: int = SEQ, batch: int = BATCH,
          steps: int = TOTAL_STEPS, model_cfg: Any = None, last_save_model_only: bool = False, pp: int = 1) -> Job:
    """The job on this process's ranks: torchtitan's llama3 model, ``parallelize_llama`` (FSDP2 at
    dp_shard = world), AdamW, the LR schedule and ``CheckpointManager``. ``loader(dp_rank, dp_world)``
    makes the dataloader (default: `TinyTokens` through ``ParallelAwareDataloader``);
    tests/writers/torchtitan_data_run.py gives torchtitan's HuggingFaceTextDataLoader. ``model_cfg``:
    another ``Llama3Model.Config`` than `model_config`'s (tests/writers/torchtitan_tied.py's tied one);
    ``last_save_model_only``: torchtitan's own default (True) for a run's last save, where the writers
    here otherwise keep the full state."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.parallelize import parallelize_llama

    world = dist.get_world_size()
    if pp > 1:
        return build_pp(dump, fuse_qkv, exclude, pp=pp, seq=seq, batch=batch, steps=steps)
    parallelism = ParallelismConfig(data_parallel_shard_degree=world, spmd_backend=SPMD_BACKEND)
    training = TrainingConfig(local_batch_size=batch, seq_len=seq, steps=steps, mixed_precision_param="float32")

    @dataclass
    class _JobConfig:  # update_from_config reads only `.parallelism` from a non-Trainer config
        parallelism: ParallelismConfig

    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    cfg = model_cfg if model_cfg is not None else model_config(fuse_qkv)
    cfg.update_from_config(config=_JobConfig(parallelism))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.build()
    model = parallelize_llama(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder=str(dump))
    materialise([model])
    return assemble([model], parallel_dims, dump, exclude, steps=steps, batch=batch, loader=loader,
                    last_save_model_only=last_save_model_only)


def build_pp(dump: Path, fuse_qkv: bool, exclude: list[str], *, pp: int, seq: int, batch: int, steps: int) -> Job:
    """The pipeline-parallel job as torchtitan's Trainer builds it (trainer.py, ``parallel_dims.pp_enabled``):
    the whole model on the meta device, ``pipeline_llm`` (its 1F1B schedule and stage split), each
    model part ``to_empty`` + ``init_weights``, the optimizer and checkpointer over ``model_parts``,
    the dataloader at the micro-batch size."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3.parallelize import parallelize_llama

    world = dist.get_world_size()
    parallelism = ParallelismConfig(data_parallel_shard_degree=world // pp, pipeline_parallel_degree=pp,
                                    pipeline_parallel_schedule="1F1B", pipeline_parallel_microbatch_size=1,
                                    spmd_backend=SPMD_BACKEND)
    training = TrainingConfig(local_batch_size=batch, seq_len=seq, steps=steps, mixed_precision_param="float32")

    @dataclass
    class _JobConfig:
        parallelism: ParallelismConfig

    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    cfg = model_config(fuse_qkv)
    cfg.update_from_config(config=_JobConfig(parallelism))
    loss_fn = CrossEntropyLoss.Config().build(compile_config=CompileConfig())
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.build()
    schedule, parts, first, last = pipeline_llm(
        model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
        compile_config=CompileConfig(), ac_config=None, dump_folder=str(dump), device=torch.device("cpu"),
        model_config=cfg, parallelize_fn=parallelize_llama, loss_fn=loss_fn)
    del model
    materialise(parts)
    return assemble(parts, parallel_dims, dump, exclude, steps=steps, batch=parallelism.pipeline_parallel_microbatch_size,
                    pp_schedule=schedule, pp_first=first, pp_last=last, model_parts=parts)


def train_pp(job: Job, steps: int, batch: int = BATCH) -> None:
    """torchtitan's ``train_step`` + ``pp_forward_backward_step``: ``batch`` micro-batches fetched on every
    rank, the schedule stepped with the first stage's inputs and the last stage's targets, the loss
    normalised by the global valid tokens, then optimizers.step and lr_schedulers.step."""
    it = iter(job.dataloader)
    for _ in range(steps):
        job.train_state.step += 1
        job.optimizers.zero_grad()
        mbs = [next(it) for _ in range(batch)]
        labels = [lab for _, lab in mbs]
        tokens = torch.tensor(sum(int(lab.numel()) for lab in labels), dtype=torch.int64)
        if job.dp_world > 1:
            dist.all_reduce(tokens, group=job.parallel_dims.get_mesh("batch").get_group())
        # torchtitan 0.3.0 passes the micro-batches as ``arg_mbs=``/``target_mbs=``, arguments of a newer
        # torch's ``step``; torch 2.13's ``step`` takes the whole batch and splits it into the same
        # micro-batches (one sample each, in order) before the same ``_step_microbatches``.
        inputs = torch.cat([d["input"] for d, _ in mbs])
        with job.train_context():
            job.pp_schedule.step(*((inputs,) if job.pp_first else ()), target=torch.cat(labels) if job.pp_last else None,
                                 losses=[] if job.pp_last else None, loss_kwargs={"global_valid_tokens": tokens},
                                 return_outputs=False)
        job.train_state.ntokens_seen += sum(int(lab.numel()) for lab in labels)
        job.optimizers.step()
        job.lr_schedulers.step()


def train(job: Job, steps: int) -> None:
    """torchtitan's train_step, reduced to its state-changing calls: fwd/bwd, optimizers.step, lr_schedulers.step."""
    if job.pp_schedule is not None:
        return train_pp(job, steps)
    it = iter(job.dataloader)
    for _ in range(steps):
        job.train_state.step += 1
        input_dict, labels = next(it)
        job.optimizers.zero_grad()
        inputs = input_dict["input"]
        if job.parallel_dims.spmd_backend == "spmd_types":
            from torchtitan.distributed.spmd_types import annotate_input_spmd_types

            inputs, labels, _ = annotate_input_spmd_types(job.parallel_dims, inputs, labels, {})
        with job.train_context():
            logits = job.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
            loss.backward()
        job.train_state.ntokens_seen += labels.numel()
        job.optimizers.step()
        job.lr_schedulers.step()


# ---------------------------------------------------------------------------- reference and comparison

def full(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def snapshot(job: Job, union: bool = False) -> dict[str, Any]:
    """Everything CheckpointManager saves, as full values (collective: every rank calls it).

    ``union``: the union over every rank (pipeline stages hold disjoint keys), on every rank."""
    snap = {
        "model": {k: full(v) for k, v in job.checkpointer.states["model"].state_dict().items()},
        "optimizer": {k: full(v) for k, v in job.optimizers.state_dict().items()},
        "lr_scheduler": job.lr_schedulers.state_dict(),
        "train_state": job.train_state.state_dict(),
    }
    if not union:
        return snap
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, snap)
    merged: dict[str, Any] = {"model": {}, "optimizer": {}}
    for part in every:
        merged["model"].update(part["model"])
        merged["optimizer"].update(part["optimizer"])
    merged["lr_scheduler"], merged["train_state"] = every[0]["lr_scheduler"], every[0]["train_state"]
    return merged


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                                                         b.view(-1).view(torch.uint8) if b.numel() else b)
    return a == b


def compare(ref: dict[str, Any], got: dict[str, Any]) -> list[str]:
    diffs = []
    for part in ("model", "optimizer", "lr_scheduler", "train_state"):
        r, g = ref[part], got[part]
        for k in sorted(set(r) | set(g)):
            if k not in g:
                diffs.append(f"{part}: {k} missing after load")
            elif k not in r:
                diffs.append(f"{part}: {k} not in reference")
            elif not same(r[k], g[k]):
                diffs.append(f"{part}: {k} differs")
    return diffs


def write(spec: dict[str, Any]) -> None:
    """Train ``steps`` steps and save with CheckpointManager; rank 0 keeps the full-value reference."""
    dump = Path(spec["dump"])
    rank = dist.get_rank()
    pp = spec.get("pp", 1)
    job = build(dump, spec.get("fuse_qkv", True), [], pp=pp)
    train(job, spec.get("steps", 2))
    job.checkpointer.save(curr_step=spec.get("steps", 2))
    snap = snapshot(job, union="pp" in spec)
    ref = dump / "reference"
    ref.mkdir(parents=True, exist_ok=True)
    torch.save(job.dataloader.state_dict(), ref / f"dataloader_rank_{rank}.pt")
    if "pp" in spec:
        torch.save(job.dataloader.state_dict(), ref / f"dataloader_dp_rank_{job.dp_rank}.pt")
    if rank == 0:
        torch.save(snap, ref / "state.pt")
    job.checkpointer.close()


def load_on_every_rank(job: Job, step: int) -> tuple[bool, str | None]:
    """``CheckpointManager.load(step)`` on every rank: (what it returned, the first rank's error or None).

    An error raised by torchtitan's load is the job's answer (its type and the message's last
    ``...Error:`` line), agreed on by every rank; the checkpointer is closed when there is one.
    """
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        loaded, error = job.checkpointer.load(step=step), None
    except (Exception, CheckpointException) as exc:  # the job's answer: what torchtitan says about this checkpoint
        text = str(exc)
        cause = [ln.strip() for ln in text.splitlines() if "Error:" in ln]
        loaded, error = False, f"{type(exc).__name__}: {cause[-1] if cause else text[:300]}"
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        job.checkpointer.close()
    return bool(loaded), first


def load(spec: dict[str, Any]) -> dict[str, Any]:
    """CheckpointManager.load(step) at this world size; every value compared bitwise with the reference.

    An error raised by torchtitan's load is the job's result (its type and message), not a crash,
    so one launch can report several jobs.
    """
    rank = dist.get_rank()
    exclude = spec.get("exclude", [])
    job = build(Path(spec["dump"]), spec.get("fuse_qkv", True), exclude, pp=spec.get("pp", 1))
    ref_dir = Path(spec["ref"])
    fresh_loader = job.dataloader.state_dict()
    loaded, error = load_on_every_rank(job, spec["step"])
    if error:
        return {"name": spec["name"], "loaded": False, "error": error, "differences": []}
    got = snapshot(job, union="pp" in spec)
    diffs = [] if loaded else ["CheckpointManager.load returned False"]
    compared: dict[str, int] = {}
    if rank == 0:
        ref = torch.load(ref_dir / "state.pt", weights_only=False)
        diffs += compare(ref, got)
        compared = {p: len(ref[p]) for p in ref}
    loader_state = job.dataloader.state_dict()
    if "dataloader" in exclude:
        loader_ok = loader_state == fresh_loader  # excluded: a fresh loader at the start of its split
    else:
        ref_loader = ref_dir / (f"dataloader_dp_rank_{job.dp_rank}.pt" if "pp" in spec else f"dataloader_rank_{rank}.pt")
        loader_ok = ref_loader.exists() and loader_state == torch.load(ref_loader, weights_only=False)
    if not loader_ok:
        diffs.append(f"dataloader state of rank {rank} is not the expected one")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, diffs)
    job.checkpointer.close()
    return {"name": spec["name"], "loaded": True, "error": None, "compared": compared,
            "differences": [d for part in gathered for d in part]}


def main(argv: list[str], write_fn: Any = None, load_fn: Any = None) -> int:
    """``write SPEC`` / ``load SPEC RESULT``: SPEC is a JSON list of jobs, run one after another in this launch.

    ``write_fn`` / ``load_fn``: another writer's jobs (tests/writers/torchtitan_moe_run.py), run the same way."""
    write_fn, load_fn = write_fn or write, load_fn or load
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["write", "load"])
    ap.add_argument("spec", type=Path)
    ap.add_argument("result", type=Path, nargs="?")
    a = ap.parse_args(argv)
    jobs = json.loads(a.spec.read_text())

    dist.init_process_group("gloo")
    cpu_mesh()
    results = []
    for spec in jobs:
        if a.mode == "write":
            write_fn(spec)
        else:
            results.append(load_fn(spec))
    if a.mode == "load" and dist.get_rank() == 0 and a.result is not None:
        a.result.write_text(json.dumps({"world_size": dist.get_world_size(), "jobs": results}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_and_exit(write_fn: Any = None, load_fn: Any = None) -> None:
    """The script's entry: `main`, then ``os._exit`` (a gloo thread can abort interpreter teardown:
    "terminate called without an active exception")."""
    code = main(sys.argv[1:], write_fn, load_fn)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()
