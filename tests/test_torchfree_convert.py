"""Issue 45: a conversion that reseeds RNG states imports no torch, and writes what torch would.

A world-size change reseeds every rank's RNG state (`reshard.semantics.rng.seeded_state`); those
states are made with numpy (`reshard.model.tensor_values.ArrayTensor`), written by the DCP writer
as ``torch.save`` writes the tensors they stand for, and verified as integer arrays. Here: the
generator state built without torch is torch's own for many seeds, each reseeded value and each
item written for it is byte for byte what the torch-made value gives, and a real ``reshard convert``
of the reference trainer's checkpoint (4 ranks -> 2, and -> 8, which adds ranks) runs in a process
that never imports torch (the process is the point: in this one torch is loaded), verifies equal
(and `reshard verify` of it re-derives the reseeded values, also without torch),
and holds the states torch's generators make; and the verification reports the reseeded integer
tensors' differences as torch's decoding did.
"""
from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from reshard.model.dtypes import dtype_named
from reshard.model.tensor_values import ArrayTensor, as_torch
from reshard.semantics import rng as rng_mod
from reshard.storage.checkpoints.dcp_writer import DcpWriter, object_item

SEEDS = [0, 1, 5489, 2**31 - 1, 2**32 - 1, 2**32, 2**32 + 7, 2**63 - 1] + \
    [rng_mod.derived_seed(s, step, r) for s in (0, 7) for step in (0, 3, 1000) for r in range(16)] + \
    [random.Random(45).getrandbits(63) for _ in range(100)]


def _torch_made(seed: int) -> dict:
    """The state as `seeded_state` made it with torch before issue 45 (and as ``train.rng.capture`` holds it)."""
    py_version, py_state, py_gauss = random.Random(seed).getstate()
    _, keys, pos, has_gauss, cached = np.random.RandomState(seed % (2**32)).get_state(legacy=True)
    g = torch.Generator()
    g.manual_seed(seed)
    return {"python": {"version": int(py_version), "state": torch.tensor(py_state, dtype=torch.int64),
                       "gauss_next": [] if py_gauss is None else [float(py_gauss)]},
            "numpy": {"keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": g.get_state()}


def test_generator_state_without_torch_is_torchs():
    for seed in SEEDS:
        g = torch.Generator()
        g.manual_seed(seed)
        assert rng_mod.torch_generator_state(seed).tobytes() == g.get_state().numpy().tobytes(), seed
    assert len(rng_mod.torch_generator_state(0)) == rng_mod.TORCH_STATE_BYTES


def test_reseeded_values_and_their_items_are_the_torch_made_ones(tmp_path):
    """Every leaf of `seeded_state` equals the torch-made state's (a tensor: dtype, shape and bytes), and
    the items the writer makes of them are byte for byte the ones it makes of the torch values."""
    for seed in SEEDS[:40]:
        ours = rng_mod.flatten(rng_mod.seeded_state(seed), "rng")
        theirs = rng_mod.flatten(_torch_made(seed), "rng")
        assert ours.keys() == theirs.keys()
        for k, v in ours.items():
            t = theirs[k]
            if isinstance(v, ArrayTensor):
                assert v.dtype == t.dtype and v.shape == tuple(t.shape), (seed, k)
                assert bytes(v.data()) == t.numpy().tobytes(), (seed, k)
                assert torch.equal(v.to_torch(), t)
            else:
                assert type(v) is type(t) and v == t, (seed, k)
    files = {}
    for name, made in (("ours", rng_mod.seeded_state), ("theirs", _torch_made)):
        d = tmp_path / name
        d.mkdir()
        w = DcpWriter(d)
        for seed in SEEDS[:3]:
            for k, v in rng_mod.flatten(made(seed), f"rng.s{seed}").items():
                if isinstance(v, (ArrayTensor, torch.Tensor)):
                    w.declare_tensor(k, tuple(v.shape), v.dtype)
                    w.write_chunk(0, k, (0,) * len(v.shape), v)
                else:
                    w.write_object(0, k, v)
        w.finish()
        files[name] = {p.name: p.read_bytes() for p in d.iterdir()}
    assert files["ours"] == files["theirs"]
    # the objects written without torch are torch.save's bytes (plain values; the serialization id too)
    for value in [3, 624, 0, 0.0, -0.0, float("nan"), 1e300, [], [0.25], {"a": [1, (2, None)], "b": "x"},
                  b"\x00\xff", True, None, 2**70, -5, "é" * 100]:
        buf = io.BytesIO()
        torch.save(value, buf)
        assert object_item(value) == buf.getvalue(), value
    # verification's comparison of a re-derived value with what an output holds (read as an array or a tensor)
    from reshard.verification.objects import identical

    a, b = rng_mod.seeded_state(1)["torch"], rng_mod.seeded_state(2)["torch"]
    assert identical(a, rng_mod.seeded_state(1)["torch"]) and not identical(a, b)
    assert identical(a, _torch_made(1)["torch"]) and identical(_torch_made(1)["torch"], a)
    assert not identical(a, _torch_made(2)["torch"])
    assert not identical(a, ArrayTensor(dtype_named("int8"), a.array.view("i1")))  # the same bytes, another dtype
    state = as_torch(rng_mod.seeded_state(SEEDS[-1]))  # the trainer restores what it loads as tensors
    assert all(isinstance(state[s][k], torch.Tensor) for s, k in (("python", "state"), ("numpy", "keys")))


CONVERT = """
import json, sys
from reshard.cli import main

code = 0
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
sys.stdout.flush()
print("\\n" + json.dumps({"exit": code, "torch_imported": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:5]}))
"""


@pytest.mark.parametrize("to", ["dp=2", "dp=8"])
def test_reseeding_convert_imports_no_torch(reference_ckpt, tmp_path, to):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-c", CONVERT, "convert", str(reference_ckpt), str(out), "--to", to, "--json"],
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    status = json.loads(p.stdout.strip().splitlines()[-1])
    assert status == {"exit": 0, "torch_imported": []}, p.stderr[-3000:]
    report = json.loads(p.stdout.strip().rsplit("\n", 1)[0])
    rng = report["plan"]["rng"]
    world = int(to.split("=")[1])
    assert rng["policy"] == "reseed" and len(rng["per_rank"]) == world
    assert report["verification"]["equal"], report["verification"]["differences"][:3]
    rewritten = {r["key"] for r in report["verification"]["rewritten"]}
    assert {f"rng.rank_{r}.torch" for r in range(min(world, 4))} <= rewritten
    # what the output holds, read back through torch: each rank's state is torch's for its derived seed
    from reshard.storage.checkpoints.index import CheckpointIndex

    if to == "dp=2":  # `reshard verify` re-derives the reseeded values and compares them, without torch too
        p = subprocess.run([sys.executable, "-c", CONVERT, "verify", str(reference_ckpt), str(out), "--json"],
                           capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
        assert json.loads(p.stdout.strip().splitlines()[-1]) == {"exit": 0, "torch_imported": []}, p.stderr[-3000:]
        verified = json.loads(p.stdout.strip().rsplit("\n", 1)[0])
        reasons = [r["reason"] for r in verified["rewritten"] if r["key"].startswith("rng.")]
        assert len(reasons) == 6 and all(r.endswith("(value re-derived)") for r in reasons), reasons
    ix = CheckpointIndex.open(out)
    for r in range(world):
        g = torch.Generator()
        g.manual_seed(rng_mod.derived_seed(rng["seed"], rng["step"], r))
        assert torch.equal(ix.read_tensor(f"rng.rank_{r}.torch"), g.get_state()), r
        assert ix.read_object(f"rng.rank_{r}.numpy.pos") == 624


def test_integer_differences_read_as_arrays_are_reported_as_torch_reports_them(reference_ckpt, tmp_path, monkeypatch):
    """`reshard verify` of a reseeding conversion's output against its source: the reseeded integer tensors
    differ, and what the comparison says of them (counts, first index, values) is the same whether their
    boxes are read as numpy arrays (`reshard.verification.arrays`) or decoded through torch."""
    from conftest import cli
    from reshard.verification import arrays
    from reshard.verification.checkpoints import verify_checkpoints

    out = tmp_path / "out"
    code, text, err = cli(["convert", reference_ckpt, out, "--to", "dp=2", "--quiet"])
    assert code == 0, text + err
    read = arrays.read_box_array
    boxes = []
    monkeypatch.setattr(arrays, "read_box_array", lambda ix, key, box: boxes.append(key) or read(ix, key, box))
    as_arrays = verify_checkpoints(reference_ckpt, out, fast=False)
    assert {f"rng.rank_{r}.{k}" for r in (0, 1) for k in ("torch", "python.state", "numpy.keys")} <= set(boxes)
    monkeypatch.setattr(arrays, "readable", lambda ix, key: False)
    through_torch = verify_checkpoints(reference_ckpt, out, fast=False)
    rng = [d for d in as_arrays["differences"] if d["key"].startswith("rng.") and d["kind"] == "value"]
    assert len(rng) == 6 and all(d["count"] > 0 for d in rng)
    assert as_arrays == through_torch
