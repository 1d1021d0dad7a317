"""Pipeline parallelism for the reference trainer: rank layout, schedule, tied-embedding sync.

Rank layout (an interface: reshard's layout code assumes mesh order (pp, dp_replicate,
dp_shard, cp, tp), row-major)::

    rank = (stage * dp + dp_rank) * tp + tp_rank

so the same (dp_rank, tp_rank) position on the next stage is ``rank + dp * tp``.

Schedule: the simplest correct one (GPipe-like with a single micro-batch in flight). For
every micro-step, stage 0 embeds and runs its blocks, each stage sends its activations to
the next with ``dist.send``/``dist.recv`` (gloo point-to-point, explicit global ranks), the
last stage computes the loss and runs backward, and each stage sends the gradient of its
input activations back. Each stage module is FSDP2-sharded over its own dp_shard group
(and TP-sharded within the stage), so FSDP's collectives never cross stages.

Tied embedding (Megatron's "embedding group"): with pp > 1 the last stage holds its own
``lm_head.weight``, initialised as a copy of stage 0's ``tok_emb.weight``. After the
backward passes of a step, the two gradients are summed over a 2-rank group {stage-0 rank,
last-stage rank} per (dp, tp) position, so both copies (and their AdamW states) stay
bitwise equal. Grad-norm clipping counts the pair once (``lm_head.weight`` is left out of
the norm, but scaled with everything else).

Optimizer param groups in the checkpoint (pp > 1): ``get_optimizer_state_dict`` nests the
param groups as ``param_groups.<i>.{lr,...,params}`` where ``params`` is the list of the
stage's FQNs. Every stage writes the key ``optim.param_groups.0.params`` with a different
value and DCP keeps ONE copy of a key saved by several ranks (the planner dedups by key),
so all stages but one would lose theirs and, on resume, load another stage's FQN list.
With pp > 1 the trainer therefore saves the optimizer with
``StateDictOptions(flatten_optimizer_state_dict=True)``: ``optim.state.<fqn>.<name>``
(unchanged) and ``optim.param_groups.<fqn>.<hyper>`` per parameter, so every key belongs
to exactly one stage and loads back on resume (also onto another pp degree > 1). pp == 1
keeps the nested ``optim.param_groups.0.*`` layout.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Coords:
    """Position of a global rank in the (pp, dp_shard, tp) row-major grid."""

    stage: int
    dp_rank: int
    tp_rank: int


def coords(rank: int, dp: int, tp: int) -> Coords:
    return Coords(stage=rank // (dp * tp), dp_rank=(rank // tp) % dp, tp_rank=rank % tp)


def global_rank(stage: int, dp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    return (stage * dp + dp_rank) * tp + tp_rank


def embedding_group(pp: int, dp: int, tp: int, rank: int):
    """Create (collectively, on every rank) the {first stage, last stage} group of each
    (dp, tp) position; return this rank's group, or None if it is on neither end or pp == 1."""
    if pp == 1:
        return None
    mine = None
    for d in range(dp):
        for t in range(tp):
            ranks = [global_rank(0, d, t, dp, tp), global_rank(pp - 1, d, t, dp, tp)]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine = g
    return mine


def _local(t: torch.Tensor) -> torch.Tensor:
    # the DTensor's own local storage (FSDP2 gradients are DTensors sharded over dp_shard)
    return t._local_tensor if isinstance(t, DTensor) else t


def sync_tied_grads(stage_module, group) -> None:
    """Sum tok_emb.weight.grad (stage 0) and lm_head.weight.grad (last stage) in place."""
    if group is None:
        return
    p = stage_module.tok_emb.weight if stage_module.is_first else stage_module.lm_head.weight
    if p.grad is None:
        raise RuntimeError("tied embedding has no gradient after backward")
    local = _local(p.grad)
    buf = local.detach().clone()
    dist.all_reduce(buf, group=group)
    with torch.no_grad():
        local.copy_(buf)


def micro_step(stage_module, *, rank: int, pp: int, dp: int, tp: int, x: torch.Tensor, y: torch.Tensor,
               divisor: int, act_shape: tuple[int, ...]) -> torch.Tensor | None:
    """Forward + backward of one micro-batch through the pipeline, on this rank's stage.

    ``x``/``y``: this dp rank's tokens and targets (every rank builds them; only the first
    stage uses x, the last y). Returns the loss / ``divisor`` (grad accumulation), detached,
    on the last stage, else None.
    """
    step = dp * tp
    first, last = stage_module.is_first, stage_module.is_last
    if first:
        inp = x
    else:
        inp = torch.empty(act_shape, dtype=torch.float32)
        dist.recv(inp, src=rank - step)
        inp.requires_grad_(True)
    if last:
        loss = stage_module(inp, y) / divisor
        loss.backward()
        out_loss = loss.detach()
    else:
        out = stage_module(inp)
        dist.send(out.detach().contiguous(), dst=rank + step)
        grad = torch.empty_like(out)
        dist.recv(grad, src=rank + step)
        torch.autograd.backward(out, grad)
        out_loss = None
    if not first:
        if inp.grad is None:
            raise RuntimeError("no gradient for the stage input")
        dist.send(inp.grad.contiguous(), dst=rank - step)
    return out_loss


__all__ = ["Coords", "coords", "global_rank", "embedding_group", "sync_tied_grads", "micro_step"]
