"""Real torch writers (and loaders) for tests/test_open_world3.py (issue 31: what inspect and plan judge).

Run as a plain script: ``python tests/writers/open_world3.py write|load JOBS.json``. ``JOBS.json`` is
a list of jobs ``{"variant", "dir", "world", "port", "result"}``; the script forks ``max(world)``
ranks once and for each job ranks ``0..world-1`` form a fresh gloo group of that size while the
others sit it out (the pattern of tests/writers/torch_variants.py).

* ``write``: build the variant's model under FSDP2 ``fully_shard``, train it a few steps on
  rank-dependent data where it has an optimizer, and save with the real
  ``torch.distributed.checkpoint.save`` exactly as that recipe's user does. Rank 0 also
  ``torch.save``s the full state just saved, gathered by torch's own ``get_state_dict`` /
  ``get_model_state_dict(full_state_dict=True)``, to ``job["result"]``.
* ``load``: build the same model (and optimizers) at ``world`` ranks, load ``dir`` the recipe's
  way (``dcp.load`` + ``set_state_dict``; for the bare state dict ``dcp.load`` of
  ``model.state_dict()`` + ``model.load_state_dict(strict=True)``), then gather the full state
  the live objects hold and save it from rank 0. The test compares the two bitwise.

Variants (``VARIANTS``):

* ``muon``: the standard Muon recipe, ``torch.optim.Muon`` for the 2-D weights and ``AdamW`` for
  the rest (biases, LayerNorm), both handed to ``get_state_dict(model, [muon, adamw])``: Muon
  keeps a ``momentum_buffer`` per matrix, AdamW ``exp_avg``/``exp_avg_sq``/``step`` per vector.
* ``counters``: ``get_state_dict`` model + Adam after 2 optimizer steps, saved beside the user's
  own ``{"step": 7, "epoch": 1}`` (the trainer counts micro-steps: 7 of them, accumulation 4).
* ``bare``: ``dcp.save(model.state_dict())`` of an FSDP2 model, no optimizer, nothing else.
* ``bare_small``: the same for a model whose every tensor has fewer rows than the 4 ranks
  (FSDP2 leaves the last ranks' shards empty, so no tensor shows 4 pieces).
* ``hf`` (one rank, no collective): transformers' own ``save_pretrained`` of a tiny
  ``LlamaForCausalLM``: ``config.json`` beside ``model.safetensors``, a Hugging Face model folder.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

VARIANTS = ("muon", "counters", "bare", "bare_small", "hf")
STEPS = 2
USER_COUNTERS = {"step": 7, "epoch": 1}
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def make_model(variant: str) -> nn.Module:
    """Linear -> LayerNorm -> Linear (2 matrices, 4 vectors); for ``bare_small`` every tensor has at most 3 rows."""
    torch.manual_seed(0)  # the same initial weights on every rank, as a trainer seeds them
    if variant == "bare_small":
        return nn.Sequential(nn.Linear(6, 3), nn.ReLU(), nn.Linear(3, 2))
    return nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 10))


def build(variant: str, world: int) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    """The variant's model under FSDP2 at ``world`` ranks and its optimizers (none for the bare state dicts)."""
    model = make_model(variant)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if variant == "muon":
        matrices = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        return model, [torch.optim.Muon(matrices, lr=1e-2), torch.optim.AdamW(rest, lr=1e-2)]
    if variant == "counters":
        return model, [torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.95))]
    return model, []


def train(model: nn.Module, optims: list[torch.optim.Optimizer], rank: int) -> None:
    """A few real optimizer steps on rank-dependent data (moments differ from their initial zeros)."""
    for s in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + s)
        model(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
        for o in optims:
            o.step()
            o.zero_grad()


def full_state(model: nn.Module, optims: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """The full, unsharded state the live objects hold (collective; complete on rank 0)."""
    if not optims:
        return {"model": get_model_state_dict(model, options=FULL)}
    msd, osd = get_state_dict(model, optims, options=FULL)
    return {"model": msd, "optim": osd}


def write_hf(job: dict[str, Any]) -> dict[str, Any]:
    """A tiny Llama saved by transformers itself (imported here, in a writer process, never in the tests')."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(job["dir"])
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def write_job(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    variant, world = job["variant"], job["world"]
    if variant == "hf":
        return write_hf(job)
    model, optims = build(variant, world)
    if optims:
        train(model, optims, rank)
        msd, osd = get_state_dict(model, optims)
        sd: dict[str, Any] = {"model": msd, "optim": osd}
        if variant == "counters":
            sd.update(USER_COUNTERS)
        dcp.save(sd, checkpoint_id=job["dir"])
    else:
        dcp.save(model.state_dict(), checkpoint_id=job["dir"])
    return full_state(model, optims)


def load_job(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    variant, world = job["variant"], job["world"]
    model, optims = build(variant, world)
    if not optims:
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=job["dir"])
        model.load_state_dict(sd, strict=True)
        return full_state(model, optims)
    msd, osd = get_state_dict(model, optims)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=job["dir"])
    set_state_dict(model, optims, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return full_state(model, optims)


if __name__ == "__main__":
    import jobs  # tests/writers is sys.path[0] when run as a script

    sys.exit(jobs.main(write_job, load_job))
