"""Hostile pickles, round two (issue 13, findings 5 and 6): bounded, and trusted only where the flag says.

Each test is the attack, on a checkpoint written by ``dcp.save`` and then edited as an
attacker would (the `.metadata` re-pickled with the real DCP classes, an item's bytes
appended to its data file and pointed at):

- an amplifying `.metadata` (about 1.5 MB, only allowed globals: one chunk record
  referenced 700,000 times, so a decoder copying each chunk builds 1.7 GB) is refused
  before it is unpickled, within a stated peak RSS;
- a zip-bomb object item (2.3 MB of deflated zeros that torch.load inflates to 512 MiB)
  is refused by key before it is loaded, within a stated peak RSS;
- ``--trust-pickle`` prints one warning line naming each object item it unpickled, and
  never lifts the safe set for a tensor item (whose payload never runs);
- deciding whether a ``torch.*`` global is allowed imports nothing: a `.metadata` naming
  ``torch._inductor`` is refused and no ``torch._inductor`` module appears;
- `pickle_cost`, the scan behind both bounds, checked against an independent count on
  random shared structures (hypothesis).

Peak RSS is measured in a fresh interpreter that runs the command as its only child and
reports ``getrusage(RUSAGE_CHILDREN).ru_maxrss``, against the same command on the
unmodified checkpoint.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import pickle
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import run_cli
from reshard.storage.pickles.safe_pickle import COST_PER_BYTE, PickleTooCostly, pickle_budget, pickle_cost

RSS_MARGIN = 256 << 20  # the stated bound: a refused attack costs at most this much more than the honest input


class Evil:
    """Unpickling this calls ``pathlib.Path.touch(marker)``: the observable "code execution"."""

    def __init__(self, marker: Path):
        self.marker = Path(marker)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


class Opaque:
    """A harmless class outside torch's safe set: loading it needs ``--trust-pickle``."""

    def __init__(self, cursor: int):
        self.cursor = cursor

    def __eq__(self, other: object) -> bool:
        return type(other) is Opaque and vars(other) == vars(self)


# ------------------------------------------------------------------------------ helpers

def _tiny_ckpt(path: Path, sampler: object = None) -> Path:
    w = torch.arange(8.0).reshape(4, 2)
    sd = {"model": {"w": w},
          "optim": {"state": {"w": {"exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.ones_like(w),
                                    "step": torch.tensor(3.0)}}},
          "trainer": {"step": 3, "tokens_seen": 96},
          "data": {"sampler": sampler if sampler is not None else {"cursor": 24, "seed": 0, "epoch": 0}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path


def _metadata(ck: Path):
    with open(ck / ".metadata", "rb") as f:  # our own file, written by dcp.save just now
        return pickle.load(f)


def _write_metadata(ck: Path, md) -> None:
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _replace_item(ck: Path, fqn: str, blob: bytes) -> str:
    """Append ``blob`` to the data file of ``fqn``'s (first) item and point `.metadata` at it; the file name."""
    md = _metadata(ck)
    idx = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[idx]
    path = ck / info.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(blob)
    md.storage_data[idx] = dataclasses.replace(info, offset=offset, length=len(blob))
    _write_metadata(ck, md)
    return info.relative_path


def _zip_bomb(inflated: int) -> bytes:
    """A torch.save archive of ``{"blob": uint8 tensor of inflated bytes}`` with every member deflated."""
    seed_n = 70001  # a size pickled as a 4-byte BININT, patched to ``inflated``
    buf = io.BytesIO()
    torch.save({"blob": torch.zeros(seed_n, dtype=torch.uint8)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for zi in src.infolist():
            if zi.filename.endswith("/data.pkl"):
                pkl = src.read(zi)
                assert pkl.count(struct.pack("<i", seed_n)) == 2  # the storage's numel and the tensor's size
                z.writestr(zi.filename, pkl.replace(struct.pack("<i", seed_n), struct.pack("<i", inflated)))
            elif "/data/" in zi.filename:
                with z.open(zi.filename, "w", force_zip64=True) as f:
                    zeros = bytes(1 << 20)
                    for _ in range(inflated >> 20):
                        f.write(zeros)
            else:
                z.writestr(zi.filename, src.read(zi))
    blob = out.getvalue()
    loaded = torch.load(io.BytesIO(blob), weights_only=True)["blob"] if inflated <= 1 << 20 else None
    assert loaded is None or loaded.numel() == inflated  # the bomb is one torch.load would inflate
    return blob


_MEASURE = """
import json, resource, subprocess, sys
p = subprocess.run([sys.executable, "-m", "reshard", *sys.argv[1:]], capture_output=True, text=True, timeout=600)
print(json.dumps({"code": p.returncode, "out": p.stdout, "err": p.stderr,
                  "rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def _run_measured(args: list) -> dict:
    """Run ``python -m reshard ARGS`` as the only child of a fresh interpreter; its exit code, output and peak RSS."""
    env = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}
    p = subprocess.run([sys.executable, "-c", _MEASURE, *map(str, args)], capture_output=True, text=True,
                       timeout=900, env=env, cwd=str(Path(__file__).resolve().parents[1]))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _one_paragraph_error(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("warning: ")]
    text = "\n".join(lines)
    assert text.startswith("error:"), err
    assert len(lines) == 1 and "Traceback" not in err, err
    return text


# ------------------------------------------------------------------------------ (6) amplifying .metadata

def _amplifying_metadata(ck: Path, *, refs: int = 700_000, dims: int = 150) -> int:
    """`.metadata` whose tensor 'model.w' lists one chunk record ``refs`` times (a memo reference each).

    Only allowed globals (DCP's own classes, torch.Size): stock pickle.load builds it in a
    few megabytes, but every reader that copies each chunk's offsets and sizes (as a
    decoder must) builds ``refs * 2 * dims`` integers: 1.7 GB of tuple slots.
    """
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    md = _metadata(ck)
    tsm = md.state_dict_metadata["model.w"]
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * dims), sizes=torch.Size([1] * dims))
    tsm.chunks = [chunk] * refs
    _write_metadata(ck, md)
    return (ck / ".metadata").stat().st_size


def test_amplifying_metadata_refused_within_memory_bound(tmp_path):
    honest = _tiny_ckpt(tmp_path / "honest")
    ck = _tiny_ckpt(tmp_path / "amplifying")
    size = _amplifying_metadata(ck)
    assert 1_000_000 < size < 2_000_000  # about 1.5 MB, as in the report
    # the structure is a valid pickle of allowed classes: stock pickle opens it without trouble
    assert len(_metadata(ck).state_dict_metadata["model.w"].chunks) == 700_000
    base = _run_measured(["inspect", honest])
    assert base["code"] == 0, base["err"]
    for args in (["inspect", ck], ["plan", ck, "--to", "dp=2"]):
        r = _run_measured(args)
        assert r["code"] == 2, (args, r)
        text = _one_paragraph_error(r["err"])
        assert str(ck / ".metadata") in text and "budget" in text, text
        assert r["rss"] < base["rss"] + RSS_MARGIN, (args, r["rss"] >> 20, base["rss"] >> 20)


def test_amplifying_metadata_refused_in_process_without_output(tmp_path, capsys):
    ck = _tiny_ckpt(tmp_path / "amplifying")
    _amplifying_metadata(ck, refs=200_000, dims=40)
    dst = tmp_path / "dst"
    for args in (["verify", ck, ck], ["convert", ck, dst, "--to", "dp=2"]):
        code, out, err = run_cli(args, capsys)
        assert code == 2, (args, code, err)
        assert ".metadata" in _one_paragraph_error(err)
    assert not dst.exists()


def _records_sharing_one_state(records: int, fields: int) -> bytes:
    """A pickle of ``records`` BytesStorageMetadata records whose BUILD re-uses one memoized state dict.

    Hand-assembled (the pickler would write each record's state out), as an attacker would:
    ``fields`` entries once in the file, copied into every record by the unpickler.
    """
    mod, name = b"torch.distributed.checkpoint.metadata", b"BytesStorageMetadata"
    body = bytearray(b"\x80\x04")
    body += b"\x8c" + bytes([len(mod)]) + mod + b"\x94" + b"\x8c" + bytes([len(name)]) + name + b"\x94"
    body += b"\x93\x94"  # STACK_GLOBAL -> memo 2: the allowed class
    body += b"}\x94("  # the shared state dict -> memo 3
    for i in range(fields):
        key = f"field{i}".encode()
        body += b"\x8c" + bytes([len(key)]) + key + b"M" + struct.pack("<H", i)
    body += b"u"  # SETITEMS
    body += b"]\x94("  # the list of records
    body += b"h\x02)\x81h\x03b" * records  # cls () NEWOBJ, state BUILD: each copies the shared dict
    body += b"e."
    return bytes(body)


def test_state_dict_reused_by_many_records_is_refused(tmp_path, capsys):
    """A second amplifier: one state dict of 500 fields applied to 20,000 records (BUILD copies it each time)."""
    body = _records_sharing_one_state(20_000, 500)
    built = pickle.loads(body)  # stock pickle (with DCP's real class) builds it: 10 million attributes
    assert len(built) == 20_000 and len(vars(built[-1])) == 500 and len(body) < 200_000
    ck = _tiny_ckpt(tmp_path / "reused-state")
    (ck / ".metadata").write_bytes(body)
    code, out, err = run_cli(["inspect", ck], capsys)
    assert code == 2, (code, err)
    text = _one_paragraph_error(err)
    assert "budget" in text and str(ck / ".metadata") in text, text


# ------------------------------------------------------------------------------ (6) zip-bomb object item

def test_zip_bomb_object_item_refused_within_memory_bound(tmp_path):
    honest = _tiny_ckpt(tmp_path / "honest")
    ck = _tiny_ckpt(tmp_path / "bomb")
    blob = _zip_bomb(512 << 20)
    assert len(blob) < 4 << 20  # a few MB on disk, 512 MiB once inflated
    fname = _replace_item(ck, "data.sampler.cursor", blob)
    base = _run_measured(["inspect", "--deep", "--json", honest])
    assert base["code"] == 0, base["err"]
    r = _run_measured(["inspect", "--deep", "--json", ck])
    assert r["code"] == 2, r
    probs = json.loads(r["out"])["problems"]
    hit = [p for p in probs if p.get("keys") == ["data.sampler.cursor"]]
    assert hit and "compressed" in hit[0]["message"] and hit[0]["file"] == fname, probs
    assert r["rss"] < base["rss"] + RSS_MARGIN, (r["rss"] >> 20, base["rss"] >> 20)
    dst = tmp_path / "dst"
    for args in (["convert", ck, dst, "--to", "dp=2", "--trust-pickle"], ["verify", honest, ck]):
        r = _run_measured(args)
        assert r["code"] == 2, (args, r)
        text = _one_paragraph_error(r["err"])
        assert "data.sampler.cursor" in text and str(ck / fname) in text and "compressed" in text, text
        assert r["rss"] < base["rss"] + RSS_MARGIN, (args, r["rss"] >> 20)
        assert not dst.exists()


def test_object_item_loading_as_a_huge_value_is_refused(tmp_path, capsys):
    """Stored members, no compression, but one 1 MiB tensor referenced 4,096 times: 4 GiB to whoever walks it."""
    ck = _tiny_ckpt(tmp_path / "views")
    t = torch.zeros(1 << 20, dtype=torch.uint8)
    buf = io.BytesIO()
    torch.save({"views": [t] * 4096}, buf)
    fname = _replace_item(ck, "data.sampler.cursor", buf.getvalue())
    code, out, err = run_cli(["inspect", "--deep", "--json", ck], capsys)
    assert code == 2, err
    hit = [p for p in json.loads(out)["problems"] if p.get("keys") == ["data.sampler.cursor"]]
    assert hit and "loads as a value of more than" in hit[0]["message"] and hit[0]["file"] == fname, out


# ------------------------------------------------------------------------------ (5) --trust-pickle

def test_trust_pickle_warns_once_naming_the_key(tmp_path, capsys):
    ck = _tiny_ckpt(tmp_path / "opaque", sampler=Opaque(24))
    code, out, err = run_cli(["inspect", "--deep", "--json", ck], capsys)
    assert code == 2 and "--trust-pickle" not in [ln.split(":")[0] for ln in err.splitlines()]
    assert "warning:" not in err
    code, out, err = run_cli(["inspect", "--deep", "--json", "--trust-pickle", ck], capsys)
    assert not any(p["code"] == "unsafe_item" for p in json.loads(out)["problems"]), out
    warn = [ln for ln in err.splitlines() if ln.startswith("warning: --trust-pickle")]
    assert len(warn) == 1 and "'data.sampler'" in warn[0] and str(ck) in warn[0], err
    assert "'trainer.step'" not in warn[0]  # loaded too, but the safe set sufficed: nothing to warn about
    # a conversion loads the item several times (plan, copy, verify of both sides): still one line
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", ck, dst, "--to", "dp=2", "--trust-pickle"], capsys)
    assert code == 0, err
    warn = [ln for ln in err.splitlines() if ln.startswith("warning: --trust-pickle")]
    assert len(warn) == 1 and "'data.sampler'" in warn[0], err
    assert json.loads((dst / "manifest.json").read_text())["lineage"][-1]["policies"]["trust_pickle"] is True
    # without the flag nothing is unpickled and nothing is announced
    code, out, err = run_cli(["inspect", ck], capsys)
    assert "warning: --trust-pickle" not in err


def _tensor_item_with_payload(marker: Path) -> bytes:
    """A torch.save of the chunk 'model.w' (4x2 float32) carrying an Evil attribute: needs a global outside the safe set."""
    t = torch.arange(8.0).reshape(4, 2)
    t.note = Evil(marker)
    buf = io.BytesIO()
    torch.save(t, buf)
    if marker.exists():  # torch.save may copy the tensor's __dict__, which runs __reduce__ here, in the test
        marker.unlink()
    return buf.getvalue()


def test_tensor_item_needing_a_global_refused_even_with_trust_pickle(tmp_path, capsys):
    marker = tmp_path / "pwned-tensor"
    ck = _tiny_ckpt(tmp_path / "evil-tensor")
    fname = _replace_item(ck, "model.w", _tensor_item_with_payload(marker))
    assert not marker.exists()
    code, out, err = run_cli(["inspect", "--deep", "--json", "--trust-pickle", ck], capsys)
    assert not marker.exists(), "inspect --deep --trust-pickle ran a tensor item's payload"
    assert code == 2, (code, out, err)
    hit = [p for p in json.loads(out)["problems"] if p["code"] == "unsafe_item" and p["keys"] == ["model.w"]]
    assert hit and hit[0]["file"] == fname and "tensor item" in hit[0]["message"], out
    assert "warning: --trust-pickle" not in err
    dst = tmp_path / "dst"
    for args in (["convert", ck, dst, "--to", "dp=2", "--trust-pickle"], ["verify", ck, ck, "--trust-pickle"]):
        code, out, err = run_cli(args, capsys)
        assert not marker.exists(), f"{args[0]} ran a tensor item's payload"
        assert code == 2, (args, code, err)
        assert "model.w" in _one_paragraph_error(err)
        assert not dst.exists()


# ------------------------------------------------------------------------------ (5) no import to decide

_IMPORTS = """
import json, sys
from reshard.cli import main

def run(args):
    try:
        main(args)
    except SystemExit as exc:
        return exc.code
    return 0

honest, hostile = sys.argv[1], sys.argv[2:]
codes = [run(["inspect", "--deep", honest])]  # every import a real inspect needs, done
before = set(sys.modules)
for ck in hostile:
    codes.append(run(["inspect", ck]))
new = sorted(m for m in set(sys.modules) - before if m.startswith("torch"))
print(json.dumps({"codes": codes, "new": new}))
"""


@pytest.mark.parametrize("module,name", [("torch", "_inductor"), ("torch._inductor.config", "patch"),
                                         ("torch", "nonexistent_module"), ("torch", "_dynamo")])
def test_metadata_naming_a_torch_submodule_imports_nothing(tmp_path, module, name):
    honest = _tiny_ckpt(tmp_path / "honest")
    hostile = []
    for proto, body in (("text", f"c{module}\n{name}\n.".encode()),
                        ("stack", b"\x80\x04\x8c" + bytes([len(module)]) + module.encode() + b"\x8c"
                         + bytes([len(name)]) + name.encode() + b"\x93.")):
        ck = tmp_path / f"hostile-{proto}"
        _tiny_ckpt(ck)
        (ck / ".metadata").write_bytes(body)
        hostile.append(ck)
    p = subprocess.run([sys.executable, "-c", _IMPORTS, str(honest), *map(str, hostile)], capture_output=True,
                       text=True, timeout=300, cwd=str(Path(__file__).resolve().parents[1]))
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["codes"] == [0, 2, 2], (r, p.stderr)
    assert not r["new"], f"deciding about '{module}.{name}' imported {r['new']}"
    assert f"refusing to unpickle global '{module}.{name}'" in p.stderr and ".metadata" in p.stderr


# ------------------------------------------------------------------------------ the scan itself

def _weight(x, shared: dict[int, int]) -> int:
    """The expanded weight `pickle_cost` promises to count at least: 1 + contents, strings 1 + len // 8."""
    if isinstance(x, str):
        return 1 + len(x.encode("utf-8")) // 8
    if isinstance(x, dict):
        return 1 + sum(_weight(k, shared) + _weight(v, shared) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return 1 + sum(_weight(v, shared) for v in x)
    return 1


def _shared_structures():
    leaves = st.one_of(st.integers(-2**40, 2**40), st.text(max_size=40), st.none(), st.booleans(), st.floats(allow_nan=False))

    def extend(children):
        return st.one_of(st.lists(children, max_size=6), st.tuples(children, children),
                         st.dictionaries(st.text(max_size=8), children, max_size=4),
                         st.tuples(children, st.integers(1, 60)).map(lambda p: [p[0]] * p[1]))  # one value, many references
    return st.recursive(leaves, extend, max_leaves=40)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(obj=_shared_structures(), protocol=st.integers(0, 5))
def test_pickle_cost_counts_the_expanded_tree(obj, protocol):
    data = pickle.dumps(obj, protocol=protocol)
    expanded = _weight(obj, {})
    cost = pickle_cost(data, limit=10**12)
    assert cost >= expanded  # memo references are charged their whole value
    assert pickle.loads(data) == obj or obj != obj  # the scanned pickle is a valid one
    if expanded > pickle_budget(len(data)):
        with pytest.raises(PickleTooCostly):
            pickle_cost(data, limit=pickle_budget(len(data)))


def test_pickle_cost_of_real_metadata_leaves_margin(tmp_path):
    """The factor is measured, not guessed: DCP's own `.metadata` costs a fraction of the budget."""
    from reshard.testing.synthetic import make_many_entries

    ck = make_many_entries(tmp_path / "many", 2_000)
    data = (ck / ".metadata").read_bytes()
    per_byte = pickle_cost(data, limit=10**12) / len(data)
    assert per_byte < COST_PER_BYTE / 3, per_byte


@pytest.mark.parametrize("body,why", [
    (b"\x80\x04]\x94r\x00\x00\x00\x40.", "memo index"),  # LONG_BINPUT 2**30: the C unpickler would size its memo by it
    (b"\x80\x04\x8e\xff\xff\xff\xff\xff\x00\x00\x00.", "past the end"),  # BINBYTES8 claiming a terabyte
    (b"\x80\x04]\x94h\x00a.", "changed after"),  # a list appended to itself after a memo reference: a cycle
    (b"\x80\x04\x82\x01.", "not used"),  # EXT1: the copyreg extension registry
])
def test_pickle_cost_refuses_what_would_allocate_by_a_claim(body, why):
    with pytest.raises(PickleTooCostly, match=why):
        pickle_cost(body, limit=pickle_budget(len(body)))
