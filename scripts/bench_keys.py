"""Benchmark (issue 45, part 1): the keys axis, 10k to 1M storage keys, against torch's read_metadata.

Why a benchmark of its own: the frontier benchmark (`scripts/bench_frontier.py`) grows the
*ranks* with a few hundred keys; a mixture-of-experts model grows the *keys* instead (one key
per expert weight, three more for its AdamW state), and the metadata path's cost per key
(classification by the conventions, the plan's per-key actions) is what it measures.

Checkpoints: an MoE-style model (per layer: attention, norms, a router, ``--experts`` experts of
three weights each) saved as ``get_state_dict(model, AdamW)`` by FSDP2 on ``--ranks`` ranks:
``model.<fqn>``, ``optim.state.<fqn>.{step,exp_avg,exp_avg_sq}``, ``optim.param_groups.0.*``.
The `.metadata` is the one torch's ``dcp.save`` writes, built by the frontier benchmark's own
builder (`reshard.testing.synthetic_metadata.make_checkpoint`, checked against real saves in
``tests/test_synthetic_metadata.py``), with sparse data files; the number of layers is chosen so
that the storage entries reach each ``--sizes`` target.

Per size, in rounds (A, B, C, A, B, C, ...: a slow spell of the shared machine falls on every
command), each in a fresh process:

* ``floor``: ``FileSystemReader(CKPT).read_metadata()`` (torch's own reader: the floor);
* ``inspect``: ``python -m reshard inspect CKPT --json --no-profile``;
* ``plan``: ``python -m reshard plan CKPT --to dp=<2 x ranks> --json --no-profile``;
* with ``--base DIR`` (a checkout of another revision, e.g. a worktree of main): ``inspect@base``
  and ``plan@base``, the same commands with ``PYTHONPATH=DIR``, in the same rounds.

CPU seconds (user + sys) and peak RSS (``ru_maxrss``) of each child alone come from
``os.wait4``; medians over the rounds. Ratios are to the floor's medians of the same size; the
slope is CPU seconds per 1,000 storage keys above the interpreter (``python -c pass``'s CPU),
so linear growth shows as a flat slope. The JSON outputs of reshard's commands are compared
between this tree and ``--base`` when both ran (identical bytes: ``same``).

Usage::

    .venv/bin/python scripts/bench_keys.py --sizes 10000,50000,180000,1000000 --rounds 3 \\
        --rounds-large 1 --base /work/main --out bench-results
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLOOR = ("import sys\nfrom torch.distributed.checkpoint import FileSystemReader\n"
         "md = FileSystemReader(sys.argv[1]).read_metadata()\n"
         "print(len(md.state_dict_metadata), len(md.storage_data))\n")
LARGE = 500_000  # sizes from here run --rounds-large rounds


@dataclass(frozen=True)
class MoeShape:
    """The MoE model's per-layer shapes: small tensors (the data files are sparse, the keys are the point)."""

    experts: int = 64
    dim: int = 64
    ffn: int = 32

    def params(self, layers: int) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(fqn, shape, TP dim) in registration order, as `synthetic_metadata.model_entries` takes them."""
        d, f = self.dim, self.ffn
        out: list[tuple[str, tuple[int, ...], int | None]] = [("tok_embeddings.weight", (1024, d), 0)]
        for i in range(layers):
            p = f"layers.{i}."
            out += [(p + "attention.wq.weight", (d, d), 0), (p + "attention.wk.weight", (d, d), 0),
                    (p + "attention.wv.weight", (d, d), 0), (p + "attention.wo.weight", (d, d), 1),
                    (p + "attention_norm.weight", (d,), None), (p + "ffn_norm.weight", (d,), None),
                    (p + "moe.router.gate.weight", (self.experts, d), None)]
            for e in range(self.experts):
                q = f"{p}moe.experts.{e}."
                out += [(q + "w1.weight", (f, d), 0), (q + "w2.weight", (d, f), 1), (q + "w3.weight", (f, d), 0)]
        out += [("norm.weight", (d,), None), ("output.weight", (1024, d), 0)]
        return out

    def entries_per_layer(self, ranks: int) -> int:
        """Storage entries a layer adds: per parameter its dp chunks for the weight and both moments, one step."""
        return (7 + 3 * self.experts) * (3 * ranks + 1)


def run_child(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """argv in a fresh process: exit, wall, CPU (user + sys) and peak RSS of that child alone, its stdout's sha256."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # not from the checkout: ``python -m`` puts the working directory first, before PYTHONPATH
        proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=tempfile.gettempdir(), env=env, start_new_session=True)
        deadline, timed_out = t0 + timeout, False
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, ru = os.wait4(proc.pid, 0)
                timed_out = True
                break
            time.sleep(0.02)
        wall = time.monotonic() - t0
        out.seek(0)
        stdout = out.read()
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return {"exit": None if timed_out else os.waitstatus_to_exitcode(status), "timeout": timed_out,
            "wall_s": round(wall, 3), "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
            "rss_mib": round(ru.ru_maxrss / 1024, 1), "out_bytes": len(stdout),
            "out_sha256": hashlib.sha256(stdout).hexdigest(), "stderr_tail": stderr[-800:]}


def commands(ckpt: Path, ranks: int, base: str | None) -> dict[str, tuple[list[str], dict[str, str] | None]]:
    """Command name -> (argv, environment): the floor, this tree's inspect and plan, and the base's."""
    py = sys.executable
    inspect = [py, "-m", "reshard", "inspect", str(ckpt), "--json", "--no-profile"]
    plan = [py, "-m", "reshard", "plan", str(ckpt), "--to", f"dp={2 * ranks}", "--json", "--no-profile"]
    here = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = {"floor": ([py, "-c", FLOOR, str(ckpt)], None), "inspect": (inspect, here), "plan": (plan, here)}
    if base:
        there = {**os.environ, "PYTHONPATH": base}
        out["inspect@base"] = (inspect, there)
        out["plan@base"] = (plan, there)
    return out


def build(work: Path, target: int, ranks: int, shape: MoeShape, reuse: bool) -> dict:
    """The checkpoint of about ``target`` storage entries (built once per size with ``--reuse``), built
    in a child process: the builder imports torch, and a child's ``ru_maxrss`` starts from its parent's."""
    facts_file = work / f"moe-{target}.build.json"
    if not (reuse and facts_file.is_file()):
        subprocess.run([sys.executable, __file__, "--build-one", str(target), "--ranks", str(ranks),
                        "--experts", str(shape.experts), "--workdir", str(work)], check=True)
    return json.loads(facts_file.read_text())


def build_one(work: Path, target: int, ranks: int, shape: MoeShape) -> None:
    """``--build-one``: write the checkpoint and its facts (``moe-<target>.build.json`` beside it)."""
    from reshard.testing import synthetic_metadata as sm

    layers = max(1, round(target / shape.entries_per_layer(ranks)))
    ckpt = work / f"moe-{target}"
    facts_file = work / f"moe-{target}.build.json"
    t0 = time.monotonic()
    res = sm.make_checkpoint(ckpt, sm.model_entries(shape.params(layers)), dp=ranks)
    facts = {"path": str(ckpt), "target": target, "layers": layers, "experts": shape.experts, "ranks": ranks,
             "keys": res.keys, "storage_entries": res.storage_entries, "metadata_bytes": res.metadata_bytes,
             "build_s": round(time.monotonic() - t0, 1)}
    facts_file.write_text(json.dumps(facts))


def summarise(runs: list[dict]) -> dict:
    """Medians (and min-max of CPU) over the runs that exited 0."""
    ok = [r for r in runs if r["exit"] == 0]
    if not ok:
        return {"n": 0, "exits": [r["exit"] for r in runs], "tail": runs[-1]["stderr_tail"] if runs else ""}
    cpu = [r["cpu_s"] for r in ok]
    return {"n": len(ok), "exits": [r["exit"] for r in runs], "cpu_s": statistics.median(cpu),
            "cpu_min": min(cpu), "cpu_max": max(cpu), "wall_s": statistics.median(r["wall_s"] for r in ok),
            "rss_mib": statistics.median(r["rss_mib"] for r in ok), "out_sha256": sorted({r["out_sha256"] for r in ok}),
            "out_bytes": ok[-1]["out_bytes"]}


def markdown(rep: dict) -> str:
    names = rep["commands"]
    lines = [f"Measured {rep['when']} on {rep['machine']['nproc']} CPUs, {rep['machine']['platform']}, Python "
             f"{rep['machine']['python']}, commit `{rep['machine']['commit']}`; load average {rep['load_start']} at the "
             f"start, {rep['load_end']} at the end.", f"Command: `{rep['command']}`.",
             f"Interpreter alone (`python -c pass`): {rep['interp_cpu_s']:.3f} s CPU.", "",
             "Medians of CPU s (user + sys) and peak RSS of each child; `[x]`: ratio to the floor's median of the size "
             "(CPU, RSS); slope: CPU ms per 1,000 storage keys above the interpreter.", "",
             "| storage keys (state-dict keys, `.metadata`) | rounds | " + " | ".join(f"`{n}`" for n in names) + " |",
             "|---|---:|" + "---|" * len(names)]
    for s in rep["sizes"]:
        floor = s["results"].get("floor", {})
        cells = []
        for n in names:
            r = s["results"].get(n, {})
            if not r.get("n"):
                cells.append(f"failed: exits {r.get('exits')}")
                continue
            cell = f"{r['cpu_s']:.2f} s ({r['cpu_min']:.2f}-{r['cpu_max']:.2f}), {r['rss_mib']:.0f} MiB"
            if n != "floor" and floor.get("n"):
                cell += f" [**{r['cpu_s'] / floor['cpu_s']:.2f}x**, {r['rss_mib'] / floor['rss_mib']:.2f}x]"
            slope = (r["cpu_s"] - rep["interp_cpu_s"]) / s["storage_entries"] * 1e6
            cell += f"; {slope:.2f} ms/1k"
            cells.append(cell)
        lines.append(f"| {s['storage_entries']:,} ({s['keys']:,}, {s['metadata_bytes'] / 2**20:.1f} MiB) | "
                     f"{s['rounds']} | " + " | ".join(cells) + " |")
    same = [f"{s['storage_entries']:,}: inspect {s.get('same_inspect')}, plan {s.get('same_plan')}"
            for s in rep["sizes"] if "same_inspect" in s]
    if same:
        lines += ["", "JSON output of this tree against the base, byte for byte: " + "; ".join(same) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10000,50000,180000,1000000", help="storage-entry targets, comma-separated")
    ap.add_argument("--ranks", type=int, default=2, help="FSDP2 ranks that wrote the checkpoint")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rounds-large", type=int, default=1, help=f"rounds at sizes of {LARGE:,} keys and more")
    ap.add_argument("--base", default=None, help="a checkout of the base revision: its inspect and plan run too")
    ap.add_argument("--only", default=None, help="a subset of the commands, comma-separated")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--reuse", action="store_true", help="keep checkpoints in --workdir and reuse them")
    ap.add_argument("--max-seconds", type=float, default=900.0, help="per command")
    ap.add_argument("--out", default=str(ROOT / "bench-results"))
    ap.add_argument("--build-one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.build_one is not None:
        build_one(Path(args.workdir), args.build_one, args.ranks, MoeShape(experts=args.experts))
        return 0

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    machine = {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(), "commit": commit}
    load_start = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-keys-"))
    work.mkdir(parents=True, exist_ok=True)
    interp = statistics.median(run_child([sys.executable, "-c", "pass"], 60)["cpu_s"] for _ in range(5))
    shape = MoeShape(experts=args.experts)
    sizes = []
    try:
        for target in (int(x) for x in args.sizes.split(",") if x):
            facts = build(work, target, args.ranks, shape, args.reuse)
            ckpt = Path(facts["path"])
            print(f"{target:,}: {facts['storage_entries']:,} storage entries, {facts['keys']:,} keys, "
                  f".metadata {facts['metadata_bytes'] / 2**20:.1f} MiB, {facts['layers']} layers "
                  f"(built in {facts['build_s']} s)", flush=True)
            cmds = commands(ckpt, args.ranks, args.base)
            if args.only:
                cmds = {k: v for k, v in cmds.items() if k in args.only.split(",")}
            rounds = args.rounds_large if target >= LARGE else args.rounds
            runs: dict[str, list[dict]] = {n: [] for n in cmds}
            for i in range(rounds):
                for name, (argv_, env) in cmds.items():
                    r = run_child(argv_, args.max_seconds, env)
                    runs[name].append(r)
                    print(f"  round {i + 1} {name:13s} exit {r['exit']} cpu {r['cpu_s']:.2f} s wall {r['wall_s']:.2f} s "
                          f"rss {r['rss_mib']:.0f} MiB", flush=True)
            row = {**facts, "rounds": rounds, "results": {n: summarise(rs) for n, rs in runs.items()}, "runs": runs}
            for verb in ("inspect", "plan"):
                a, b = row["results"].get(verb, {}), row["results"].get(f"{verb}@base", {})
                if a.get("n") and b.get("n"):
                    row[f"same_{verb}"] = a["out_sha256"] == b["out_sha256"]
            sizes.append(row)
            partial = Path(args.out) / "bench_keys.partial.json"  # what a stopped run measured so far
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(sizes, indent=2))
            if not args.reuse:
                shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    names = list(sizes[0]["results"]) if sizes else []
    rep = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine,
           "command": " ".join(["python", "scripts/bench_keys.py"] + (argv if argv is not None else sys.argv[1:])),
           "load_start": load_start, "load_end": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
           "interp_cpu_s": interp, "commands": names, "sizes": sizes}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_keys.json").write_text(json.dumps(rep, indent=2))
    md = markdown(rep)
    (out / "bench_keys.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
