"""Issue 47 (For people III): what a new user met, one test per case, each failing on the code before it.

Classes covered here: cheap checks before the heavy start-up (2: a `.metadata` file for a folder, the
values `--format hf` needs, a `--trainer` command without placeholders, an occupied destination), impossible model values (4),
advice that fails on an unwritable destination (5). The refusals that must come before torch
is imported run in one real process whose import hook refuses torch (the process is the point:
this one has torch loaded); the others run the CLI in-process on the session's reference
checkpoint. Cost: about 3 s (one subprocess, in-process plans of a 1 MiB checkpoint).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli

MANY_WITHOUT_TORCH = """
import contextlib, io, json, sys


class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported before the refusal: " + name)
        return None


sys.meta_path.insert(0, NoTorch())
from reshard.cli import main

results = []
for line in json.loads(sys.argv[1]):
    err = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(line)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def refusals_without_torch(lines: list[list[str]]) -> list[tuple[int, str]]:
    """Each command line run by ``reshard.cli.main`` in one process that cannot import torch."""
    p = subprocess.run([sys.executable, "-c", MANY_WITHOUT_TORCH, json.dumps([[str(a) for a in x] for x in lines])],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return [(c, e.strip()) for c, e in json.loads(p.stdout)]


@pytest.fixture(scope="module")
def occupied(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("occupied") / "out"
    d.mkdir()
    (d / "someone-elses.txt").write_text("kept")
    return d


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A torchtitan-convention Llama checkpoint (real `dcp.save`), for the Hugging Face export's questions."""
    from reshard.testing.synthetic_llama import LlamaShape, make_llama_checkpoint

    shape = LlamaShape(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=40, vocab_multiple=8)
    return make_llama_checkpoint(tmp_path_factory.mktemp("llama") / "ckpt", shape=shape, tp=1, dp=1, fused=False)


def test_cheap_refusals_come_before_torch(reference_ckpt, llama, occupied, tmp_path):
    """Class 2 and 5: a `.metadata` file for a folder, an occupied destination without --overwrite and a
    destination no file can be created in are each answered by a process that never imports torch, in the
    words the later check used, and the unwritable place is not called full (`--force` cannot help)."""
    src = reference_ckpt
    cases = {
        "export of .metadata": ["export", src / ".metadata", tmp_path / "a"],
        "convert into occupied": ["convert", src, occupied, "--to", "dp=2"],
        "export into occupied": ["export", src, occupied],
        "import into occupied": ["import", src, occupied],
        "convert into /proc": ["convert", src, "/proc/reshard-out", "--to", "dp=2"],
        "convert into /proc --force": ["convert", src, "/proc/reshard-out", "--to", "dp=2", "--force"],
        "export into /proc": ["export", src, "/proc/reshard-out"],
        "hf values missing": ["export", llama, tmp_path / "hf", "--format", "hf"],
        "trainer without placeholders": ["rehearse", "--from", "dp=2", "--to", "dp=1", "--trainer", "python train.py",
                                         "--out", tmp_path / "rehearsal"],
    }
    got = dict(zip(cases, refusals_without_torch(list(cases.values()))))
    for name, (code, err) in got.items():
        assert code == 2, (name, err)
        assert err.startswith("error:") and "\n" not in err and "torch imported" not in err, (name, err)
    assert "a DCP checkpoint is a directory, this is a file" in got["export of .metadata"][1]
    assert f"Give the directory that holds it: {src}." in got["export of .metadata"][1]
    for name in ("convert into occupied", "export into occupied", "import into occupied"):
        assert "already exists and is not empty" in got[name][1] and "--overwrite" in got[name][1], name
    for name in ("convert into /proc", "convert into /proc --force", "export into /proc"):
        err = got[name][1]
        assert "cannot be written" in err and "'proc' file system" in err, (name, err)
        assert "free" not in err and "--force" not in err, (name, err)
    err = got["hf values missing"][1]
    for name in ("rms_norm_eps", "rope_theta", "rope_scaling_factor"):
        assert f"--model-config {name}=" in err, err
    err = got["trainer without placeholders"][1]
    assert "lacks placeholders {ckpt_in}" in err and "one of {world} or {dp} or {layout}" in err, err
    assert (occupied / "someone-elses.txt").read_text() == "kept"
    assert not (tmp_path / "a").exists() and not (tmp_path / "hf").exists() and not (tmp_path / "rehearsal").exists()
    assert not list(Path("/proc").glob(".reshard-probe-*"))


@pytest.mark.parametrize("values, named", [
    (["n_heads=5"], ["--model-config n_heads=5", "dim 32", "model.tok_emb.weight"]),
    (["n_heads=4", "n_kv_heads=3"], ["--model-config n_kv_heads=3", "n_heads 4", "--model-config n_heads=4"]),
])
def test_an_impossible_model_value_is_refused_naming_both(reference_ckpt, values, named, capsys):
    """Class 4: `--model-config n_heads=5` on a width of 32 was accepted and a "nearest feasible tp" offered.
    Each typed value is held to the divisions with the others and with what the tensors carry."""
    given = [x for v in values for x in ("--model-config", v)]
    for to in ("dp=2", "dp=2,tp=2"):
        code, out, err = run_cli(["plan", reference_ckpt, "--to", to, *given], capsys)
        assert code == 2, (to, out, err)
        assert "nearest feasible" not in out + err
        for word in named:
            assert word in err, (to, word, err)


def test_a_possible_model_value_still_plans(reference_ckpt, capsys):
    code, out, err = run_cli(["plan", reference_ckpt, "--to", "dp=2", "--model-config", "n_heads=4",
                              "--model-config", "n_kv_heads=2", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["feasible"]
