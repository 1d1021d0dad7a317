"""Manifest: round trip, schema/dataclass agreement, bad input names the file."""
from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest

from reshard.semantics import manifest as mf
from reshard.errors import BadInput
from reshard.formats import ROOT as FORMATS

SCHEMA = json.loads((FORMATS / "manifest.schema.json").read_text())


def sample_manifest() -> mf.Manifest:
    topo = mf.Topology.make(dp_shard=4, tp=2, mesh_order=["dp_shard", "tp"])
    new = mf.Topology.make(dp_shard=2, tp=2, mesh_order=["dp_shard", "tp"])
    return mf.Manifest(
        experiment_id="exp-1", step=12, tokens_seen=12 * 32 * 16, samples_seen=12 * 32,
        key_convention="reshard", topology=new,
        batch=mf.Batch(micro_batch=2, grad_accum=4, seq_len=16, global_batch=32),
        accumulation=mf.Accumulation(micro_step=0, in_flight_grads=False),
        precision=mf.Precision(param_dtype="bfloat16", reduce_dtype="float32", loss_scaler={"kind": "dynamic"}),
        model=mf.ModelInfo(family="reshard-reference-gpt", config={"dim": 32, "n_layers": 2},
                           tied=[["tok_emb.weight", "lm_head.weight"]]),
        optimizer=mf.OptimizerInfo(name="AdamW", config={"lr": 3e-3, "betas": [0.9, 0.95]}),
        scheduler=mf.SchedulerInfo(name="warmup-cosine", config={"warmup": 2}, unit="steps"),
        data=mf.DataPosition(sampler="reshard.train.ElasticSampler", seed=0, epoch=1, cursor=128,
                             dataset_len=256, order="randperm(seed+epoch)"),
        rng=mf.RngInfo(policy="per-rank", keyed_by_rank=True, seed=0),
        continuity="continuation",
        lineage=[
            mf.LineageEvent(event="created", from_=None, to=topo, at_step=0, tool="t", time="2025-01-01T00:00:00+00:00"),
            mf.LineageEvent(event="transition", from_=topo, to=new, at_step=12, policies={"rng": "reseed"},
                            tool="reshard 0.1.0", kind="continuation", reason="lost a node"),
        ],
        writer=mf.Writer(tool="reshard 0.1.0", torch="2.13.0", time="2025-01-01T00:00:00+00:00"),
    )


def test_round_trip_dict_and_file(tmp_path):
    m = sample_manifest()
    d = m.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["lineage"][1]["from"]["dims"]["dp_shard"] == 4 and "from_" not in d["lineage"][1]
    assert mf.Manifest.from_dict(d) == m
    mf.write_manifest(tmp_path, m)
    assert (tmp_path / "manifest.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temp file left behind
    assert mf.read_manifest(tmp_path) == m
    assert oct(os.stat(tmp_path / "manifest.json").st_mode & 0o777) == "0o644"


def test_absent_manifest_is_none(tmp_path):
    assert mf.read_manifest(tmp_path) is None


def test_top_level_shape_matches_spec():
    keys = list(sample_manifest().to_dict())
    assert keys == ["format", "format_version", "experiment_id", "step", "tokens_seen", "samples_seen",
                    "key_convention", "topology", "batch", "accumulation", "precision", "model", "optimizer",
                    "scheduler", "data", "rng", "continuity", "lineage", "writer"]


def _schema_node(ref_or_node):
    if "$ref" in ref_or_node:
        return SCHEMA["$defs"][ref_or_node["$ref"].rsplit("/", 1)[1]]
    return ref_or_node


def _json_name(field: dataclasses.Field) -> str:
    return "from" if field.name == "from_" else field.name


@pytest.mark.parametrize("cls, node", [
    (mf.Manifest, SCHEMA),
    (mf.Topology, SCHEMA["$defs"]["topology"]),
    (mf.Batch, SCHEMA["properties"]["batch"]),
    (mf.Accumulation, SCHEMA["properties"]["accumulation"]),
    (mf.Precision, SCHEMA["properties"]["precision"]),
    (mf.ModelInfo, SCHEMA["properties"]["model"]),
    (mf.OptimizerInfo, SCHEMA["properties"]["optimizer"]),
    (mf.SchedulerInfo, SCHEMA["properties"]["scheduler"]),
    (mf.DataPosition, SCHEMA["properties"]["data"]),
    (mf.RngInfo, SCHEMA["properties"]["rng"]),
    (mf.LineageEvent, SCHEMA["properties"]["lineage"]["items"]),
    (mf.Writer, SCHEMA["properties"]["writer"]),
])
def test_schema_and_dataclasses_agree(cls, node):
    node = _schema_node(node)
    names = {_json_name(f) for f in dataclasses.fields(cls)}
    props = set(node["properties"])
    assert names == props, f"{cls.__name__}: only in dataclass {names - props}, only in schema {props - names}"
    optional = {"integrity"} if cls is mf.Manifest else set()  # optional fields, absent in older manifests
    assert set(node["required"]) == props - optional
    assert node.get("additionalProperties") is False
    for name, prop in node["properties"].items():
        assert "description" in prop or "$ref" in prop, f"{cls.__name__}.{name} undocumented"


def test_schema_dims_and_enums_match_code():
    dims = SCHEMA["$defs"]["topology"]["properties"]["dims"]
    assert tuple(dims["properties"]) == mf.DIM_NAMES
    assert SCHEMA["properties"]["key_convention"]["type"] == "string"  # any shipped convention's name
    assert {"reshard", "torchtitan", "torch-get-state-dict", "torch-dcp-recipe"} <= set(mf.key_conventions())
    assert "generic" not in mf.key_conventions()
    assert tuple(SCHEMA["properties"]["rng"]["properties"]["policy"]["enum"]) == mf.RNG_POLICIES
    assert tuple(SCHEMA["properties"]["continuity"]["enum"]) == mf.CONTINUITY
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def _write_raw(tmp_path, payload) -> str:
    path = tmp_path / "manifest.json"
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return str(path)


def test_invalid_json_names_the_file(tmp_path):
    path = _write_raw(tmp_path, '{"format": "reshard-manifest", ')
    with pytest.raises(BadInput) as exc:
        mf.read_manifest(tmp_path)
    assert exc.value.where == path and path in str(exc.value) and exc.value.exit_code == 2


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("step"), "step"),
    (lambda d: d.__setitem__("step", "12"), "step"),
    (lambda d: d.__setitem__("step", True), "step"),
    (lambda d: d.__setitem__("key_convention", "megatron"), "key_convention"),
    (lambda d: d["topology"]["dims"].pop("tp"), "topology.dims.tp"),
    (lambda d: d["topology"].__setitem__("world_size", 7), "topology.world_size"),
    (lambda d: d["batch"].__setitem__("micro_batch", 0), "batch.micro_batch"),
    (lambda d: d["accumulation"].__setitem__("in_flight_grads", 0), "accumulation.in_flight_grads"),
    (lambda d: d["lineage"][1].__setitem__("event", "moved"), "lineage[1].event"),
    (lambda d: d["lineage"][1]["from"].pop("mesh_order"), "lineage[1].from.mesh_order"),
    (lambda d: d["model"].__setitem__("tied", [["tok_emb.weight"]]), "model.tied[0]"),
    (lambda d: d.__setitem__("format_version", 2), "format_version"),
    (lambda d: d.__setitem__("rng", None), "rng"),
])
def test_wrong_fields_raise_bad_input_naming_file_and_field(tmp_path, mutate, field):
    d = copy.deepcopy(sample_manifest().to_dict())
    mutate(d)
    path = _write_raw(tmp_path, d)
    with pytest.raises(BadInput) as exc:
        mf.read_manifest(tmp_path)
    assert exc.value.where == path
    assert f"'{field}'" in str(exc.value)


def test_top_level_not_object(tmp_path):
    _write_raw(tmp_path, "[1, 2]")
    with pytest.raises(BadInput):
        mf.read_manifest(tmp_path)


def test_torch_version_is_importlib_metadatas():
    """The manifest's and the resume key's torch version, read from the dist-info without importing
    importlib.metadata, is the one it gives (names compared normalized, as it compares them)."""
    from importlib.metadata import version

    from reshard.semantics.manifest import dist_info_version, torch_version

    assert torch_version() == version("torch")
    for name in ("torch", "numpy", "typer", "typing_extensions", "typing-extensions"):
        assert dist_info_version(name) == version(name), name
    assert dist_info_version("no-such-package-here") is None
