"""Issue 33: the metadata path never imports torch, and says exactly what it said with torch.

Each command runs as a real process with an import hook on ``sys.meta_path`` that refuses
``torch`` and every ``torch.*`` module (the process is the point here: an in-process run would
have torch imported already). Its exit code and output are compared with the same command run
in this process, where torch is loaded: ``inspect``, ``plan``, ``window``, ``verify``, ``convert
--data link`` (whose ``.metadata`` must be byte-identical and load in torch's own ``dcp.load``,
strictly, every tensor bitwise), and the refusals of a missing path and a bad option.

The constants stated so that no torch is needed (the dtype table, the DCP version, the
``torch.save`` overhead) are checked against the installed torch.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli

HOOK = """
import sys


class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported on the metadata path: " + name)
        return None


sys.meta_path.insert(0, NoTorch())
from reshard.cli import main

main(sys.argv[1:])
"""


def without_torch(args: list) -> tuple[int, str, str]:
    """``reshard ARGS`` in a process that cannot import torch: (exit code, stdout, stderr)."""
    p = subprocess.run([sys.executable, "-c", HOOK, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert "torch imported on the metadata path" not in p.stderr, p.stderr[-3000:]
    return p.returncode, p.stdout, p.stderr


def _steady(text: str) -> str:
    """Output with what differs between two runs of one command masked: durations and rates."""
    text = re.sub(r"\d+(\.\d+)? (s|ms)\b", "<t>", text)
    return re.sub(r'"(seconds|elapsed_s|took_s)": [0-9.e-]+', r'"\1": <t>', text)


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> tuple[Path, Path]:
    """Two step logs around a transition, as a trainer writes them (JSON lines)."""
    d = tmp_path_factory.mktemp("logs")
    before, after = d / "before.jsonl", d / "after.jsonl"
    before.write_text("".join(json.dumps({"step": s, "loss": 4.0 - 0.1 * s, "grad_norm": 1.0, "tokens_per_s": 1000.0})
                              + "\n" for s in range(1, 11)))
    after.write_text("".join(json.dumps({"step": s, "loss": 4.0 - 0.1 * s, "grad_norm": 1.0, "tokens_per_s": 990.0})
                             + "\n" for s in range(11, 16)))
    return before, after


@pytest.mark.parametrize("args", [
    ["inspect", "{ckpt}"],
    ["inspect", "{ckpt}", "--json"],
    ["plan", "{ckpt}", "--to", "dp=2"],
    ["plan", "{ckpt}", "--to", "dp=3", "--json"],
    ["window", "{before}", "{after}"],
    ["inspect", "/no/such/checkpoint"],
    ["plan", "/no/such/checkpoint", "--to", "dp=2"],
    ["convert", "/no/such/checkpoint", "{tmp}/out", "--to", "dp=2"],
    ["verify", "/no/such/checkpoint", "{ckpt}"],
    ["plan", "{ckpt}", "--to", "dp=two"],
], ids=["inspect", "inspect-json", "plan", "plan-json", "window", "inspect-missing", "plan-missing",
        "convert-missing", "verify-missing", "plan-bad-option"])
def test_metadata_commands_import_no_torch_and_say_the_same(args, plain_fsdp2_ckpt, logs, tmp_path):
    args = [a.format(ckpt=plain_fsdp2_ckpt, before=logs[0], after=logs[1], tmp=tmp_path) for a in args]
    code, out, err = without_torch(args)
    want_code, want_out, want_err = cli(args)
    assert code == want_code, err[-3000:]
    assert _steady(out) == _steady(want_out)
    assert err == want_err
    if "missing" in " ".join(args) or "/no/such" in " ".join(args) or "two" in args:
        assert code == 2 and err.startswith("error:"), err


def test_link_conversion_and_its_verify_import_no_torch(plain_fsdp2_ckpt, tmp_path):
    """``convert --data link`` and ``verify`` of its output in processes without torch: the same
    report and byte-identical ``.metadata`` as with torch, and torch's own ``dcp.load`` reads the
    output strictly, every tensor bitwise the source's."""
    import torch.distributed.checkpoint as dcp

    out, ref = tmp_path / "out", tmp_path / "ref"
    code, text, err = without_torch(["convert", plain_fsdp2_ckpt, out, "--to", "dp=2", "--data", "link", "--json"])
    assert code == 0, err[-3000:]
    want_code, want_text, _ = cli(["convert", plain_fsdp2_ckpt, ref, "--to", "dp=2", "--data", "link", "--json"])
    assert want_code == 0
    report, want = json.loads(text), json.loads(want_text)
    def same(v: dict) -> dict:  # the comparison without the paths compared (out/ and ref/)
        return {k: x for k, x in v.items() if k not in ("a", "b")}

    assert report["verification"]["equal"] and same(report["verification"]) == same(want["verification"])
    assert report["data"]["mode"] == "link" and report["data"]["written_keys"] == 0
    assert report["data"]["linked_tensors"] == want["data"]["linked_tensors"] > 0
    assert (out / ".metadata").read_bytes() == (ref / ".metadata").read_bytes()

    code, text, err = without_torch(["verify", plain_fsdp2_ckpt, out])
    assert code == 0, text + err
    assert _steady(text) == _steady(cli(["verify", plain_fsdp2_ckpt, out])[1])

    src_md = dcp.FileSystemReader(str(plain_fsdp2_ckpt)).read_metadata()
    tensors = {k: v for k, v in src_md.state_dict_metadata.items() if hasattr(v, "chunks")}
    assert tensors
    a = {k: torch.zeros(tuple(v.size), dtype=v.properties.dtype) for k, v in tensors.items()}
    b = {k: torch.ones(tuple(v.size), dtype=v.properties.dtype) for k, v in tensors.items()}
    dcp.load(a, checkpoint_id=str(plain_fsdp2_ckpt), no_dist=True)
    dcp.load(b, checkpoint_id=str(out), no_dist=True)  # strict: every key must be found
    for k in tensors:
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


TENSOR_MODULES = {
    "reshard/engine/import_sources.py", "reshard/engine/importing.py",
    "reshard/engine/local_output.py", "reshard/semantics/transforms.py",
}  # engine/export.py and semantics/hf.py import it where a tensor is touched (issue 47: --format hf's questions first)
"""Modules below the trainers layer whose every path works on tensors (docs/architecture.md, "Where torch is imported")."""


def test_torch_at_module_top_only_where_tensors_are_the_work():
    """No module below the trainers layer imports torch when it is imported, except `TENSOR_MODULES`:
    the others import it inside the functions that decode or encode tensor bytes."""
    import ast

    root = Path(__file__).resolve().parents[1]
    trainers = ("reshard/train/", "reshard/reference/", "reshard/testing/", "reshard/rehearsal/")
    found = set()
    for path in sorted((root / "reshard").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(trainers):
            continue
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "torch" or n.startswith("torch.") for n in names):
                found.add(rel)
    assert found == TENSOR_MODULES, f"imports torch at its top: {sorted(found - TENSOR_MODULES)}; " \
                                    f"no longer does: {sorted(TENSOR_MODULES - found)}"


def test_stated_constants_match_torch():
    """What reshard states so that the metadata path needs no torch, against the installed torch."""
    import io

    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    from reshard.engine.space import SAVE_OVERHEAD
    from reshard.model.dtypes import DTYPES, dtype_named, from_torch, unstorable_reason
    from reshard.storage.checkpoints.dcp_writer import DCP_VERSION

    assert DCP_VERSION == CURRENT_DCP_VERSION
    buf = io.BytesIO()
    torch.save(torch.empty(0, dtype=torch.float32), buf)
    assert SAVE_OVERHEAD == len(buf.getvalue())
    theirs = {name: d for name, d in vars(torch).items() if isinstance(d, torch.dtype)}
    assert set(theirs) == set(DTYPES), set(theirs) ^ set(DTYPES)
    for name, d in theirs.items():
        ours = DTYPES[name]
        assert ours == d and d == ours and ours.torch is d and from_torch(d) is ours, name
        assert (ours.itemsize, ours.is_floating_point, ours.is_complex) == (d.itemsize, d.is_floating_point,
                                                                            d.is_complex), name
        assert str(ours) == str(d)
        quantized = d in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)
        assert (ours.kind == "quantized") == quantized, name
    for bad in ("int4", "uint7", "qint8"):
        assert unstorable_reason(dtype_named(bad)) is not None
    with pytest.raises(ValueError, match="not a torch dtype"):
        dtype_named("_inductor")
