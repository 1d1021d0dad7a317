"""Issue 15 acceptance: the matrix of torch checkpoint variations, written and read back by real torch.

Six checkpoints are written once per module by tests/writers/torch_variants.py, in spawned
gloo processes running FSDP2 ``fully_shard`` and the real ``torch.distributed.checkpoint.save``:

| variant | what is saved | written at | converted to |
|---|---|---|---|
| ``extras`` | ``get_state_dict`` model + Adam, LambdaLR under ``scheduler``, OneCycleLR under ``lr_scheduler``, ``step``, ``epoch``, nested ``config``, ``extra.blob`` (``io.BytesIO``), ``extra.raw`` (``bytes``) | 2 ranks | dp=4 |
| ``appstate`` | the DCP tutorial's ``{"app": AppState(model, optimizer)}`` | 4 ranks | dp=2 |
| ``batchnorm`` | BatchNorm1d buffers (running statistics, ``num_batches_tracked``) + Adam | 2 ranks | dp=4 |
| ``tied`` | ``enc.table.weight`` tied to ``dec.proj.weight`` (not in formats/models/ties.toml) + Adam | 4 ranks | dp=2 |
| ``optim_only`` | ``{"optim": get_optimizer_state_dict(...)}`` only (HF Accelerate's separate optimizer folder) | 2 ranks | dp=4 |
| ``hsdp`` | ``fully_shard(mesh=(dp_replicate=2, dp_shard=2))`` model + Adam | 4 ranks | dp=2 |

For each: ``reshard inspect --json`` exit 0 with the roles torch's own ``.metadata`` implies
(counted from the metadata read by torch's ``FileSystemReader``) and the right topology,
``reshard convert`` to the other DP degree, the output loaded back by the same script's
loader at the new world size (``dcp.load`` + ``set_state_dict``; ``AppState`` through
``dcp.load``'s Stateful protocol; the optimizer-only folder into a freshly built model's
optimizer), and the full state the live modules then hold compared bitwise with the full
state rank 0 gathered (torch's ``get_state_dict(full_state_dict=True)``) and ``torch.save``d
at write time. ``reshard verify SRC OUT`` exits 0.

CPU substitutions: the process group is gloo on CPU instead of NCCL on GPUs and the device
mesh is a ``"cpu"`` mesh. DCP writes the same ``.metadata`` and the same ``torch.save`` items
whatever the device (tensors are moved to CPU before serialisation), so the files are what a
GPU job writes. The ranks are forked from one parent that has imported torch (start-up cost
only). ``extra.blob`` is a pickled ``io.BytesIO`` (DCP pickles every non-tensor value); it is
inert data and is read without ``--trust-pickle``.
"""
from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from rank_jobs import free_port, result, spawn  # noqa: E402
from conftest import cli  # noqa: E402

from reshard.verification.objects import identical, object_difference  # noqa: E402

WRITER = Path(__file__).parent / "writers" / "torch_variants.py"
VARIANTS = ("extras", "appstate", "batchnorm", "tied", "optim_only", "hsdp")
SRC_WORLD = {"extras": 2, "appstate": 4, "batchnorm": 2, "tied": 4, "optim_only": 2, "hsdp": 4}
TARGET_DP = {"extras": 4, "appstate": 2, "batchnorm": 4, "tied": 2, "optim_only": 4, "hsdp": 2}
TRUST: dict[str, list[str]] = {}  # extra CLI flags per variant (none: every variant is read safely)
BUFFERS = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Every variant's source checkpoint and the reference full state saved with it."""
    root = tmp_path_factory.mktemp("torch_variants")
    jobs = [{"variant": v, "dir": str(root / v), "world": SRC_WORLD[v], "port": free_port(),
             "result": str(root / f"{v}.reference.pt")} for v in VARIANTS]
    spawn(WRITER, "write", jobs, root)
    return {j["variant"]: {"dir": Path(j["dir"]), "reference": result(j["result"]), "root": root} for j in jobs}


@pytest.fixture(scope="module")
def inspected(written) -> dict[str, tuple[int, dict[str, Any] | None, str]]:
    """``reshard inspect DIR --json`` of every variant: (exit code, report, stderr)."""
    out = {}
    for v in VARIANTS:
        code, stdout, err = cli(["inspect", written[v]["dir"], "--json", *TRUST.get(v, [])])
        try:
            report = json.loads(stdout)
        except json.JSONDecodeError:
            report = None
        out[v] = (code, report, err)
    return out


def _asks_for_from(report: dict[str, Any] | None) -> bool:
    """inspect's explicit answer that the layout is ambiguous and ``--from`` is needed."""
    if not report:
        return False
    said = any("--from" in f.get("message", "") for f in report.get("problems", []) + report.get("notes", []))
    return bool(report["topology"].get("ambiguous")) or said


@pytest.fixture(scope="module")
def converted(written, inspected) -> dict[str, dict[str, Any]]:
    """``reshard convert`` of every variant to its other DP degree, then one load of all outputs."""
    root: Path = written["extras"]["root"]
    out: dict[str, dict[str, Any]] = {}
    jobs = []
    for v in VARIANTS:
        dst = root / f"out_{v}"
        args = ["convert", written[v]["dir"], dst, "--to", f"dp={TARGET_DP[v]}", *TRUST.get(v, [])]
        if v == "hsdp" and _asks_for_from(inspected[v][1]):
            args += ["--from", "dp_replicate=2,dp_shard=2"]
        code, stdout, err = cli(args)
        out[v] = {"dst": dst, "code": code, "stdout": stdout, "stderr": err, "loaded": None}
        if code == 0:
            jobs.append({"variant": v, "dir": str(dst), "world": TARGET_DP[v], "port": free_port(),
                         "result": str(root / f"{v}.loaded.pt")})
    if jobs:
        spawn(WRITER, "load", jobs, root)
        for j in jobs:
            out[j["variant"]]["loaded"] = result(j["result"])
    return out


# ------------------------------------------------------------------------ expectations from torch's metadata
def _metadata_keys(path: Path) -> dict[str, str]:
    """Every flat key of the checkpoint with ``tensor`` / ``object``, as torch's reader sees them."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: "object" if isinstance(m, BytesStorageMetadata) else "tensor" for k, m in md.items()}


def _expected_role(variant: str, key: str) -> str:
    """The role a flat key has by what the writer put there (not by any reshard rule)."""
    k = key[len("app."):] if variant == "appstate" else key
    if k.startswith("model."):
        return "parameter"
    if k.startswith("optim.state."):
        return "optimizer_step" if k.endswith(".step") else "optimizer_moment"
    if k.startswith("optim.param_groups."):
        return "param_group"
    if k.startswith(("scheduler.", "lr_scheduler.")):
        return "scheduler"
    if k in ("step", "epoch"):
        return "counter"
    if k.startswith("config."):
        return "config"
    if k.startswith("extra."):
        return "blob"
    raise AssertionError(f"the writer wrote a key this test does not know: {key}")


def _role_counts(report: dict[str, Any]) -> Counter:
    counts = Counter({r: v["count"] for r, v in report["by_role"].items()})
    counts["parameter"] += counts.pop("buffer", 0)  # a buffer is a model entry either way
    return +counts


def _assert_inspect_ok(variant: str, inspected) -> dict[str, Any]:
    code, report, err = inspected[variant]
    assert report is not None, f"inspect printed no JSON (exit {code}): {err}"
    assert code == 0, f"inspect exit {code}: problems {json.dumps(report['problems'], indent=1)}"
    assert report["complete"] and report["consistent"], report["problems"]
    assert report["unknown_keys"] == []
    return report


# ------------------------------------------------------------------------ inspect
@pytest.mark.parametrize("variant", VARIANTS)
def test_inspect_roles(variant, written, inspected):
    """Exit 0, and every key has the role its writer gave it (counts from torch's own metadata)."""
    report = _assert_inspect_ok(variant, inspected)
    keys = _metadata_keys(written[variant]["dir"])
    expected = +Counter(_expected_role(variant, k) for k in keys)
    assert _role_counts(report) == expected, (dict(report["by_role"]), dict(expected))
    opt = report["optimizer"]
    assert opt["missing_moments"] == [] and opt["shape_mismatches"] == []
    assert opt["step_counters"]["consistent"] and opt["step_counters"]["values"] == [3]


def test_inspect_extras_counters(inspected):
    """``step`` and ``epoch`` are read as the trainer's counters, with their values."""
    report = _assert_inspect_ok("extras", inspected)
    assert report["counters"].get("step") == 3 and report["counters"].get("epoch") == 1, report["counters"]
    assert report["step"] == 3


def test_inspect_appstate_moments_not_parameters(inspected):
    """Under the DCP recipe's ``app.`` wrapper the Adam moments are moments, and the 4 parameters are covered."""
    report = _assert_inspect_ok("appstate", inspected)
    assert report["by_role"]["parameter"]["count"] == 4
    assert report["by_role"]["optimizer_moment"]["count"] == 8
    assert report["optimizer"]["parameters"] == 4 and report["optimizer"]["with_moments"] == 4


def test_inspect_batchnorm_buffers(inspected):
    """Running statistics and ``num_batches_tracked`` expect no moments; the trainable six all have them."""
    report = _assert_inspect_ok("batchnorm", inspected)
    buffers = {k.removeprefix("model.") for k in report["optimizer"]["buffers"]}
    assert buffers == BUFFERS, report["optimizer"]


def test_inspect_tie_found_with_evidence(inspected):
    """The tie is found from the bytes (the names are in no list) and listed with its evidence."""
    report = _assert_inspect_ok("tied", inspected)
    ties = report["optimizer"]["tied"]
    names = [{n.removeprefix("model.") for n in t["names"]} for t in ties]
    assert {"enc.table.weight", "dec.proj.weight"} in names, report["optimizer"]
    tie = ties[names.index({"enc.table.weight", "dec.proj.weight"})]
    assert tie["equal"] is True and tie.get("evidence"), tie
    assert "dec.proj.weight" not in {k.removeprefix("model.") for k in report["optimizer"]["buffers"]}


def test_inspect_optimizer_only_topology(inspected):
    """No model entries: the topology comes from the moments' geometry (2 ranks, dp_shard=2)."""
    report = _assert_inspect_ok("optim_only", inspected)
    topo = report["topology"]
    assert (topo["dp_shard"], topo["dp_replicate"], topo["world_size"]) == (2, 1, 2), topo
    assert "parameter" not in report["by_role"]


def test_inspect_hsdp_topology(inspected):
    """2 replicas of 2 shards: told as dp_replicate=2, dp_shard=2, or explicitly ambiguous; never dp_shard=2 world 2."""
    code, report, err = inspected["hsdp"]
    assert report is not None, err
    topo = report["topology"]
    if _asks_for_from(report):  # the honest "cannot tell": the true layout listed, --from asked for
        assert topo.get("ambiguous") and "dp_replicate=2,dp_shard=2" in topo.get("alternatives", []), topo
        assert any("--from" in f["message"] for f in report["problems"] + report["notes"]), report["problems"]
        return
    assert code == 0, report["problems"]
    assert (topo["dp_replicate"], topo["dp_shard"], topo["world_size"]) == (2, 2, 4), topo


# ------------------------------------------------------------------------ convert, load back, verify
def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Every place where ``b`` is not ``a`` bit for bit (tensors: dtype, shape and bits)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return [f"{path}: tensor vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        return [] if torch.equal(_bits(a), _bits(b)) else [f"{path}: values differ"]
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} on one side only"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if identical(a, b) else [f"{path}: {a!r} vs {b!r}"]


def _assert_converted(variant: str, converted) -> dict[str, Any]:
    c = converted[variant]
    assert c["code"] == 0, f"convert exit {c['code']}:\n{c['stderr']}\n{c['stdout'][-2000:]}"
    assert c["loaded"] is not None
    return c


@pytest.mark.parametrize("variant", VARIANTS)
def test_convert_and_load_back_bitwise(variant, written, converted):
    """The converted checkpoint, loaded by the writer's own loading code at the new world size, is what was saved."""
    c = _assert_converted(variant, converted)
    reference, loaded = written[variant]["reference"], c["loaded"]
    assert reference["optim"]["state"], "the reference holds optimizer state"
    diffs = _differences(reference, loaded, variant)
    assert not diffs, "\n".join(diffs[:40])


def test_loaded_extras_objects(written, converted):
    """Counters, config, the BytesIO blob and the bytes value come back as themselves."""
    loaded = _assert_converted("extras", converted)["loaded"]["objects"]
    assert loaded["blob_type"] == "BytesIO" and loaded["raw_type"] == "bytes"
    assert loaded == written["extras"]["reference"]["objects"]
    assert loaded["step"] == 3 and loaded["epoch"] == 1


def test_hsdp_lineage_records_replicas(converted):
    """The lineage records the source as 2 replicas x 2 shards on 4 ranks, not a guess of dp_shard=2 on 2."""
    c = _assert_converted("hsdp", converted)
    manifest = json.loads((c["dst"] / "manifest.json").read_text())
    src = manifest["lineage"][-1]["from"]
    assert src["world_size"] == 4 and src["dims"]["dp_replicate"] == 2 and src["dims"]["dp_shard"] == 2, src


@pytest.mark.parametrize("variant", VARIANTS)
def test_verify_source_and_output(variant, written, converted):
    """``reshard verify SRC OUT`` finds them equal (blobs compared by their bytes)."""
    c = _assert_converted(variant, converted)
    code, out, err = cli(["verify", written[variant]["dir"], c["dst"], *TRUST.get(variant, [])])
    assert code == 0, f"verify exit {code}:\n{err}\n{out[-2000:]}"


# ------------------------------------------------------------------------ blobs compared by their bytes
def test_bytesio_compared_by_bytes():
    """Two BytesIO with the same bytes are the same value (``==`` is identity for BytesIO)."""
    a, b = io.BytesIO(b"\x00blob\xff"), io.BytesIO(b"\x00blob\xff")
    assert a != b  # why the fix is needed
    assert object_difference(a, b) is None and identical(a, b)
    assert object_difference({"extra": {"blob": a}}, {"extra": {"blob": b}}) is None


def test_bytesio_differences_are_reported():
    """Different contents, lengths or read positions are differences, named precisely."""
    d = object_difference(io.BytesIO(b"abcd"), io.BytesIO(b"abXd"), "extra.blob")
    assert d == "extra.blob: BytesIO contents differ (first at byte 2)"
    d = object_difference(io.BytesIO(b"abcd"), io.BytesIO(b"abc"), "extra.blob")
    assert d == "extra.blob: BytesIO of 4 bytes in A, 3 bytes in B"
    moved = io.BytesIO(b"abcd")
    moved.seek(2)
    assert object_difference(io.BytesIO(b"abcd"), moved) == "value: BytesIO position 0 in A, 2 in B"
    assert object_difference(io.BytesIO(b"ab"), b"ab") is not None  # a BytesIO is not bytes
    assert object_difference(b"\x00raw", b"\x00raw") is None and object_difference(b"raw", b"raW") is not None
