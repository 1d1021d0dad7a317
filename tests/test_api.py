"""The public Python API (docs/api.md, issue 44 item 5): its examples run, it imports no torch where
the CLI imports none, and its errors are the `ReshardError` hierarchy with their exit codes.

Every fenced ``python`` block of docs/api.md runs here, in order and in one namespace (as in a
notebook), with the documents' checkpoint ``ckpt/step-200`` replaced by the shared
`plain_fsdp2_ckpt` (the smallest DCP checkpoint written by real torch code: four gloo ranks,
FSDP2, ``get_state_dict`` + ``dcp.save``) and the working directory a fresh temporary one, so
the examples' outputs (``out/...``, ``plan.json``) land there. The results are then checked
from that namespace and the examples' printed lines.

Cost: about 5 s on a quiet 2-core machine besides the shared checkpoint (which other modules
make anyway): three small conversions, an export and a verify in this process, and one fresh
interpreter without torch (about 1 s).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import reshard
from reshard.errors import BadInput, Infeasible, ReshardError

ROOT = Path(__file__).resolve().parents[1]
DOC_CKPT = "ckpt/step-200"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)


@pytest.fixture(scope="module")
def examples(plain_fsdp2_ckpt, tmp_path_factory) -> tuple[dict, str]:
    """docs/api.md's examples run once: (their namespace, what they printed)."""
    work = tmp_path_factory.mktemp("api-examples")
    namespace: dict = {"__name__": "docs_api"}
    out = io.StringIO()
    here = os.getcwd()
    os.chdir(work)
    try:
        with contextlib.redirect_stdout(out):
            for block in _blocks():
                code = block.replace(f'"{DOC_CKPT}"', repr(str(plain_fsdp2_ckpt)))
                exec(compile(code, "docs/api.md", "exec"), namespace)  # noqa: S102 - the documentation's own code
    finally:
        os.chdir(here)
    return namespace | {"_work": work}, out.getvalue()


def test_the_documented_examples_run_and_say_what_the_docs_say(examples, plain_fsdp2_ckpt):
    ns, printed = examples
    work = ns["_work"]
    assert len(_blocks()) >= 9
    # plan: a feasible plan whose verdict and kept state are what `reshard plan --json` prints
    p = ns["p"]
    assert isinstance(p, reshard.Plan) and p.feasible
    assert p.to_dict(tensors=False)["verdict"]["kind"] in ("continuation", "continuation_with_changes", "warm_start")
    assert set(p.to_dict(tensors=False)["verdict"]["kept"]) == {"optimizer_state", "lr_schedule", "data_position",
                                                                "rng", "accumulation_phase"}
    # inspect: the 4-rank FSDP2 checkpoint, complete
    assert ns["ins"].exit_code == 0 and ns["ins"].report["complete"] and ns["ins"].topology.world_size == 4
    # convert + verify: the output at dp=2 verified equal, and verified again by `verify`
    assert ns["report"]["verification"]["equal"]
    assert (work / "out" / "step-200-dp2" / ".metadata").is_file()
    assert ns["result"]["equal"] is True and ns["result"]["differences"] == []
    # the launcher converted (the source is dp=4) and resumes from its output
    assert ns["resume_from"] == "out/step-200-dp2" and "resume from out/step-200-dp2" in printed
    assert re.search(r"^resuming out/step-200-dp2: step \d+, 2 ranks \(dp_shard=2\)$", printed, re.M), printed
    # the reviewed plan executed exactly: same fingerprint, dp=3 written
    assert "True" in printed and (work / "out" / "step-200-dp3" / ".metadata").is_file()
    assert json.loads((work / "plan.json").read_text())["fingerprint"] == ns["p"].fingerprint()
    # export: safetensors shards written
    assert ns["exported"]["format"] == "safetensors" and any((work / "out" / "step-200-safetensors").glob("*.safetensors"))
    # estimate: figures, room enough on the test's disk
    assert ns["room"]["needed_bytes"] > 0 and "enough" in ns["room"]
    # the errors example printed each error's exit code first
    assert re.search(r"^2 ckpt/no-such-step no such checkpoint directory$", printed, re.M), printed
    assert re.search(r"^2 --schedule 'hours' is not one of steps, tokens\.$", printed, re.M), printed


NO_TORCH = """
import sys


class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported by the API: " + name)
        return None


sys.meta_path.insert(0, NoTorch())
"""


def test_plan_from_python_imports_no_torch(plain_fsdp2_ckpt, tmp_path):
    """The issue's acceptance line, word for word, in a fresh interpreter that cannot import torch
    (the import hook installed by a ``sitecustomize`` on its path, so the line stays as the issue
    writes it); and `import reshard` alone loads nothing but the version."""
    ckpt = str(plain_fsdp2_ckpt)
    (tmp_path / "sitecustomize.py").write_text(NO_TORCH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))

    def run(line: str) -> list[str]:
        done = subprocess.run([sys.executable, "-c", line], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=env)
        assert done.returncode == 0 and "torch imported" not in done.stderr, done.stderr[-3000:]
        return done.stdout.splitlines()

    refused = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path, env=env)
    assert refused.returncode != 0 and "torch imported by the API" in refused.stderr  # the hook is in place
    printed = run(f"import reshard; p = reshard.plan({ckpt!r}, to='dp=2'); print(p.verdict)")
    want = reshard.plan(ckpt, to="dp=2")
    assert printed == [str(want.verdict)]  # the verdict, as the process with torch makes it
    assert want.feasible and want.to_dict(tensors=False)["verdict"]["kind"] in printed[0]
    assert run("import reshard, sys; print(sorted(m for m in sys.modules if m.startswith('reshard')))") == [
        "['reshard', 'reshard.version']"]  # the facade loads the API on first use only


def test_errors_are_the_hierarchy_with_their_exit_codes(plain_fsdp2_ckpt, tmp_path):
    """A missing path, a bad target, a bad choice and a plan whose source changed raise what the CLI
    exits with (BadInput, 2), never SystemExit; an infeasible plan is returned, and converting it
    raises Infeasible (1); a misspelled option is a TypeError."""
    cases = [
        (lambda: reshard.inspect(tmp_path / "missing"), BadInput, "no such checkpoint directory"),
        (lambda: reshard.plan(tmp_path / "missing", to="dp=2"), BadInput, "no such checkpoint directory"),
        (lambda: reshard.verify(tmp_path / "missing", plain_fsdp2_ckpt), BadInput, "no such checkpoint directory"),
        (lambda: reshard.convert(tmp_path / "missing", tmp_path / "out", to="dp=2"), BadInput, "no such checkpoint"),
        (lambda: reshard.plan(plain_fsdp2_ckpt, to="dp=two"), BadInput, "must be a positive integer"),
        (lambda: reshard.plan(plain_fsdp2_ckpt, to="dp=2", micro_batch=0), BadInput, "--micro-batch 0"),
        (lambda: reshard.convert(plain_fsdp2_ckpt, tmp_path / "out", to="dp=2", data="link", buffered=True),
         BadInput, "contradict"),
        (lambda: reshard.convert(plain_fsdp2_ckpt, tmp_path / "out"), BadInput, "needs --to"),
    ]
    for call, cls, words in cases:
        with pytest.raises(cls) as caught:
            call()
        assert caught.value.exit_code == 2 and words in str(caught.value), str(caught.value)
    with pytest.raises(TypeError, match="micro_bacth"):
        reshard.plan(plain_fsdp2_ckpt, to="dp=2", micro_bacth=2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        reshard.plan(plain_fsdp2_ckpt, to="dp=2", seed=3, rng_policy="carry")
    assert [str(w.message) for w in said if w.category is reshard.ReshardWarning] == [
        "--seed has no effect with --rng-policy carry: only reseed uses it."]

    # a plan that cannot be carried out (a global batch of 2 x 2 x 4 = 16 over dp=3) is an answer...
    p = reshard.plan(plain_fsdp2_ckpt, to="dp=3", source_micro_batch=2, source_grad_accum=2)
    assert not p.feasible and "batch recipe" in p.reasons[0]
    with pytest.raises(Infeasible) as caught:  # ...and converting it is refused, exit code 1, nothing written
        reshard.convert(p, tmp_path / "never")
    assert caught.value.exit_code == 1 and not (tmp_path / "never").exists()

    # a Plan executed after its source changed: made again, another fingerprint, refused as --plan refuses
    import shutil

    src = tmp_path / "src"
    shutil.copytree(plain_fsdp2_ckpt, src)
    before = reshard.plan(src, to="dp=2")
    moved = tmp_path / "moved"
    reshard.convert(src, moved, to="dp=3", data="link")
    shutil.rmtree(src)
    shutil.copytree(moved, src)  # the same path now holds another checkpoint (3 ranks)
    with pytest.raises(BadInput, match="does not match what this source and these options produce now") as caught:
        reshard.convert(before, tmp_path / "out")
    assert caught.value.exit_code == 2 and not (tmp_path / "out").exists()
    assert issubclass(BadInput, ReshardError) and issubclass(Infeasible, ReshardError)


def test_the_package_facade():
    """`__all__` names what the API offers, each reachable from `reshard` and documented in docs/api.md."""
    doc = (ROOT / "docs" / "api.md").read_text()
    for name in reshard.__all__:
        assert getattr(reshard, name) is not None
        if callable(getattr(reshard, name)) and name[0].islower():
            assert f"### `reshard.{name}(" in doc, f"reshard.{name} is not documented in docs/api.md"
    assert set(reshard.__all__) <= set(dir(reshard))
    with pytest.raises(AttributeError):
        reshard.no_such_function  # noqa: B018


# The CLI's flags that only a terminal has: the output's form (--json, --verbose), progress on stderr,
# plan's --dst (`reshard.estimate`) and --tensors-out (`Plan.write_tensors`), convert's --workers
# (it relaunches the command line) and the old name --window.
CLI_ONLY = {"json", "quiet", "verbose", "progress", "workers", "window"}


def test_each_verb_takes_the_cli_options_named_as_its_flags():
    """The API's keywords are the CLI's long flags in snake_case, verb by verb, so a flag added to
    the CLI without its keyword (or the reverse) fails here. ``plan`` also takes ``dtype`` and
    ``only``: the plan of a reduced copy, which `convert` would make from those flags."""
    import inspect as pyinspect

    import typer.main

    from reshard.cli import app

    group = typer.main.get_command(app)

    def flags(verb: str) -> set[str]:
        out = set()
        for param in group.commands[verb].params:
            if param.param_type_name == "option":
                flag = next(o for o in param.opts if o.startswith("--"))
                out.add({"--from": "from_spec"}.get(flag, flag[2:].replace("-", "_")))
        return out - CLI_ONLY

    def keywords(fn) -> set[str]:
        params = pyinspect.signature(fn).parameters.values()
        out = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
        if any(p.kind is p.VAR_KEYWORD for p in params):
            out |= set(reshard.PlanOptions.__annotations__)
        return out - {"progress"}

    for verb, fn, extra in (("inspect", reshard.inspect, set()), ("plan", reshard.plan, {"dtype", "only"}),
                            ("convert", reshard.convert, set()), ("verify", reshard.verify, set()),
                            ("export", reshard.export, set()), ("import", reshard.import_, set())):
        assert keywords(fn) == flags(verb) | extra, (verb, keywords(fn) ^ (flags(verb) | extra))


def test_the_api_plans_what_the_cli_plans(plain_fsdp2_ckpt, capsys):
    """The same options given as keywords and as flags make the same plan: `Plan.to_dict()` is
    `reshard plan --json` (fingerprint included), and the failing options fail alike."""
    from conftest import run_cli

    flags = ["--micro-batch", "2", "--source-micro-batch", "2", "--source-grad-accum", "2", "--seed", "0",
             "--rng-policy", "reseed", "--keep", "^nothing$=no such key", "--drop", "^nor$", "--schedule", "steps"]
    code, out, _ = run_cli(["plan", plain_fsdp2_ckpt, "--to", "dp=2", "--json", *flags], capsys)
    p = reshard.plan(plain_fsdp2_ckpt, to="dp=2", micro_batch=2, source_micro_batch=2, source_grad_accum=2, seed=0,
                     rng_policy="reseed", keep="^nothing$=no such key", drop=["^nor$"], schedule="steps")
    assert code == (0 if p.feasible else 1)
    assert json.loads(out) == json.loads(json.dumps(p.to_dict(tensors="auto")))
    assert p.options.seed == 0 and p.options.keep == ["^nothing$"]

    code, _, err = run_cli(["plan", plain_fsdp2_ckpt, "--to", "dp=2,pp=2"], capsys)
    with pytest.raises(BadInput) as caught:
        reshard.plan(plain_fsdp2_ckpt, to="dp=2,pp=2")
    assert code == caught.value.exit_code == 2 and err == f"error: {caught.value}\n"
