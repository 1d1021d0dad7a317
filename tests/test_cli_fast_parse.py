"""Issue 33: the command line is parsed without the costs typer 0.29 pays on every line, and says the same.

`reshard.cli_parse.click_command` builds the group with only the command a line names, and gives every
parameter `reshard.cli_parse.coercion`, which answers plain values itself and hands the rest to typer's
own coercion (a pydantic adapter per parameter, ~0.1 s to import and build). Checked here:

* for every parameter of every command (the help options too) and values plain and not, the cheap
  coercion gives what typer's gives: the same value of the same type, or the same error;
* a line gives the same exit code, stdout and stderr as through the whole group with typer's
  coercion (`app(...)` as it was), on a real checkpoint and on the refusals;
* a missing path is refused, for every command that takes a checkpoint, in a process where
  neither pydantic nor torch can be imported (the wall time is printed, never asserted: the
  target, under 0.3 s, is measured by scripts/bench_metadata_path.py).
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from hypothesis import given, settings, strategies as st
from typer.main import get_command

import reshard.cli as cli
import reshard.cli_parse as cli_parse
from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]


def _outcome(call):
    """What a coercion did: ("value", type, repr) or ("error", type, message)."""
    try:
        value = call()
    except Exception as exc:  # noqa: BLE001 - the error is the outcome compared
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        return "error", type(exc).__name__, message
    return "value", type(value).__name__, repr(value)


@functools.cache
def _params() -> list[tuple[str, object, typer.Context]]:
    """(command name, parameter, context) for every parameter of the whole group, help options included
    (built once: typer's coercion of a parameter is built on its first use and kept)."""
    group = get_command(cli.app)
    out = []
    for name, command in [("", group), *group.commands.items()]:
        ctx = typer.Context(command, info_name=name or "reshard")
        out += [(name, p, ctx) for p in command.get_params(ctx) if hasattr(p, "type_descriptor")]
    return out


def _both(param, ctx, value):
    """(cheap, typer's) outcomes for ``value``."""
    cheap = cli_parse.coercion(param)()
    theirs = type(param).get_runtime_param(param)
    return (_outcome(lambda: cheap.coerce(value, param=param, ctx=ctx)),
            _outcome(lambda: theirs.coerce(value, param=param, ctx=ctx)))


def test_cheap_coercion_gives_typers_own_result(tmp_path):
    folder, file = tmp_path / "dir", tmp_path / "file.toml"
    folder.mkdir()
    file.write_text("")
    values = [None, "", " ", "x", "0", "1", "2", "007", "-1", "+3", " 3", "3 ", "1_0", "1.5", "0.5", ".5", "5.",
              "1e-3", "0.0005", "0.001", "nan", "inf", "abc", "\u0663", "99999999999999999999", "steps", "tokens",
              "carry", "link", "bf16", "model+optim", "hf", "json", "dp=2", "/no/such", str(folder), str(file),
              "a\x00b", 0, 1, 24, -1, True, False, 0.0, 0.5, 1e-4, Path("/no/such"), folder, (), ("a",),
              ("a", "b"), ("/no/such", str(folder)), ["x"], ("1", "x"), (str(file), "")]
    params = _params()
    assert len(params) > 100 and len({n for n, _, _ in params}) == 10  # the group and its nine commands
    differ = []
    for name, param, ctx in params:
        for value in values:
            cheap, theirs = _both(param, ctx, value)
            if cheap != theirs:
                differ.append(f"{name} {param.name} {value!r}: {cheap} != typer's {theirs}")
    assert not differ, "\n".join(differ[:20])


NUMERIC = st.one_of(st.text(alphabet="0123456789+-._e ", max_size=7), st.text(max_size=4),
                    st.integers(-3, 10**6), st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=200, deadline=None)
@given(value=NUMERIC)
def test_cheap_coercion_of_numbers_and_choices_agrees_with_typer(value):
    """Numbers as typed (signs, spaces, underscores, exponents, other digits) on every kind of
    number option, and the same text on a choice and a path."""
    wanted = {("plan", "micro_batch"), ("plan", "seed"), ("verify", "rtol"), ("rehearse", "timeout"),
              ("rehearse", "steps"), ("plan", "schedule"), ("inspect", "ckpt"), ("plan", "model_config")}
    for name, param, ctx in _params():
        if (name, param.name) in wanted:
            cheap, theirs = _both(param, ctx, value)
            assert cheap == theirs, (name, param.name, value)


def test_the_command_named_is_the_only_one_built():
    assert list(cli_parse.click_command(cli.app, ["plan", "x", "--to", "dp=2"]).commands) == ["plan"]
    assert list(cli_parse.click_command(cli.app, ["--debug", "import", "x", "y"]).commands) == ["import"]
    whole = sorted(get_command(cli.app).commands)
    for line in ([], ["-h"], ["--version"], ["--debug"], ["inspekt", "x"], ["--", "inspect", "x"], ["--json"]):
        assert sorted(cli_parse.click_command(cli.app, line).commands) == whole, line


def _as_before(monkeypatch):
    """`main` as it was: the whole group, typer's own coercion (``app(...)`` builds exactly this)."""
    monkeypatch.setattr(cli_parse, "click_command", lambda app, line: get_command(app))


LINES = [
    [], ["-h"], ["--version"], ["inspekt", "x"], ["--bogus", "inspect", "x"], ["--help", "plan"],
    ["inspect", "-h"], ["convert", "--help"], ["rehearse", "-h"], ["import", "-h"],
    ["inspect"], ["inspect", "{ckpt}", "{ckpt}"], ["plan", "{ckpt}"], ["plan", "{ckpt}", "--to"],
    ["inspect", "{ckpt}"], ["inspect", "{ckpt}", "--json", "--no-profile", "-v"], ["--debug", "inspect", "{ckpt}"],
    ["plan", "{ckpt}", "--to", "dp=4", "--micro-batch", "2", "--schedule", "steps", "--seed", "007", "--json"],
    ["plan", "{ckpt}", "--to", "dp=4", "--data-policy", "translate", "--rng-policy", "reseed", "--tie", "a=b"],
    ["plan", "{ckpt}", "--to", "dp=2", "--grad-accum", "0"], ["plan", "{ckpt}", "--to", "dp=2", "--seed", "+3"],
    ["plan", "{ckpt}", "--to", "dp=2", "--schedule", "step", "--json"], ["verify", "{ckpt}", "{ckpt}", "--rtol", "1e-3"],
    ["verify", "{ckpt}", "{ckpt}", "--atol", "-1"], ["convert", "{ckpt}", "{tmp}/o", "--to", "dp=2", "--only", "weights"],
    ["convert", "{ckpt}", "{tmp}/o", "--to", "dp=2", "--workers", "0"], ["export", "{ckpt}", "{tmp}/e", "--format", "gguf"],
    ["rehearse", "--from", "dp=4", "--to", "dp=2", "--steps", "4", "--switch-at", "4"], ["window", "/no/a", "/no/b"],
    ["inspect", "/no/such"], ["plan", "/no/such", "--to", "dp=2"], ["convert", "/no/such", "{tmp}/o", "--to", "dp=2"],
    ["verify", "/no/such", "{ckpt}"], ["export", "/no/such", "{tmp}/e"], ["--json", "plan", "/no/such", "--to", "dp=2"],
    ["import", "/no/such", "{tmp}/i", "--format", "nope"],
]


def test_every_line_says_what_it_said_before(plain_fsdp2_ckpt, tmp_path, monkeypatch, capsys):
    """Exit code, stdout and stderr of each line, through `main`, against `main` as it was."""
    differ = []
    for line in LINES:
        argv = [a.format(ckpt=plain_fsdp2_ckpt, tmp=tmp_path) for a in line]
        now = run_cli(argv, capsys)
        with monkeypatch.context() as m:
            _as_before(m)
            before = run_cli(argv, capsys)
        if "Traceback" in now[2]:  # --debug: the frames differ by app's own __call__; the rest may not
            now, before = [(c, o, e.splitlines()[-1]) for c, o, e in (now, before)]
        if now[0] != before[0] or now[1] != before[1] or now[2] != before[2]:
            differ.append(f"{argv}: {now} != {before}")
    assert not differ, "\n\n".join(differ)


NO_PYDANTIC = """
import json, sys


class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "pydantic", "pydantic_core"):
            raise ImportError("imported while refusing a missing path: " + name)
        return None


sys.meta_path.insert(0, Refuse())
from reshard.cli import main

codes = []
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
    except SystemExit as exc:
        codes.append(exc.code)
print(json.dumps(codes))
"""


def test_a_missing_path_is_refused_without_pydantic_or_torch(tmp_path):
    lines = [["inspect", "/no/such"], ["plan", "/no/such", "--to", "dp=2"],
             ["convert", "/no/such", str(tmp_path / "o"), "--to", "dp=2"], ["verify", "/no/such", "/no/such-b"],
             ["export", "/no/such", str(tmp_path / "e")], ["--json", "inspect", "/no/such"]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RESHARD_DEBUG", None)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", NO_PYDANTIC, json.dumps(lines)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=env)
    print(f"{len(lines)} missing paths refused in one process in {time.perf_counter() - t0:.2f} s")
    assert "imported while refusing" not in p.stderr, p.stderr[-3000:]
    assert json.loads(p.stdout.splitlines()[-1]) == [2] * len(lines), p.stderr
    said = p.stderr.splitlines()
    assert said == ["error: /no/such: no such checkpoint directory. Check the path (a checkpoint is the directory "
                    "that holds `.metadata`)."] * len(lines), said
    assert json.loads(p.stdout.splitlines()[0])["code"] == "bad_input"
