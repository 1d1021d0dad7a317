"""The data path's CPU and the fixed cost of a conversion, side by side with their anchors (issue 45, part 2).

    python scripts/bench_datapath.py [--gib 4] [--rounds 3] [--small-rounds 7] [--tree main=/path/to/other/tree] [--out bench-results]

Builds two real checkpoints once, with torch's own ``dcp.save``:

* large: ``make_sharded`` (4 gloo ranks, float32 tensors of 16 MiB, ``Shard(0)``; the layout of
  ``scripts/bench_speed.py``) of ``--gib`` GiB, converted ``--to dp=2``, and the same layout at
  ``--mid-gib`` GiB: the difference of their CPU seconds over the difference of their sizes is the
  marginal CPU per GiB, the data path's own cost without the fixed cost;
* small: the reference trainer's 4-rank checkpoint at step 3 (model, Adam moments, scheduler,
  sampler, per-rank RNG: about 300 items, about 1 MB), converted ``--to dp=2``.

Then runs, in rounds, each command once per round and in the same order (A, B, A, B...), every
command in a fresh process, the page cache dropped before each large one when this process may
(root: ``/proc/sys/vm/drop_caches``; the output says when it could not); the small ones run warm:

* ``reshard convert LARGE DST --to dp=2`` of every tree (``--tree NAME=PATH``, first on
  ``PYTHONPATH``; default: this tree only), wall time and CPU seconds (user + sys of the child,
  ``os.wait4``);
* ``scripts/directcopy.py LARGE DST`` (``O_DIRECT``, 4 streams, fsync at the end): the device's
  durable direct copy;
* ``python -c "import torch"`` and ``reshard convert SMALL DST --to dp=2`` of every tree, warm (an
  unrecorded import first): the fixed cost is the convert's wall (and CPU) minus the import's in the
  same round.

Every tree is byte-compiled first (``compileall``), as an installed package is: with
``PYTHONDONTWRITEBYTECODE`` set and no ``__pycache__``, each run would compile reshard's modules again.

The small conversion and its anchor may run more rounds than the large ones (``--small-rounds``: they
take seconds, the large ones minutes); each small conversion is also reported against the import
run just before it (``per_round_*``), and every run records the 1-minute load average it ended at.

Reports medians (and every run) in ``OUT/bench_datapath.{json,md}``. CPU seconds, not wall time,
are the figure to read on a machine shared with other work; every ratio is against the anchor of
the same round. The outputs of the trees are compared byte for byte (reports excepted, their
``seconds`` differ).
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_convert_memory import GIB, add_manifest, machine  # noqa: E402 - scripts/ is not a package
from bench_speed import can_drop_caches, drop_caches  # noqa: E402

REPORTS = {"reshard-report.json", "reshard-report.md"}


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> dict:
    """``cmd`` in a fresh process: wall seconds, CPU seconds (user + sys), peak RSS, exit code."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    p.stderr.close()
    # (no peak RSS: a child's ru_maxrss counts this process's pages at the fork, torch's included)
    return {"wall_s": round(wall, 3), "cpu_s": round(ru.ru_utime + ru.ru_stime, 3), "user_s": round(ru.ru_utime, 3),
            "sys_s": round(ru.ru_stime, 3), "exit_code": p.returncode, "load_1min": round(os.getloadavg()[0], 2),
            **({"stderr_tail": err.decode(errors="replace")[-800:]} if p.returncode else {})}


def same_outputs(a: Path, b: Path) -> bool:
    """Every file of ``a`` and ``b`` byte-identical (the reports' ``seconds`` excepted)."""
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name not in REPORTS)
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.name not in REPORTS)
    return fa == fb and all(filecmp.cmp(a / f, b / f, shallow=False) for f in fa)


def build(tmp: Path, gib: float, mid_gib: float, world_size: int) -> tuple[Path, Path | None, Path]:
    """The large and the mid-sized ``make_sharded`` checkpoints and the reference trainer's small one,
    each made once under ``tmp`` (a later run with the same ``--tmp`` reuses them)."""
    from reshard.reference import TrainConfig, run_reference
    from reshard.testing.synthetic import make_sharded

    shape = (1024, 4096)  # 16 MiB of float32 per tensor, bench_speed's default

    def sharded(name: str, size: float) -> Path:
        out = tmp / name
        if not (out / ".metadata").exists():
            n = max(1, round(size * GIB / (shape[0] * shape[1] * 4)))
            make_sharded(out, world_size=world_size, n_tensors=n, shape=shape, seed=0, timeout=3600)
            add_manifest(out, world_size=world_size)
        return out

    large = sharded("large" if gib == 4.0 else f"large-{gib:g}", gib)
    mid = sharded(f"mid-{mid_gib:g}", mid_gib) if mid_gib > 0 else None
    small_run = tmp / "small-run"
    small = next(iter(sorted(small_run.glob("step*"))), None) if small_run.exists() else None
    if small is None:
        cfg = TrainConfig(dp=4, tp=1, steps=3, save_at=[3], out=str(small_run), experiment_id="bench-datapath")
        small = Path(run_reference(cfg)[-1])
    return large, mid, small


def items(ckpt: Path) -> int:
    from reshard.storage.checkpoints.index import CheckpointIndex

    return CheckpointIndex.open(ckpt).item_count()


def dir_facts(p: Path) -> dict:
    files = [f for f in p.rglob("*") if f.is_file()]
    return {"bytes": sum(f.stat().st_size for f in files), "files": len(files)}


def med(rs: list[dict], field: str) -> float | None:
    xs = [r[field] for r in rs if r.get("exit_code") == 0 and r.get(field) is not None]
    return round(statistics.median(xs), 3) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0, help="size of the large checkpoint (default 4)")
    ap.add_argument("--mid-gib", type=float, default=1.0,
                    help="a second make_sharded size for the marginal CPU per GiB (default 1; 0: none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small-rounds", type=int, default=None,
                    help="rounds of the small conversion and its import anchor (default: --rounds); the large runs "
                         "take the first --rounds of them")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--tree", action="append", default=[],
                    help="NAME=PATH of a reshard tree to run (repeatable; default: this tree as 'this')")
    ap.add_argument("--streams", type=int, default=4, help="directcopy.py streams (default 4)")
    ap.add_argument("--tmp", default=None, help="where the checkpoints go (kept there: reused by a later run)")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--no-large", action="store_true")
    ap.add_argument("--no-small", action="store_true")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--no-compile", action="store_true",
                    help="do not byte-compile the trees first (then every run compiles reshard's modules, about 0.3 s of CPU, "
                         "where PYTHONDONTWRITEBYTECODE is set)")
    args = ap.parse_args(argv)

    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(ROOT)}
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="bench-datapath-"))
    tmp.mkdir(parents=True, exist_ok=True)
    cold = can_drop_caches()
    print(f"checkpoints in {tmp}; page cache dropped before each command: {cold}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    large, mid, small = build(tmp, args.gib, args.mid_gib, args.world_size)
    print(f"built in {time.perf_counter() - t0:.1f} s: large {dir_facts(large)}, small {dir_facts(small)}",
          file=sys.stderr, flush=True)
    py = args.python
    if not args.no_compile:  # as an installed package has them; PYTHONDONTWRITEBYTECODE=1 would recompile every run
        for tree in trees.values():
            subprocess.run([py, "-m", "compileall", "-q", str(Path(tree) / "reshard")], check=True,
                           stdout=subprocess.DEVNULL)
    runs: dict[str, list[dict]] = {}
    same: dict[str, bool] = {}

    def one(name: str, cmd: list[str], tree: str | None = None, dst: Path | None = None, drop: bool = True) -> dict:
        if dst is not None:
            shutil.rmtree(dst, ignore_errors=True)
        env = dict(os.environ, SOURCE_DATE_EPOCH="1")
        if tree is not None:
            env["PYTHONPATH"] = trees[tree]
        drop_caches(cold and drop)
        r = run(cmd, env=env, cwd=Path(trees[tree]) if tree is not None else None)
        runs.setdefault(name, []).append(r)
        print(f"  {name}: wall {r['wall_s']:.2f} s, CPU {r['cpu_s']:.2f} s (user {r['user_s']:.2f}, sys {r['sys_s']:.2f}), "
              f"exit {r['exit_code']}", file=sys.stderr, flush=True)
        if r["exit_code"]:
            print(r.get("stderr_tail", ""), file=sys.stderr)
        return r

    def compare_and_clear(kind: str, outs: dict[str, Path]) -> None:
        """Every tree's output against the first tree's, byte for byte (a difference in any round counts)."""
        first = next(iter(outs.values()))
        for name, d in outs.items():
            if d != first and d.exists() and first.exists():
                same[f"{kind} {name}"] = same.get(f"{kind} {name}", True) and same_outputs(first, d)
        for d in outs.values():
            shutil.rmtree(d, ignore_errors=True)

    small_rounds = args.rounds if args.small_rounds is None else args.small_rounds
    rounds = max(args.rounds, small_rounds)
    for i in range(rounds):
        print(f"round {i + 1}/{rounds}, load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        if not args.no_large and i < args.rounds:
            outs = {}
            for name in trees:
                dst = tmp / f"out-large-{name}"
                one(f"convert_large[{name}]", [py, "-m", "reshard", "convert", str(large), str(dst), "--to", "dp=2",
                                               "--json"], name, dst)
                outs[name] = dst
                dcp = tmp / "directcopy"
                one("directcopy_large", [py, str(HERE / "directcopy.py"), str(large), str(dcp), "--streams",
                                         str(args.streams)], None, dcp)
                shutil.rmtree(dcp, ignore_errors=True)
                if mid is not None:
                    mdst = tmp / f"out-mid-{name}"
                    one(f"convert_mid[{name}]", [py, "-m", "reshard", "convert", str(mid), str(mdst), "--to", "dp=2",
                                                 "--json"], name, mdst)
                    shutil.rmtree(mdst, ignore_errors=True)
            compare_and_clear("large", outs)
        if not args.no_small and i < small_rounds:
            # warm: the fixed cost is CPU work, not the disk reading torch's libraries (a cold `import torch`
            # reads hundreds of MB, which would be most of both figures); one unrecorded import warms the cache
            run([py, "-c", "import torch"])
            outs = {}
            for name in trees:
                one("import_torch", [py, "-c", "import torch"], None, drop=False)
                dst = tmp / f"out-small-{name}"
                one(f"convert_small[{name}]", [py, "-m", "reshard", "convert", str(small), str(dst), "--to", "dp=2",
                                               "--json"], name, dst, drop=False)
                outs[name] = dst
            compare_and_clear("small", outs)

    gib = dir_facts(large)["bytes"] / GIB
    mid_gib = dir_facts(mid)["bytes"] / GIB if mid is not None else None
    n_small = items(small)
    summary: dict = {}
    for name in trees:
        big = runs.get(f"convert_large[{name}]", [])
        if big:
            summary[f"convert_large[{name}]"] = {
                "wall_s": med(big, "wall_s"), "cpu_s": med(big, "cpu_s"),
                "cpu_s_per_gib": round(med(big, "cpu_s") / gib, 3) if med(big, "cpu_s") else None,
                "wall_x_directcopy": round(med(big, "wall_s") / med(runs["directcopy_large"], "wall_s"), 2)
                if med(big, "wall_s") and med(runs.get("directcopy_large", []), "wall_s") else None}
        mids = runs.get(f"convert_mid[{name}]", [])
        if mids and big and med(mids, "cpu_s") and med(big, "cpu_s"):
            summary[f"convert_mid[{name}]"] = {
                "wall_s": med(mids, "wall_s"), "cpu_s": med(mids, "cpu_s"),
                "marginal_cpu_s_per_gib": round((med(big, "cpu_s") - med(mids, "cpu_s")) / (gib - mid_gib), 3)}
        sm = runs.get(f"convert_small[{name}]", [])
        if sm:
            over = med(sm, "cpu_s") - med(runs["import_torch"], "cpu_s")
            # each round's convert against the import run just before it (the same tree's slot in that round)
            imports = runs["import_torch"][list(trees).index(name)::len(trees)]
            pairs = [(c, t) for c, t in zip(sm, imports) if c.get("exit_code") == 0 and t.get("exit_code") == 0]
            summary[f"convert_small[{name}]"] = {
                "wall_s": med(sm, "wall_s"), "cpu_s": med(sm, "cpu_s"),
                "wall_minus_import_torch_s": round(med(sm, "wall_s") - med(runs["import_torch"], "wall_s"), 3),
                "cpu_minus_import_torch_s": round(over, 3), "items": n_small,
                "cpu_us_per_item_over_import": round(over / n_small * 1e6),
                "per_round_wall_minus_import_s": [round(c["wall_s"] - t["wall_s"], 3) for c, t in pairs],
                "per_round_cpu_minus_import_s": [round(c["cpu_s"] - t["cpu_s"], 3) for c, t in pairs],
                "load_1min": [c["load_1min"] for c in sm]}
    for k in ("directcopy_large", "import_torch"):
        if runs.get(k):
            summary[k] = {"wall_s": med(runs[k], "wall_s"), "cpu_s": med(runs[k], "cpu_s")}
    result = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "trees": trees, "cold_cache": cold, "large": {**dir_facts(large), "gib": round(gib, 3)},
              "mid": {**dir_facts(mid), "gib": round(mid_gib, 3)} if mid is not None else None,
              "small": {**dir_facts(small), "items": n_small}, "rounds": args.rounds, "small_rounds": small_rounds, "summary": summary, "outputs_identical": same,
              "load_average": os.getloadavg(), "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_datapath.json").write_text(json.dumps(result, indent=1))
    lines = ["| command | wall (median, s) | CPU (median, s) | derived |", "|---|---:|---:|---|"]
    for k, v in summary.items():
        extra = ", ".join(f"{a} {b}" for a, b in v.items() if a not in ("wall_s", "cpu_s"))
        lines.append(f"| {k} | {v['wall_s']} | {v['cpu_s']} | {extra} |")
    (out / "bench_datapath.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({"outputs_identical": same, "load_average": result["load_average"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
