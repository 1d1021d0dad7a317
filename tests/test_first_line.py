"""Every command says what it is doing at once on a terminal, and nothing on a pipe.

tests/test_progress.py checks the commands that move bytes (inspect --deep, convert,
verify, export, import). This file checks the rest as a person meets them: plan, inspect,
window, rehearse and the demo, each run as a real process with stderr on a pseudo-terminal
(tests/terminal.py):

* the first thing on the terminal is the command's first line, printed before torch is
  imported (``python -X importtime`` writes a line per module to the same stderr), which is
  what keeps it within a second whatever the machine; the seconds are printed, not asserted;
* rehearse and the demo then show a line per optimizer step of each training run, read
  from the run's step log as it grows;
* on a pipe, stderr stays empty: the result is on stdout only.

The rehearsal runs once on a pipe, to the end (its verdict on stdout); its step logs are the
inputs of ``window``. The demo and the rehearsal on a terminal are stopped once their first
step lines have shown.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from terminal import TORCH_IMPORT, first_line_seconds, run_on_terminal

REHEARSE = ["rehearse", "--from", "dp=2", "--to", "dp=1", "--steps", "4", "--switch-at", "2", "--window", "2"]
STEP_LINE = re.compile(r"^\s+\S+( ranks)?\s+step \d+/\d+\s+loss \d", re.M)


def _text(r: dict) -> str:
    """stderr as the terminal shows it: per line, the text after its last carriage return (the
    seconds a waiting row counts, `Progress.waiting`, are redrawn and erased with them)."""
    return "\n".join(ln.rsplit("\r", 1)[-1] for ln in r["err"].replace("\r\n", "\n").split("\n"))


WAITING_ROW = re.compile(r"^(\s*… \d+ s)+")  # the waiting row, which the command keeps for its whole life


def _shown(r: dict) -> list[str]:
    """The terminal's lines that are not ``-X importtime``'s (which run into a waiting row, as they bypass it)."""
    lines = (WAITING_ROW.sub("", ln) for ln in _text(r).split("\n"))
    return [ln for ln in lines if ln.strip() and not ln.startswith("import time:")]


def _check_first_line(r: dict, pattern: str) -> str:
    """The first line shown matches ``pattern`` and came before torch was imported (if it was)."""
    shown = _shown(r)
    assert shown and re.fullmatch(pattern, shown[0].rstrip("\r")), _text(r)[-3000:]
    text = _text(r)
    torch_line = TORCH_IMPORT.search(text)
    if torch_line is not None:
        assert text.index(shown[0]) < torch_line.start(), "the first line must come before torch is imported"
    return shown[0]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> dict:
    """A small reference rehearsal (dp=2 -> dp=1), run to the end with stderr a pipe."""
    out = tmp_path_factory.mktemp("first_line") / "rh"
    r = run_on_terminal([*REHEARSE, "--out", str(out)], terminal=False, timeout=600)
    return {"run": r, "out": out}


def test_rehearse_on_a_pipe_writes_only_its_verdict(rehearsal):
    r = rehearsal["run"]
    assert r["code"] == 0, r["out"][-3000:] + r["err"][-3000:]
    assert r["err"] == "", r["err"][-3000:]
    assert "verdict" in r["out"].lower() or "within" in r["out"], r["out"][-2000:]


def test_rehearse_on_a_terminal_shows_each_run_and_its_steps(tmp_path):
    r = run_on_terminal([*REHEARSE, "--out", str(tmp_path / "rh")], terminal=True, importtime=True, timeout=600,
                        stop_when=lambda out, err: len(STEP_LINE.findall(err.replace("\r\n", "\n"))) >= 2)
    assert r["stopped"], _text(r)[-3000:]
    first = _check_first_line(r, r"rehearsing dp=2 -> dp=1 in .* …")
    shown = _shown(r)
    assert shown[1].startswith("baseline run on dp=2 (from scratch"), shown
    assert re.match(r"\s+baseline\s+step 1/4\s+loss \d+\.\d{4}", shown[2]), shown
    print(f"\nrehearse: first line after {first_line_seconds(r, first):.2f} s (under -X importtime)")


@pytest.mark.parametrize("name", ["plan", "inspect", "window"])
def test_first_line_at_once_and_nothing_on_a_pipe(name, reference_ckpt, rehearsal):
    logs = rehearsal["out"]
    args, first = {
        "plan": (["plan", str(reference_ckpt), "--to", "dp=2"], r"reading .* to plan --to dp=2 …"),
        "inspect": (["inspect", str(reference_ckpt)], r"reading .* …"),
        "window": (["window", str(logs / "baseline.jsonl"), str(logs / "resumed.jsonl")],
                   r"reading the step logs .* …"),
    }[name]
    r = run_on_terminal(args, terminal=True, importtime=True)
    assert r["code"] == 0, r["out"] + _text(r)[-3000:]
    line = _check_first_line(r, first)
    print(f"\n{name}: first line after {first_line_seconds(r, line):.2f} s (under -X importtime)")
    piped = run_on_terminal(args, terminal=False)
    assert piped["code"] == 0 and piped["out"], piped["out"] + piped["err"]
    assert piped["err"] == "", piped["err"][-3000:]


def test_demo_shows_its_first_line_then_each_training_step(tmp_path):
    r = run_on_terminal(["demo", "--out", str(tmp_path / "d")], terminal=True, importtime=True, timeout=600,
                        stop_when=lambda out, err: bool(STEP_LINE.search(err.replace("\r\n", "\n"))))
    assert r["stopped"], r["out"][-2000:] + _text(r)[-3000:]
    line = _check_first_line(r, r"demo into .*: train on 4 CPU ranks, convert to 2, resume, rehearse …")
    assert re.search(r"^\s+4 ranks\s+step 1/6\s+loss ", _text(r), re.M), _text(r)[-2000:]
    assert "=== [1/6]" in r["out"]  # the transcript is on stdout
    print(f"\ndemo: first line after {first_line_seconds(r, line):.2f} s (under -X importtime)")


def test_demo_on_a_pipe_keeps_stderr_empty(tmp_path: Path):
    """Piped, the demo's first stage (the training run, which shows steps on a terminal) says nothing on stderr."""
    r = run_on_terminal(["demo", "--out", str(tmp_path / "d")], terminal=False, timeout=600,
                        stop_when=lambda out, err: "=== [2/6]" in out or bool(err))
    assert r["stopped"] and "=== [2/6]" in r["out"], r["out"][-2000:] + r["err"][-3000:]
    assert r["err"] == "", r["err"][-3000:]
