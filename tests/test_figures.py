"""The report figures, read back from the matplotlib Figure object (issue 20).

No training here: the rehearsal figure is drawn from a report-shaped dict (the keys
``render_png`` reads from rehearsal.json), the window figure from small step logs written
to disk and judged by the real ``window`` code. Each test checks what a reader sees: axis
labels, the verdict in the title, whole-step ticks, the switch line, the notes and
annotations, and the role colours shared by both figures.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
import numpy as np  # noqa: E402  (matplotlib's own dependency)
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from reshard.commands.window import figure_panels, judge  # noqa: E402
from reshard.render.plot import COLORS, Panel, Series, build_figure, line_chart, overlap_note  # noqa: E402
from reshard.render.rehearsal import render_png, rehearsal_figure, rehearsal_panels  # noqa: E402
from reshard.render.window import window_title  # noqa: E402
from reshard.semantics.steplog import read_steplog  # noqa: E402

K, STEPS = 4, 12  # rehearsal: switch after step 4, window steps 5..12
APART = 7  # the fixture's control sits on the others at steps 5 and 6 and moves away from step 7
OUT = "/runs/reh"  # the fixture rehearsal's directory
RESUMED_CMD = (f"/opt/venv/bin/python examples/fsdp2_trainer.py --nproc 2 --resume {OUT}/converted "
               f"--out {OUT}/resumed --log {OUT}/resumed.jsonl")


def xy(steps, f) -> dict:
    return {"xs": [float(s) for s in steps], "ys": [float(f(s)) for s in steps]}


def report(*, resumed_offset: float = 1e-7, exit_code: int = 0, repeated: int = 32) -> dict:
    """The part of rehearsal.json the figure reads: a dp=4 -> dp=2 rehearsal whose resumed
    run lies on the baseline (+ ``resumed_offset``) and whose naive control re-read ``repeated`` ids."""
    base, window = range(1, STEPS + 1), range(K + 1, STEPS + 1)
    loss = lambda s: 4.2 - 0.05 * s  # noqa: E731
    gn = lambda s: 1.0 + 0.1 * (s % 3)  # noqa: E731
    ctl = lambda s: loss(s) - (0.004 if s < APART else 0.08)  # noqa: E731  (on the others at the switch)
    rep_ys = [repeated] * len(window)
    return {
        "from": "dp=4", "to": "dp=2", "switch_at": K, "window": STEPS - K, "exit_code": exit_code,
        "tolerances": {"loss_rtol": 1e-4, "grad_norm_rtol": 1e-3},
        "loss": {"max_rel": abs(resumed_offset) / loss(STEPS), "worst_step": STEPS},
        "grad_norm": {"max_rel": 0.0, "worst_step": K + 1},
        "trainer": {"command": "{python} examples/fsdp2_trainer.py --nproc {world} --resume {ckpt_in}",
                    "runs": {"resumed": {"command": RESUMED_CMD}},
                    "checkpoint": f"{OUT}/baseline/step_4"},
        "paths": {"converted": f"{OUT}/converted", "logs": {"resumed": f"{OUT}/resumed.jsonl"}},
        "coverage": {"control": {"repeated": repeated, "skipped": 0,
                                 "per_step": {"steps": list(window), "repeated": rep_ys, "skipped": [0] * len(window)}}},
        "series": {
            "loss": {"baseline": xy(base, loss), "resumed": xy(window, lambda s: loss(s) + resumed_offset),
                     "control": xy(window, ctl)},
            "grad_norm": {"baseline": xy(base, gn), "resumed": xy(window, gn), "control": xy(window, lambda s: gn(s) + 0.2)},
            "control_coverage": {"repeated": xy(window, lambda s: repeated), "skipped": xy(window, lambda s: 0)},
        },
    }


def drawn(fig):
    """Lay the figure out (ticks are chosen at draw time) and return its panels' axes."""
    FigureCanvasAgg(fig).draw()
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def lines_by_label(ax) -> dict[str, Line2D]:
    return {ln.get_label(): ln for ln in ax.get_lines()}


def switch_lines(ax) -> list[float]:
    return [ln.get_xdata()[0] for ln in ax.get_lines()
            if len(set(ln.get_xdata())) == 1 and ln.get_label().startswith("switch")]


def assert_whole_step_ticks(ax) -> None:
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_rehearsal_figure_reads_as_a_verdict():
    fig = rehearsal_figure(report())
    axes = drawn(fig)
    assert len(axes) == 3
    assert fig.get_suptitle().startswith("rehearsal dp=4 \u2192 dp=2: PASS")
    assert "tolerance 1.00e-04" in fig.get_suptitle()
    assert axes[-1].get_xlabel() == "step"
    assert [ax.get_ylabel() for ax in axes] == ["loss", "L2 norm before clipping", "sample ids"]
    assert axes[0].get_title(loc="left").startswith("loss: baseline")
    for ax in axes:
        assert_whole_step_ticks(ax)
        assert switch_lines(ax) == [K + 0.5]  # the switch on every panel, between step K and K+1
        assert ax.get_shared_x_axes().joined(axes[0], ax)
    x0s, x1s = {round(ax.get_position().x0, 6) for ax in axes}, {round(ax.get_position().x1, 6) for ax in axes}
    assert len(x0s) == 1 and len(x1s) == 1  # panels aligned
    cov_lo, cov_hi = axes[2].get_ylim()
    assert all(float(t).is_integer() for t in axes[2].get_yticks() if cov_lo <= t <= cov_hi)  # id counts


def test_rehearsal_figure_notes_overlap_and_the_controls_repeats():
    axes = drawn(rehearsal_figure(report()))
    loss_notes = texts(axes[0])
    assert any(t.startswith("resumed overlaps baseline: loss max rel diff 2.78e-08 (step 12)") for t in loss_notes), \
        loss_notes
    assert any(t.startswith("resumed overlaps baseline: grad norm max rel diff 0.00e+00") for t in texts(axes[1]))
    (ann,) = [a for a in axes[0].texts if "control (naive resume)\nrepeats 32 samples" in a.get_text()]
    assert ann.xy == (float(APART), pytest.approx(4.2 - 0.05 * APART - 0.08))  # where the control leaves the others
    assert "32 sample ids read twice" in texts(axes[2])
    # the resumed curve is drawn with hollow markers over the baseline's line, so both stay visible
    res = lines_by_label(axes[0])["resumed"]
    assert res.get_marker() == "o" and res.get_markerfacecolor() == "none"


SCI = r"(\d\.\d\de[+-]\d\d)"


def test_rehearsal_figure_speaks_one_metric():
    """Issue 35: the title gave a relative loss difference and the box an absolute one. Both now
    give the verdict's metric (the judge compares the loss's max rel diff with loss_rtol), in the
    same words, with the same value, and the footer says what "rel diff" is."""
    r = report(resumed_offset=3e-7)
    fig = rehearsal_figure(r)
    axes = drawn(fig)
    title = re.fullmatch(rf"rehearsal dp=4 \u2192 dp=2: PASS \(loss max rel diff {SCI}, tolerance {SCI}\)",
                         fig.get_suptitle())
    assert title, fig.get_suptitle()
    (note,) = [m for t in texts(axes[0]) if (m := re.fullmatch(rf"resumed overlaps baseline: loss max rel diff {SCI} "
                                                                 r"\(step (\d+)\)", t))]
    assert note.group(1) == title.group(1) == f"{r['loss']['max_rel']:.2e}"  # one quantity, one value
    assert int(note.group(2)) == r["loss"]["worst_step"]
    assert re.fullmatch(rf"resumed overlaps baseline: grad norm max rel diff {SCI} \(step \d+\)", texts(axes[1])[0])
    every = [fig.get_suptitle(), *(t.get_text() for t in fig.texts), *(t for ax in axes for t in texts(ax))]
    assert not any("\u0394" in t or "abs" in t for t in every), every  # no absolute gap left anywhere
    assert "rel diff: |resumed - baseline| / |baseline|" in fig.texts[-1].get_text()
    # without the judge's figures (an older report) the note computes the same metric from the curves
    r["loss"] = {"max_rel": r["loss"]["max_rel"]}  # no worst_step
    assert f"resumed overlaps baseline: loss max rel diff {title.group(1)} (step {STEPS})" in \
        texts(drawn(rehearsal_figure(r))[0])


def px(ax, x: float, y: float):
    return ax.transData.transform((x, y))


def test_rehearsal_figure_every_curve_visible_at_the_switch():
    """Issue 35: the control hid under the other two at the switch, its arrow pointing into the
    overlap. Every curve is drawn, visible, inside the axes; the control has its own line style
    and marker and is drawn above the others (its squares show inside the resumed run's hollow
    circles, which sit on the baseline's line); the arrow points where the control is apart;
    no annotation box covers a curve or the note."""
    fig = rehearsal_figure(report())
    axes = drawn(fig)
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        for ln in ax.get_lines():
            xs, ys = (np.asarray(v, dtype=float) for v in (ln.get_xdata(), ln.get_ydata()))
            assert ln.get_visible() and (ln.get_alpha() is None or ln.get_alpha() > 0), ln.get_label()
            if not ln.get_label().startswith("switch"):
                assert len(xs) and ((x0 <= xs) & (xs <= x1) & (y0 <= ys) & (ys <= y1)).all(), ln.get_label()
    for ax in axes[:2]:
        by = lines_by_label(ax)
        base, res, ctl = by["baseline"], by["resumed"], by["control"]
        assert ctl.get_linestyle() not in {base.get_linestyle(), res.get_linestyle()}
        assert ctl.get_marker() not in {base.get_marker(), res.get_marker(), "None", None, ""}
        assert base.get_zorder() < res.get_zorder() < ctl.get_zorder()
        assert ctl.get_markersize() < res.get_markersize()  # inside the hollow circle, not over it
        assert K + 1 in ctl.get_xdata() and K + 1 in res.get_xdata()  # the switch step is drawn by all three
    # the arrow: at the first step where the control is apart from both others, by pixels a reader sees
    (ann,) = [a for a in axes[0].texts if a.get_text().startswith("control (naive resume)")]
    at, y = ann.xy
    by = {k: dict(zip(v.get_xdata(), v.get_ydata())) for k, v in lines_by_label(axes[0]).items()
          if not k.startswith("switch")}
    gaps = {n: abs(px(axes[0], at, y)[1] - px(axes[0], at, by[n][at])[1]) for n in ("baseline", "resumed")}
    assert at == APART and min(gaps.values()) > 8, gaps
    assert abs(px(axes[0], K + 1, by["control"][K + 1])[1] - px(axes[0], K + 1, by["baseline"][K + 1])[1]) < 8
    # every annotation box is clear of every curve's points and segments and of the notes box
    for ax in axes:
        notes = [t for t in ax.texts if not hasattr(t, "xyann")]
        for a in [t for t in ax.texts if hasattr(t, "xyann")]:
            box = a.get_bbox_patch().get_window_extent(renderer)
            frame = ax.get_window_extent(renderer)
            assert frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            assert not any(box.overlaps(n.get_bbox_patch().get_window_extent(renderer)) for n in notes)
            for ln in ax.get_lines():
                xy = ln.get_transform().transform(ln.get_xydata())
                dense = np.concatenate([p0 + np.linspace(0, 1, 50)[:, None] * (p1 - p0) for p0, p1 in zip(xy, xy[1:])]
                                       or [xy])
                inside = ((dense[:, 0] > box.x0) & (dense[:, 0] < box.x1)
                          & (dense[:, 1] > box.y0) & (dense[:, 1] < box.y1))
                assert not inside.any(), (a.get_text(), ln.get_label())


def test_rehearsal_figure_footer_shows_the_command_that_ran():
    """Issue 35: the footer printed the trainer template ``{python} ... {layout}``. It prints the
    resumed run's command as it ran: the interpreter by name, paths relative to the rehearsal's
    directory (named once), the checkpoint it resumed; no text in the figure holds a placeholder."""
    fig = rehearsal_figure(report())
    axes = drawn(fig)
    every = [fig.get_suptitle(), *(t.get_text() for t in fig.texts)]
    for ax in axes:
        every += [ax.get_title(loc="left"), ax.get_ylabel(), ax.get_xlabel(), *texts(ax),
                  *(t.get_text() for t in ax.get_legend().get_texts())]
    assert not any("{" in t or "}" in t for t in every), [t for t in every if "{" in t]
    footer = fig.texts[-1].get_text().replace("\n", " ")
    assert "trainer: python examples/fsdp2_trainer.py --nproc 2 --resume converted --out resumed --log resumed.jsonl" \
        in " ".join(footer.split()), footer
    assert f"(resumed run, in {OUT}); checkpoint (step 4): baseline/step_4, converted by reshard into converted" \
        in " ".join(footer.split()), footer
    assert "/opt/venv" not in footer
    # a report without run records (written before runs were recorded) says the template is one
    r = report()
    r["trainer"].pop("runs")
    assert rehearsal_panels(r)[2][0].startswith("trainer command template: {python}")


def test_rehearsal_figure_fail_and_apart_curves():
    axes = drawn(fig := rehearsal_figure(report(resumed_offset=0.3, exit_code=1, repeated=0)))
    assert ": FAIL" in fig.get_suptitle()
    assert not any("overlaps" in t for t in texts(axes[0]))  # visibly apart: nothing to explain
    assert not any("naive resume" in t for t in texts(axes[0]))  # nothing repeated, nothing to annotate


def test_overlap_note_needs_shared_steps():
    a, b = Series("resumed", [5, 6], [1.0, 1.0]), Series("baseline", [1, 2], [1.0, 1.0])
    assert overlap_note(a, b, "loss") is None
    assert overlap_note(a, Series("baseline", [5, 6, 7], [1.0, 1.0 + 1e-9, 3.0]), "loss").endswith("(step 6)")


def step_logs(tmp_path: Path, *, jump_at: int | None = None) -> tuple[Path, Path]:
    """A 4-rank run to step 8 and its 2-rank continuation to step 14 (16 ids a step, in order)."""
    def rec(s: int, ws: int) -> dict:
        loss = 4.0 - 0.04 * s + (1.0 if s == jump_at else 0.0)
        return {"step": s, "loss": loss, "grad_norm": 1.0, "tokens_per_s": 1000.0 * ws,
                "sample_ids": list(range(16 * (s - 1), 16 * s)), "world_size": ws}
    before, after = tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    before.write_text("".join(json.dumps(rec(s, 4)) + "\n" for s in range(1, 9)))
    after.write_text("".join(json.dumps(rec(s, 2)) + "\n" for s in range(9, 15)))
    return before, after


def window_figure(tmp_path: Path, **kw):
    before, after = step_logs(tmp_path, **kw)
    r = judge(before, after, trend_steps=6)
    at = r["transition"]["at_step"]
    pre = [x for x in read_steplog(before) if x.step <= at]
    post = [x for x in read_steplog(after) if x.step > at]
    return r, build_figure(figure_panels(r, pre, post), title=window_title(r))


def test_window_figure_title_labels_colours(tmp_path):
    r, fig = window_figure(tmp_path)
    assert r["ok"], r["checks"]
    axes = drawn(fig)
    assert fig.get_suptitle() == "verification window after step 8 (world 4 \u2192 2): OK"
    assert [ax.get_title(loc="left") for ax in axes] == ["loss", "grad norm", "tokens/s", "coverage: ids per step"]
    assert axes[-1].get_xlabel() == "step" and all(ax.get_ylabel() for ax in axes)
    for ax in axes:
        assert_whole_step_ticks(ax)
        assert switch_lines(ax) == [8.5]
    loss = lines_by_label(axes[0])
    after = to_hex(loss["after"].get_color())
    assert after == COLORS["after"].lower() and after != "#ff0000" and after != "#d62728"  # "after" not in red
    # one palette across figures: the window's before/after are the rehearsal's baseline/resumed
    reh = lines_by_label(drawn(rehearsal_figure(report()))[0])
    assert to_hex(reh["baseline"].get_color()) == to_hex(loss["before"].get_color())
    assert to_hex(reh["resumed"].get_color()) == after


def test_window_figure_title_names_the_failed_check(tmp_path):
    r, fig = window_figure(tmp_path, jump_at=10)
    assert not r["ok"]
    title = fig.get_suptitle()
    failed = [c["name"] for c in r["checks"] if not c["ok"] and c["severity"] != "warning"]
    assert failed and title.endswith("FAILED: " + ", ".join(failed))


def test_saved_figure_is_an_rgb_png_of_the_described_size(tmp_path):
    path = tmp_path / "rehearsal.png"
    desc = render_png(path, report())
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (desc["width"], desc["height"])
    assert data[24:26] == bytes([8, 2])  # 8-bit RGB
    assert [p.name for p in tmp_path.iterdir()] == ["rehearsal.png"]  # the temporary file was renamed
    assert desc["panels"][0]["vlines"] == [[K + 0.5, f"switch after step {K}"]]
    assert "".join(desc["caption"]).replace(" ", "").startswith("trainer:pythonexamples/fsdp2_trainer.py")
    assert desc["title"].startswith("rehearsal dp=4 \u2192 dp=2: PASS")


def test_line_chart_describes_nan_as_none(tmp_path):
    desc = line_chart(tmp_path / "n.png", [Panel("p", [Series("a", [1, 2, 3], [5.0, float("nan"), 5.0], style="points")])])
    assert desc["panels"][0]["series"][0]["ys"] == [5.0, None, 5.0]
    assert (desc["width"], desc["height"]) == (900, 264)


def test_import_and_cli_do_not_import_matplotlib():
    code = ("import sys, reshard, reshard.cli, reshard.render.plot, reshard.render.rehearsal, reshard.render.window; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
