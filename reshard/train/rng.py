"""Per-rank RNG capture and restore.

Why: dropout and other random ops draw from per-process generators (python ``random``,
numpy, torch CPU). Resuming the same trajectory needs every rank's state back. DCP keeps
ONE copy of any key several ranks save (pytorch #120356), so per-rank state MUST be saved
under a rank-specific key: ``rng.rank_<r>`` (see :func:`rng_key`).

The captured dict holds only tensors, ints, floats, lists and None, so it round-trips
through ``torch.save`` / ``torch.load(weights_only=True)`` and through DCP (tensors are
stored as tensors, with fixed shapes so a template can be loaded in place).
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_key(rank: int) -> str:
    """Flat checkpoint key under which rank ``rank`` saves its RNG state."""
    return f"rng.rank_{rank}"


def rank_entry(rank: int) -> str:
    """Key of rank ``rank`` inside the ``rng`` sub-dict (``rng_key`` without the prefix)."""
    return f"rank_{rank}"


def capture() -> dict[str, Any]:
    """Snapshot python, numpy and torch CPU generator states of this process."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    if np_kind != "MT19937":  # pragma: no cover - numpy's legacy state is always MT19937
        raise RuntimeError(f"unexpected numpy bit generator {np_kind}")
    return {
        "python": {
            "version": int(py_version),
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss_next": [] if py_gauss is None else [float(py_gauss)],
        },
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64).copy()),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch": torch.get_rng_state().clone(),
    }


def restore(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture`."""
    py = state["python"]
    gauss = py["gauss_next"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()),
                     float(gauss[0]) if len(gauss) else None))
    npst = state["numpy"]
    np.random.set_state(("MT19937", npst["keys"].numpy().astype(np.uint32), int(npst["pos"]),
                         int(npst["has_gauss"]), float(npst["cached_gaussian"])))
    torch.set_rng_state(state["torch"].to(dtype=torch.uint8, device="cpu").contiguous())


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch from one integer (numpy needs < 2**32)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
