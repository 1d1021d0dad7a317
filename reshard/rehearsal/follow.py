"""One line per optimizer step while a training run is going, read from its step log.

Why: a rehearsal or the demo runs a trainer for tens of seconds per run, in other
processes, and a terminal that shows nothing in the meantime looks hung. Every trainer under
the contract appends one JSON record per step to its step log (formats/step_log.md), so
following that file shows progress for any trainer, the reference one or the user's,
without asking it to print anything.

The log is read as data (``json.loads`` of complete lines), never executed; a line that is
not a step record is skipped, since the comparison, not this echo, judges the log.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["follow_steps", "step_line"]

POLL_S = 0.2  # how often the log is looked at: a step takes longer than this on any trainer worth rehearsing


def step_line(label: str, record: dict, total: int | None) -> str | None:
    """``  baseline  step 3/24  loss 4.1023  grad norm 1.20``, or None for a record with no step."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    parts = [f"  {label:<9} step {step}" + (f"/{total}" if total else "")]
    for name, field in (("loss", "loss"), ("grad norm", "grad_norm")):
        value = record.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{name} {value:.4f}")
    return "  ".join(parts)


@contextmanager
def follow_steps(log: Path, label: str, total: int | None, say: Callable[[str], None] | None) -> Iterator[None]:
    """While the block runs, ``say`` a line for each step record appended to ``log``.

    ``say`` None (nobody watching: a pipe, ``--json``, ``--quiet``) follows nothing. The
    file may not exist yet, be replaced by a retried run (it shrinks: read again from the
    start) or end in a half-written line (kept until its newline arrives). Whatever is in the
    log when the block ends is shown too.
    """
    if say is None:
        yield
        return
    stop = threading.Event()
    state = {"pos": 0, "partial": b""}

    def drain() -> None:
        try:
            with open(log, "rb") as fh:
                fh.seek(0, 2)
                if fh.tell() < state["pos"]:  # a retried run started the log again
                    state["pos"], state["partial"] = 0, b""
                fh.seek(state["pos"])
                data = fh.read()
                state["pos"] = fh.tell()
        except OSError:  # not written yet
            return
        *lines, state["partial"] = (state["partial"] + data).split(b"\n")
        for raw in lines:
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError):  # a partial or absurd line: the step log check reports it
                continue
            line = step_line(label, record, total) if isinstance(record, dict) else None
            if line:
                say(line)

    def loop() -> None:
        while not stop.wait(POLL_S):
            drain()

    thread = threading.Thread(target=loop, name=f"follow {label}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        drain()
