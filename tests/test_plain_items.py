"""reshard.storage.pickles.plain_items: small torch.save items decoded without torch, equal to torch.load's values.

Every item here is written by real ``torch.save`` (or torch's own single-process ``dcp.save``)
and decoded twice: by ``torch.load(weights_only=True)`` and by `decode_item`; the values must be
the same, floats compared by their bits (NaN payloads, -0.0 and infinities included). What needs
torch (another global, a float8 tensor, a larger tensor) must be `NotPlain`, the caller's cue to
fall back to torch.load, and a pickle naming ``os.system`` must never run. Last, a child process
in which importing torch raises decodes items: nothing in the module or its imports reaches torch.
"""
from __future__ import annotations

import collections
import datetime
import io
import json
import math
import os
import pickle
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from reshard.errors import BadInput  # noqa: E402
from reshard.storage.checkpoints import dcp as dcp_io  # noqa: E402
from reshard.storage.checkpoints.fastread import check_item_crcs  # noqa: E402
from reshard.storage.pickles.plain_items import NotPlain, PlainTensor, decode_item  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

DECODED = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
           "float16", "bfloat16", "float32", "float64")
"""Every dtype `decode_item` decodes; the typed-storage ones go through _rebuild_tensor_v2, uint16-64 through _v3."""


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _same(got: Any, want: Any) -> bool:
    """``got`` (decode_item's value) equals ``want`` (torch.load's), types included, floats by their bits."""
    if isinstance(want, torch.Tensor):
        return (isinstance(got, PlainTensor) and got.dtype.name == str(want.dtype).removeprefix("torch.")
                and got.shape == tuple(want.shape) and got.numel == want.numel()
                and _same(got.tolist(), want.tolist())
                and (want.numel() != 1 or _same(got.item(), want.item())))
    if type(got) is not type(want):
        return False
    if isinstance(want, float):
        return struct.pack("<d", got) == struct.pack("<d", want)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    if isinstance(want, dict):
        return list(got) == list(want) and all(_same(got[k], want[k]) for k in want)
    return got == want


def _random_bits(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``name`` filled with random bytes (so floats include NaNs with payloads, infinities, subnormals)."""
    dtype = getattr(torch, name)
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if name == "bool":
        return (raw % 2).to(torch.bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


def _extremes(name: str) -> torch.Tensor:
    dtype = getattr(torch, name)
    if name == "bool":
        return torch.tensor([True, False])
    if dtype.is_floating_point:
        fi = torch.finfo(dtype)
        vals = [0.0, -0.0, 1.0, -2.5, fi.max, fi.min, fi.tiny, fi.smallest_normal / 4, math.inf, -math.inf, math.nan]
        return torch.tensor(vals, dtype=torch.float64).to(dtype)
    ii = torch.iinfo(dtype)
    return torch.tensor([ii.min, ii.max, 0, 1, -1 if ii.min < 0 else 2], dtype=dtype)


def _tensor_cases() -> list[tuple[str, torch.Tensor]]:
    cases = []
    for i, name in enumerate(DECODED):
        dtype = getattr(torch, name)
        cases.append((f"{name}-0d", _random_bits(name, (), i)))
        cases.append((f"{name}-1", _random_bits(name, (1,), 100 + i)))
        cases.append((f"{name}-2x3", _random_bits(name, (2, 3), 200 + i)))
        cases.append((f"{name}-extremes", _extremes(name)))
        cases.append((f"{name}-empty", torch.zeros((2, 0), dtype=dtype)))
    ten = torch.arange(10)
    cases += [
        ("strided-view", ten[2:8:2]),                                  # storage offset 2, stride 2, storage of 10
        ("transposed", torch.arange(6, dtype=torch.int32).reshape(2, 3).t()),
        ("expanded", torch.tensor([7.5]).expand(4)),                   # stride 0
        ("view-one-element", _random_bits("bfloat16", (16,), 7)[5]),   # 0-d view deep into its storage
        ("uint64-view", torch.tensor([0, 2**64 - 1, 2**63], dtype=torch.uint64)[1:]),
        ("negative", torch.tensor([-1, -2**63], dtype=torch.int64)),
        # signalling NaNs with payloads: torch widens through float32 and the last step quiets them
        ("snan-float16", torch.tensor([0x7DDE, 0xFC01], dtype=torch.int32).to(torch.int16).view(torch.float16)),
        ("snan-bfloat16", torch.tensor([0x7F81, 0xFFA0], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)),
        ("snan-float32", torch.tensor([0x7F800001, 0x7FA00000], dtype=torch.int32).view(torch.float32)),
    ]
    return cases


TENSORS = _tensor_cases()


@pytest.mark.parametrize("name,tensor", TENSORS, ids=[c[0] for c in TENSORS])
def test_tensor_items_equal_torch_load(name: str, tensor: torch.Tensor) -> None:
    """(1) Every decoded dtype, 0-d, one element, small, extremes, empty, non-contiguous views: torch.load's values."""
    data = _saved(tensor)
    want = torch.load(io.BytesIO(data), weights_only=True)
    got = decode_item(data, key=name, where="mem")
    assert _same(got, want), (name, got, want.tolist())


def test_object_items_equal_torch_load() -> None:
    """(1) Plain objects and containers of them, tensors nested inside, shared storages: torch.load's values."""
    base = torch.arange(12, dtype=torch.float32) / 3
    objects = [
        7, -2**70, 0.1, math.nan, -0.0, math.inf, True, False, None, "schedule", "",
        [1, 2.5, None, "x"], (1, (2, (3,))), {"last_epoch": 3, "base_lrs": [0.001, 0.002], "_step_count": 4},
        collections.OrderedDict([("b", 1), ("a", {"c": [True, None]})]),
        {"step": torch.tensor(12.0), "counts": [torch.tensor([1, 2], dtype=torch.int32)], "n": 5},
        {"a": base[1:3], "b": base[0], "c": base.view(3, 4)[:, 1]},   # three views of one storage, saved once
        {1: "int key", (2, 3): "tuple key"},
    ]
    for obj in objects:
        data = _saved(obj)
        want = torch.load(io.BytesIO(data), weights_only=True)
        got = decode_item(data, key="obj", where="mem")
        assert _same(got, want), (obj, got)
    assert type(decode_item(_saved(objects[14]), key="obj", where="mem")) is collections.OrderedDict


@pytest.fixture(scope="module")
def dcp_ckpt(tmp_path_factory) -> Path:
    """A real checkpoint written by torch's own ``dcp.save``, single process (no process group)."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path_factory.mktemp("plain") / "ckpt"
    state = {"step": 7, "sched": {"last_epoch": 3, "base_lrs": [0.01]}, "t": torch.tensor(5.0),
             "adam_step": torch.tensor(12.0), "counts": torch.tensor([3, 1, 4], dtype=torch.int64),
             "name": "run-a", "w": torch.arange(100, dtype=torch.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(out))
    return out


def test_real_dcp_items_decoded_from_their_byte_ranges(dcp_ckpt: Path) -> None:
    """(2) Each item of a real dcp.save checkpoint, read from its byte range as the index does: the same value as
    reshard's torch.load path (`dcp.load_item`), and as what was saved; the 100-element tensor is NotPlain."""
    raw = dcp_io.read_raw_metadata(dcp_ckpt)
    decoded: dict[str, Any] = {}
    for (key, offsets), loc in raw.locations.items():
        where = str(dcp_ckpt / loc.file)
        data = dcp_io.untransform(dcp_io.read_item_bytes(dcp_ckpt, loc, key=key), loc.transforms, key=key, where=where)
        check_item_crcs(data, key=key, where=where)
        want = dcp_io.load_item(dcp_ckpt, loc, key=key, tensor=offsets is not None)
        if key == "w":
            with pytest.raises(NotPlain, match="100 elements"):
                decode_item(data, key=key, where=where)
            continue
        got = decode_item(data, key=key, where=where)
        assert _same(got, want), (key, got, want)
        decoded[key] = got
    assert decoded["step"] == 7 and decoded["sched.last_epoch"] == 3 and decoded["sched.base_lrs"] == [0.01]
    assert decoded["name"] == "run-a"
    assert decoded["t"].item() == 5.0 and decoded["adam_step"].item() == 12.0 and decoded["t"].shape == ()
    assert decoded["counts"].tolist() == [3, 1, 4]


def _archive(pkl: bytes) -> bytes:
    """A torch.save-shaped archive (stored members under one folder) around a hand-written ``data.pkl``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
    return buf.getvalue()


_INDUCTOR = b"\x80\x02ctorch._inductor.config\nshape_padding\n)R."
"""A pickle naming a lazy torch submodule: resolving it by getattr or import would import torch._inductor."""


def _system_pickle(command: str) -> bytes:
    """``os.system(command)`` as a pickle, by hand (GLOBAL posix.system, BINUNICODE, TUPLE1, REDUCE)."""
    arg = command.encode()
    return b"\x80\x02cposix\nsystem\nX" + struct.pack("<I", len(arg)) + arg + b"\x85R."


class _RunsShell:
    """An object whose pickle asks the unpickler to call ``os.system`` (``posix.system``)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_needs_torch_is_not_plain() -> None:
    """(3) What needs torch is NotPlain, the fallback cue: float8, complex, more than max_elements, a Parameter,
    requires_grad, another global (datetime, an optimizer's state with its class), a bare dtype or storage."""
    cases = {
        "float8": torch.zeros(2, dtype=torch.float8_e4m3fn),
        "complex": torch.zeros(1, dtype=torch.complex64),
        "large": torch.zeros(65),
        "parameter": torch.nn.Parameter(torch.zeros(1)),
        "requires_grad": torch.zeros(1, requires_grad=True),
        "datetime": {"saved": datetime.datetime(2024, 1, 2)},
        "optimizer": torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
        "dtype": torch.float32,
        "storage": torch.zeros(2).untyped_storage(),
        "size": torch.Size([2, 3]),
    }
    for name, obj in cases.items():
        with pytest.raises(NotPlain):
            decode_item(_saved(obj), key=name, where="mem")
    assert decode_item(_saved(torch.zeros(65)), key="large", where="mem", max_elements=65).numel == 65
    with pytest.raises(NotPlain, match="more tensor elements"):  # many small tensors in one item: no counter
        decode_item(_saved([torch.zeros(64) for _ in range(65)]), key="many", where="mem")


def test_os_system_never_runs(tmp_path: Path) -> None:
    """(3) A torch.save item naming os.system (and one naming a lazy torch submodule) is NotPlain, and nothing ran."""
    marker = tmp_path / "ran"
    data = _saved({"step": _RunsShell(marker)})
    assert b"system" in dcp_io.item_pickle(data, key="evil", where="mem")
    with pytest.raises(NotPlain, match="system"):
        decode_item(data, key="evil", where="mem")
    assert not marker.exists()
    for pkl in (_INDUCTOR, _system_pickle(f"touch {marker}")):
        with pytest.raises(NotPlain, match="the pickle names"):
            decode_item(_archive(pkl), key="forged", where="mem")
    assert not marker.exists()


def _with_pickle(item: bytes, pkl: bytes) -> bytes:
    """The torch.save archive ``item`` with its ``data.pkl`` replaced (every other member kept, stored)."""
    src = zipfile.ZipFile(io.BytesIO(item))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            z.writestr(info.filename, pkl if info.filename.endswith("/data.pkl") else src.read(info))
    return buf.getvalue()


def test_forged_build_cannot_smuggle_stand_ins() -> None:
    """A forged BUILD that hangs a stand-in (a dtype) on an OrderedDict, or rewrites a decoded tensor's values,
    is NotPlain: no stand-in leaves the module, and a decoded tensor is what its storage holds."""
    item = _saved(torch.tensor([1.0, 2.0]))
    pkl = dcp_io.item_pickle(item, key="t", where="mem")
    assert pkl.endswith(b".")
    forged = [
        b"\x80\x02ccollections\nOrderedDict\n)R}X\x01\x00\x00\x00actorch\nfloat32\nsb.",
        pkl[:-1] + b"}X\x06\x00\x00\x00valuesK\x01K\x02\x86sb.",          # PlainTensor.values := (1, 2)
        pkl[:-1] + b"N}X\x06\x00\x00\x00valuesK\x01K\x02\x86s\x86b.",     # the same as slot state
    ]
    for p in forged:
        with pytest.raises(NotPlain):
            decode_item(_with_pickle(item, p), key="forged", where="mem")
    assert decode_item(_with_pickle(item, pkl), key="t", where="mem").values == (1.0, 2.0)


def test_empty_tensor_with_a_huge_dimension_is_not_plain() -> None:
    """A forged 0 x 10**12 tensor has no element but 10**12 positions (its tolist() alone would not end): NotPlain at
    once, for torch.load to decide; a 0 x 3 one is decoded."""
    item = _saved(torch.zeros(0, 3))
    pkl = dcp_io.item_pickle(item, key="t", where="mem")
    assert b"K\x00K\x03\x86" in pkl
    forged = pkl.replace(b"K\x00K\x03\x86", b"K\x00\x8a\x06" + (10**12).to_bytes(6, "little") + b"\x86")
    with pytest.raises(NotPlain, match="empty tensor"):
        decode_item(_with_pickle(item, forged), key="t", where="mem")
    assert decode_item(item, key="t", where="mem").tolist() == []


def test_bad_archive_is_bad_input() -> None:
    """A compressed (bomb-shaped) archive is refused for every reader: BadInput from item_pickle, key named."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", pickle.dumps(7, protocol=2))
        z.writestr("archive/byteorder", b"little")
    with pytest.raises(BadInput, match="'counter'"):
        decode_item(buf.getvalue(), key="counter", where="mem")


_CHILD = r"""
import json, sys
from pathlib import Path

attempts = []

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            attempts.append(name)
            raise ImportError(f"torch is blocked in this process ({name})")
        return None

sys.meta_path.insert(0, NoTorch())
from reshard.storage.pickles.plain_items import NotPlain, decode_item

out = {}
for path in sorted(Path(sys.argv[1]).iterdir()):
    try:
        v = decode_item(path.read_bytes(), key=path.name, where=str(path))
        out[path.name] = ["tensor", v.dtype.name, list(v.shape), v.tolist()] if hasattr(v, "dtype") else ["value", v]
    except NotPlain as exc:
        out[path.name] = ["NotPlain", str(exc)]
print(json.dumps({"out": out, "attempts": attempts, "torch": "torch" in sys.modules}))
"""


def test_no_torch_import(tmp_path: Path) -> None:
    """(4) In a process where importing torch raises, the module imports and decodes items; torch is never asked for,
    even by an item naming torch globals it does not admit."""
    items = tmp_path / "items"
    items.mkdir()
    (items / "step").write_bytes(_saved({"step": 7, "sched": {"last_epoch": 3}}))
    (items / "adam_step").write_bytes(_saved(torch.tensor(12.0)))
    (items / "bf16").write_bytes(_saved(torch.tensor([1.5, -2.0], dtype=torch.bfloat16)))
    (items / "u64").write_bytes(_saved(torch.tensor([2**64 - 1], dtype=torch.uint64)))
    (items / "float8").write_bytes(_saved(torch.zeros(1, dtype=torch.float8_e5m2)))
    (items / "param").write_bytes(_saved(torch.nn.Parameter(torch.zeros(1))))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _CHILD, str(items)], capture_output=True, text=True, env=env,
                       timeout=120, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["attempts"] == [] and res["torch"] is False, res
    out = res["out"]
    assert out["step"] == ["value", {"step": 7, "sched": {"last_epoch": 3}}]
    assert out["adam_step"] == ["tensor", "float32", [], 12.0]
    assert out["bf16"] == ["tensor", "bfloat16", [2], [1.5, -2.0]]
    assert out["u64"] == ["tensor", "uint64", [1], [2**64 - 1]]
    assert out["float8"][0] == "NotPlain" and out["param"][0] == "NotPlain"
