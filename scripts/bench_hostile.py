#!/usr/bin/env python
"""Benchmark: peak memory and time of ``reshard inspect`` on hostile inputs of growing size.

Issue 13 asks for bounded resources: a `.metadata` of N bytes never costs more than a fixed
multiple of N whatever it holds, the coverage check is O(n log n), special files are refused
before they are read. This benchmark builds each hostile input (with the builders of
``scripts/fuzz_inputs.py``, shared with ``tests/test_fuzz.py``) at growing sizes and runs
the CLI exactly as a user does::

    python -m reshard inspect X --json

in a fresh subprocess, reading that child's own peak RSS from ``wait4`` (``ru_maxrss``).
Beside it, where the input is one stock DCP can read, the same input goes through the best
alternative, torch's own ``FileSystemReader(X).read_metadata()``, in the same run, and the
table gives the ratio of the two peaks. Cases:

- ``amplify``: a `.metadata` built only from the allow-listed globals whose tensors share
  one memoised chunk list (K tensors x K chunks in about 105 K bytes), 0.1 / 0.5 / 1.5 / 5 MB;
- ``huge-declared``: a real one-tensor checkpoint whose `.metadata` declares the tensor
  2^10 / 2^20 / 2^30 times longer than its items hold (the 128 GiB in 8 KiB items);
- ``staircase``: a forged staircase layout of 2,000 / 8,000 / 20,000 chunks (every column
  of a 2-D tensor cut at a different row: a pairwise coverage check is quadratic), with the
  in-process time of ``reshard.model.geometry.coverage_problems`` on the same layout;
- ``dev-zero`` / ``fifo``: `.metadata` a symlink to /dev/zero, and a FIFO;
- ``baseline``: the same one-tensor checkpoint, benign (start-up memory of the CLI).

Every child runs under an address-space cap (``--cap-gib``, default 8) so an unbounded
reader fails with MemoryError instead of exhausting the machine, and under a timeout.

Usage::

    .venv/bin/python scripts/bench_hostile.py                    # writes docs/hostile.md
    .venv/bin/python scripts/bench_hostile.py --quick --out /tmp/hostile.md

Exit 0 when every hostile case exits 2 (baseline and the tiled staircase 0) without
timing out; 1 otherwise.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_convert_memory import machine  # noqa: E402  (one description of the machine for every benchmark)

_spec = importlib.util.spec_from_file_location("reshard_fuzz_inputs", HERE / "fuzz_inputs.py")
fz = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fz
_spec.loader.exec_module(fz)

MIB = 1 << 20
FIFO_TORCH_TIMEOUT = 20.0  # stock DCP blocks on a FIFO .metadata: stop it after this long
PER_BYTE_MIN = 64 << 10  # inputs smaller than this show no per-byte figure (allocator noise dominates)
PAIRWISE_MAX_N = 1000  # the old quadratic sweep is timed on the 2,000-chunk staircase only (8,000 took minutes)
TORCH_READ = ("import sys; from torch.distributed.checkpoint import FileSystemReader; "
              "FileSystemReader(sys.argv[1]).read_metadata()")


@dataclass
class Run:
    """One child process: exit code, peak RSS (from wait4), wall time, the tail of stderr."""

    code: int | None
    rss_bytes: int
    wall_s: float
    timed_out: bool = False
    err_tail: str = ""

    def to_dict(self) -> dict:
        return {"code": self.code, "rss_bytes": self.rss_bytes, "wall_s": round(self.wall_s, 3),
                "timed_out": self.timed_out, "err_tail": self.err_tail}


def run_measured(cmd: list[str], *, timeout: float = 300.0, cap_bytes: int | None = 8 << 30) -> Run:
    """Run ``cmd``; its own peak RSS comes from ``wait4``, not from sampling.

    ``cap_bytes`` caps the child's address space (RLIMIT_AS): an unbounded reader gets a
    MemoryError instead of the machine's OOM killer. A child past ``timeout`` is killed.
    """
    def limit() -> None:
        if cap_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))

    env = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, preexec_fn=limit, env=env)
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        err.seek(0)
        tail = err.read()[-600:].decode("utf-8", "replace").strip()
    return Run(None if fired.is_set() else p.returncode, ru.ru_maxrss * 1024, wall, fired.is_set(), tail)


def inspect_cmd(python: str, ckpt: Path) -> list[str]:
    return [python, "-m", "reshard", "inspect", str(ckpt), "--json"]


def torch_cmd(python: str, ckpt: Path) -> list[str]:
    return [python, "-c", TORCH_READ, str(ckpt)]


@dataclass
class Case:
    name: str
    size: str               # what grows (a human label)
    input_bytes: int        # bytes of the hostile input file (.metadata)
    expect: int             # exit code of a safe inspect
    reshard: Run | None = None
    torch: Run | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "size": self.size, "input_bytes": self.input_bytes, "expect": self.expect,
                "reshard": self.reshard.to_dict() if self.reshard else None,
                "torch": self.torch.to_dict() if self.torch else None, **self.extra}


def one_tensor_checkpoint(out: Path) -> Path:
    """A real single-process dcp.save of one float32 tensor (2,048 x 4), for the declared-size cases."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    out.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model.w": torch.arange(8192, dtype=torch.float32).view(2048, 4)}, checkpoint_id=str(out), no_dist=True)
    return out


def coverage_time(n: int) -> float:
    """In-process seconds of `coverage_problems` on the staircase of ``2n`` chunks (best of 3)."""
    from reshard.model.geometry import Box, coverage_problems

    boxes = [Box(o, s) for o, s in fz.staircase_chunks(n)]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        assert coverage_problems((n + 1, n), boxes) == []
        best = min(best, time.perf_counter() - t0)
    return best


def pairwise_time(n: int) -> float | None:
    """Seconds of the pairwise sweep coverage_problems used before issue 13 (kept as the
    reference in tests/test_geometry.py) on the same staircase; None without the tests."""
    test = HERE.parent / "tests" / "test_geometry.py"
    if not test.exists():
        return None
    spec = importlib.util.spec_from_file_location("reshard_test_geometry", test)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from reshard.model.geometry import Box

    boxes = [Box(o, s) for o, s in fz.staircase_chunks(n)]
    t0 = time.perf_counter()
    assert mod.reference_coverage_problems((n + 1, n), boxes) == []
    return time.perf_counter() - t0


def build_cases(tmp: Path, quick: bool) -> list[tuple[Case, Path]]:
    """(case, checkpoint) for every case, built in ``tmp``."""
    cases: list[tuple[Case, Path]] = []
    base = one_tensor_checkpoint(tmp / "baseline")
    cases.append((Case("baseline", "1 tensor", (base / ".metadata").stat().st_size, 0), base))
    for mb in ((0.1, 0.5) if quick else (0.1, 0.5, 1.5, 5.0)):
        d = tmp / f"amplify-{mb}"
        s = fz.amplifying_metadata(d, int(mb * 1e6))
        cases.append((Case("amplify", f"{mb} MB ({s.what.split('(')[1].rstrip(')')})",
                           (d / ".metadata").stat().st_size, 2), d))
    for exp in ((10, 20) if quick else (10, 20, 30)):
        d = tmp / f"huge-{exp}"
        import shutil

        shutil.copytree(base, d)
        fz.forge_item_lengths(d, 1 << exp)
        declared = 2048 * 4 * 4 * (1 << exp)
        cases.append((Case("huge-declared", f"{declared / (1 << 30):,.2f} GiB declared in 32 KiB",
                           (d / ".metadata").stat().st_size, 2), d))
    for n in ((1000, 4000) if quick else (1000, 4000, 10000)):
        d = tmp / f"stair-{n}"
        fz.forge_staircase(d, n)
        c = Case("staircase", f"{2 * n:,} chunks", (d / ".metadata").stat().st_size, 0)
        c.extra["coverage_s"] = round(coverage_time(n), 4)
        if n <= PAIRWISE_MAX_N:
            p = pairwise_time(n)
            if p is not None:
                c.extra["pairwise_coverage_s"] = round(p, 2)
        cases.append((c, d))
        d = tmp / f"stair-gap-{n}"
        fz.forge_staircase(d, n, damage="gap")
        cases.append((Case("staircase+gap", f"{2 * n:,} chunks", (d / ".metadata").stat().st_size, 2), d))
    d = tmp / "dev-zero"
    d.mkdir()
    os.symlink("/dev/zero", d / ".metadata")
    cases.append((Case("dev-zero", ".metadata -> /dev/zero", 0, 2), d))
    d = tmp / "fifo"
    d.mkdir()
    os.mkfifo(d / ".metadata")
    cases.append((Case("fifo", ".metadata is a FIFO", 0, 2), d))
    return cases


def _mib(r: Run | None) -> str:
    return "-" if r is None else f"{r.rss_bytes / MIB:,.0f}"


def _code(r: Run | None) -> str:
    if r is None:
        return "-"
    return "timeout" if r.timed_out else str(r.code)


def markdown(result: dict) -> str:
    m = result["machine"]
    base = next(c for c in result["cases"] if c["name"] == "baseline")["reshard"]["rss_bytes"]
    lines = [
        "# Hostile inputs: peak memory of `reshard inspect`",
        "",
        f"Run {result['when']} with `scripts/bench_hostile.py`"
        + (" (--quick)" if result.get("quick") else "") + ". Each row is one fresh `python -m reshard inspect X --json`;",
        "peak RSS is the child's own `ru_maxrss` (wait4). *Above start-up* is the peak minus the benign baseline's;",
        "*per input byte* divides it by the size of the hostile `.metadata` (inputs of 64 KiB and more). The torch",
        "columns run stock DCP's `FileSystemReader(X).read_metadata()` on the same input in the same run (exit 1 there",
        "is torch refusing it, *timeout* is torch blocked); ratio = reshard peak / torch peak. Children run under an",
        f"address-space cap of {result['cap_gib']} GiB and a {result['timeout_s']:.0f} s timeout "
        f"({FIFO_TORCH_TIMEOUT:.0f} s for torch on the FIFO).",
        "",
        "| case | size | .metadata bytes | exit (want) | reshard peak MiB | above start-up MiB | per input byte | wall s "
        "| torch read_metadata peak MiB | torch wall s | RSS ratio |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cases"]:
        r, t = c["reshard"], c["torch"]
        extra = max(r["rss_bytes"] - base, 0)
        # per byte only where the input is large enough for the ratio to mean something
        above = extra / c["input_bytes"] if c["input_bytes"] >= PER_BYTE_MIN and c["name"] != "baseline" else None
        ratio = r["rss_bytes"] / t["rss_bytes"] if t and t["rss_bytes"] and not t["timed_out"] else None
        code = "timeout" if r["timed_out"] else str(r["code"])
        t_mib = "-" if not t else ("timeout" if t["timed_out"] else f"{t['rss_bytes'] / MIB:,.0f}" + ("" if t["code"] == 0 else f" (exit {t['code']})"))
        t_wall = "-" if not t else f"{t['wall_s']:.2f}"
        above_s = "-" if above is None else f"{above:.1f}"
        ratio_s = "-" if ratio is None else f"{ratio:.2f}"
        lines.append(
            f"| {c['name']} | {c['size']} | {c['input_bytes']:,} | {code} ({c['expect']}) | {r['rss_bytes'] / MIB:,.0f} "
            f"| {extra / MIB:,.0f} | {above_s} | {r['wall_s']:.2f} | {t_mib} | {t_wall} | {ratio_s} |")
    hostile = [c for c in result["cases"] if c["name"] != "baseline"]
    per_byte = [((c["reshard"]["rss_bytes"] - base) / c["input_bytes"], c) for c in hostile if c["input_bytes"] >= PER_BYTE_MIN]
    if per_byte:
        worst, wc = max(per_byte, key=lambda x: x[0])
        safe = all(not c["reshard"]["timed_out"] and c["reshard"]["code"] == c["expect"] for c in hostile)
        top = max(c["reshard"]["rss_bytes"] for c in hostile)
        lines += ["", f"Largest memory above start-up per byte of `.metadata`: {max(worst, 0):.1f} ({wc['name']}, {wc['size']}). "
                  f"Highest peak of any hostile case: {top / MIB:,.0f} MiB (start-up {base / MIB:,.0f} MiB). "
                  + ("Every case gave its safe outcome (hostile ones exit 2), none timed out or reached the cap."
                     if safe else "Some cases did not give the safe outcome (listed below).")]
    stairs = [c for c in result["cases"] if c["name"] == "staircase"]
    if stairs:
        lines += ["", "Coverage check alone (in process, best of 3, `reshard.model.geometry.coverage_problems` on the tiled staircase): "
                  + ", ".join(f"{c['size']} {c['coverage_s']:.3f} s" for c in stairs) + "."]
        old = [c for c in stairs if "pairwise_coverage_s" in c]
        if old:
            lines += ["A pairwise sweep (the reference the tests compare it with, in tests/test_geometry.py) on the same layouts: "
                      + ", ".join(f"{c['size']} {c['pairwise_coverage_s']:.2f} s" for c in old)
                      + "; it is quadratic (8,000 chunks take over 2 minutes)."]
    lines += ["", f"Machine: {m['nproc']} CPUs, {m.get('mem_total_gib', '?')} GiB RAM, {m['platform']}, "
              f"Python {m['python']}, torch {m['torch']}, reshard {m['reshard']}"
              + (f", load average {m['loadavg'][0]:.2f}" if m.get("loadavg") else "") + "."]
    bad = [c for c in result["cases"] if c["reshard"]["timed_out"] or c["reshard"]["code"] != c["expect"]]
    if bad:
        lines += ["", "Cases that did not give the safe outcome:", ""]
        for c in bad:
            code = "timeout" if c["reshard"]["timed_out"] else c["reshard"]["code"]
            lines.append(f"- {c['name']} {c['size']}: exit {code}; stderr tail: `{c['reshard']['err_tail'][-300:]}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE.parent / "docs" / "hostile.md", help="Markdown output")
    ap.add_argument("--json", type=Path, default=None, help="also write every run as JSON here")
    ap.add_argument("--quick", action="store_true", help="the two smallest sizes of each case")
    ap.add_argument("--cap-gib", type=float, default=8.0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--python", default=sys.executable)
    a = ap.parse_args(argv)
    cap = int(a.cap_gib * (1 << 30))
    with tempfile.TemporaryDirectory(prefix="reshard-hostile-") as tmp:
        built = build_cases(Path(tmp), a.quick)
        cases = []
        for c, ckpt in built:
            c.reshard = run_measured(inspect_cmd(a.python, ckpt), timeout=a.timeout, cap_bytes=cap)
            c.torch = run_measured(torch_cmd(a.python, ckpt), cap_bytes=cap,
                                   timeout=FIFO_TORCH_TIMEOUT if c.name == "fifo" else a.timeout)
            print(f"{c.name:14} {c.size:40} exit {_code(c.reshard):>7} (want {c.expect})  reshard {_mib(c.reshard):>6} MiB "
                  f"{c.reshard.wall_s:6.2f} s   torch {_mib(c.torch):>6} MiB", flush=True)
            cases.append(c)
    result = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "quick": a.quick, "cap_gib": a.cap_gib,
              "timeout_s": a.timeout, "machine": machine(), "cases": [c.to_dict() for c in cases]}
    md = markdown(result)
    print()
    print(md)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md)
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    ok = all(not c.reshard.timed_out and c.reshard.code == c.expect for c in cases)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
