"""The verification window after a real transition: reference run on 4 ranks, `reshard convert
--to dp=2`, resume on 2 ranks with doubled accumulation; then doctored copies of the AFTER log.

Also unit tests for the step-log reader and the PNG writer.
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from conftest import run_cli
from reshard.errors import BadInput
from reshard.render.plot import Panel, Series, line_chart, read_png
from reshard.semantics.steplog import read_steplog
from reshard.commands.window import judge
from reshard.render.window import render_window

K, W, TREND = 8, 6, 6  # switch after step K, W steps after it; trend window
DATASET = 96  # 6 steps of 16 per epoch: epochs end at steps 6 and 12, inside both logs


def png_chunks(path: Path) -> dict[bytes, list[bytes]]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, out = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(kind + body) & 0xFFFFFFFF
        out.setdefault(kind, []).append(body)
        pos += 12 + n
    return out


def write_log(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ------------------------------------------------------------------------------ real logs
@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict[str, Path]:
    from reshard.semantics.manifest import read_manifest
    from reshard.reference import TrainConfig, run_reference

    root = tmp_path_factory.mktemp("window")
    before, after = root / "before.jsonl", root / "after.jsonl"
    cfg = TrainConfig(dp=4, steps=K, save_at=[K], out=str(root / "run4"), log=str(before), dropout=0.0,
                      total_steps=K + W, dataset_len=DATASET, experiment_id="window")
    (src,) = run_reference(cfg)

    class Cap:  # run_cli only calls readouterr
        def readouterr(self):
            return "", ""

    dst = root / "dp2"
    code, out, err = run_cli(["convert", src, dst, "--to", "dp=2"], Cap())
    assert code == 0, out + err
    m = read_manifest(dst)
    assert (m.batch.micro_batch, m.batch.grad_accum) == (2, 4)  # accumulation doubled: global batch kept
    run_reference(TrainConfig(dp=2, steps=K + W, total_steps=K + W, micro_batch=m.batch.micro_batch,
                              grad_accum=m.batch.grad_accum, dropout=0.0, dataset_len=DATASET,
                              resume=str(dst), log=str(after)))
    return {"root": root, "before": before, "after": after, "dst": dst}


def test_real_transition_passes(real):
    out = real["root"] / "ok"
    r = judge(real["before"], real["after"], manifest=real["dst"], out=out, trend_steps=TREND)
    assert r["ok"] and r["exit_code"] == 0, render_window(r)
    t = r["transition"]
    assert (t["at_step"], t["from_world_size"], t["to_world_size"], t["kind"]) == (K, 4, 2, "continuation")
    assert t["source"] == "manifest lineage"
    assert r["coverage"] == {**r["coverage"], "repeated": 0, "skipped": 0, "ranges": [], "dataset_len": DATASET}
    assert {c["name"] for c in r["checks"]} >= {"loss continuity", "loss jumps", "grad norm", "throughput", "coverage"}
    assert r["throughput"]["world_size_before"] == 4 and r["throughput"]["world_size_after"] == 2
    # without the manifest: the switch is the first AFTER step - 1, the dataset length max id + 1
    r2 = judge(real["before"], real["after"], trend_steps=TREND)
    assert r2["ok"] and r2["transition"]["at_step"] == K and r2["transition"]["source"] == "logs"

    # the figure: a valid PNG of the announced size whose curves are the ones in window.json
    png, saved = Path(r["figure"]), json.loads((out / "window.json").read_text())
    chunks = png_chunks(png)
    w, h, depth, ctype = struct.unpack(">IIBB", chunks[b"IHDR"][0][:10])
    assert (w, h, depth, ctype) == (r["plot"]["width"], r["plot"]["height"], 8, 2)
    assert w == 900 and h == 26 + 4 * 260
    assert sum(len(b) for b in chunks[b"IDAT"]) > 0 and read_png(png).shape == (h, w, 3)
    assert saved["plot"] == r["plot"] and saved["checks"] == r["checks"]
    loss_panel = r["plot"]["panels"][0]
    series = {s["label"]: s for s in loss_panel["series"]}
    assert series["after"]["xs"] == [float(x["step"]) for x in records(real["after"])]
    assert series["after"]["ys"] == [x["loss"] for x in records(real["after"])]
    assert series["before"]["ys"] == [x["loss"] for x in records(real["before"])]
    assert [p["title"] for p in r["plot"]["panels"]] == ["loss", "grad norm", "tokens/s", "coverage: ids per step"]
    assert (out / "window.md").read_text().startswith("# Verification window: OK")


def test_cli_window(real, capsys):
    code, out, err = run_cli(["window", real["before"], real["after"], "--manifest", real["dst"] / "manifest.json",
                              "--json"], capsys)
    assert code in (0, 1), out + err  # default trend window (10) is longer than this log: only the exit contract
    assert json.loads(out)["transition"]["at_step"] == K


def test_repeated_samples_fail_naming_the_steps(real, tmp_path):
    recs = records(real["after"])
    replayed = records(real["before"])[-1]["sample_ids"][:4]  # step K's first 4 ids consumed again...
    for r in recs[1:3]:  # ... at steps K+2 and K+3 (same epoch as step K)
        r["sample_ids"] = sorted(replayed + r["sample_ids"][4:])
    bad = write_log(tmp_path / "after.jsonl", recs)
    r = judge(real["before"], bad, manifest=real["dst"], out=tmp_path / "out", trend_steps=TREND)
    assert not r["ok"] and r["exit_code"] == 1
    (cov,) = [c for c in r["checks"] if c["name"] == "coverage"]
    assert not cov["ok"] and cov["steps"][0] == K + 2
    assert r["coverage"]["repeated"] == 8
    ids = ", ".join(str(i) for i in sorted(replayed))
    assert f"repeated at step {K + 2}" in cov["detail"] and f"repeated at step {K + 3}" in cov["detail"]
    assert any(rng["kind"] == "repeated" and rng["steps"] == [K + 2, K + 2] for rng in r["coverage"]["ranges"])
    # the ids displaced by the replay were never consumed: skipped, seen when the epoch ends (step 12)
    assert r["coverage"]["skipped"] == 8 and cov["steps"] == [K + 2, 12]
    assert all(str(i) in cov["detail"] or ".." in cov["detail"] for i in ids.split(", "))
    coverage_panel = r["plot"]["panels"][3]
    rep = {s["label"]: s for s in coverage_panel["series"]}["repeated"]
    assert dict(zip(rep["xs"], rep["ys"]))[float(K + 2)] == 4.0
    assert "FAIL" in render_window(r)


@pytest.mark.parametrize("at", [K + 1, K + 3])
def test_loss_jump_fails_naming_the_step(real, tmp_path, at):
    recs = records(real["after"])
    for r in recs:
        if r["step"] == at:
            r["loss"] *= 1.10
    r = judge(real["before"], write_log(tmp_path / "after.jsonl", recs), manifest=real["dst"], trend_steps=TREND)
    assert r["exit_code"] == 1
    failed = {c["name"]: c for c in r["checks"] if not c["ok"]}
    assert failed["loss jumps"]["steps"] == [at, at] and f"step {at}" in failed["loss jumps"]["detail"]
    if at == K + 1:
        assert failed["loss continuity"]["steps"] == [at, at]
    else:
        assert "loss continuity" not in failed


def test_gradnorm_and_throughput(real, tmp_path):
    recs = records(real["after"])
    recs[2]["grad_norm"] *= 50
    for r in recs:
        r["tokens_per_s"] = 1.0  # a collapse: a warning, not a failure
    r = judge(real["before"], write_log(tmp_path / "after.jsonl", recs), manifest=real["dst"], trend_steps=TREND)
    checks = {c["name"]: c for c in r["checks"]}
    assert not checks["grad norm"]["ok"] and checks["grad norm"]["steps"] == [K + 3, K + 3]
    assert not checks["throughput"]["ok"] and checks["throughput"]["severity"] == "warning"
    recs[2]["grad_norm"] /= 50
    r = judge(real["before"], write_log(tmp_path / "after.jsonl", recs), manifest=real["dst"], trend_steps=TREND)
    assert r["ok"] and r["throughput"]["ratio"] < 0.5


# ------------------------------------------------------------------------------ synthetic coverage
def _cursor_logs(tmp_path, shift: int):
    rec = lambda s, c: {"step": s, "loss": 2.0 - 0.01 * s, "cursor": c % 100, "epoch": c // 100}  # noqa: E731
    before = [rec(s, 8 * s) for s in range(1, 11)]
    after = [rec(s, 8 * s + shift) for s in range(11, 15)]
    return write_log(tmp_path / "b.jsonl", before), write_log(tmp_path / "a.jsonl", after)


def test_cursor_coverage(tmp_path):
    b, a = _cursor_logs(tmp_path, 0)
    ok = judge(b, a)
    assert ok["ok"] and ok["coverage"]["mode"] == "cursor"
    b, a = _cursor_logs(tmp_path, 4)  # the resumed cursor jumped 4 samples ahead
    r = judge(b, a)
    (cov,) = [c for c in r["checks"] if c["name"] == "coverage"]
    assert not cov["ok"] and r["coverage"]["skipped"] == 4 and cov["steps"] == [11, 11]
    assert "positions 80..83 skipped" in cov["detail"]
    b, a = _cursor_logs(tmp_path, -3)  # replayed 3
    r = judge(b, a)
    assert r["coverage"]["repeated"] == 3 and "77..79 repeated at step 11" in r["checks"][-1]["detail"]


# ------------------------------------------------------------------------------ step log
@pytest.mark.parametrize("lines, message", [
    (['{"step": 1, "loss": 2.0}', '{"step": 2, "loss": 1.9'], ":2: not valid JSON"),
    (['{"step": 1, "loss": 2.0}', '{"step": 2}'], ":2: missing required field 'loss'"),
    (['{"loss": 2.0}'], ":1: missing required field 'step'"),
    (['{"step": 2, "loss": 2.0}', '', '{"step": 2, "loss": 1.0}'], ":3: step 2 does not increase"),
    (['{"step": 1, "loss": "x"}'], ":1: field 'loss' must be a number"),
    (['{"step": 1, "loss": 1.0, "sample_ids": [1, -2]}'], "sample_ids"),
    (['{"step": 1, "loss": 1.0, "cursor": 5}'], "needs 'epoch'"),
    ([''], "no records"),
])
def test_steplog_rejects(tmp_path, lines, message):
    p = tmp_path / "log.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadInput) as exc:
        read_steplog(p)
    assert str(p) in str(exc.value) and message in str(exc.value)


def test_steplog_reads_optional_fields(tmp_path):
    p = write_log(tmp_path / "log.jsonl", [{"step": 3, "loss": float("nan"), "sample_ids": [5, 1], "world_size": 2,
                                            "extra": 1}, {"step": 4, "loss": 1.0, "cursor": 7, "epoch": 0}])
    a, b = read_steplog(p)
    assert a.sample_ids == [1, 5] and a.world_size == 2 and a.grad_norm is None and a.line == 1
    assert (b.cursor, b.epoch, b.sample_ids) == (7, 0, None)


# ------------------------------------------------------------------------------ PNG
def test_png_horizontal_line(tmp_path):
    red = (250, 0, 0)
    desc = line_chart(tmp_path / "c.png", [Panel("flat", [Series("flat", list(range(11)), [1.0] * 11, color=red),
                                                         Series("up", [0, 10], [0.0, 2.0])],
                                                 vlines=[(5.0, "switch")])], width=400, height_per_panel=200,
                      title="t")
    chunks = png_chunks(tmp_path / "c.png")
    assert struct.unpack(">IIBBBBB", chunks[b"IHDR"][0]) == (400, 226, 8, 2, 0, 0, 0)
    img = read_png(tmp_path / "c.png")
    assert img.shape == (226, 400, 3) and desc["width"] == 400 and desc["height"] == 226
    assert (img[:, :, 0].astype(int) - img[:, :, 2] > 150).sum() > 200  # the red series is drawn (curves: test_figures)
    assert desc["panels"][0]["series"][0] == {"label": "flat", "xs": [float(x) for x in range(11)], "ys": [1.0] * 11}
    assert desc["panels"][0]["vlines"] == [[5.0, "switch"]]


def test_png_handles_nan_and_constant(tmp_path):
    desc = line_chart(tmp_path / "n.png", [Panel("p", [Series("a", [1, 2, 3], [5.0, float("nan"), 5.0], style="points")])])
    assert desc["panels"][0]["series"][0]["ys"] == [5.0, None, 5.0]
    assert read_png(tmp_path / "n.png").shape == (264, 900, 3)
