"""Measure the README's set-up as a new user meets it: fresh clone, fresh venv, each part timed.

Why: the README once promised "about 80 s on 2 cores" for its first command, and a new user
measured 9 min 17 s (install 5.5 min, demo 3.5-4 min). A figure a person plans around must be
measured, and measured as they run it: a ``git clone`` of the repository into an empty
directory, the README's own commands (read from its ``bash`` blocks, not retyped here, so a
change to them is measured as written), an empty pip cache, and the machine's facts beside
the figures (CPU count and model, memory, load average before and after each part: this is a
shared machine, and a loaded one stretches every figure).

Parts, each timed separately with ``time.perf_counter`` around a shell running it in the clone:

* ``venv``: the first command's ``python3 -m venv .venv``;
* ``install``: its ``pip install`` part (torch and reshard, what a user needs);
* ``demo``: its ``reshard demo`` (stdout read line by line as it comes, so each of the demo's
  six stages gets its own time);
* ``s3_install`` and ``pip_check``: the README's install line of the ``s3`` extra, in that venv,
  then ``pip check``, which must find no version conflict in what it left (issue 47);
* ``test_install``: the second (developer) command's ``pip install``, run in the same venv after
  the first, as a developer who ran the first command would: the ``test`` and ``interop``
  extras (pytest and the heavy trainers). The suite itself is not run here (docs/testing.md
  records each run of it).

Usage::

    .venv/bin/python scripts/measure_setup.py                # writes docs/setup-times.json and .md
    .venv/bin/python scripts/measure_setup.py --skip-test-install --keep

Exit 0 when every part succeeded, 1 when one failed (its output's tail is in the JSON), 2 bad usage.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Part:
    """One timed part of the set-up: the command as run, its wall time and the load around it."""

    name: str
    command: str
    seconds: float = 0.0
    exit_code: int | None = None
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)  # the demo's "=== [k/6]" headings and when each began
    tail: str = ""  # the last lines of its output when it failed


def readme_commands(readme: Path) -> tuple[list[str], list[str]]:
    """The README's two set-up commands, each split at ``&&`` (the user's and the developer's)."""
    blocks = re.findall(r"```bash\n(.*?)\n```", readme.read_text(), re.S)
    commands = [b.strip() for b in blocks if "python3 -m venv" in b]
    if len(commands) != 2:
        raise SystemExit(f"error: {readme} must hold exactly two set-up commands, found {len(commands)}")
    user = next(c for c in commands if "pytest" not in c)
    dev = next(c for c in commands if "pytest" in c)
    return [p.strip() for p in user.split("&&")], [p.strip() for p in dev.split("&&")]


def s3_install(readme: Path) -> str:
    """The README's install line of the ``s3`` extra (quoted inline where it tells the store path)."""
    found = re.findall(r"`(pip install [^`]*\[s3\][^`]*)`", readme.read_text())
    if len(found) != 1:
        raise SystemExit(f"error: {readme} must quote the s3 extra's install line once, found {len(found)}")
    return found[0]


def machine() -> dict:
    """What the figures depend on: cores, CPU model, memory, Python, OS."""
    model = ""
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "")
    except OSError:
        pass
    mem = None
    try:
        kib = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                   if ln.startswith("MemTotal"))
        mem = round(kib / 1024 / 1024, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "memory_gib": mem, "python": platform.python_version(),
            "platform": platform.platform(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def run_part(part: Part, cwd: Path, env: dict[str, str], log: Path) -> Part:
    """Run ``part.command`` in a shell in ``cwd``, its output (both streams) to ``log`` line by line."""
    part.load_before = [round(x, 2) for x in os.getloadavg()]
    print(f"[{part.name}] {part.command}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as fh:
        p = subprocess.Popen(part.command, shell=True, cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
        assert p.stdout is not None
        for line in p.stdout:
            now = time.perf_counter() - start
            fh.write(f"{now:8.2f} {line}")
            if line.startswith("=== ["):
                part.stages.append({"stage": line.strip().removeprefix("=== "), "at_s": round(now, 2)})
                print(f"  {now:7.1f} s  {line.strip()}", flush=True)
        part.exit_code = p.wait()
    part.seconds = round(time.perf_counter() - start, 2)
    part.load_after = [round(x, 2) for x in os.getloadavg()]
    if part.exit_code != 0:
        part.tail = "\n".join(log.read_text().splitlines()[-30:])
    print(f"[{part.name}] {part.seconds:.1f} s, exit {part.exit_code}, load {part.load_before} -> {part.load_after}",
          flush=True)
    return part


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(round(seconds % 60)):02d} s"


def markdown(record: dict) -> str:
    m = record["machine"]
    rows = [f"| {p['name']} | `{p['command']}` | {minutes(p['seconds'])} | {p['exit_code']} | "
            f"{p['load_before'][0]:.2f} -> {p['load_after'][0]:.2f} |" for p in record["parts"]]
    stages = []
    for p in record["parts"]:
        for i, s in enumerate(p["stages"]):
            end = p["stages"][i + 1]["at_s"] if i + 1 < len(p["stages"]) else p["seconds"]
            stages.append(f"| {s['stage'][:70]} | {end - s['at_s']:.0f} s |")
    out = [
        "# Set-up times",
        "",
        f"Measured by `scripts/measure_setup.py` on {record['date']} at commit {record.get('commit', '?')[:12]}: a fresh "
        "`git clone`, a fresh venv, an empty pip cache, the README's commands as written.",
        "",
        f"Machine: {m['cpus']} CPUs ({m['cpu_model'] or 'unknown model'}), {m['memory_gib']} GiB, Python "
        f"{m['python']}; load average (1 min) at the start {m['load_average_at_start'][0]:.2f} (a shared machine: "
        "a load above the core count stretches every figure).",
        "",
        "| part | command | wall time | exit | load (1 min) before -> after |",
        "|---|---|---|---|---|",
        *rows,
    ]
    if stages:
        out += ["", "The demo's stages:", "", "| stage | wall time |", "|---|---|", *stages]
    out += ["", "The test suite itself (the developer command's `pytest`) is not timed here: see "
            "[testing.md](testing.md).", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=ROOT, help="The repository to clone (default: this one).")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "setup-times.json", help="The JSON record.")
    ap.add_argument("--skip-test-install", action="store_true", help="Do not time the developer command's install.")
    ap.add_argument("--keep", action="store_true", help="Keep the clone (its path is printed).")
    ns = ap.parse_args(argv)

    user, dev = readme_commands(ns.repo / "README.md")
    work = Path(tempfile.mkdtemp(prefix="reshard-setup-"))
    clone = work / "reshard"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "RESHARD_DEBUG")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if "/.venv/" not in p)
    env["PIP_CACHE_DIR"] = str(work / "pip-cache")  # empty: a new user's first install
    env["PYTHONUNBUFFERED"] = "1"  # the demo's stage headings arrive as printed, so each is timed
    record: dict = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "machine": machine(), "parts": []}
    print(f"machine: {record['machine']}", flush=True)
    code = 0
    try:
        subprocess.run(["git", "clone", "--quiet", str(ns.repo), str(clone)], check=True)
        record["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, check=True, capture_output=True,
                                          text=True).stdout.strip()
        venv, install, demo = user[0], " && ".join(user[1:-1]), user[-1]
        dev_install = next(p for p in dev if " install " in p)
        parts = [Part("venv", venv), Part("install", install), Part("demo", demo),
                 # the README's S3 line, then whether pip finds a version conflict in what it left (issue 47)
                 Part("s3_install", ".venv/bin/" + s3_install(ns.repo / "README.md")), Part("pip_check", ".venv/bin/pip check")]
        if not ns.skip_test_install:
            parts.append(Part("test_install", dev_install))
        for part in parts:
            run_part(part, clone, env, work / f"{part.name}.log")
            record["parts"].append(asdict(part))
            if part.exit_code != 0:
                code = 1
                break
    finally:
        record["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(record, indent=2) + "\n")
        if record["parts"]:
            ns.out.with_suffix(".md").write_text(markdown(record))
            print(markdown(record))
        if ns.keep:
            print(f"clone kept in {clone}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
