"""Issue 13, finding 3: `verify` trusts nothing the checkpoint under test says about itself.

Each test is the attack: a checkpoint B that differs from A and carries something meant to
excuse the difference (a forged `reshard-report.json`, a forged lineage in `manifest.json`,
a forged `export-report.json`, object values equal only to Python's `==`). The safe outcome
is exit 1 naming the key. A genuine `reshard convert` or `reshard export` output still
verifies (exit 0), its changes re-derived by the verifier from A itself.
"""
from __future__ import annotations

import json
import math
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import cli, run_cli
from reshard.storage.checkpoints.index import RANK_FILE, CheckpointIndex
from reshard.storage.files.integrity import record as integrity_record
from reshard.storage.checkpoints import dcp as dcp_io
from reshard.storage.checkpoints.dcp_writer import CHECKSUM_ALGORITHM, DcpWriter
from reshard.verification.objects import identical, object_difference

MOMENT = "optim.state.blocks.0.mlp.fc1.weight.exp_avg_sq"
WEIGHT = "blocks.0.mlp.fc1.weight"


# ------------------------------------------------------------------------------ helpers
def _rank(file: str) -> int:
    m = RANK_FILE.match(file)
    assert m, file
    return int(m.group(1))


def rewrite(src: Path, dst: Path, *, tensor: tuple[str, Callable[[torch.Tensor], None]] | None = None,
            objects: dict[str, Any] | None = None) -> None:
    """Copy checkpoint ``src`` into ``dst`` item by item through the DCP writer, every item's bytes
    verbatim except the first chunk of ``tensor[0]`` (changed in place by ``tensor[1]``) and the
    objects in ``objects`` (written with these values). The manifest is copied with item
    checksums of the new bytes, as an attacker would write them (so B is not merely corrupt)."""
    objects = objects or {}
    ix = CheckpointIndex.open(src)
    dst.mkdir(parents=True)
    w = DcpWriter(dst)
    done = False
    for k, e in ix.entries.items():
        if e.is_tensor:
            w.declare_tensor(k, e.shape, e.dtype, path=e.path)
            for ch in e.chunks:
                rank = _rank(ch.location.file)
                if tensor is not None and k == tensor[0] and not done and not ch.box.is_empty():
                    t = dcp_io.load_item(ix.root, ch.location, key=k)
                    tensor[1](t)
                    w.write_chunk(rank, k, ch.box.offsets, t)
                    done = True
                else:
                    w.write_chunk_bytes(rank, k, ch.box.offsets, ch.box.sizes,
                                        dcp_io.read_item_bytes(ix.root, ch.location, key=k))
        elif k in objects:
            w.write_object(_rank(e.location.file), k, objects[k], path=e.path)
        else:
            w.write_object_bytes(_rank(e.location.file), k, dcp_io.read_item_bytes(ix.root, e.location, key=k),
                                 path=e.path)
    w.finish()
    assert tensor is None or done
    if (src / "manifest.json").exists():
        m = json.loads((src / "manifest.json").read_text())
        if "integrity" in m:
            m["integrity"] = integrity_record(w.checksums(), algorithm=CHECKSUM_ALGORITHM)
        (dst / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")


def set_first(value: float) -> Callable[[torch.Tensor], None]:
    def change(t: torch.Tensor) -> None:
        t.view(-1)[0] = value
    return change


def edit_manifest(path: Path, change: Callable[[dict], None]) -> None:
    m = json.loads((path / "manifest.json").read_text())
    change(m)
    (path / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")


def verify_json(a: Path, b: Path, capsys, *extra: str) -> tuple[int, dict, str]:
    code, out, err = run_cli(["verify", a, b, "--json", *extra], capsys)
    assert "Traceback" not in out + err
    return code, json.loads(out), err


def _save(path: Path, sd: dict) -> Path:
    """A single-process DCP save (real dcp.save, one writer file)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile_verify")


@pytest.fixture(scope="module")
def converted(root, reference_ckpt) -> Path:
    """A genuine `reshard convert` of the 4-rank reference checkpoint to dp=2 (RNG reseeded)."""
    dst = root / "dp2"
    code, out, err = cli(["convert", reference_ckpt, dst, "--to", "dp=2"])
    assert code == 0, out + err
    return dst


@pytest.fixture(scope="module")
def moment_changed(root, reference_ckpt) -> Path:
    """A copy of the reference checkpoint with one Adam second moment set to 123."""
    dst = root / "moment123"
    rewrite(reference_ckpt, dst, tensor=(MOMENT, set_first(123.0)))
    return dst


@pytest.fixture(scope="module")
def exported(root, reference_ckpt) -> Path:
    from reshard.engine.export import export

    dst = root / "export"
    export(reference_ckpt, dst, fmt="safetensors")
    return dst


# ------------------------------------------------------------------------------ conversions
def test_genuine_conversion_verifies_with_rewrites_rederived(reference_ckpt, converted, capsys):
    code, r, err = verify_json(reference_ckpt, converted, capsys)
    assert code == 0 and r["equal"], r["differences"][:3]
    rng = [w for w in r["rewritten"] if w["key"].startswith("rng.rank_")]
    assert rng and all(w["reason"].endswith("(value re-derived)") for w in rng), r["rewritten"][:3]
    assert r["evidence"].startswith(f"the plan recomputed from {reference_ckpt}")
    # the other way round too: A's lineage names B as its source
    code, r, _ = verify_json(converted, reference_ckpt, capsys)
    assert code == 0, r["differences"][:3]
    # --strict excuses none of it
    code, r, _ = verify_json(reference_ckpt, converted, capsys, "--strict")
    assert code == 1 and {d["key"] for d in r["differences"]} == {w["key"] for w in rng}


def test_genuine_schedule_remap_verifies(root, reference_ckpt, capsys):
    """A transition whose plan rewrites the LR schedule's position (global batch changed, --schedule tokens)."""
    dst = root / "remapped"
    code, out, err = cli(["convert", reference_ckpt, dst, "--to", "dp=2", "--micro-batch", "1", "--grad-accum", "1",
                          "--schedule", "tokens"])
    assert code == 0, out + err
    planned = {k["key"] for k in json.loads((dst / "reshard-report.json").read_text())["plan"]["keys"]
               if k["action"] == "rewritten" and k["key"].startswith("scheduler.")}
    assert planned, "the plan remapped no scheduler key"
    code, r, _ = verify_json(reference_ckpt, dst, capsys)
    assert code == 0, r["differences"][:3]
    assert planned <= {w["key"] for w in r["rewritten"] if w["reason"].endswith("(value re-derived)")}


def test_forged_report_does_not_excuse_a_changed_moment(reference_ckpt, moment_changed, tmp_path, capsys):
    b = tmp_path / "b"
    shutil.copytree(moment_changed, b)
    (b / "reshard-report.json").write_text(json.dumps({
        "report_version": 1, "source": str(reference_ckpt.resolve()), "destination": str(b.resolve()),
        "plan": {"keys": [{"key": MOMENT, "role": "optimizer_moment", "action": "rewritten",
                           "reason": "schedule remapped"}]}}))
    code, r, _ = verify_json(reference_ckpt, b, capsys)
    assert code == 1 and not r["equal"]
    (d,) = r["differences"]
    assert (d["key"], d["kind"], d["b"]) == (MOMENT, "value", 123.0)
    assert r["rewritten"] == [] and r["evidence"] is None
    code, out, err = run_cli(["verify", reference_ckpt, b], capsys)
    assert code == 1 and MOMENT in out and "Traceback" not in out + err


def _forge_lineage(b: Path, source_plan_of: Path, **option_changes) -> None:
    """Give B the lineage a genuine conversion of ``source_plan_of`` would carry, options changed."""
    genuine = json.loads((source_plan_of / "manifest.json").read_text())["lineage"][-1]

    def change(m: dict) -> None:
        entry = json.loads(json.dumps(genuine))
        entry["policies"]["options"].update(option_changes)
        m["lineage"] = list(m.get("lineage") or []) + [entry]
    edit_manifest(b, change)


def test_forged_lineage_naming_a_does_not_excuse_a_changed_moment(reference_ckpt, converted, moment_changed,
                                                                  tmp_path, capsys):
    """B names A as its source with options that are real (dp=4: nothing rewritten) but make no moment change."""
    b = tmp_path / "b"
    shutil.copytree(moment_changed, b)
    _forge_lineage(b, converted, to="dp=4")
    code, r, _ = verify_json(reference_ckpt, b, capsys)
    assert code == 1 and [d["key"] for d in r["differences"]] == [MOMENT]


def test_forged_lineage_options_that_do_not_produce_bs_values(reference_ckpt, converted, tmp_path, capsys):
    """The genuine dp=2 output, its lineage claiming another RNG seed: the reseeded states are not that seed's."""
    b = tmp_path / "b"
    shutil.copytree(converted, b)
    edit_manifest(b, lambda m: m["lineage"][-1]["policies"]["options"].update(seed=999))
    code, r, _ = verify_json(reference_ckpt, b, capsys)
    assert code == 1
    assert r["differences"] and all(d["key"].startswith("rng.rank_") for d in r["differences"])


def test_genuine_lineage_does_not_excuse_a_value_the_plan_did_not_write(reference_ckpt, converted, tmp_path, capsys):
    """The genuine lineage, but one rewritten key (a reseeded RNG position) holds another value."""
    ix = CheckpointIndex.open(converted)
    key = next(k for k in sorted(ix.entries) if k.startswith("rng.rank_1.") and k.endswith("numpy.pos"))
    b = tmp_path / "b"
    rewrite(converted, b, objects={key: ix.read_object(key) + 1})
    code, r, _ = verify_json(reference_ckpt, b, capsys)
    assert code == 1 and [d["key"] for d in r["differences"]] == [key], r["differences"]
    code, out, _ = run_cli(["verify", reference_ckpt, b], capsys)
    assert code == 1 and key in out


def test_lineage_from_another_source_excuses_nothing(reference_ckpt, converted, tmp_path, capsys):
    b = tmp_path / "b"
    shutil.copytree(converted, b)
    edit_manifest(b, lambda m: m["lineage"][-1]["policies"].update(source_fingerprint="0" * 16))
    code, r, _ = verify_json(reference_ckpt, b, capsys)
    assert code == 1 and r["evidence"] is None
    assert any("names a source with fingerprint 0000000000000000" in n for n in r["notes"])


def test_lineage_options_of_the_wrong_type_excuse_nothing(reference_ckpt, converted, tmp_path, capsys):
    b = tmp_path / "b"
    shutil.copytree(converted, b)
    edit_manifest(b, lambda m: m["lineage"][-1]["policies"]["options"].update(seed="0; rm -rf /"))
    code, r, _ = verify_json(reference_ckpt, b, capsys)
    assert code == 1 and r["evidence"] is None and any("plan option seed=" in n for n in r["notes"])


def test_lineage_never_turns_on_trust_pickle(reference_ckpt, converted, tmp_path, capsys):
    """A lineage recording trust_pickle=True is recomputed with this run's choice (off)."""
    b = tmp_path / "b"
    shutil.copytree(converted, b)
    edit_manifest(b, lambda m: m["lineage"][-1]["policies"]["options"].update(trust_pickle=True))
    code, r, _ = verify_json(reference_ckpt, b, capsys)
    assert code == 0, r["differences"][:3]  # same plan either way for this source; nothing unpickled


# ------------------------------------------------------------------------------ exports
def _patch_safetensors(path: Path, name: str, value: float) -> None:
    """Overwrite the first element of float32 tensor ``name`` in a safetensors file, in place."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])
    assert h[name]["dtype"] == "F32"
    at = 8 + n + h[name]["data_offsets"][0]
    path.write_bytes(raw[:at] + struct.pack("<f", value) + raw[at + 4:])


def test_genuine_export_verifies(reference_ckpt, exported, capsys):
    for extra in ((), ("--strict",)):
        code, r, _ = verify_json(reference_ckpt, exported, capsys, *extra)
        assert code == 0, r["differences"][:3]
        assert MOMENT in {w["key"] for w in r["rewritten"]}  # dropped under --only model, re-derived from A
    code, r, _ = verify_json(exported, reference_ckpt, capsys)
    assert code == 0, r["differences"][:3]


@pytest.mark.parametrize("strict", [False, True])
def test_forged_export_report_does_not_excuse_a_changed_weight(reference_ckpt, exported, tmp_path, capsys, strict):
    b = tmp_path / "export"
    shutil.copytree(exported, b)
    _patch_safetensors(b / "model.safetensors", WEIGHT, 123.0)
    rep = json.loads((b / "export-report.json").read_text())
    for k in rep["keys"]:
        if k["key"] == "model." + WEIGHT:
            k.update(action="dropped", reason="forged")
    (b / "export-report.json").write_text(json.dumps(rep))
    code, r, _ = verify_json(reference_ckpt, b, capsys, *(("--strict",) if strict else ()))
    assert code == 1
    (d,) = r["differences"]
    assert (d["key"], d["kind"], d["b"]) == ("model." + WEIGHT, "value", 123.0)


def test_export_header_claiming_only_model_does_not_excuse_a_changed_moment(reference_ckpt, tmp_path, capsys):
    """An export with optimizer state: a changed moment is a difference whatever the report says."""
    from reshard.engine.export import export

    b = tmp_path / "export"
    export(reference_ckpt, b, fmt="safetensors", only="model+optim")
    name = "optim." + MOMENT[len("optim.state."):]
    _patch_safetensors(b / "model.safetensors", name, 123.0)
    rep = json.loads((b / "export-report.json").read_text())
    for k in rep["keys"]:
        if k["key"] == MOMENT:
            k.update(action="dropped", reason="forged")
    (b / "export-report.json").write_text(json.dumps(rep))
    code, r, _ = verify_json(reference_ckpt, b, capsys)
    assert code == 1 and [d["key"] for d in r["differences"]] == [MOMENT]


# ------------------------------------------------------------------------------ objects, bitwise
def _bits_nan(payload: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000000 | payload))[0]


@pytest.mark.parametrize("name,a,b", [
    ("signed zero", {"lr": 0.0, "betas": [0.9, 0.95]}, {"lr": -0.0, "betas": [0.9, 0.95]}),
    ("nan payload", {"lr": _bits_nan(1), "betas": [0.9, 0.95]}, {"lr": _bits_nan(2), "betas": [0.9, 0.95]}),
    ("int vs float", {"lr": 1, "betas": [0.9, 0.95]}, {"lr": 1.0, "betas": [0.9, 0.95]}),
    ("tensor signed zero", {"lr": torch.tensor([0.0]), "betas": [0.9]}, {"lr": torch.tensor([-0.0]), "betas": [0.9]}),
    ("float dict key", {0.0: "x", "betas": [0.9]}, {-0.0: "x", "betas": [0.9]}),
])
def test_object_items_compare_bitwise(tmp_path, capsys, name, a, b):
    # a tuple is stored whole, as one object item (DCP flattens dicts and lists)
    sa = _save(tmp_path / "a", {"model.w": torch.ones(3), "optim.param_groups.0.extra": (a,)})
    sb = _save(tmp_path / "b", {"model.w": torch.ones(3), "optim.param_groups.0.extra": (b,)})
    code, r, _ = verify_json(sa, sb, capsys)
    assert code == 1, name
    assert [(d["key"], d["kind"]) for d in r["differences"]] == [("optim.param_groups.0.extra", "object")]
    same = _save(tmp_path / "same", {"model.w": torch.ones(3), "optim.param_groups.0.extra": (a,)})
    code, r, _ = verify_json(sa, same, capsys)
    assert code == 0, (name, r["differences"])


def test_object_difference_rules_are_bitwise():
    nan1, nan2 = _bits_nan(1), _bits_nan(2)
    assert math.isnan(nan1) and math.isnan(nan2)
    assert identical(nan1, nan1) and not identical(nan1, nan2)
    assert not identical(0.0, -0.0) and not identical([0.0], [-0.0]) and not identical(1, 1.0)
    assert not identical(True, 1) and not identical((1,), [1]) and not identical({1: "a"}, {1.0: "a"})
    assert not identical(complex(0.0, 0.0), complex(0.0, -0.0))
    assert not identical({0.0}, {-0.0}) and identical({1, 2}, {2, 1})
    assert identical({"a": 1, "b": 2}, {"b": 2, "a": 1})  # insertion order is not state
    assert not identical(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert identical(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert not identical(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert "[0]['lr']" in object_difference([{"lr": 0.0}], [{"lr": -0.0}])


def test_self_referencing_object_is_bad_input():
    from reshard.errors import BadInput

    one: list = []
    one.append(one)
    other: list = []
    other.append(other)
    with pytest.raises(BadInput):
        object_difference(one, other)


# ------------------------------------------------------------------------------ chains
@pytest.fixture(scope="module")
def chained(root, converted) -> Path:
    """reference (dp=4) -> dp=2 -> dp=4: two genuine conversions."""
    dst = root / "dp2to4"
    code, out, err = cli(["convert", converted, dst, "--to", "dp=4"])
    assert code == 0, out + err
    return dst


def test_genuine_chain_verifies_through_its_intermediate(reference_ckpt, converted, chained, capsys):
    code, r, _ = verify_json(reference_ckpt, chained, capsys)
    assert code == 0, (r["differences"][:3], r["notes"])
    assert "through 1 intermediate checkpoint(s), each verified" in r["evidence"]
    assert any(w["key"].startswith("rng.rank_2.") for w in r["rewritten"])  # rewritten by the second hop


def test_chain_through_a_tampered_intermediate_excuses_nothing(reference_ckpt, converted, chained, tmp_path, capsys):
    """The lineage's path names an intermediate whose values are not what its own plan makes of A."""
    fake = tmp_path / "dp2"
    rewrite(converted, fake, tensor=(MOMENT, set_first(123.0)))
    b = tmp_path / "dp2to4"
    shutil.copytree(chained, b)
    edit_manifest(b, lambda m: m["lineage"][-1]["policies"].update(source_path=str(fake)))
    code, r, _ = verify_json(reference_ckpt, b, capsys)
    assert code == 1 and r["evidence"] is None
    assert any(f"{fake} is not what the plan its lineage records makes of" in n and MOMENT in n for n in r["notes"])
