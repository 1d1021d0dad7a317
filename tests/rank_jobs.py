"""The test side of the writer scripts in tests/writers/: run one for a list of jobs, read its results.

Each writer (``python tests/writers/X.py write|load JOBS.json``, its ranks run by
`tests/writers/jobs.py`) forks max(world) gloo ranks once for all the jobs, so a module pays
one torch start-up per direction; rank 0 ``torch.save``s each job's result, a failing rank its
traceback beside it.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    """A TCP port on the loopback for one job's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(writer: Path, mode: str, jobs: list[dict[str, Any]], where: Path, *, python_flags: tuple[str, ...] = (),
          timeout: int = 600) -> None:
    """Run ``writer`` once for all ``jobs`` (one fork of max(world) ranks); its output in the assertion if it fails."""
    spec = where / f"{mode}-jobs.json"
    spec.write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, *python_flags, str(writer), mode, str(spec)], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{mode} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


def result(path: str | Path) -> Any:
    """What rank 0 returned for a job; a failing rank's traceback as the assertion."""
    path = Path(path)
    errs = sorted(path.parent.glob(path.name + ".rank*.err"))
    assert not errs, "\n".join(torch.load(e, weights_only=False)["error"] for e in errs)
    res = torch.load(path, weights_only=False)
    assert res["error"] is None, res["error"]
    return res["state"]
