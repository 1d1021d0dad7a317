"""A small GPT-style decoder and a synthetic deterministic token dataset.

Read in one sitting (nanoGPT-like). Parameter names are part of the interface the
partition rules in ``formats/`` rely on:

    tok_emb.weight (tied: lm_head.weight), pos_emb.weight,
    blocks.<i>.ln1.{weight,bias}, blocks.<i>.attn.{wq,wk,wv,wo}.{weight,bias},
    blocks.<i>.ln2.{weight,bias}, blocks.<i>.mlp.{fc1,fc2}.{weight,bias},
    ln_f.{weight,bias}

Under pipeline parallelism (``GPTStage``) each stage keeps the GLOBAL names of the
parameters it holds (``blocks`` becomes a ModuleDict keyed by the global block index), so
a pp>1 checkpoint has the same model keys as a pp=1 one. With pp>1 the last stage's
``lm_head.weight`` is its own parameter (a copy of ``tok_emb.weight``), kept equal to
stage 0's by summing the two gradients (see ``reshard.reference.pipeline``).

Attention infers the number of *local* heads from the projection's output width, so the
same code runs unsharded and with q/k/v column-sharded by tensor parallelism.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FAMILY = "reshard-reference-gpt"
TIED = [["tok_emb.weight", "lm_head.weight"]]


@dataclass
class GPTConfig:
    """Model hyper-parameters (tiny by default so CPU runs take seconds)."""

    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    max_seq_len: int = 16
    mlp_ratio: int = 4
    dropout: float = 0.1

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: local heads (all heads unsharded, n_heads / tp under tensor parallelism)
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.wo(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one tensor, two names
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def stage_layers(n_layers: int, pp: int) -> list[list[int]]:
    """``[[first, last_exclusive], ...]``: the blocks each of ``pp`` stages holds (even split)."""
    if pp < 1 or n_layers % pp:
        raise ValueError(f"pp={pp} must divide n_layers={n_layers}")
    per = n_layers // pp
    return [[s * per, (s + 1) * per] for s in range(pp)]


class GPTStage(nn.Module):
    """Stage ``stage`` of a ``pp``-way pipeline split of a (freshly initialised) :class:`GPT`.

    Holds blocks ``stage_layers(n_layers, pp)[stage]``; the first stage also holds
    ``tok_emb``/``pos_emb`` (and the embedding dropout), the last ``ln_f`` and ``lm_head``.
    With ``pp == 1`` the head stays tied to ``tok_emb``; otherwise the last stage's
    ``lm_head.weight`` is a separate parameter initialised as a copy of ``tok_emb.weight``.
    ``forward(x, targets)``: ``x`` is token ids on the first stage, the previous stage's
    activations [b, t, dim] elsewhere; returns activations, or (last stage) logits / the loss.
    """

    def __init__(self, full: GPT, stage: int, pp: int):
        super().__init__()
        cfg = full.cfg
        if not 0 <= stage < pp:
            raise ValueError(f"stage {stage} outside 0..{pp - 1}")
        self.cfg, self.stage, self.pp = cfg, stage, pp
        self.is_first, self.is_last = stage == 0, stage == pp - 1
        lo, hi = stage_layers(cfg.n_layers, pp)[stage]
        if self.is_first:
            self.tok_emb, self.pos_emb, self.drop = full.tok_emb, full.pos_emb, full.drop
        self.blocks = nn.ModuleDict({str(i): full.blocks[i] for i in range(lo, hi)})
        if self.is_last:
            self.ln_f = full.ln_f
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            if self.is_first:
                self.lm_head.weight = self.tok_emb.weight  # pp == 1: tied, one tensor
            else:
                self.lm_head.weight = nn.Parameter(full.tok_emb.weight.detach().clone())

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        if self.is_first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = block(x)
        if not self.is_last:
            return x
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class SyntheticTokens:
    """Deterministic synthetic dataset: sample ``i`` depends on (seed, i) only.

    Each sample is an arithmetic progression modulo the vocabulary with a random start
    and stride (so a model can learn it and the loss goes down) plus a little noise.
    Returns ``seq_len + 1`` tokens; inputs are ``[:-1]``, targets ``[1:]``.
    """

    def __init__(self, length: int, seq_len: int, vocab_size: int, seed: int = 0, noise: float = 0.05):
        self.length, self.seq_len, self.vocab_size, self.seed, self.noise = length, seq_len, vocab_size, seed, noise

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.length:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = int(torch.randint(self.vocab_size, (1,), generator=g))
        stride = int(torch.randint(1, 4, (1,), generator=g))
        seq = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        flip = torch.rand(self.seq_len + 1, generator=g) < self.noise
        seq[flip] = torch.randint(self.vocab_size, (int(flip.sum()),), generator=g)
        return seq

    def batch(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack samples ``ids`` into (inputs, targets) of shape [len(ids), seq_len]."""
        seqs = torch.stack([self[i] for i in ids])
        return seqs[:, :-1], seqs[:, 1:]
