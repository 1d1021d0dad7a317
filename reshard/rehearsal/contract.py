"""The trainer contract (formats/trainer_contract.md): a command with placeholders that reshard runs.

The rehearsal knows a trainer only through this contract: it fills the placeholders of one
command line per run (baseline, noise floor, resumed, control), runs it as a child process,
and reads back what the contract promises: DCP checkpoints under ``{ckpt_out}`` and the
step log at ``{log}``. reshard never imports the trainer; the built-in reference trainer is
one more user of the same contract (``reference_command``), so there is one rehearsal engine.

Why a command template and not a Python hook: the user's trainer is usually launched by
torchrun with its own environment, and what decides whether state survives (its optimizer,
data loader, checkpoint code) is exactly what an in-process hook would replace.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import BadInput
from reshard.model.topology import Topology

CONTRACT_DOC = "formats/trainer_contract.md"

PLACEHOLDERS: dict[str, str] = {
    "world": "ranks of this run: pp x dp x tp (torchrun's --nproc-per-node)",
    "layout": "the run's layout spec, e.g. dp=4 or dp=2,tp=2",
    "dp": "data-parallel (FSDP shard) degree",
    "tp": "tensor-parallel degree",
    "pp": "pipeline-parallel degree",
    "steps": "absolute optimizer step to stop after (a resumed run continues from the checkpoint's step)",
    "total_steps": "LR-schedule horizon: the baseline's steps, the same in every run",
    "save_at": "comma-separated steps after which to save a checkpoint, e.g. 4,5",
    "ckpt_out": "directory receiving the checkpoints; the one saved after step k is a directory in it "
                "whose name ends in k (step_4, step-4)",
    "ckpt_in": "DCP checkpoint to resume from; the baseline has none (the token and its flag are dropped)",
    "log": "step log to append to, one JSON line per optimizer step (formats/step_log.md), rank 0",
    "micro_batch": "samples per rank per micro-step",
    "grad_accum": "micro-steps per optimizer step",
    "global_batch": "micro_batch x grad_accum x dp: samples per optimizer step",
    "seed": "seed of the initial weights and the data order",
    "dataset_len": "samples the trainer's data should hold, so that no run crosses an epoch boundary",
    "python": "the Python interpreter running reshard",
}
REQUIRED = ("ckpt_in", "ckpt_out", "save_at", "log", "steps", "micro_batch", "grad_accum")
SIZE = ("world", "dp", "layout")  # at least one: the run must learn its size
_FIELD = re.compile(r"\{(\w*)\}")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_STEP_IN_NAME = re.compile(r"(\d+)\D*$")


def layout_spec(t: Topology) -> str:
    """The {layout} text: dp=4, dp=2,tp=2 (dp for dp_shard, the way users write it; size-1 dims left out)."""
    names = {"dp_shard": "dp"}
    parts = [f"{names.get(d, d)}={n}" for d, n in t.degrees().items() if n != 1 and d != "dp_shard"]
    return ",".join([f"dp={t.dp_shard}"] + parts)


@dataclass
class RunSpec:
    """One run of the trainer: the values its placeholders take."""

    name: str                 # baseline, floor, resumed, control
    layout: Topology
    micro_batch: int
    grad_accum: int
    steps: int
    total_steps: int
    save_at: list[int]
    ckpt_out: Path
    log: Path
    seed: int
    dataset_len: int
    ckpt_in: Path | None = None

    def values(self) -> dict[str, str | None]:
        t = self.layout
        return {"world": str(t.world_size), "layout": layout_spec(t), "dp": str(t.dp), "tp": str(t.tp), "pp": str(t.pp),
                "steps": str(self.steps), "total_steps": str(self.total_steps),
                "save_at": ",".join(str(k) for k in sorted(set(self.save_at))),
                "ckpt_out": str(self.ckpt_out), "ckpt_in": None if self.ckpt_in is None else str(self.ckpt_in),
                "log": str(self.log), "micro_batch": str(self.micro_batch), "grad_accum": str(self.grad_accum),
                "global_batch": str(self.micro_batch * self.grad_accum * t.dp), "seed": str(self.seed),
                "dataset_len": str(self.dataset_len), "python": sys.executable}

    def identity(self) -> dict[str, object]:
        """What decides the run's trajectory (paths excluded): a reused baseline must match it."""
        return {"layout": layout_spec(self.layout), "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                "steps": self.steps, "total_steps": self.total_steps, "save_at": sorted(set(self.save_at)),
                "seed": self.seed, "dataset_len": self.dataset_len}


@dataclass
class RunResult:
    """What one run did: the command line, its exit code, wall time and where its output went."""

    name: str
    argv: list[str]
    returncode: int
    seconds: float
    output: Path
    attempts: int = 1
    error: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def command(self) -> str:
        return " ".join(shlex.quote(a) for a in [f"{k}={v}" for k, v in self.env.items()] + self.argv)

    def to_dict(self) -> dict[str, object]:
        return {"command": self.command, "returncode": self.returncode, "seconds": round(self.seconds, 2),
                "output": str(self.output), "attempts": self.attempts, "error": self.error}


@dataclass(frozen=True)
class TrainerCommand:
    """A trainer command template, checked once: every placeholder known, the required ones present."""

    template: str
    reference: bool = False   # the built-in reference trainer (reshard.reference)

    def __post_init__(self) -> None:
        try:
            tokens = shlex.split(self.template)
        except ValueError as exc:
            raise BadInput(f"--trainer: cannot split the command into words ({exc})",
                           hint="Quote it as a shell would; see " + CONTRACT_DOC + ".") from exc
        if not tokens:
            raise BadInput("--trainer: the command is empty", hint="See " + CONTRACT_DOC + ".")
        used = {m.group(1) for t in tokens for m in _FIELD.finditer(t.replace("{{", "").replace("}}", ""))}
        unknown = sorted(used - set(PLACEHOLDERS))
        if unknown:
            raise BadInput(f"--trainer: unknown placeholders {', '.join('{' + u + '}' for u in unknown)}",
                           hint="Known: " + ", ".join("{" + p + "}" for p in PLACEHOLDERS) + f" ({CONTRACT_DOC}).")
        missing = ["{" + p + "}" for p in REQUIRED if p not in used]
        if not any(p in used for p in SIZE):
            missing.append("one of " + " or ".join("{" + p + "}" for p in SIZE))
        if missing:
            raise BadInput("--trainer: the command lacks placeholders " + ", ".join(missing),
                           hint="reshard must tell each run where to resume, save and log, when to stop and "
                                f"which batch recipe to use ({CONTRACT_DOC}).")

    def render(self, spec: RunSpec) -> tuple[list[str], dict[str, str]]:
        """(argv, extra environment) for one run. A word holding a placeholder without a value
        ({ckpt_in} of the baseline) is dropped, and the option flag right before it too."""
        values = spec.values()
        tokens = shlex.split(self.template)
        env: dict[str, str] = {}
        while tokens and _ENV.match(tokens[0]) and "{" not in tokens[0].split("=", 1)[0]:
            k, v = tokens.pop(0).split("=", 1)
            env[k] = _fill(v, values) or ""
        argv: list[str] = []
        for tok in tokens:
            filled = _fill(tok, values)
            if filled is None:
                if len(argv) > 1 and argv[-1].startswith("-") and "=" not in argv[-1]:
                    argv.pop()
                continue
            argv.append(filled)
        return argv, env


def _fill(token: str, values: dict[str, str | None]) -> str | None:
    """The word with its placeholders filled; None when one of them has no value in this run."""
    absent = False

    def sub(m: re.Match) -> str:
        nonlocal absent
        v = values[m.group(1)]
        if v is None:
            absent = True
            return ""
        return v

    parts = token.split("{{")
    out = "{".join("}".join(_FIELD.sub(sub, q) for q in p.split("}}")) for p in parts)
    return None if absent else out


def reference_command(*, dropout: float = 0.0, warmup: int = 2, model: dict[str, int] | None = None) -> TrainerCommand:
    """The built-in reference trainer as a contract command (``python -m reshard.reference --spawn``)."""
    extra = "".join(f" --{k.replace('_', '-')} {v}" for k, v in sorted((model or {}).items()))
    return TrainerCommand(
        "{python} -m reshard.reference --spawn --layout {layout} --resume {ckpt_in} --save-at {save_at} "
        "--out {ckpt_out} --steps {steps} --total-steps {total_steps} --log {log} --micro-batch {micro_batch} "
        "--grad-accum {grad_accum} --seed {seed} --dataset-len {dataset_len} "
        f"--dropout {dropout:g} --warmup {warmup} --experiment-id rehearsal" + extra, reference=True)


def run(command: TrainerCommand, spec: RunSpec, *, out_dir: Path, timeout: float | None = None,
        retries: int = 1) -> RunResult:
    """Run ``spec`` with ``command``; its stdout and stderr go to ``out_dir/<name>.out``.

    A failed run is retried ``retries`` times from clean outputs (its log and ``ckpt_out``
    removed): a free port taken between probe and bind, or a gloo connection lost on a loaded
    machine, must not read as a failed transition. Never raises for a failed run: the result
    says so (``returncode``, ``error`` with the output's last lines).
    """
    argv, env = command.render(spec)
    output = out_dir / f"{spec.name}.out"
    full_env = {**os.environ, **env}
    t0 = time.perf_counter()
    rc, error, attempts = 1, None, 0
    for attempt in range(retries + 1):
        attempts = attempt + 1
        if attempt:
            spec.log.unlink(missing_ok=True)
            if spec.ckpt_in is None or spec.ckpt_out.resolve() != Path(spec.ckpt_in).resolve():
                shutil.rmtree(spec.ckpt_out, ignore_errors=True)
        spec.ckpt_out.mkdir(parents=True, exist_ok=True)
        try:
            with open(output, "w", encoding="utf-8") as fh:
                fh.write("$ " + " ".join(shlex.quote(a) for a in argv) + "\n")
                fh.flush()
                rc = _run_group(argv, full_env, fh, timeout)
        except FileNotFoundError as exc:
            return RunResult(spec.name, argv, 127, time.perf_counter() - t0, output, attempts,
                             f"{spec.name} run: cannot start {argv[0]!r} ({exc.strerror})", env)
        if rc == 0:
            return RunResult(spec.name, argv, 0, time.perf_counter() - t0, output, attempts, None, env)
        error = f"{spec.name} run exited {rc if rc >= 0 else 'on timeout'}: {_tail(output)}"
    return RunResult(spec.name, argv, rc, time.perf_counter() - t0, output, attempts, error, env)


def _run_group(argv: list[str], env: dict[str, str], fh: Any, timeout: float | None) -> int:
    """Run ``argv`` in a session of its own; on a timeout or an interrupt, kill that whole group
    (torchrun's workers too, not only the launcher). -1 means the run timed out."""
    proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return -1
    except BaseException:
        _kill_group(proc)
        raise


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# torchrun's own account of a failed worker starts with this line; everything after it (its traceback,
# "Root Cause", "error_file: <N/A>") is the launcher's, not the trainer's
_LAUNCHER_FAILED = re.compile(r"torch/distributed/elastic/\S+\] failed \(exitcode|ChildFailedError")
_RANK_TAG = r"(?:\[(?:rank|default)(?P<rank>\d+)\]:\s*)?"
_RAISED = re.compile(_RANK_TAG + r"(?P<what>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?)$")
_ROOT_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank")  # torchrun's "rank : 0 (local_rank: 0)"
_FRAME = re.compile(_RANK_TAG + r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def trainer_error(text: str, lines: int = 3) -> str:
    """What a failed run said of its failure, in the trainer's own words: the last exception it raised
    (with the rank that raised it and the file and line), read from before torchrun's account of the
    failure, whose boilerplate (``error_file: <N/A>``) says nothing of the cause. Without an exception,
    the last ``lines`` non-blank lines the trainer printed."""
    rows = [r.strip() for r in text.splitlines() if r.strip()]
    cut = next((i for i, r in enumerate(rows) if _LAUNCHER_FAILED.search(r)), len(rows))
    own = rows[:cut] or rows
    raised = [(i, m) for i, m in enumerate(_RAISED.match(r) for r in own) if m is not None]
    # the rank that failed first (torchrun's "Root Cause"), else the first rank that raised: the others'
    # errors ("Connection closed by peer") are what its failure did to them
    cause = next((i for i in range(cut, len(rows)) if rows[i].startswith("Root Cause")), len(rows))
    root = next((m.group(1) for r in rows[cause:] for m in [_ROOT_RANK.match(r)] if m), None)
    ranks = [m.group("rank") for _, m in raised if m.group("rank") is not None]
    first = root if root in ranks else (ranks[0] if ranks else None)
    for i, m in reversed(raised):
        if first is not None and m.group("rank") != first:
            continue
        where = next((f for f in (_FRAME.match(r) for r in reversed(own[:i])) if f is not None), None)
        said = m.group("what")
        if m.group("rank") is not None:
            said += f" (rank {m.group('rank')}"
            said += f", {where.group('file')} line {where.group('line')})" if where is not None else ")"
        elif where is not None:
            said += f" ({where.group('file')} line {where.group('line')})"
        return said
    return " | ".join(own[-lines:])


def _tail(output: Path, lines: int = 3) -> str:
    """The trainer's own last error (`trainer_error`), for the report (the full text is in the file)."""
    try:
        text = output.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"(no output at {output})"
    return trainer_error(text, lines) + f" (full output: {output})"


def find_checkpoint(ckpt_out: Path, step: int) -> Path | None:
    """The checkpoint a run saved after ``step``: a directory in ``ckpt_out`` whose name ends in
    that number and that holds a DCP ``.metadata`` (step_4, step-4, checkpoint_0004), or None."""
    if not ckpt_out.is_dir():
        return None
    hits = []
    for d in sorted(ckpt_out.iterdir()):
        m = _STEP_IN_NAME.search(d.name)
        if d.is_dir() and m and int(m.group(1)) == step and (d / ".metadata").is_file():
            hits.append(d)
    return hits[0] if len(hits) == 1 else None


__all__ = ["PLACEHOLDERS", "REQUIRED", "RunSpec", "RunResult", "TrainerCommand", "reference_command", "run",
           "find_checkpoint", "layout_spec", "CONTRACT_DOC"]
