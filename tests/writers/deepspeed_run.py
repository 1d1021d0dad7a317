"""Write a DeepSpeed ZeRO checkpoint with DeepSpeed's own engine, or load reshard's import of one into torch's
FSDP2 / TP model.

Run under ``python -m torch.distributed.run --nproc-per-node N`` with ``DS_ACCELERATOR=cpu``:

    deepspeed_run.py save DIR 2:mlp 3:llama   # N=2: per STAGE:MODEL, deepspeed.initialize, 2 steps,
                                          # engine.save_checkpoint(DIR/zero<STAGE>/ckpt); rank 0 then runs
                                          # DeepSpeed's converters: zero_to_fp32's
                                          # get_fp32_state_dict_from_zero_checkpoint -> fp32.pt, and
                                          # `python -m deepspeed.checkpoint.ds_to_universal` -> universal/
    deepspeed_run.py load RES JOBS        # N ranks, JOBS a JSON list of {dcp, src, model, tp}: per job the
                                          # model with torchtitan-style TP (parallelize_module) over tp ranks
                                          # and FSDP2 (fully_shard) over N / tp, torch AdamW; dcp.load +
                                          # set_state_dict(strict), compared with src's DeepSpeed outputs
                                          # bitwise; RES (JSON) gets what each job compared

Models (``MODEL``): ``mlp``, a tiny MLP with a LayerNorm (5 parameters, one without bias) and one
persistent buffer, which no shipped partition rules describe; ``llama``, a two-layer Llama-style
decoder with torchtitan's module names (21 parameters), whose TP plan is torchtitan's. The
optimizer is DeepSpeed's config ``"optimizer": {"type": "AdamW", "params": {..., "torch_adam": true}}``
with ``"zero_force_ds_cpu_optimizer": false``: DeepSpeed's engine wraps ``torch.optim.AdamW`` in its ZeRO
optimizer (its own choice for ``torch_adam``; the config still names AdamW), so that no optimizer op is
compiled (DeepSpeed's FusedAdam CPU kernel, csrc/cpu/adam/fused_adam.cpp, takes minutes with ninja on a
fresh machine). The checkpoint is DeepSpeed's own format all the same: flat fp32 partitions, the inner
optimizer's moments and step per partition, param groups.
ZeRO-2 saves ``mp_rank_00_model_states.pt`` and one ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``
per rank; ZeRO-3 one model-states and one optim-states file per rank.

The client state passed to ``save_checkpoint`` holds ``universal_checkpoint_info`` (an empty
dict, version 0.2): ``ds_to_universal`` requires the client to create it (Megatron-DeepSpeed
does; the engine does not for ZeRO-1/2), and it changes no tensor that is written.

CPU substitutions: ``DS_ACCELERATOR=cpu`` and the gloo process group torchrun gives (DeepSpeed's
CPU accelerator), with its shared-memory collectives op marked not compatible (`SHM_COMM`), so that its
comm backend uses torch.distributed's gloo collectives rather than compile the op. Nothing is compiled
(checked with an empty ``TORCH_EXTENSIONS_DIR``). Nothing else.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 2
SHM_COMM = "deepspeed_shm_comm"
"""DeepSpeed's CPU shared-memory collectives op (`ShareMemCommBuilder.NAME`), marked not compatible before the
engine starts: its comm backend then takes the fallback it takes on any platform the op does not support
(torch.distributed, here gloo) instead of compiling the op with ninja (minutes on a fresh machine)."""
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01


class Tiny(torch.nn.Module):
    """An MLP no shipped model family describes (so an import to tp > 1 has no TP plan for it), with a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 6)
        self.ln = torch.nn.LayerNorm(6)
        self.b = torch.nn.Linear(6, 3, bias=False)
        self.register_buffer("scale", torch.arange(3, dtype=torch.float32) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.ln(self.a(x))) * self.scale

    def example(self, g: torch.Generator) -> torch.Tensor:
        return torch.randn(2, 8, generator=g)

    def tp_plan(self) -> dict:
        """Megatron-style: ``a`` column-wise, ``b`` row-wise (what the test's user rules file says)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"a": ColwiseParallel(), "b": RowwiseParallel()}


DIM, HEADS, FFN, VOCAB, SEQ = 16, 4, 32, 24, 6


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, DIM))


class FeedForward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(DIM, FFN, bias=False), torch.nn.Linear(DIM, FFN, bias=False)
        self.w2 = torch.nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(DIM), torch.nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(torch.nn.Module):
    """A two-layer Llama-style decoder (no rotary) with torchtitan's module names, so that the shipped
    ``llama-torchtitan`` partition rules, and torchtitan's TP plan (`TP_PLAN`), describe it."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([Block() for _ in range(2)])
        self.norm = torch.nn.RMSNorm(DIM)
        self.output = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def example(self, g: torch.Generator) -> torch.Tensor:
        return torch.randint(0, VOCAB, (2, SEQ), generator=g)

    def tp_plan(self) -> dict:
        """torchtitan's Llama TP plan (torchtitan/models/llama3/infra/parallelize.py, apply_tp) in torch's styles:
        embeddings row-wise, q/k/v and w1/w3 column-wise, wo and w2 row-wise, output column-wise."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Replicate())}
        for i in range(len(self.layers)):
            for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
                plan[f"layers.{i}.{name}"] = ColwiseParallel()
            for name in ("attention.wo", "feed_forward.w2"):
                plan[f"layers.{i}.{name}"] = RowwiseParallel()
        return plan


MODELS = {"mlp": Tiny, "llama": Llama}


def save(out: Path, stage: int, model_name: str) -> subprocess.Popen | None:
    """One DeepSpeed run saved to OUT/ckpt; rank 0 returns the ds_to_universal process it started (still running)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__[SHM_COMM] = False  # gloo's all-reduce, not the shm op compiled on first use
    torch.manual_seed(0)
    model = MODELS[model_name]()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                                                     "torch_adam": True}},
           "zero_force_ds_cpu_optimizer": False}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = model.example(g)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    ckpt = out / "ckpt"
    engine.save_checkpoint(str(ckpt), client_state={"universal_checkpoint_info": {"universal_checkpoint_version": 0.2}})
    dist.barrier()
    universal = converters(out, ckpt) if rank == 0 else None
    dist.barrier()
    return universal


def converters(out: Path, ckpt: Path) -> subprocess.Popen:
    """DeepSpeed's own consolidation and its universal-checkpoint converter, on the checkpoint just saved."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    torch.save({k: v.detach().clone() for k, v in sd.items()}, out / "fp32.pt")
    tag = (ckpt / "latest").read_text().strip()
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt / tag),
           "--output_folder", str(out / "universal"), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_",
                                                                       "TORCHELASTIC", "GROUP_", "ROLE_"))}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=(out / "universal.log").open("w"), env=env)


def finish(out: Path, proc: subprocess.Popen) -> None:
    """Wait for one ds_to_universal and record how it ended (the test asserts it succeeded)."""
    code = proc.wait(timeout=600)
    tail = (out / "universal.log").read_text()[-3000:]
    (out / "universal.json").write_text(json.dumps({"returncode": code, "tail": tail}))


def load(dcp_dir: Path, out: Path, model_name: str, tp: int) -> dict[str, int]:
    """The model at this world size (FSDP2 over dp = world / tp, and torchtitan's TP plan over tp), torch AdamW
    made with other hyper-parameters; the import loaded strictly through get_state_dict/set_state_dict and
    compared with DeepSpeed's own outputs; every parameter's and moment's stored chunks must be the
    model's own shards (the import wrote this very layout, nothing was resharded on load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(1)
    model = MODELS[model_name]()
    dp = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], model.tp_plan())
    if dp > 1 or tp == 1:
        for m in [m for m in model.children() if not isinstance(m, torch.nn.ModuleList)] + list(getattr(model, "layers", [])):
            if any(True for _ in m.parameters()):
                fully_shard(m, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.5, 0.5), eps=0.5, weight_decay=0.5)
    msd, osd = get_state_dict(model, opt)  # initialises the AdamW state (step, exp_avg, exp_avg_sq)
    want = {"model": msd, "optim": osd}
    meta = dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    asked = set(_flat(want))
    assert set(meta) == asked, ("keys differ", sorted(set(meta) ^ asked))
    layout = _own_chunks(want, meta)
    dcp.load(want, checkpoint_id=str(dcp_dir))  # strict: a key asked for and not stored raises
    set_state_dict(model, opt, model_state_dict=want["model"], optim_state_dict=want["optim"],
                   options=StateDictOptions(strict=True))
    group = opt.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == (LR, BETAS, EPS, WD), group
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    ref = torch.load(out / "fp32.pt", weights_only=True)
    params = {k for k, _ in model.named_parameters()}
    assert set(full) == set(ref), sorted(set(full) ^ set(ref))  # zero_to_fp32 gives parameters and buffers
    checked = {"params": 0, "moments": 0, "buffers": 0, "own_chunks": layout}
    for k, v in full.items():
        _bitwise(v, ref[k], k)
        checked["params" if k in params else "buffers"] += 1
    universal = out / "universal" / "zero"
    by_param = dict(model.named_parameters())
    for name, p in by_param.items():
        st = opt.state[p]
        assert float(st["step"]) == float(STEPS), (name, st["step"])
        for moment in ("exp_avg", "exp_avg_sq"):
            got = st[moment].full_tensor() if hasattr(st[moment], "full_tensor") else st[moment]
            u = torch.load(universal / name / f"{moment}.pt", weights_only=True)
            u = u["param"] if isinstance(u, dict) else u
            _bitwise(got, u.reshape(got.shape), f"{name}.{moment}")
            checked["moments"] += 1
    return checked


def _own_chunks(want: dict, meta: dict) -> int:
    """How many tensor keys are stored exactly as this model's state dict would save them: DCP's own save
    planner says which (offsets, sizes) every rank would write (a DTensor its shard, a plain tensor such as
    a buffer the whole); the stored chunks of each key must be exactly those."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    planner = DefaultSavePlanner()
    planner.set_up_planner({k: v for k, v in _flat(want).items() if isinstance(v, torch.Tensor)}, None,
                           dist.get_rank() == 0)
    mine = [(i.index.fqn, tuple(i.tensor_data.chunk.offsets), tuple(i.tensor_data.chunk.sizes))
            for i in planner.create_local_plan().items if i.tensor_data is not None]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    planned: dict[str, set] = {}
    for rank in every:
        for fqn, off, size in rank:
            planned.setdefault(fqn, set()).add((off, size))
    for fqn, chunks in planned.items():
        md = meta[fqn]
        assert isinstance(md, TensorStorageMetadata), fqn
        stored = {(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks}
        assert stored == chunks, (fqn, sorted(stored), sorted(chunks))
    return len(planned)


def _bitwise(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where


def _flat(d: dict, prefix: str = "") -> dict:
    """DCP's flattened keys: nested dicts, and lists of dicts (``param_groups``) by index."""
    out = {}
    for k, v in d.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            v = dict(enumerate(v))
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def main() -> None:
    """``save OUT STAGE:MODEL...`` (OUT/zero<STAGE> each) or ``load RES JOBS_JSON``: several runs in one launch,
    so that the test pays torch's, DeepSpeed's and the process group's start-up once."""
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    try:
        if mode == "save":
            running = []
            for spec in sys.argv[3:]:
                stage, model_name = spec.split(":")
                out = Path(sys.argv[2]) / f"zero{stage}"
                out.mkdir(exist_ok=True)
                running.append((out, save(out, int(stage), model_name)))  # universal conversions overlap the next run
            for out, proc in running:
                if proc is not None:
                    finish(out, proc)
        else:
            jobs = json.loads(sys.argv[3])
            results = [load(Path(j["dcp"]), Path(j["src"]), j["model"], int(j["tp"])) for j in jobs]
            if dist.get_rank() == 0:
                Path(sys.argv[2]).write_text(json.dumps(results))
        dist.barrier()  # every rank done before the group is torn down (gloo aborts a rank torn down mid-exchange)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
