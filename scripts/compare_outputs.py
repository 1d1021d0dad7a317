"""Are this tree's outputs byte-identical to another revision's? For refactors that promise "behaviour unchanged".

    python scripts/compare_outputs.py BASE_REV [--this REV] [--work DIR] [--mib 64]

Checks out ``BASE_REV`` (and ``--this REV``, else this working tree is used) in a temporary git worktree, makes the checkpoints once with this
tree's makers (the benchmark's `make_sharded` layout at ``--mib`` MiB, a plain FSDP2
`get_state_dict` checkpoint, and the reference trainer's 4-rank checkpoint with its full
trainer state), then runs the same commands with each tree (``PYTHONPATH`` first on the
path, same destination path, ``SOURCE_DATE_EPOCH`` set) and compares every output file byte
for byte: convert (direct, ``--buffered``, to one rank, a TP target with the benchmark's
rules file, ``--output-format local``), export (safetensors, torch) and import (of the
reference's safetensors export, made once by this tree, to dp=2 and to dp=3). Prints one line per
command and exits 1 if any output differs.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))



def _make(work: Path, mib: int) -> dict[str, Path]:
    from reshard.reference import TrainConfig, run_reference
    from reshard.testing.synthetic import make_plain_fsdp2, make_sharded

    n = max(1, mib // 16)
    ck = {"sharded": make_sharded(work / "sharded", world_size=4, n_tensors=n, shape=(1024, 4096)),
          "plain": make_plain_fsdp2(work / "plain", world_size=4)}
    cfg = TrainConfig(dp=4, tp=1, steps=3, save_at=[3], out=str(work / "reference"), experiment_id="compare")
    ck["reference"] = run_reference(cfg)[-1]
    exported = work / "exported"  # the import's source: this tree's safetensors export of the reference run
    subprocess.run([sys.executable, "-m", "reshard", "export", str(ck["reference"]), str(exported), "--format",
                    "safetensors"], check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    ck["exported"] = exported
    return ck


def _commands(ck: dict[str, Path], rules: Path) -> dict[str, list[str]]:
    return {
        "sharded convert dp=2": ["convert", ck["sharded"], "{dst}", "--to", "dp=2"],
        "sharded convert dp=3 --buffered": ["convert", ck["sharded"], "{dst}", "--to", "dp=3", "--buffered"],
        "sharded convert dp=2,tp=2": ["convert", ck["sharded"], "{dst}", "--to", "dp=2,tp=2", "--rules", rules],
        "plain convert dp=1": ["convert", ck["plain"], "{dst}", "--to", "dp=1"],
        "reference convert dp=2": ["convert", ck["reference"], "{dst}", "--to", "dp=2"],
        "reference convert local": ["convert", ck["reference"], "{dst}", "--to", "dp=2", "--output-format", "local"],
        "reference export safetensors": ["export", ck["reference"], "{dst}", "--format", "safetensors"],
        "reference export torch": ["export", ck["reference"], "{dst}", "--format", "torch"],
        "export import dp=2": ["import", ck["exported"], "{dst}", "--to", "dp=2", "--experiment-id", "compare-import"],
        "export import dp=3": ["import", ck["exported"], "{dst}", "--to", "dp=3", "--experiment-id", "compare-import"],
    }


def _run(tree: Path, args: list, dst: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree), "SOURCE_DATE_EPOCH": "1700000000"}
    argv = [sys.executable, "-m", "reshard", *[str(a).replace("{dst}", str(dst)) for a in args]]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(dst.parent))


def _same_tree(a: Path, b: Path) -> list[str]:
    diffs = []
    names = sorted({p.relative_to(a) for p in a.rglob("*")} | {p.relative_to(b) for p in b.rglob("*")})
    for n in names:
        pa, pb = a / n, b / n
        if pa.is_dir() or pb.is_dir():
            continue
        if not (pa.exists() and pb.exists()) or not filecmp.cmp(pa, pb, shallow=False):
            diffs.append(str(n))
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="the revision to compare with (e.g. the commit before a refactor)")
    ap.add_argument("--this", default=None, help="compare this revision instead of the working tree")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--mib", type=int, default=64, help="size of the sharded benchmark-layout checkpoint")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="reshard-compare-"))
    base = work / "base-tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), a.base], check=True,
                   capture_output=True)
    this = ROOT
    if a.this:
        this = work / "this-tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(this), a.this], check=True,
                       capture_output=True)
    failed = 0
    try:
        ck = _make(work / "ckpts", a.mib)
        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_speed import RULES_TOML  # the benchmark's own TP rules (dim 1: the column-block path)

        rules = work / "rules.toml"
        rules.write_text(RULES_TOML.format(dim=1))
        for name, args in _commands(ck, rules).items():
            dst = work / "run" / "out"
            dst.parent.mkdir(parents=True, exist_ok=True)
            outs = {}
            for label, tree in (("base", base), ("this", this)):
                shutil.rmtree(dst, ignore_errors=True)
                r = _run(tree, args, dst)
                if r.returncode != 0:
                    outs[label] = None
                    print(f"{name}: {label} tree exited {r.returncode}: {r.stderr.strip()[:300]}")
                    continue
                outs[label] = dst.rename(work / "run" / f"{label}-{len(outs)}")
            if outs.get("base") is None or outs.get("this") is None:
                failed += 1
                continue
            diffs = _same_tree(outs["base"], outs["this"])
            failed += bool(diffs)
            print(f"{name}: {'identical' if not diffs else 'DIFFERENT: ' + ', '.join(diffs[:8])}"
                  f" ({sum(p.stat().st_size for p in outs['this'].rglob('*') if p.is_file()):,} bytes)")
            shutil.rmtree(outs["base"]), shutil.rmtree(outs["this"])
    finally:
        for tree in {base, this} - {ROOT}:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    print("all outputs identical" if not failed else f"{failed} command(s) differ")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
