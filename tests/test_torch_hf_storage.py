"""Issue 31: torch's own ``HuggingFaceStorageWriter`` read as the checkpoint it is.

tests/writers/torch_hf_storage.py runs a small net under FSDP2 ``fully_shard`` on 2 gloo ranks
and saves it with torch 2.13's ``HuggingFaceStorageWriter`` three times (one spawn):

| folder | how torch wrote it | what reshard does with it |
|---|---|---|
| ``sharded`` | ``{"model": state}``, ``save_distributed=True``: per-rank safetensors whose headers carry ``DCP_SHARDING_INFO`` | inspect, plan, convert (to dp=4, a normal DCP checkpoint) and verify read it as a sharded checkpoint |
| ``consolidated`` | the flat state, ``enable_consolidation=True``: full tensors + ``model.safetensors.index.json``, shards in ``sharded/`` | an export: inspect names it, plan and convert refuse it alike naming ``reshard import``; import (to dp=3) and a convert of its ``sharded/`` (to dp=1) work |
| ``with_optim`` | model + Adam state, ``save_distributed=True`` | torch writes the param_groups as a ``torch.save`` archive in front of the safetensors bytes: torch's own reader fails on it, reshard refuses it with one paragraph |

Every output is loaded back by torch in one spawn: the DCP outputs with ``dcp.load`` and the
default ``FileSystemReader`` at their new world size, then ``set_model_state_dict`` (strict);
the source itself with torch's ``HuggingFaceStorageReader`` (what torch reads is what the
fixture is). Each loaded full state is compared bitwise with the full state rank 0 gathered
with ``get_model_state_dict(full_state_dict=True)`` when it saved, and each checkpoint's keys
(as torch's reader lists them) with the model's.

CPU substitutions: gloo on CPU instead of NCCL, a ``"cpu"`` device mesh; the writer moves
tensors to CPU before serialising them, so the files are what a GPU job writes.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("safetensors")

from rank_jobs import free_port, result, spawn  # noqa: E402
from conftest import cli  # noqa: E402

WRITER = Path(__file__).parent / "writers" / "torch_hf_storage.py"
SHARD_1 = "shard-00001-model-00001-of-00001.safetensors"
SHARD_2 = "shard-00002-model-00001-of-00001.safetensors"


def _bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys whose tensors differ in shape, dtype or any bit (both key sets must be equal)."""
    assert sorted(a) == sorted(b)
    return [k for k in a if a[k].shape != b[k].shape or a[k].dtype != b[k].dtype
            or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Any]:
    """The three folders torch wrote and the reference full state."""
    root = tmp_path_factory.mktemp("torch_hf_storage")
    job = {"kind": "write", "world": 2, "port": free_port(), "result": str(root / "reference.pt"),
           "sharded": str(root / "sharded"), "consolidated": str(root / "consolidated"),
           "with_optim": str(root / "with_optim")}
    spawn(WRITER, "write", [job], root)
    return {"root": root, "sharded": root / "sharded", "consolidated": root / "consolidated",
            "with_optim": root / "with_optim", "reference": result(Path(job["result"]))["full"]}


@pytest.fixture(scope="module")
def converted(written) -> dict[str, Any]:
    """convert (sharded -> dp=4), import (consolidated -> dp=3), convert (consolidated/sharded -> dp=1),
    then one spawn that loads those three outputs with dcp.load and the source with torch's HF reader."""
    root: Path = written["root"]
    runs = {
        "out": (["convert", written["sharded"], root / "out", "--to", "dp=4"], 4, "model"),
        "imported": (["import", written["consolidated"], root / "imported", "--to", "dp=3"], 3, "model"),
        "from_sharded": (["convert", written["consolidated"] / "sharded", root / "from_sharded", "--to", "dp=1",
                          "--from", "dp_shard=2"], 1, ""),
    }
    out: dict[str, Any] = {}
    jobs = []
    for name, (args, world, nest) in runs.items():
        code, stdout, err = cli(args)
        out[name] = {"code": code, "stdout": stdout, "stderr": err, "dir": args[2], "loaded": None}
        if code == 0:
            jobs.append({"kind": "load", "name": name, "dir": str(args[2]), "world": world, "nest": nest,
                         "reader": "dcp", "port": free_port(), "result": str(root / f"{name}.loaded.pt")})
    for name, src, world, nest in (("source", written["sharded"], 2, "model"), ("consolidated", written["consolidated"], 3, "")):
        jobs.append({"kind": "load", "name": name, "dir": str(src), "world": world, "nest": nest, "reader": "hf",
                     "port": free_port(), "result": str(root / f"{name}.loaded.pt")})
        out[name] = {"loaded": None}
    spawn(WRITER, "load", jobs, root)
    for j in jobs:
        out[j["name"]]["loaded"] = result(Path(j["result"]))
    return out


def _model_keys(reference: dict[str, Any], prefix: str) -> list[str]:
    return sorted(prefix + k for k in reference)


# ------------------------------------------------------------------------------------ the sharded form
def test_inspect_reads_the_shards_as_torch_does(written):
    """inspect exit 0 (complete, 2 ranks, the format named); the global shapes and chunks reshard reads
    are those of torch's own HuggingFaceStorageReader and of the full state torch gathered."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from reshard.storage.checkpoints.local_format import open_any

    code, out, err = cli(["inspect", written["sharded"], "--json"])
    assert code == 0, err
    r = json.loads(out)
    assert r["complete"] and r["consistent"] and r["dcp_version"] == "hf-safetensors-dcp/1.0"
    assert (r["topology"]["dp_shard"], r["topology"]["world_size"], r["writer_ranks"]) == (2, 2, 2)
    ref = written["reference"]
    assert r["entries"] == len(ref) and r["problems"] == []
    assert r["by_role"]["parameter"]["bytes"] == sum(t.numel() * t.element_size() for t in ref.values())

    ix = open_any(written["sharded"])
    md = HuggingFaceStorageReader(str(written["sharded"])).read_metadata().state_dict_metadata
    assert sorted(ix.entries) == sorted(md) == _model_keys(ref, "model.")
    for key, e in ix.entries.items():
        assert e.shape == tuple(md[key].size) == tuple(ref[key[len("model."):]].shape), key
        assert e.dtype == md[key].properties.dtype == ref[key[len("model."):]].dtype, key
        assert sorted((c.box.offsets, c.box.sizes) for c in e.chunks) == \
            sorted((tuple(c.offsets), tuple(c.sizes)) for c in md[key].chunks), key
    assert len(ix.entries["model.inp.weight"].chunks) == 2  # 11 rows on 2 ranks: 6 + 5
    assert [len(ix.entries[k].chunks) for k in ("model.running_mean", "model.scale")] == [1, 1]  # replicated: one copy


def test_torch_reader_loads_the_source(written, converted):
    """The fixture is what torch reads: its HuggingFaceStorageReader loads it bitwise into FSDP2 at 2 ranks."""
    got = converted["source"]["loaded"]
    assert got["checkpoint_keys"] == _model_keys(written["reference"], "model.")
    assert _bitwise_equal(got["full"], written["reference"]) == []


def test_convert_to_dp4_loads_in_torch(written, converted):
    """convert exit 0, a normal DCP checkpoint (``.metadata`` + ``.distcp``), that ``dcp.load`` with the
    default FileSystemReader loads strictly at 4 ranks, every value bitwise the source's."""
    run = converted["out"]
    assert run["code"] == 0, run["stderr"]
    names = {p.name for p in Path(run["dir"]).iterdir()}
    assert ".metadata" in names and {f"__{r}_0.distcp" for r in range(4)} <= names
    assert not any(n.endswith(".safetensors") for n in names)
    got = run["loaded"]
    assert got["checkpoint_keys"] == _model_keys(written["reference"], "model.")
    assert _bitwise_equal(got["full"], written["reference"]) == []


def test_verify_plan_and_link(written, converted):
    """verify SRC OUT (and OUT SRC) exit 0; plan exit 0 and feasible, as convert found it; ``--data link``
    is refused (exit 2): the source's files hold no DCP items to share."""
    for a, b in ((written["sharded"], converted["out"]["dir"]), (converted["out"]["dir"], written["sharded"])):
        code, out, err = cli(["verify", a, b, "--json"])
        assert code == 0, out + err
        assert json.loads(out)["equal"]
    code, out, err = cli(["plan", written["sharded"], "--to", "dp=4", "--json"])
    assert code == 0, err
    plan = json.loads(out)
    assert plan["feasible"] and plan["data_link"]["available"] is False
    dst = written["root"] / "linked"
    code, _, err = cli(["convert", written["sharded"], dst, "--to", "dp=4", "--data", "link"])
    assert code == 2 and "safetensors" in err and "--data copy" in err and not dst.exists()


def test_import_of_the_shards_names_convert(written):
    """import takes full tensors: the shards are refused (exit 2) naming ``reshard convert``."""
    dst = written["root"] / "imported_shards"
    code, _, err = cli(["import", written["sharded"], dst, "--to", "dp=2"])
    assert code == 2 and f"reshard convert {written['sharded']} DST" in err and not dst.exists()
    assert "Traceback" not in err


# ------------------------------------------------------------------------------------ the consolidated form
def test_consolidated_is_named_and_refused_alike(written):
    """inspect names the consolidated output; plan and convert both refuse it (exit 2) with the same
    paragraph, naming ``reshard import`` and the shards folder convert reads."""
    src = written["consolidated"]
    code, out, err = cli(["inspect", src, "--json"])
    assert code == 0, err
    notes = [n["message"] for n in json.loads(out)["notes"] if n["code"] == "consolidated_export"]
    assert len(notes) == 1 and "enable_consolidation=True" in notes[0] and f"reshard import {src} DST" in notes[0]
    code_p, _, err_p = cli(["plan", src, "--to", "dp=2"])
    dst = written["root"] / "refused"
    code_c, _, err_c = cli(["convert", src, dst, "--to", "dp=2"])
    assert (code_p, code_c) == (2, 2) and not dst.exists()
    assert err_p == err_c
    assert f"`reshard import {src} DST --to dp=2`" in err_c
    assert f"`reshard convert {src / 'sharded'} DST --to dp=2`" in err_c


def test_import_of_consolidated_loads_in_torch(written, converted):
    """``reshard import`` of the consolidated output (dp=3) loads with ``dcp.load`` at 3 ranks, bitwise what
    torch's HuggingFaceStorageReader reads from the consolidated files. (Those equal the saved state but for
    the 0-d ``scale``: torch 2.13's consolidation skips tensors without dims and leaves their bytes zero.)"""
    run = converted["imported"]
    assert run["code"] == 0, run["stderr"]
    got, torch_read = run["loaded"], converted["consolidated"]["loaded"]
    assert got["checkpoint_keys"] == _model_keys(written["reference"], "model.")
    assert torch_read["checkpoint_keys"] == _model_keys(written["reference"], "")
    assert _bitwise_equal(got["full"], torch_read["full"]) == []
    assert _bitwise_equal(torch_read["full"], written["reference"]) in ([], ["scale"])


def test_convert_of_its_shards_folder_loads_in_torch(written, converted):
    """The other way out the refusal names: ``sharded/`` (flat keys) converted to dp=1 loads bitwise."""
    run = converted["from_sharded"]
    assert run["code"] == 0, run["stderr"]
    got = run["loaded"]
    assert got["checkpoint_keys"] == _model_keys(written["reference"], "")
    assert _bitwise_equal(got["full"], written["reference"]) == []


# ------------------------------------------------------------------------------------ what the writer cannot store
def test_optimizer_state_through_the_writer_is_refused(written):
    """Given Adam's state, torch writes the param_groups as a torch.save archive in front of the safetensors
    bytes: torch's own reader fails on the folder, and reshard refuses it (exit 2) naming the file and why."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    src = written["with_optim"]
    with pytest.raises(Exception):
        HuggingFaceStorageReader(str(src)).read_metadata()
    for args in (["inspect", src], ["plan", src, "--to", "dp=4"]):
        code, _, err = cli(args)
        assert code == 2 and "torch.save archive" in err and "FileSystemWriter" in err, err
        assert "Traceback" not in err and ".safetensors" in err


# ------------------------------------------------------------------------------------ hostile headers
def _rewrite(path: Path, edit) -> None:
    """Rewrite one safetensors file with ``edit(header, sharding_info)`` applied to its header."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    edit(header, info)
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])


def _del_info(h, i):
    del i["model.out.bias"]


def _bad_rank(h, i):
    i["model.out.weight"]["saved_offsets"] = [5]


def _gap(h, i):
    i["model.out.weight"]["saved_offsets"] = [6, 0]  # rank 1's rows 5..9 said to start at row 6


def _overlap(h, i):
    a, b = h["model.inp.bias"]["data_offsets"], h["model.norm.bias"]["data_offsets"]
    h["model.norm.bias"]["data_offsets"] = [a[0], a[0] + b[1] - b[0]]


def _past_end(h, i):
    key = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
    b, e = h[key]["data_offsets"]
    h[key]["data_offsets"] = [b + 4096, e + 4096]


def _deep_json(h, i):
    i["model.out.bias"] = {"saved_offsets": [[[[[[[[0]]]]]]]]}


HOSTILE = {"no_sharding_info_for_a_tensor": (_del_info, "model.out.bias"),
           "offsets_of_another_rank": (_bad_rank, "model.out.weight"),
           "gap_between_chunks": (_gap, "model.out.weight"),
           "overlapping_tensors": (_overlap, "overlap"),
           "data_past_the_end": (_past_end, "ends at byte"),
           "nested_offsets": (_deep_json, "model.out.bias")}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_header_is_named(written, tmp_path, case):
    """A forged header is exit 2 from inspect and plan, naming the key or the problem and never a traceback;
    convert commits nothing."""
    import shutil

    edit, needle = HOSTILE[case]
    src = tmp_path / "src"
    shutil.copytree(written["sharded"], src)
    _rewrite(src / SHARD_2, edit)
    for args in (["inspect", src], ["plan", src, "--to", "dp=4"], ["convert", src, tmp_path / "dst", "--to", "dp=4"]):
        code, out, err = cli(args)
        assert code == 2 and needle in out + err and "Traceback" not in err, (args[0], out, err)
    assert not (tmp_path / "dst").exists()


def test_lost_or_linked_shard_is_named(written, tmp_path):
    """Rank 0's file lost: the rows it held are a gap (exit 2); a shard that is a symlink out of the
    folder is refused by name before it is read."""
    import shutil

    lost = tmp_path / "lost"
    shutil.copytree(written["sharded"], lost)
    (lost / SHARD_1).unlink()
    code, out, err = cli(["inspect", lost, "--json"])
    assert code == 2 and any(p["code"] == "chunk_gap" for p in json.loads(out)["problems"])
    linked = tmp_path / "linked"
    shutil.copytree(written["sharded"], linked)
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(linked / SHARD_1, outside)
    (linked / SHARD_1).symlink_to(outside)
    code, _, err = cli(["inspect", linked])
    assert code == 2 and SHARD_1 in err and "outside the checkpoint" in err
