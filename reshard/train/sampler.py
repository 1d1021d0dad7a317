"""An elastic, global-cursor sampler.

Why: ``DistributedSampler`` makes each rank take every W-th index, so its natural resume
state is a *local* count that means something different on another world size (replaying
it skips or repeats samples). Here the state is one *global* cursor, identical on every
rank, and each rank derives its share from it. The set of samples an optimizer step
consumes is therefore a function of (seed, epoch, cursor, global_batch) only -- never of
the world size -- so a job may resume on a different number of data-parallel ranks.

The order
---------
Epoch ``e`` is ``torch.randperm(dataset_len, generator=seeded(seed + e))``. Epochs are
concatenated into one endless stream; stream position ``p`` (counted from the start of
the current epoch) is the sample ``perm(epoch + p // N)[p % N]``. A step whose window runs
past the end of an epoch continues into the next one (nothing is dropped or padded).

The split of one optimizer step
-------------------------------
A step takes the window ``[cursor, cursor + global_batch)`` of the stream. With ``A``
accumulation micro-steps and ``W`` data-parallel ranks, micro-step ``m`` covers the
contiguous sub-window ``[m * G/A, (m+1) * G/A)`` of the step's window and rank ``r`` takes
the contiguous slice ``[r * G/(A*W), (r+1) * G/(A*W))`` of that (``G`` = global_batch, so
the micro-batch is ``G/(A*W)``). Whatever ``W`` and ``A``, the union over ranks and
micro-steps is exactly the window.
"""
from __future__ import annotations

from typing import Any

import torch

ORDER_DESCRIPTION = (
    "epoch e is torch.randperm(dataset_len, generator=torch.Generator().manual_seed(seed + e)); "
    "epochs are concatenated; a step takes [cursor, cursor + global_batch) of the stream; "
    "micro-step m of A takes the m-th contiguous 1/A of it and dp rank r of W the r-th contiguous 1/W of that"
)


class ElasticSampler:
    """Global-cursor sampler whose per-step sample set is independent of the world size.

    State (``state_dict()``): ``seed``, ``epoch``, ``cursor`` (global samples consumed in
    this epoch), ``dataset_len``. Identical on every rank, so saving it under one shared
    key is safe (DCP keeps one copy of shared keys).
    """

    name = "reshard.train.ElasticSampler"
    order = ORDER_DESCRIPTION

    def __init__(self, dataset_len: int, seed: int = 0, epoch: int = 0, cursor: int = 0):
        if dataset_len <= 0:
            raise ValueError(f"dataset_len must be positive, got {dataset_len}")
        if not 0 <= cursor < dataset_len:
            raise ValueError(f"cursor must be in [0, {dataset_len}), got {cursor}")
        self.dataset_len = int(dataset_len)
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.cursor = int(cursor)
        self._perms: dict[int, torch.Tensor] = {}

    # ----------------------------------------------------------------- the order
    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of ``epoch`` (cached; only a couple of epochs are kept)."""
        perm = self._perms.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.dataset_len, generator=g)
            if len(self._perms) >= 4:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def _stream(self, start: int, length: int) -> list[int]:
        """Samples at stream positions [start, start+length), start counted from this epoch."""
        out: list[int] = []
        pos = start
        end = start + length
        n = self.dataset_len
        while pos < end:
            epoch = self.epoch + pos // n
            lo = pos % n
            hi = min(n, lo + (end - pos))
            out.extend(self.permutation(epoch)[lo:hi].tolist())
            pos += hi - lo
        return out

    # ----------------------------------------------------------------- per step
    def step_ids(self, global_batch: int) -> list[int]:
        """All sample ids the next optimizer step consumes, in stream order."""
        if global_batch <= 0:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        return self._stream(self.cursor, global_batch)

    def local_ids(self, global_batch: int, world_size: int, rank: int, micro_step: int = 0,
                  grad_accum: int = 1) -> list[int]:
        """Sample ids of dp rank ``rank`` (of ``world_size``) for ``micro_step`` of the next step.

        Requires ``global_batch`` divisible by ``grad_accum * world_size``; the micro-batch
        is ``global_batch // (grad_accum * world_size)``.
        """
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in a world of {world_size}")
        if not 0 <= micro_step < grad_accum:
            raise ValueError(f"micro_step {micro_step} not in [0, {grad_accum})")
        if global_batch % (grad_accum * world_size):
            raise ValueError(
                f"global batch {global_batch} is not divisible by grad_accum {grad_accum} x "
                f"world size {world_size}; choose grad_accum/micro_batch so the global batch is kept")
        micro = global_batch // (grad_accum * world_size)
        start = self.cursor + micro_step * (global_batch // grad_accum) + rank * micro
        return self._stream(start, micro)

    def advance(self, global_batch: int) -> None:
        """Mark one optimizer step of ``global_batch`` samples as consumed (rolls epochs over)."""
        if global_batch <= 0:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        self.cursor += global_batch
        while self.cursor >= self.dataset_len:
            self.cursor -= self.dataset_len
            self._perms.pop(self.epoch, None)
            self.epoch += 1

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch`` (cursor 0)."""
        self.epoch = int(epoch)
        self.cursor = 0

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor, "dataset_len": self.dataset_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"seed", "epoch", "cursor", "dataset_len"} - set(state)
        if missing:
            raise KeyError(f"sampler state lacks {sorted(missing)}")
        dataset_len = int(state["dataset_len"])
        if dataset_len != self.dataset_len:
            raise ValueError(f"sampler state is for a dataset of {dataset_len} samples, this one has {self.dataset_len}")
        if int(state["seed"]) != self.seed:
            self._perms.clear()
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])

    def __repr__(self) -> str:
        return f"ElasticSampler(dataset_len={self.dataset_len}, seed={self.seed}, epoch={self.epoch}, cursor={self.cursor})"
