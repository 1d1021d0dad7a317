"""Shared checkpoints written by real torch code (spawned gloo ranks, torchrun, real trainers).

The suite runs on every core (pytest-xdist, `-n auto`); a checkpoint that several tests read
is written ONCE PER RUN, whichever worker asks first, through `once_per_run` (a file lock in
the directory all workers share), and never modified afterwards: tests that damage one copy
it first (`copy_of`), and every shared checkpoint's files are hashed when written and checked
again when the worker's session ends, so a test that writes into one fails the run.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import pytest

_SHARED_USED: dict[Path, dict[str, str]] = {}


def _run_root(tmp_path_factory) -> Path:
    """The directory every worker of this run shares (the basetemp's parent under xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _fingerprint(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def once_per_run(tmp_path_factory, key: str, make: Callable[[Path], Any]) -> Any:
    """``make(work)`` run once per test run for ``key`` (by the first worker to ask), its JSON result shared.

    ``work`` is an empty directory that outlives the worker that made it; the result (paths as
    strings, or a dict of them) is what every later caller gets back. A failure is recorded
    and raised again in every worker that asks, rather than retried. The files under ``work``
    are fingerprinted and checked unchanged when each worker's session ends.
    """
    from filelock import FileLock

    root = _run_root(tmp_path_factory) / "shared"
    root.mkdir(exist_ok=True)
    work, done, failed = root / key, root / f"{key}.json", root / f"{key}.failed"
    with FileLock(str(root / f"{key}.lock")):
        if failed.exists():
            raise RuntimeError(f"shared checkpoint {key} failed in another worker:\n{failed.read_text()}")
        if not done.exists():
            work.mkdir()
            try:
                result = make(work)
            except BaseException as exc:
                failed.write_text(f"{type(exc).__name__}: {exc}"[-8000:])
                raise
            done.write_text(json.dumps({"result": result, "files": _fingerprint(work)}, default=str))
        record = json.loads(done.read_text())
    _SHARED_USED[work] = record["files"]
    return record["result"]


@pytest.fixture(scope="session", autouse=True)
def _shared_checkpoints_unchanged():
    """At the end of the session: every shared checkpoint this worker used is byte for byte as written."""
    yield
    changed = {str(w): sorted(set(f) ^ set(now) | {n for n in f if now.get(n) != f[n]})
               for w, f in _SHARED_USED.items() if (now := _fingerprint(w)) != f}
    assert not changed, f"a test modified a shared checkpoint in place (copy it first): {changed}"


# The modules that take longest (docs/testing.md, measured), started first: under
# `--dist loadfile` a module runs on one worker, and a long one begun last would leave the
# other core idle at the end of the run (longest-first scheduling).
SLOWEST_FIRST = [
    "test_faults", "test_rehearse", "test_torchtitan_data", "test_interop_torchtitan_pp", "test_hostile_distributed", "test_slice",
    "test_resume", "test_first_line", "test_layout_ambiguity", "test_interop_torchtitan_moe",
    "test_progress", "test_convert", "test_tp_pp", "test_reference_pipeline", "test_distributed",
    "test_rehearse_trainer", "test_hf_roundtrip", "test_reference_trainer", "test_preflight", "test_cli_validation",
    "test_fuzz", "test_hostile_errors", "test_interop_accelerate", "test_interop_lightning", "test_data_link",
    "test_interop_torchtune", "test_interop_deepspeed",
]


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda it: rank.get(Path(str(it.fspath)).stem, len(rank)))  # stable: file order kept otherwise


def writer_key(script: Path, *packages: str) -> str:
    """A cache key for a writer script: its name, its content and the versions of the packages it runs."""
    from importlib.metadata import version

    digest = hashlib.sha256(script.read_bytes()).hexdigest()[:12]
    return "-".join([script.stem, digest, *(f"{p}{version(p)}" for p in packages)])


@pytest.fixture(scope="session")
def reference_ckpt(tmp_path_factory) -> Path:
    """A 4-rank FSDP2 checkpoint from the reference trainer, reshard convention, with manifest."""
    from reshard.reference import TrainConfig, run_reference

    def make(out: Path) -> str:
        cfg = TrainConfig(dp=4, tp=1, steps=3, save_at=[3], out=str(out), log=str(out / "steps.jsonl"),
                          experiment_id="test-ref")
        return str(run_reference(cfg)[-1])

    return Path(once_per_run(tmp_path_factory, "reference", make))


@pytest.fixture(scope="session")
def torchtitan_ckpt(tmp_path_factory) -> Path:
    """A 2-rank checkpoint in torchtitan's key layout, without manifest."""
    from reshard.reference import TrainConfig, run_reference

    def make(out: Path) -> str:
        cfg = TrainConfig(dp=2, tp=1, steps=2, save_at=[2], out=str(out), convention="torchtitan")
        return str(run_reference(cfg)[-1])

    return Path(once_per_run(tmp_path_factory, "titan", make))


@pytest.fixture(scope="session")
def plain_fsdp2_ckpt(tmp_path_factory) -> Path:
    """A checkpoint from a plain FSDP2 script (get_state_dict + dcp.save, no manifest)."""
    from reshard.testing.synthetic import make_plain_fsdp2

    return Path(once_per_run(tmp_path_factory, "plain", lambda w: str(make_plain_fsdp2(w / "ckpt", world_size=4))))


@pytest.fixture(scope="session")
def seed64_ckpt(plain_fsdp2_ckpt, tmp_path_factory) -> Path:
    """The seed run's layout: ``plain_fsdp2_ckpt`` laid out for 64 FSDP ranks (``reshard convert --to dp=64``),
    then stripped of what the conversion added beside the DCP files (manifest, reports), so that nothing
    records its recipe or layout, as a plain script leaves a checkpoint. ``--from dp=64`` is then what its
    chunks show (they are ``torch.chunk``'s for 64 shards; no tensor has 64 rows, so only 50 ranks wrote
    data), where on the 4-rank original inspect refuses it (issue 31)."""

    def make(work: Path) -> str:
        dst = work / "ckpt"
        code, out, err = cli(["convert", plain_fsdp2_ckpt, dst, "--to", "dp=64", "--quiet"])
        assert code == 0, out + err
        for name in ("manifest.json", "reshard-report.json", "reshard-report.md"):
            (dst / name).unlink()
        return str(dst)

    return Path(once_per_run(tmp_path_factory, "seed64", make))


TORCHTITAN_WRITER = Path(__file__).parent / "writers" / "torchtitan_run.py"


@pytest.fixture(scope="session")
def torchtitan_sources(tmp_path_factory) -> dict[str, Path]:
    """torchtitan 0.3.0's own training and ``CheckpointManager.save`` (tests/writers/torchtitan_run.py):
    a 2-layer Llama at dp_shard=2, 2 steps, fused and separate QKV, in one 2-rank launch, written
    once per run (keyed by the writer's content and torchtitan's version) and shared by every
    module that reads it. ``<dump>/checkpoint/step-2`` is the checkpoint, ``<dump>/reference``
    the full state the writer saved beside it."""
    require_packages("torchtitan")

    def make(work: Path) -> dict[str, str]:
        jobs = [{"dump": str(work / "fused"), "fuse_qkv": True, "steps": 2},
                {"dump": str(work / "unfused"), "fuse_qkv": False, "steps": 2}]
        (work / "write.json").write_text(json.dumps(jobs))
        run_torchrun(TORCHTITAN_WRITER, 2, "write", work / "write.json")
        return {"fused": str(work / "fused"), "unfused": str(work / "unfused")}

    made = once_per_run(tmp_path_factory, writer_key(TORCHTITAN_WRITER, "torchtitan"), make)
    return {k: Path(v) for k, v in made.items()}


@pytest.fixture
def copy_of(tmp_path):
    """Copy a session checkpoint so a test may damage it."""

    def _copy(src: Path) -> Path:
        dst = tmp_path / ("copy_" + src.name)
        shutil.copytree(src, dst)
        return dst

    return _copy


def require_packages(*names: str) -> None:
    """Skip the calling test module when a trainer package of the `interop` extra is missing.

    Found by ``importlib.util.find_spec`` on the top-level name, which imports nothing: a
    trainer imported into the test process may change torch's global state (megatron.core
    adds ``pathlib.PosixPath`` to torch's weights_only safe globals on import), and the
    interop tests run every trainer in its own processes anyway. Under CI (``CI`` set), where
    the README's test command installs the extra, a missing package is an error, not a skip.
    """
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        if os.environ.get("CI"):
            raise RuntimeError(f"the interop extra is not installed ({', '.join(missing)} missing); "
                               "run the README's test command")
        pytest.skip(f"{', '.join(missing)} not installed (pip install -c constraints.txt -e '.[interop]')",
                    allow_module_level=True)


def run_torchrun(script: Path, nproc: int, *args: str | Path) -> None:
    """Run a writer script of tests/writers/ under torchrun; a failure shows the script's own output."""
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *map(str, args)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"


def assert_bitwise_equal(a, b, where: str = "") -> None:
    """Same structure, same python values, tensors equal bit for bit (dtype and shape included)."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    from reshard.cli import main

    code = 0
    try:
        main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    out, err = capsys.readouterr()
    return code, out, err


class _Capture:
    """A capsys stand-in for module-scoped fixtures (`run_cli` only calls `readouterr`)."""

    def __init__(self) -> None:
        import io

        self.out, self.err = io.StringIO(), io.StringIO()

    def readouterr(self) -> tuple[str, str]:
        o, e = self.out.getvalue(), self.err.getvalue()
        self.out.seek(0), self.out.truncate(), self.err.seek(0), self.err.truncate()
        return o, e


def cli(args: list) -> tuple[int, str, str]:
    """`run_cli` without a capsys fixture (usable in module-scoped fixtures)."""
    import contextlib

    cap = _Capture()
    with contextlib.redirect_stdout(cap.out), contextlib.redirect_stderr(cap.err):
        return run_cli(args, cap)


@contextmanager
def mounted_tmpfs(where: Path, options: str):
    """A tmpfs mounted at ``where`` with ``options`` (root only); the test is skipped where mounting is not allowed."""
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)
