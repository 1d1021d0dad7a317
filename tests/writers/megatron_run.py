"""Write or load a Megatron-Core ``dist_checkpointing`` (torch_dist) checkpoint, on CPU gloo.

Run under ``python -m torch.distributed.run --nproc-per-node N``:

    megatron_run.py save CKPT REF --tp T     # Megatron's own save path; REF gets the reference
    megatron_run.py load CKPT REF --tp T     # Megatron's own load path at this world size, compared bitwise

The model is a tiny ``GPTModel`` built from ``get_gpt_layer_local_spec`` (no Transformer
Engine); the optimizer state is a plain ``torch.optim.Adam`` over the model's parameters,
put into Megatron's sharded form by ``megatron.core.optimizer.optimizer.Float16...``'s
helper ``optim_state_to_sharding_state`` (the same call Megatron's ``FP32Optimizer`` makes),
so its moments are keyed and sharded exactly like the parameters they belong to.

CPU substitutions (each changes nothing that is written to disk):

- gloo instead of nccl: the collectives that exchange save plans and metadata carry the same
  objects; the bytes each rank writes come from its own tensors.
- ``use_cpu_initialization=True`` and ``perform_initialization=True``: weights are made on the
  CPU (Megatron's documented path for machines without a GPU) instead of on a CUDA device.
- ``torch.cuda`` RNG tracker not seeded (``model_parallel_cuda_manual_seed`` needs CUDA): the
  model has no dropout in the forward pass we run (dropout 0), and no RNG state is saved.
- The optimizer is Megatron's ``FP32Optimizer`` path reproduced with its own helper on a plain
  ``torch.optim.Adam`` (``get_megatron_optimizer`` needs Megatron's DDP, whose grad buffers
  are allocated on ``torch.cuda.current_device()``): the keys, shapes and replica ids of the
  moments are those Megatron's ``sharded_state_dict`` gives them.

The reference (REF/rank_<r>.pt) holds, per rank, every ShardedTensor's key, global shape,
global offset and local data as it was at save time, plus the common state; the loader
assembles global tensors from all reference files and compares each tensor it loaded with
the box of the global tensor it stands for, bitwise.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HIDDEN = 32
LAYERS = 2
HEADS = 4
VOCAB = 64
SEQ = 16
STEPS = 2  # optimizer steps taken before the save; Megatron-LM saves the same number as `iteration`


def cpu_shims() -> None:
    """The two CUDA calls on Megatron's torch_dist save path, given their CPU meaning (see the docstring).

    ``FileSystemWriterAsync.preload_tensors`` (filesystem_async.py:230) calls
    ``torch.cuda.synchronize()`` after its device-to-host copies: on the CPU there is no copy
    and nothing to wait for, so it is a no-op. ``save_state_dict_async_finalize``
    (state_dict_saver.py:252) makes its one-int failure flag on ``torch.cuda.current_device()``
    for a broadcast: on gloo that flag lives on the CPU. Set in this process only; the installed
    packages are not changed.
    """
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"


def build(tp: int):
    """parallel_state for (tp, dp = world / tp) and a tiny GPTModel on the CPU."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    torch.manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=4 * HIDDEN,
        use_cpu_initialization=True, perform_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, params_dtype=torch.float32, bf16=False, fp16=False,
    )
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, share_embeddings_and_output_weights=False)
    return model


def optimizer_for(model: torch.nn.Module, steps: int) -> torch.optim.Adam:
    """A plain torch Adam with ``steps`` real steps taken on a loss of the model's parameters."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for s in range(steps):
        opt.zero_grad()
        loss = sum(((p.float() * (s + 1)) ** 2).sum() for p in model.parameters())
        loss.backward()
        opt.step()
    return opt


def sharded_state(model: torch.nn.Module, opt: torch.optim.Adam) -> dict:
    """Megatron's sharded state dict: the model's, plus the optimizer's in Megatron's FP32Optimizer form."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                           make_sharded_optimizer_tensor,
                                                           optim_state_to_sharding_state)

    model_sd = model.sharded_state_dict()
    id_to_sharded = get_param_id_to_sharded_param_map(model_sd, [p for g in opt.param_groups for p in g["params"]])
    osd = opt.state_dict()
    steps = {float(st["step"]) for st in osd["state"].values() if "step" in st}  # FP32Optimizer._extract_common_per_param_step
    assert len(steps) <= 1, steps
    optim_state_to_sharding_state(osd, id_to_sharded, exclude_keys="step")
    if steps:
        osd["state"]["common_step"] = next(iter(osd["state"].values()))["step"] if False else torch.tensor(steps.pop())
    del make_sharded_optimizer_tensor
    return {"model": model_sd, "optimizer": osd, "iteration": STEPS, "checkpoint_version": 3.0}


def model_tensors_only(sd: dict) -> dict:
    """``--model-only``: the model's ShardedTensors alone (no optimizer, no ``_extra_state`` ShardedObjects), as a
    weights-only save of Megatron's state leaves it: the Megatron key names with nothing else to recognise them by."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {"model": {k: v for k, v in sd["model"].items() if isinstance(v, ShardedTensor)},
            "iteration": sd["iteration"], "checkpoint_version": sd["checkpoint_version"]}


def flat_sharded(sd: dict, prefix: str = "") -> dict:
    """Every ShardedTensor in a (nested) sharded state dict, by its path."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    items = sd.items() if isinstance(sd, dict) else enumerate(sd) if isinstance(sd, list) else ()
    for k, v in items:
        path = f"{prefix}{k}"
        if isinstance(v, ShardedTensor):
            out[path] = v
        elif isinstance(v, (dict, list)):
            out.update(flat_sharded(v, path + "/"))
    return out


def save(ckpt: Path, ref: Path, tp: int, model_only: bool = False) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    model = build(tp)
    opt = optimizer_for(model, steps=STEPS)
    sd = sharded_state(model, opt)
    if model_only:
        sd = model_tensors_only(sd)
    rank = dist.get_rank()
    ref.mkdir(parents=True, exist_ok=True)
    pieces = {path: dict(key=t.key, global_shape=tuple(t.global_shape), box=t.global_slice(),
                         replica_id=t.replica_id, data=t.data.detach().clone())
              for path, t in flat_sharded(sd).items()}
    torch.save({"pieces": pieces, "world": dist.get_world_size(), "tp": tp}, ref / f"rank_{rank}.pt")
    ckpt.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, str(ckpt), sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1))
    dist.barrier()


def global_reference(ref: Path) -> dict[str, torch.Tensor]:
    """Global tensors by Megatron key, assembled from every writer rank's pieces."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ref.glob("rank_*.pt")):
        for p in torch.load(f, weights_only=False)["pieces"].values():
            g = out.setdefault(p["key"], torch.full(p["global_shape"], float("nan"), dtype=p["data"].dtype))
            g[p["box"]] = p["data"]
    return out


def load(ckpt: Path, ref: Path, tp: int, model_only: bool = False) -> None:
    from megatron.core import dist_checkpointing

    model = build(tp)
    for p in model.parameters():  # nothing of the freshly built model may survive into the comparison
        p.data.fill_(float("nan"))
    opt = optimizer_for(model, steps=1)  # moments exist (shape only); their values are overwritten by the load
    sd = sharded_state(model, opt)
    if model_only:
        sd = model_tensors_only(sd)
    expect = flat_sharded(sd)
    loaded = dist_checkpointing.load(sd, str(ckpt))
    got = flat_sharded_plain(loaded, expect)
    reference = global_reference(ref)
    bad = []
    for path, t in expect.items():
        want = reference[t.key][t.global_slice()]
        have = got[path]
        if have.dtype != want.dtype or have.shape != want.shape or not torch.equal(
                have.view(torch.uint8) if have.is_floating_point() else have, want.view(torch.uint8) if want.is_floating_point() else want):
            bad.append(path)
    if loaded.get("iteration") != STEPS:  # common.pt, read by Megatron's common strategy
        bad.append(f"iteration={loaded.get('iteration')!r}")
    common_step = loaded.get("optimizer", {}).get("state", {}).get("common_step")
    if not model_only and not (isinstance(common_step, torch.Tensor) and common_step.item() == float(STEPS)):
        bad.append(f"optimizer.state.common_step={common_step!r}")
    if bad:
        print(f"rank {dist.get_rank()}: DIFFERENT {bad}", flush=True)
        sys.exit(1)
    print(f"rank {dist.get_rank()}: loaded {len(expect)} tensors bitwise equal", flush=True)


def flat_sharded_plain(loaded: dict, like: dict) -> dict[str, torch.Tensor]:
    """The loaded plain tensors at the same paths as the ShardedTensors of ``like``."""
    out = {}
    for path in like:
        node = loaded
        for part in path.split("/"):
            node = node[int(part)] if isinstance(node, list) else node[part] if part in node else node[int(part)]
        out[path] = node
    return out


def run_rank(rank: int, world: int, port: int, mode: str, ckpt: Path, ref: Path, tp: int,
             model_only: bool = False) -> None:
    """One rank: the process group over gloo, the CPU shims, then Megatron's save or load."""
    if world:  # started by --nproc (forked): torchrun's environment, set by hand
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    cpu_shims()
    try:
        (save if mode == "save" else load)(ckpt, ref, tp, model_only)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Under torchrun: this process is one rank. With ``--nproc N``: import Megatron once, fork N ranks.

    Importing megatron.core takes 15-30 s of CPU (it imports torch._inductor, wandb, ...); forking
    the ranks after one import (torch.multiprocessing, "fork") instead of starting N interpreters
    saves that N-1 times on a 2-core machine. Nothing about the ranks differs: each is a process
    with its own gloo process group, exactly as torchrun would start it.
    """
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "load"])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("ref", type=Path)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--nproc", type=int, default=0, help="fork this many ranks (default: run under torchrun)")
    ap.add_argument("--model-only", action="store_true", help="save/load the model's ShardedTensors only")
    a = ap.parse_args(argv)
    if not a.nproc:
        run_rank(0, 0, 0, a.mode, a.ckpt, a.ref, a.tp, a.model_only)
        return
    import socket

    import megatron.core.dist_checkpointing  # noqa: F401  (imported once, before the fork)
    import megatron.core.models.gpt  # noqa: F401
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=run_rank, args=(r, a.nproc, port, a.mode, a.ckpt, a.ref, a.tp, a.model_only)) for r in range(a.nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        print(f"rank exit codes {codes}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
