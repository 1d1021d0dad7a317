"""One conversion pipeline: every output kind goes through `reshard.engine.pipeline.run_conversion`'s
one order of steps, and the conversion's end is written nowhere else.

(a) Each real output kind (a DCP copy, ``--data link``, per-rank safetensors, a distributed worker,
here the only one of a real gloo process group of one) is wrapped so that it records the steps it is asked to take;
a real conversion of a small FSDP2 checkpoint runs through each, and each must have taken exactly
`STEPS`, in that order, and produced an output equal to its source.
(b) The code is read (ast): the tail of a conversion (the report built and written, a difference
refused, the commit) is called only in ``engine/pipeline.py``, so a new output kind cannot grow
its own copy of it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from reshard.engine.copy import CopyOutput
from reshard.engine.distributed import Collective, DistributedOutput
from reshard.engine.link import LinkOutput
from reshard.engine.pipeline import STEPS, Output, run_conversion
from reshard.model.plan import Options
from reshard.planning.plan import make_plan
from reshard.storage.source import Source

ROOT = Path(__file__).resolve().parents[1] / "reshard"


@pytest.fixture
def group_of_one():
    """A real gloo process group of one worker (torch.distributed, in this process), torn down after."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group is already up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Collective(dist, 0, 1)
    finally:
        dist.destroy_process_group()


def _recording(kind: type[Output]) -> type[Output]:
    """``kind`` that notes the name of every step it is asked to take, then takes it as ``kind`` does."""

    class Recording(kind):  # type: ignore[misc, valid-type]
        def step(self, run, name, fn):
            self.taken.append(name)
            return super().step(run, name, fn)

    return Recording


def _local_output() -> type[Output]:
    from reshard.engine.local_output import LocalOutput  # imports torch

    return LocalOutput


KINDS = {
    "copy": lambda dst: _recording(CopyOutput)(dst),
    "link": lambda dst: _recording(LinkOutput)(dst),
    "local": lambda dst: _recording(_local_output())(dst),
    "distributed": lambda dst, group: _recording(DistributedOutput)(dst, collective=group),
}


@pytest.fixture(scope="module")
def planned(plain_fsdp2_ckpt):
    return make_plan(plain_fsdp2_ckpt, Options(to="dp=2"))


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_output_kind_takes_the_one_order(kind, planned, plain_fsdp2_ckpt, tmp_path, request):
    group = (request.getfixturevalue("group_of_one"),) if kind == "distributed" else ()
    output = KINDS[kind](tmp_path / "out", *group)
    output.taken = []
    report = run_conversion(planned, Source.local(plain_fsdp2_ckpt), output)
    assert output.taken == list(STEPS), output.taken
    assert report["verification"]["equal"] and (tmp_path / "out" / "reshard-report.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name != "out"], "the hidden directory was left behind"


TAIL = {"build_report", "write_reports", "refuse_if_different", "check_tied_copies"}
"""A conversion's end: only `run_conversion` calls these."""

COMMIT = {"start_commit", "end_commit"}
"""The commit's progress: a conversion's is `run_conversion`'s; an export and an import commit their own outputs."""


def _calls(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def test_the_conversion_tail_is_called_only_in_the_pipeline():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        calls = _calls(path)
        tail = calls & TAIL if rel != "engine/pipeline.py" else set()
        commit = calls & COMMIT if rel not in ("engine/pipeline.py", "engine/export.py", "engine/importing.py") else set()
        if tail | commit:
            found[rel] = sorted(tail | commit)
    assert not found, f"the conversion's end called outside engine/pipeline.py: {found}"
    assert TAIL | COMMIT <= _calls(ROOT / "engine" / "pipeline.py")
