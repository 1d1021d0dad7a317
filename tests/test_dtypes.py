"""Issue 31: every dtype DCP can save is read, written, compared and exported, or refused by name up front.

Two checkpoints are written once per module by tests/writers/dtypes_run.py, in one spawn of
gloo ranks running FSDP2 ``fully_shard``, a few real Adam steps on an ordinary ``nn.Linear``
and torch 2.13's own ``dcp.save``: beside the trained layer, a frozen parameter (sharded by
FSDP2, 10 rows: unevenly cut on 4 ranks) and a buffer (replicated, as FP8 recipes keep
scales and amax histories) of each dtype, filled with random bytes (NaN patterns included):

| checkpoint | dtypes | written at | what is done with it |
|---|---|---|---|
| ``all`` | float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz, float8_e8m0fnu, float4_e2m1fn_x2, uint16, uint32, uint64, complex32, complex64, complex128 | 2 ranks | inspect, plan, convert to dp=1 and dp=4, verify, loaded back by ``dcp.load`` + ``set_state_dict`` (strict) at 1 and 4 ranks, bitwise; refused by ``export --format safetensors`` and ``--output-format local`` naming each complex32/complex128 key |
| ``storable`` | those safetensors 0.8 can store (asked of ``safetensors.torch.save`` itself) | 2 ranks | ``convert --output-format local`` to dp=4 (each rank file loaded by ``safetensors.torch.load_file`` and compared with the FSDP2 shard torch cuts) and ``export --format safetensors`` (loaded by ``load_file``), bitwise |

Not written by the writer: the bits dtypes, because torch's own ``dcp.save`` cannot save them
(`test_dcp_save_cannot_save_bits_dtypes` checks that it still fails, with torch's error), and
quantized dtypes, which ``dcp.save`` does save (`test_quantized_dtype_refused_by_inspect_and_plan`:
refused by inspect and plan, exit 2, key and dtype named). Values are compared by their raw
bytes (``view(torch.uint8)``): float8 and float4 have no ``torch.equal`` on CPU, and two NaNs
are the same value only when their bits are.

CPU substitutions: gloo on CPU and a ``"cpu"`` device mesh; DCP writes the same items whatever
the device. The model state is gathered to rank 0 by hand (``all_gather_object`` of each
rank's local bytes at the offsets torch computes) because gloo has no collective for these
dtypes; the optimizer state (float32) by torch's ``get_optimizer_state_dict(full_state_dict=True)``.
"""
from __future__ import annotations

import importlib.util
import io
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")
safetensors_torch = pytest.importorskip("safetensors.torch")

from rank_jobs import free_port, result, spawn  # noqa: E402
from conftest import cli  # noqa: E402

WRITER = Path(__file__).parent / "writers" / "dtypes_run.py"
_spec = importlib.util.spec_from_file_location("dtypes_run", WRITER)
dtypes_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dtypes_run)  # DTYPES and the random bytes the writer fills them with

ALL: tuple[str, ...] = dtypes_run.DTYPES


def _safetensors_stores(name: str) -> bool:
    """Whether the installed safetensors can store ``name`` (asked of the library, not of reshard)."""
    try:
        safetensors_torch.save({"x": dtypes_run.random_bytes(getattr(torch, name), (2, 2), 0)})
    except (KeyError, ValueError, TypeError, RuntimeError):
        return False
    return True


STORABLE = tuple(n for n in ALL if _safetensors_stores(n))
UNSTORABLE = tuple(n for n in ALL if n not in STORABLE)
TARGETS = (1, 4)


# ------------------------------------------------------------------------ fixtures: one spawn each way
@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Any]:
    """Both source checkpoints and the full state rank 0 gathered when each was saved."""
    assert "bits8" not in ALL and set(UNSTORABLE) >= {"complex32", "complex128"}, (ALL, UNSTORABLE)
    root = tmp_path_factory.mktemp("dtypes")
    jobs = [{"dir": str(root / name), "world": 2, "port": free_port(), "result": str(root / f"{name}.reference.pt"),
             "dtypes": list(dtypes)} for name, dtypes in (("all", ALL), ("storable", STORABLE))]
    spawn(WRITER, "write", jobs, root, python_flags=("-W", "ignore"))
    return {"root": root, **{Path(j["dir"]).name: {"dir": Path(j["dir"]), "reference": result(j["result"])}
                             for j in jobs}}


@pytest.fixture(scope="module")
def converted(written) -> dict[int, dict[str, Any]]:
    """``reshard convert`` of ``all`` to dp=1 and dp=4, then one load of both outputs at their world sizes."""
    root: Path = written["root"]
    out: dict[int, dict[str, Any]] = {}
    jobs = []
    for dp in TARGETS:
        dst = root / f"out_dp{dp}"
        code, stdout, err = cli(["convert", written["all"]["dir"], dst, "--to", f"dp={dp}"])
        out[dp] = {"dst": dst, "code": code, "stdout": stdout, "stderr": err, "loaded": None}
        if code == 0:
            jobs.append({"dir": str(dst), "world": dp, "port": free_port(), "result": str(root / f"dp{dp}.loaded.pt"),
                         "dtypes": list(ALL)})
    if jobs:
        spawn(WRITER, "load", jobs, root, python_flags=("-W", "ignore"))
        for j in jobs:
            out[j["world"]]["loaded"] = result(j["result"])
    return out


# ------------------------------------------------------------------------ comparison by raw bytes
def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _full(reference: dict[str, Any], fqn: str) -> torch.Tensor:
    """The reference's full value of model entry ``fqn`` as a tensor of its dtype (rebuilt from its bytes)."""
    dtype, shape, raw = reference["model"][fqn]
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _optim_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Full optimizer state dicts compared: every moment and step bitwise, the param groups exactly."""
    diffs = []
    if set(a["state"]) != set(b["state"]):
        return [f"optimizer state keys {sorted(a['state'])} vs {sorted(b['state'])}"]
    for fqn, sa in a["state"].items():
        for name, va in sa.items():
            vb = b["state"][fqn].get(name)
            if not isinstance(vb, torch.Tensor) or va.dtype != vb.dtype or va.shape != vb.shape or _raw(va) != _raw(vb):
                diffs.append(f"optim.state.{fqn}.{name}")
    if a["param_groups"] != b["param_groups"]:
        diffs.append("optim.param_groups")
    return diffs


# ------------------------------------------------------------------------ archive framing for every dtype
@pytest.mark.parametrize("name", ALL + ("bits8", "bits16", "bits1x8", "bits2x4", "bits4x2", "bfloat16", "bool"))
def test_item_framing_is_torch_saves_for_every_dtype(name):
    """reshard's hand-framed item is ``torch.save``'s, member for member (``_rebuild_tensor_v3`` over an
    untyped storage for float8, float4, uint16-64, bits and complex32), and loads back bitwise."""
    import zipfile

    from reshard.storage.checkpoints.archive import archive_bytes

    t = dtypes_run.random_bytes(getattr(torch, name), (3, 5), 11)
    buf = io.BytesIO()
    torch.save(t, buf)
    ref, ours = buf.getvalue(), archive_bytes(t)
    assert len(ours) == len(ref)
    zr, zo = zipfile.ZipFile(io.BytesIO(ref)), zipfile.ZipFile(io.BytesIO(ours))
    assert [(i.filename, i.header_offset) for i in zo.infolist()] == [(i.filename, i.header_offset) for i in zr.infolist()]
    assert zo.testzip() is None
    for member in zr.namelist():
        if not member.endswith("serialization_id"):
            assert zo.read(member) == zr.read(member), member
    back = torch.load(io.BytesIO(ours), weights_only=True)
    assert back.dtype == t.dtype and back.shape == t.shape and _raw(back) == _raw(t)


# ------------------------------------------------------------------------ inspect, plan
def test_inspect_and_plan_accept_every_dtype(written):
    """inspect exits 0 with each dtype's parameter and buffer under the parameters' role; plan to dp=4 is feasible
    (exit 0) and cuts every frozen parameter as FSDP2 would (3, 3, 3, 1 rows), whatever its dtype."""
    code, stdout, err = cli(["inspect", written["all"]["dir"], "--json"])
    assert code == 0, err
    report = json.loads(stdout)
    assert report["complete"] and report["consistent"], report["problems"]
    assert report["unknown_keys"] == []
    by_dtype = report["by_role"]["parameter"]["dtypes"]
    assert {n: by_dtype[n]["count"] for n in ALL} == {n: 2 for n in ALL}, by_dtype
    code, stdout, err = cli(["plan", written["all"]["dir"], "--to", "dp=4", "--json"])
    assert code == 0, err
    plan = json.loads(stdout)
    assert plan["feasible"], plan["reasons"]
    cuts = {t["key"]: (t["dtype"], [c["sizes"][0] for c in t["chunks"]]) for t in plan["tensors"]
            if t["key"].startswith("model.odd.w_")}
    for name in ALL:
        assert cuts[f"model.odd.w_{name}"] == (name, [3, 3, 3, 1]), cuts[f"model.odd.w_{name}"]


# ------------------------------------------------------------------------ convert, load back, verify
@pytest.mark.parametrize("dp", TARGETS)
def test_convert_and_load_back_bitwise(dp, written, converted):
    """Each output loaded by torch's ``dcp.load`` + strict ``set_state_dict`` into a fresh FSDP2 model at the new
    world size holds, byte for byte, what was saved: every dtype, and the Adam moments of the trained layer."""
    c = converted[dp]
    assert c["code"] == 0, f"convert exit {c['code']}:\n{c['stderr']}\n{c['stdout'][-2000:]}"
    reference, loaded = written["all"]["reference"], c["loaded"]
    assert set(loaded["model"]) == set(reference["model"])
    seen = set()
    for fqn, (dtype, shape, raw) in reference["model"].items():
        got = loaded["model"][fqn]
        assert got[:2] == (dtype, shape), (fqn, got[:2], (dtype, shape))
        assert got[2] == raw, f"{fqn} ({dtype}) differs after dp=2 -> dp={dp}"
        seen.add(dtype)
    assert seen == set(ALL) | {"float32"}
    assert reference["optim"]["state"], "the reference holds optimizer state"
    assert not _optim_differences(reference["optim"], loaded["optim"])


@pytest.mark.parametrize("dp", TARGETS)
def test_verify_source_and_output(dp, written, converted):
    """``reshard verify SRC OUT`` compares every dtype and finds them equal."""
    c = converted[dp]
    assert c["code"] == 0, c["stderr"]
    code, stdout, err = cli(["verify", written["all"]["dir"], c["dst"], "--json"])
    assert code == 0, f"verify exit {code}:\n{err}\n{stdout[-2000:]}"
    r = json.loads(stdout)
    reference = written["all"]["reference"]
    optim_tensors = sum(len(s) for s in reference["optim"]["state"].values())  # moments and step counters
    assert r["equal"] and r["compared"]["tensors"] == len(reference["model"]) + optim_tensors, r["compared"]


# ------------------------------------------------------------------------ local output and export
def test_local_output_loads_with_safetensors_bitwise(written, tmp_path):
    """``--output-format local`` to dp=4: each rank's file, loaded by ``safetensors.torch.load_file``, holds the
    shard FSDP2 gives that rank (``torch.chunk`` along dim 0: 3, 3, 3, 1 rows) of every parameter and moment,
    byte for byte (F4 included: its header counts 4-bit values, torch's shape counts bytes). The buffers hold
    the piece ``local-index.json`` gives each rank, byte for byte, and those pieces tile the buffer (the
    planner places a model buffer like a parameter, ``FSDP Shard(0)``, whatever its dtype; FSDP2 itself keeps
    buffers whole, which a DCP output's ``dcp.load`` reassembles but a local output does not)."""
    dst = tmp_path / "local"
    code, stdout, err = cli(["convert", written["storable"]["dir"], dst, "--to", "dp=4", "--output-format", "local"])
    assert code == 0, f"convert exit {code}:\n{err}\n{stdout[-2000:]}"
    reference = written["storable"]["reference"]
    index = json.loads((dst / "local-index.json").read_text())["tensors"]
    moments = {f"optim.state.{fqn}.{name}": v for fqn, s in reference["optim"]["state"].items() for name, v in s.items()
               if v.dim()}
    checked = set()
    covered: dict[str, int] = {}
    for rank in range(4):
        held = safetensors_torch.load_file(str(dst / f"rank-{rank:05d}-of-00004.safetensors"))
        for fqn in reference["model"]:
            full = _full(reference, fqn)
            if ".s_" in fqn:  # a buffer: the box the index names for this rank
                box = index[f"model.{fqn}"]["ranks"][str(rank)]
                want = full[tuple(slice(o, o + n) for o, n in zip(box["offsets"], box["sizes"]))]
                covered[fqn] = covered.get(fqn, 0) + want.numel()
            else:
                want = torch.chunk(full, 4, dim=0)[rank]
            got = held[f"model.{fqn}"]
            assert got.dtype == want.dtype and got.shape == want.shape and _raw(got) == _raw(want), (rank, fqn)
            checked.add(str(full.dtype).removeprefix("torch."))
    assert all(n == dtypes_run.HISTORY for n in covered.values()), covered
    for rank in range(4):
        held = safetensors_torch.load_file(str(dst / f"rank-{rank:05d}-of-00004.safetensors"))
        for key, full in moments.items():  # Adam's moments: sharded like their parameter
            want = torch.chunk(full, 4, dim=0)[rank]
            assert _raw(held[key]) == _raw(want) and held[key].dtype == want.dtype, (rank, key)
    assert checked == set(STORABLE) | {"float32"}
    code, stdout, err = cli(["verify", written["storable"]["dir"], dst])
    assert code == 0, f"verify exit {code}:\n{err}\n{stdout[-2000:]}"


def test_export_safetensors_loads_bitwise(written, tmp_path):
    """``export --format safetensors``: ``safetensors.torch.load_file`` returns every parameter and buffer in its own
    dtype (F8_E4M3 ... F8_E8M0, F4, U16-U64, C64), byte for byte; ``reshard verify`` agrees."""
    dst = tmp_path / "export"
    code, stdout, err = cli(["export", written["storable"]["dir"], dst, "--format", "safetensors"])
    assert code == 0, f"export exit {code}:\n{err}\n{stdout[-2000:]}"
    loaded = safetensors_torch.load_file(str(dst / "model.safetensors"))
    reference = written["storable"]["reference"]
    assert set(loaded) == set(reference["model"])
    for fqn in reference["model"]:
        want = _full(reference, fqn)
        got = loaded[fqn]
        assert got.dtype == want.dtype and got.shape == want.shape and _raw(got) == _raw(want), fqn
    code, stdout, err = cli(["verify", written["storable"]["dir"], dst])
    assert code == 0, f"verify exit {code}:\n{err}\n{stdout[-2000:]}"


def test_what_safetensors_cannot_store_is_refused_by_name(written, tmp_path):
    """complex32 and complex128 have no safetensors name: ``export --format safetensors`` and ``convert
    --output-format local`` refuse with exit 2 before writing, naming every such key with its dtype and the way
    out; ``export --format torch`` (torch.save stores every dtype) writes them, bitwise."""
    src = written["all"]["dir"]
    bad = [f"model.odd.{kind}_{name}" for name in UNSTORABLE for kind in ("w", "s")]
    for args, way_out in ((["export", src, tmp_path / "st", "--format", "safetensors"], "--format torch"),
                          (["convert", src, tmp_path / "loc", "--to", "dp=4", "--output-format", "local"],
                           "--output-format dcp")):
        code, stdout, err = cli(args)
        assert code == 2, (args, code, stdout[-1000:], err)
        assert "Traceback" not in err and way_out in err, err
        for key in bad:
            assert f"'{key}' ({key.split('_', 1)[1]})" in err, (key, err)
        assert not Path(args[2]).exists(), "nothing is written"
    dst = tmp_path / "torch"
    code, stdout, err = cli(["export", src, dst, "--format", "torch"])
    assert code == 0, err
    loaded = torch.load(dst / "model.pt", weights_only=True)
    for fqn in written["all"]["reference"]["model"]:
        want = _full(written["all"]["reference"], fqn)
        assert loaded[fqn].dtype == want.dtype and _raw(loaded[fqn]) == _raw(want), fqn


# ------------------------------------------------------------------------ differences are seen bit for bit
def test_verify_tells_float8_nan_payloads_and_float4_apart(tmp_path):
    """Two checkpoints saved by torch's ``dcp.save`` that differ only in a float8 NaN's sign bit and one float4
    byte: verify exits 1 naming both keys and the differing bits (also within a tolerance: float4 has no
    arithmetic, so it is compared bit for bit)."""
    import torch.distributed.checkpoint as dcp

    def f8(*b):
        return torch.tensor(b, dtype=torch.uint8).view(torch.float8_e4m3fn)

    def f4(*b):
        return torch.tensor(b, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)

    a, b = tmp_path / "a", tmp_path / "b"
    dcp.save({"model": {"amax": f8(0x7F, 0x00, 0x38), "w4": f4(0x0F, 0x21)}}, checkpoint_id=str(a), no_dist=True)
    dcp.save({"model": {"amax": f8(0xFF, 0x00, 0x38), "w4": f4(0x0F, 0x12)}}, checkpoint_id=str(b), no_dist=True)
    code, stdout, err = cli(["verify", a, b, "--json"])
    assert code == 1, (code, err)
    diffs = {d["key"]: d for d in json.loads(stdout)["differences"]}
    assert set(diffs) == {"model.amax", "model.w4"}
    assert (diffs["model.amax"]["index"], diffs["model.amax"]["a"], diffs["model.amax"]["b"]) == \
        ([0], "nan (0x7f)", "nan (0xff)")
    assert (diffs["model.w4"]["index"], diffs["model.w4"]["a"], diffs["model.w4"]["b"]) == ([1], "0x21", "0x12")
    code, stdout, err = cli(["verify", a, b, "--rtol", "0.5", "--json"])
    assert code == 1 and {d["key"] for d in json.loads(stdout)["differences"]} == {"model.w4"}, (code, stdout, err)
    code, stdout, err = cli(["verify", a, a])
    assert code == 0, err


# ------------------------------------------------------------------------ what cannot be written
def test_quantized_dtype_refused_by_inspect_and_plan(tmp_path):
    """torch's ``dcp.save`` saves a quantized tensor; its items carry the quantizer, not plain bytes, so reshard
    refuses it up front: inspect and plan exit 2 naming the key and the dtype (no traceback)."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "q"
    with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors; dcp.save still saves them
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_tensor(torch.linspace(-1, 1, 8), 0.01, 0, torch.qint8)
    dcp.save({"model": {"w": torch.ones(4), "q": q}}, checkpoint_id=str(src), no_dist=True)
    for args in (["inspect", src], ["plan", src, "--to", "dp=2"]):
        code, stdout, err = cli(args)
        assert code == 2, (args, code, stdout, err)
        assert "'model.q' (qint8)" in err and "quantized" in err and "Traceback" not in err, err


def test_dcp_save_cannot_save_bits_dtypes(tmp_path):
    """Why the writer has no bits8: torch 2.13's own ``dcp.save`` fails on it (its planner sizes every item with
    ``torch._utils._element_size``, which raises for bits). When torch learns to, add them to the writer."""
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.api import CheckpointException

    t = dtypes_run.random_bytes(torch.bits8, (4,), 0)
    with pytest.raises(CheckpointException) as failed:
        dcp.save({"model": {"b": t}}, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    cause, _frames = failed.value.failures[0]  # the coordinator's error and its frames, as DCP collects them
    assert isinstance(cause, TypeError) and "torch.iinfo() requires an integer input type" in str(cause), repr(cause)
    assert not (tmp_path / "b" / ".metadata").exists()
