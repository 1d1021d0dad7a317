"""Never silent for more than 2 s on a terminal, and the estimate before the work on a pipe (issue 35).

A person at a terminal who sees nothing move for a few seconds thinks the command hung. Each
command says a line before its work, bars move by bytes, and between them
(`reshard.render.progress.Progress.waiting`) a row counts the seconds since the last line.
These tests run real processes with stderr on a pseudo-terminal (tests/terminal.py), stamp
each piece of output as it arrives, and check the largest gap between two pieces:

* ``convert`` of a real 4-rank FSDP2 checkpoint (the reference trainer's, `reference_ckpt`),
  from its first line to its last, as a fresh ``python -m reshard`` (its torch import, 2-3 s,
  is the longest stretch without bytes to count; ``-X importtime``'s own lines are left out);
* the demo's first stage, 4 ranks training: a line per optimizer step, and nothing still for
  2 s from the first line to the third step (the demo is stopped there);
* the waiting row itself, on a stream that says it is a terminal, against a block that says
  nothing for 2.5 s (a machine-independent check of the mechanism), and nothing on a pipe;

and on a pipe, ``convert`` prints its ``estimate:`` block before the result, while ``--json``
keeps stdout one JSON document.
"""
from __future__ import annotations

import io
import json
import re
import time

from conftest import cli
from terminal import run_on_terminal

GAP_S = 2.0  # the longest a terminal may stay still (issue 35)
STEP_LINE = re.compile(r"^\s+4 ranks\s+step (\d+)/\d+\s+loss \d", re.M)


def _rows(r: dict) -> list[tuple[float, str]]:
    """Every visible row written to the terminal (split at newlines and carriage returns), with
    the time its piece arrived."""
    return [(t, part) for t, text in r["pieces"] for part in re.split(r"[\r\n]+", text)
            if part.strip() and not part.startswith("import time:")]


def _largest_gap(rows: list[tuple[float, str]]) -> tuple[float, str]:
    """The longest stretch between two rows, and the row it ended on."""
    gaps = [(b[0] - a[0], b[1]) for a, b in zip(rows, rows[1:])]
    return max(gaps, default=(0.0, ""))


def _terminal_text(r: dict) -> str:
    """What the terminal shows: per line, the text after its last carriage return."""
    return "\n".join(ln.rsplit("\r", 1)[-1] for ln in r["err"].replace("\r\n", "\n").split("\n"))


def test_convert_on_a_terminal_is_never_still_for_2_s(reference_ckpt, tmp_path):
    r = run_on_terminal(["convert", str(reference_ckpt), str(tmp_path / "out"), "--to", "dp=2"], terminal=True,
                        importtime=True)
    assert r["code"] == 0, r["out"][-2000:] + r["err"][-3000:]
    rows = _rows(r)
    rows = rows[next(i for i, (_, text) in enumerate(rows) if text.startswith("reading ")):]
    shown = _terminal_text(r)
    for line in ("reading ", "planning the conversion to dp=2 …", "checking space: "):
        assert line in shown, shown[-3000:]
    gap, at = _largest_gap(rows)
    print(f"\nconvert: {len(rows)} rows on the terminal in {rows[-1][0] - rows[0][0]:.2f} s, largest gap "
          f"{gap:.2f} s (before {at[:60]!r})")
    assert gap <= GAP_S, [(round(t, 2), text[:80]) for t, text in rows]


def test_demo_first_stage_shows_each_step_and_is_never_still_for_2_s(tmp_path):
    def third_step(out: str, err: str) -> bool:
        return any(int(n) >= 3 for n in STEP_LINE.findall(_terminal_text({"err": err})))

    r = run_on_terminal(["demo", "--out", str(tmp_path / "d")], terminal=True, timeout=600, stop_when=third_step)
    assert r["stopped"], r["out"][-2000:] + r["err"][-3000:]
    shown = _terminal_text(r)
    assert "4 ranks   starting" in shown, shown[-3000:]
    assert [int(n) for n in STEP_LINE.findall(shown)][:3] == [1, 2, 3], shown[-3000:]
    rows = _rows(r)
    gap, at = _largest_gap(rows)
    print(f"\ndemo stage 1: {len(rows)} rows to step 3 in {rows[-1][0] - rows[0][0]:.2f} s, largest gap {gap:.2f} s")
    assert gap <= GAP_S, [(round(t, 2), text[:80]) for t, text in rows]


class _Terminal(io.StringIO):
    """A stream that says it is a terminal: what `Progress.for_terminal` shows bars and rows on."""

    def isatty(self) -> bool:
        return True


def test_the_waiting_row_counts_seconds_and_is_cleared():
    from reshard.render.progress import Progress

    term = _Terminal()
    progress = Progress.for_terminal(stream=term)
    progress.say("planning …")
    with progress.waiting():
        time.sleep(2.6)
    progress.say("done")
    text = term.getvalue()
    counts = re.findall(r"\r  … (\d+) s", text)
    assert len(counts) >= 2 and counts == sorted(counts), repr(text)  # redrawn each second, counting up
    before_done = text.split("done\n")[0]
    assert before_done.endswith("\r"), repr(text)  # the row was erased before the next line
    assert _terminal_text({"err": text}).split("\n") == ["planning …", "done", ""], repr(text)

    piped = io.StringIO()  # not a terminal: nothing at all, as before
    quiet = Progress.for_terminal(stream=piped)
    quiet.say("planning …")
    with quiet.waiting():
        time.sleep(1.3)
    assert piped.getvalue() == ""


def test_convert_on_a_pipe_prints_the_estimate_before_the_result(reference_ckpt, tmp_path):
    code, out, err = cli(["convert", reference_ckpt, tmp_path / "out", "--to", "dp=2"])
    assert code == 0, out + err
    assert err == "", err  # nothing on stderr off a terminal
    lines = out.splitlines()
    assert lines[0].startswith("estimate: writes about"), out
    first_result = next(i for i, ln in enumerate(lines) if ln.startswith("converted "))
    assert first_result > 0 and not any(ln.startswith("estimate:") for ln in lines[first_result:]), out

    code, out, err = cli(["convert", reference_ckpt, tmp_path / "out-json", "--to", "dp=2", "--json"])
    assert code == 0, out + err
    report = json.loads(out)  # stdout one JSON document: the estimate is inside it, not printed beside it
    assert report["estimate"]["needed_bytes"] > 0
