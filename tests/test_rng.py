"""Per-rank RNG capture/restore."""
from __future__ import annotations

import random

import numpy as np
import torch

from reshard.train import capture_rng, restore_rng, rng_key, seed_all


def draws():
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(),
            torch.rand(4).tolist(), torch.randn(2).tolist())


def test_round_trip_reproduces_draws():
    seed_all(7)
    random.gauss(0, 1)  # leave a cached gaussian in python's state
    np.random.randn()   # ... and possibly in numpy's
    state = capture_rng()
    first = draws()
    draws()  # move on
    restore_rng(state)
    assert draws() == first


def test_capture_loads_with_weights_only(tmp_path):
    seed_all(11)
    random.gauss(0, 1)
    state = capture_rng()
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    first = draws()
    restore_rng(loaded)
    assert draws() == first


def test_capture_is_a_snapshot_not_a_view():
    seed_all(3)
    state = capture_rng()
    before = state["torch"].clone()
    torch.rand(10)
    assert torch.equal(state["torch"], before)


def test_rng_key_is_rank_specific():
    assert rng_key(0) == "rng.rank_0"
    assert rng_key(13) == "rng.rank_13"
    assert len({rng_key(r) for r in range(8)}) == 8
