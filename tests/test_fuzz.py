"""Bad input, fuzzed: byte-level mutations of a real checkpoint never crash, hang or commit.

Mutations (flip / insert / delete bytes, truncate) hit `.metadata`, one item inside a
`.distcp` file (its zip structure, its zip signatures or its tensor payload), a whole data
file (truncation) or `manifest.json` of a copy of the 4-rank reference checkpoint. Every
case runs inspect, inspect --deep, plan, convert (fresh destination) and verify and checks
the properties in `scripts/fuzz_inputs.py` (the engine shared with the long-running
fuzzer): exit code in {0, 1, 2}, no traceback, a one-paragraph `error:`, nothing committed
by a failed convert, and exit 2 when the mutation makes the input structurally invalid by
an oracle independent of reshard's reader.

Most cases run in-process (`run_cli`); a few go through real processes (forked from a server
that imported reshard once, `tests/forked.py`) with a timeout for the traceback/hang properties.
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
def _process_runner(timeout: float = 60.0):
    """`scripts/fuzz_inputs.subprocess_runner`'s contract (-999 on a timeout) on forked processes."""
    import os
    import subprocess

    import forked

    env = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}

    def run(args: list) -> tuple[int, str, str]:
        try:
            p = forked.run(args, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return -999, "", f"TIMEOUT after {timeout} s"
        return p.returncode, p.stdout, p.stderr

    return run


@pytest.mark.parametrize("mutation", [
    pytest.param(("metadata", 7), id="metadata"),
    pytest.param(("zip_signature", 11), id="zip_signature"),
])
def test_mutations_as_subprocesses(mutation, reference_ckpt, regions, tmp_path):
    target, seed = mutation
    m = fz.draw_mutation(random.Random(seed), reference_ckpt, regions, target)
    commands = fz.COMMANDS if target == "metadata" else ("inspect", "inspect_deep", "convert")
    (tmp_path / "w").mkdir()
    r = fz.run_case(reference_ckpt, regions, m, tmp_path / "w", _process_runner(timeout=60), commands)
    assert not r.failures and not r.unexpected, _report(r)
    assert all(c != -999 for c in r.codes.values())


# ------------------------------------------------------------------- hostile structures (issue 13)
# Built, not flipped: special files as each input, symlinks out of and inside the checkpoint,
# staircase chunk layouts, item lengths that contradict their chunks, deep JSON. Builders are
# in scripts/fuzz_inputs.py (shared with scripts/bench_hostile.py); hypothesis draws them here.
# Every example runs `inspect` in-process under two guards, so a reader that is not safe fails
# the test instead of hanging it or exhausting the machine: a FIFO left blocking a reader is
# unblocked after GUARD_S seconds (and the case fails), and the address space is capped.

import contextlib  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import threading  # noqa: E402

GUARD_S = 20.0
MEMORY_HEADROOM = 4 << 30


def hostile(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def guarded(fifos=()):
    """Run a command that must neither block on a FIFO nor read a device until memory runs out."""
    hung: list[str] = []
    done = threading.Event()

    def watchdog() -> None:
        if done.wait(GUARD_S):
            return
        while not done.is_set():
            for f in fifos:
                try:  # succeeds only while a reader holds the FIFO open: give it EOF
                    os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
                    hung.append(str(f))
                except OSError:
                    pass
            done.wait(0.2)

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + MEMORY_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    t = threading.Thread(target=watchdog, daemon=True)
    t.start()
    try:
        yield hung
    finally:
        done.set()
        t.join()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _inspect(ck: Path, s, capsys, *, args=()) -> tuple[int, str, str]:
    with guarded([s.fifo] if s.fifo else []) as hung:
        code, out, err = run_cli(["inspect", *args, ck], capsys)
    assert not hung, f"inspect blocked on the FIFO {hung[0]} ({s.what})"
    return code, out, err


def _assert_safe(s, result) -> None:
    code, out, err = result
    bad = fz.check_structure(s, code, out, err)
    assert not bad, f"{s.what}: " + "; ".join(bad)


def _work(tmp_path: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=tmp_path))


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
@pytest.mark.parametrize("name", fz.INPUT_FILES)
def test_special_file_as_each_input(name, kind, reference_ckpt, tmp_path, capsys):
    """The attack: a FIFO, or a symlink to /dev/zero, as each input file. A file inspect reads
    is refused by name (exit 2, one paragraph, no traceback, no hang, memory bounded); the
    report, which nothing reads as evidence, is left alone (exit 0, also for verify)."""
    ck = tmp_path / "ck"
    shutil.copytree(reference_ckpt, ck)
    s = fz.plant_special(ck, name, kind, outside=tmp_path / "private")
    _assert_safe(s, _inspect(ck, s, capsys))
    if name == "reshard-report.json":
        with guarded([s.fifo] if s.fifo else []) as hung:
            code, out, err = run_cli(["verify", reference_ckpt, ck], capsys)
        assert not hung and code == 0, (code, err)


@st.composite
def special_files(draw):
    """A special file or symlink as one input file, the checkpoint maybe reached through a
    symlinked root (``latest -> step``, which is fine)."""
    data_files = [f"__{r}_0.distcp" for r in range(4)]
    name = draw(st.sampled_from([".metadata", "manifest.json", "reshard-report.json"] + data_files))
    return name, draw(st.sampled_from(fz.SPECIAL_KINDS)), draw(st.booleans())


def test_special_files_drawn(reference_ckpt, tmp_path, capsys):
    @hostile(8)
    @given(special_files())
    def case(drawn) -> None:
        name, kind, via_link = drawn
        work = _work(tmp_path)
        try:
            ck = work / "step_3"
            shutil.copytree(reference_ckpt, ck)
            s = fz.plant_special(ck, name, kind, outside=work / "private")
            if via_link:
                os.symlink("step_3", work / "latest")
                ck = work / "latest"
            _assert_safe(s, _inspect(ck, s, capsys))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    case()


def test_symlinked_checkpoint_leaks_nothing(reference_ckpt, tmp_path, capsys):
    """The attack of finding 1: every file of a directory is a symlink into another (private)
    checkpoint. It is refused, naming the first file, and nothing of the private one is read."""
    private = tmp_path / "private"
    shutil.copytree(reference_ckpt, private)
    ck = tmp_path / "innocent"
    ck.mkdir()
    for f in sorted(private.iterdir()):
        os.symlink(f, ck / f.name)
    code, out, err = run_cli(["inspect", ck], capsys)
    bad = fz.check_result("inspect", code, out, err, need_two="every file links out", dst_parent=None)
    assert not bad, bad
    assert ".metadata" in out + err


@st.composite
def staircases(draw):
    return (draw(st.integers(2, 40)), draw(st.sampled_from([None, "gap", "overlap", "out_of_bounds"])),
            draw(st.integers(1, 3)))


def test_staircase_layouts(tmp_path, capsys):
    """Real staircase checkpoints (each column cut at a different row): a tiling inspects as
    complete; a gap, an overlap or a chunk out of bounds is named with its key."""
    @hostile(6)
    @given(staircases())
    def case(drawn) -> None:
        n, damage, ranks = drawn
        work = _work(tmp_path)
        try:
            s = fz.write_staircase(work / "stair", n, damage=damage, ranks=ranks)
            _assert_safe(s, _inspect(work / "stair", s, capsys))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    case()


@st.composite
def inconsistent_lengths(draw):
    return draw(st.sampled_from([2, 7, 1 << 10, 1 << 24])), draw(st.sampled_from([None, "model.embed.weight"]))


def test_item_lengths_inconsistent_with_their_chunks(reference_ckpt, tmp_path, capsys):
    """`.metadata` declares a tensor far larger than its items hold (128 GiB in 8 KiB items):
    refused from metadata alone, naming `.metadata` and the key."""
    @hostile(4)
    @given(inconsistent_lengths())
    def case(drawn) -> None:
        factor, key = drawn
        work = _work(tmp_path)
        try:
            ck = work / "ck"
            shutil.copytree(reference_ckpt, ck)
            try:
                s = fz.forge_item_lengths(ck, factor, key=key)
            except KeyError:  # the reference model has no such key: the largest one instead
                s = fz.forge_item_lengths(ck, factor)
            _assert_safe(s, _inspect(ck, s, capsys))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    case()


@st.composite
def nested_manifests(draw):
    depth = draw(st.sampled_from([65, 100, 1_000, 100_000, 1_000_000]))
    return depth, draw(st.sampled_from(["list", "dict"])), draw(st.booleans())


def test_deeply_nested_manifest(reference_ckpt, tmp_path, capsys):
    """manifest.json nested past any real depth (alone or in one field): exit 2 naming it,
    never the last-resort handler (RecursionError)."""
    @hostile(5)
    @given(nested_manifests())
    def case(drawn) -> None:
        depth, form, wrap = drawn
        work = _work(tmp_path)
        try:
            ck = work / "ck"
            shutil.copytree(reference_ckpt, ck)
            s = fz.plant_nested_manifest(ck, depth, form=form, wrap=wrap)
            _assert_safe(s, _inspect(ck, s, capsys))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    case()


def test_fifo_metadata_as_a_subprocess(reference_ckpt, tmp_path):
    """End to end as a user runs it: `python -m reshard inspect` on a FIFO `.metadata` returns
    (exit 2, naming it) instead of hanging; the timeout is the hang detector."""
    ck = tmp_path / "ck"
    shutil.copytree(reference_ckpt, ck)
    s = fz.plant_special(ck, ".metadata", "fifo", outside=tmp_path / "private")
    code, out, err = _process_runner(timeout=60)(["inspect", ck])
    assert code != -999, "inspect hung on a FIFO .metadata"
    _assert_safe(s, (code, out, err))
