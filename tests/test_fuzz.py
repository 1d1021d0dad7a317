"""Bad input, fuzzed: byte-level mutations of a real checkpoint never crash, hang or commit.

Mutations (flip / insert / delete bytes, truncate) hit `.metadata`, one item inside a
`.distcp` file (its zip structure, its zip signatures or its tensor payload), a whole data
file (truncation) or `manifest.json` of a copy of the 4-rank reference checkpoint. Every
case runs inspect, inspect --deep, plan, convert (fresh destination) and verify and checks
the properties in `scripts/fuzz_inputs.py` (the engine shared with the long-running
fuzzer): exit code in {0, 1, 2}, no traceback, a one-paragraph `error:`, nothing committed
by a failed convert, and exit 2 when the mutation makes the input structurally invalid by
an oracle independent of reshard's reader.

Most cases run in-process (`run_cli`); a few go through `python -m reshard` subprocesses
with a timeout for the traceback/hang properties.
"""
from __future__ import annotations

import importlib.util
import random
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import run_cli

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_inputs.py"
_spec = importlib.util.spec_from_file_location("reshard_fuzz_inputs", _SCRIPT)
fz = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fz
_spec.loader.exec_module(fz)

# examples per target, in-process: bounded so the file runs well under two minutes
BUDGET = {"metadata": 5, "zip_header": 3, "zip_signature": 3, "payload": 2, "truncate": 3, "manifest": 4}


@pytest.fixture(scope="module")
def regions(reference_ckpt):
    return fz.item_regions(reference_ckpt)


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("RESHARD_DEBUG", raising=False)


def _report(r) -> str:
    return f"{r.mutation.describe()} -> {r.codes}\n  " + "\n  ".join(r.failures + r.unexpected)


@pytest.mark.parametrize("target", fz.TARGETS)
def test_mutations_in_process(target, reference_ckpt, regions, tmp_path, capsys):
    @settings(max_examples=BUDGET[target], deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(rnd=st.randoms(use_true_random=False))
    def case(rnd: random.Random) -> None:
        m = fz.draw_mutation(rnd, reference_ckpt, regions, target)
        work = Path(tempfile.mkdtemp(dir=tmp_path))
        try:
            r = fz.run_case(reference_ckpt, regions, m, work, lambda args: run_cli(args, capsys))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        assert not r.failures and not r.unexpected, _report(r)

    case()


# ------------------------------------------------------------------- oracles and the engine itself

def test_engine_sanity(reference_ckpt, regions):
    original = (reference_ckpt / ".metadata").read_bytes()
    assert fz.metadata_loads(original) is not None
    assert fz.metadata_loads(original[: len(original) // 2]) is None
    man = (reference_ckpt / "manifest.json").read_bytes()
    assert fz.manifest_invalid(man) is None
    assert fz.manifest_invalid(man.replace(b'"format_version": 1', b'"format_version": 2')) is not None
    assert fz.manifest_invalid(man[:-10]) is not None
    files = {it.file for it in regions}
    assert files == {p.name for p in reference_ckpt.glob("*.distcp")}
    for it in regions[:20]:
        for a, b in it.payload + it.header + it.signatures:
            assert it.offset <= a < b <= it.offset + it.length
    assert fz.apply_ops(b"abcdef", [("delete", 4, 1), ("insert", 1, b"XY"), ("flip", 0, 1)]) == b"`XYbcdf"


@pytest.mark.parametrize("cut", ["metadata", "data"])
def test_truncation_must_exit_2(cut, reference_ckpt, regions, tmp_path, capsys):
    """Deterministic anchors for the two clearest structural breaks."""
    if cut == "metadata":
        size = (reference_ckpt / ".metadata").stat().st_size
        m = fz.Mutation("metadata", ".metadata", [("truncate", size - 1)])
    else:
        f = "__2_0.distcp"
        m = fz.Mutation("truncate", f, [("truncate", fz._needed_end(regions, f) - 1)])
    (tmp_path / "w").mkdir()
    r = fz.run_case(reference_ckpt, regions, m, tmp_path / "w", lambda a: run_cli(a, capsys))
    assert not r.failures and not r.unexpected, _report(r)
    assert r.codes["inspect"] == 2 and r.codes["plan"] == 2 and r.codes["convert"] == 2


@pytest.mark.parametrize("damage", ["truncated_data", "invalid_manifest"])
def test_text_inspect_of_damaged_checkpoint_prints_its_report(damage, reference_ckpt, copy_of, capsys):
    ck = copy_of(reference_ckpt)
    if damage == "truncated_data":
        with open(ck / "__2_0.distcp", "r+b") as f:
            f.truncate(1000)
    else:
        (ck / "manifest.json").write_text("{")
    code, out, err = run_cli(["inspect", ck], capsys)
    assert code == 2
    assert "unexpected" not in err, err
    assert ("__2_0.distcp" if damage == "truncated_data" else "manifest") in out


# ------------------------------------------------------------------- subprocesses: no traceback, no hang

@pytest.mark.parametrize("mutation", [
    pytest.param(("metadata", 7), id="metadata"),
    pytest.param(("zip_signature", 11), id="zip_signature"),
])
def test_mutations_as_subprocesses(mutation, reference_ckpt, regions, tmp_path):
    target, seed = mutation
    m = fz.draw_mutation(random.Random(seed), reference_ckpt, regions, target)
    commands = fz.COMMANDS if target == "metadata" else ("inspect", "inspect_deep", "convert")
    (tmp_path / "w").mkdir()
    r = fz.run_case(reference_ckpt, regions, m, tmp_path / "w", fz.subprocess_runner(timeout=60), commands)
    assert not r.failures and not r.unexpected, _report(r)
    assert all(c != -999 for c in r.codes.values())
