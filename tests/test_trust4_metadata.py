"""Issue 42, item 10: where the torch-free `.metadata` reader and `verify` were not exact.

(a) **A chunk of another rank than its tensor, read by the fallback.** The native decoder
    (reshard/storage/pickles/metadecode.c) declines such a file, so the safe unpickler's records are
    turned into columns (`metadata_columns.from_raw`), where a key's chunks are rows of its
    rank, one key after another: one chunk of another rank shifted the rows of every later
    key, and the refusal named those keys (coverage errors of 'b', 'c', ...), never the one
    whose chunk was wrong. The file is now refused as it is decoded, naming the key and the
    chunk (`dcp.chunk_rank_mismatch`).

(b) **A bool byte other than 0x00/0x01.** A uint8 tensor saved through ``.view(torch.bool)``
    (what ``dcp.save`` below writes, with the CRC-32 of exactly those bytes) holds 0x02 where
    torch reads True. Every decoding path (`CheckpointIndex.read_box`: verify's slow path, a
    conversion that decodes, export) copied it with torch's bool copy, which writes 0x01, so
    `verify` called 0x02 and 0x01 equal "bitwise" and a conversion of a zstd source wrote
    0x01. An exact tool neither normalises nor refuses what its writer wrote: the byte is kept
    and compared as stored (verify exits 1 naming it), and ``inspect --deep`` says where such a
    byte is (a warning: torch reads it inconsistently, but the file is what its writer wrote).

(c) **Memo tricks in `.metadata`.** A fetch of a memo index never set, an index beyond the
    pickle (LONG_BINPUT 2^32-1) or set twice (a rebinding that makes later fetches name
    another object) were refused in the words of the cost budget ("a pickle built to exhaust
    memory"), or reached the reader's catch-all ("cannot parse the checkpoint metadata
    (UnpicklingError: STACK_GLOBAL requires str)"); a memoised list or dict used as a dict key
    or called as a class reached it as a bare ``TypeError``; a shared list changed after its
    second reference was called a cycle. Each is now one paragraph naming the file and what
    the pickle does, through the native decoder and cost scan and through the Python ones.

Every file here is a real ``dcp.save`` in this process, changed as each test says (our own
files, so ``pickle.load`` of them is trusted). Cost: about 3 s on the 2-core machine (the
saves, a conversion, and 26 in-process CLI runs over tiny checkpoints).
"""
from __future__ import annotations

import json
import os
import pickle
import pickletools
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import cli
from reshard.model.dtypes import DTYPES
from reshard.storage.checkpoints import dcp as dcp_io
from reshard.storage.pickles import metadata_columns, safe_pickle
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.storage.pickles.safe_pickle import PickleTooCostly, pickle_budget, pickle_cost, python_pickle_cost

EXCEPTION_NAMES = ("TypeError", "UnpicklingError", "KeyError", "IndexError", "RecursionError", "MemoryError",
                   "ValueError", "AttributeError", "Traceback", "unexpected")
COST_WORDS = ("budget", "exhaust memory", "units per byte")


# ------------------------------------------------------------------------------------------ helpers

def _save(path: Path, state: dict, **writer) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, **writer), checkpoint_id=path, no_dist=True)
    return path


def _metadata(ckpt: Path):
    """The checkpoint's Metadata as torch's own objects (our own file, written just now: trusted)."""
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)


def _beside(src: Path, dst: Path, metadata: bytes) -> Path:
    """A checkpoint whose data files are src's (hard links) and whose `.metadata` is ``metadata``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != ".metadata":
            os.link(f, dst / f.name)
    (dst / ".metadata").write_bytes(metadata)
    return dst


def _native_decode(ckpt: Path) -> dict | None:
    """What the native decoder answers for ``ckpt``'s `.metadata` (None: it declines, the safe path reads it)."""
    assert metadata_columns.native is not None, "the native decoder is built by the install (setup.py)"
    fd = os.open(ckpt / ".metadata", os.O_RDONLY)
    try:
        n = os.fstat(fd).st_size
        return metadata_columns.native.decode(fd, n, metadata_columns._native_roles(), frozenset(DTYPES),
                                              pickle_budget(n))
    finally:
        os.close(fd)


def _refusal(code: int, out: str, err: str, ckpt: Path) -> str:
    """Exit 2, one paragraph naming ``ckpt``'s `.metadata`, no exception's name and no catch-all: the paragraph."""
    text = (out + err).strip()
    assert code == 2, text
    assert len(text.splitlines()) == 1, text
    assert f"{ckpt / '.metadata'}:" in text, text
    assert not any(w in text for w in EXCEPTION_NAMES), text
    return text


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small checkpoint of several ranks of tensor, a bool, a 0-d tensor and an object."""
    return _save(tmp_path_factory.mktemp("trust4") / "base",
                 {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5), "c": torch.zeros(2, 3, dtype=torch.int64),
                  "flag": torch.tensor([True, False]), "step": torch.tensor(7), "extra": {"lr": 0.1}})


# ---------------------------------------------------------------------- (a) a chunk of another rank

@pytest.mark.parametrize("offsets, sizes", [((0, 0, 0), (3, 4, 1)), ((0, 0), (12,))],
                         ids=["offsets-and-sizes-of-rank-3", "sizes-of-rank-1"])
def test_fallback_reader_names_the_key_whose_chunk_has_another_rank(base, tmp_path, offsets, sizes):
    """Chunk 0 of 'a' (shape [3, 4]) given rank 3, or sizes of rank 1: the native decoder declines, and the
    safe path's refusal names 'a' and its chunk, not the keys after it whose rows the chunk shifted."""
    md = _metadata(base)
    chunk = md.state_dict_metadata["a"].chunks[0]
    chunk.offsets, chunk.sizes = torch.Size(offsets), torch.Size(sizes)
    ck = _beside(base, tmp_path / "ck", pickle.dumps(md, protocol=4))
    assert _native_decode(ck) is None  # the fallback is what reads this file
    text = _refusal(*cli(["inspect", ck]), ck)
    assert f"chunk 0 of tensor 'a' has offsets {list(offsets)} and sizes {list(sizes)}" in text, text
    assert "shape [3, 4] has 2" in text, text
    assert not any(f"'{k}'" in text for k in ("b", "c", "flag", "step")), text
    code, out, _ = cli(["inspect", ck, "--json"])
    assert code == 2 and json.loads(out)["keys"] == ["a"], out


# ---------------------------------------------------------------------- (b) bool bytes as stored

@dataclass(frozen=True)
class Bools:
    odd: Path       # mask's bytes 02 00 01 01: 0x02 where torch reads True
    odd_zstd: Path  # the same, every item zstd-compressed (a conversion decodes such items: read_box)
    plain: Path     # mask's bytes 01 00 01 01


@pytest.fixture(scope="module")
def bools(tmp_path_factory) -> Bools:
    from torch.distributed.checkpoint._extension import ZStandard

    root = tmp_path_factory.mktemp("bools")

    def state(mask: list[int]) -> dict:
        return {"w": torch.arange(12.0).reshape(3, 4), "mask": torch.tensor(mask, dtype=torch.uint8).view(torch.bool)}

    return Bools(_save(root / "odd", state([2, 0, 1, 1])),
                 _save(root / "odd_zstd", state([2, 0, 1, 1]), _extensions=[ZStandard()]),
                 _save(root / "plain", state([1, 0, 1, 1])))


def _stored_mask(ckpt: Path) -> list[list[int]]:
    """The bytes each item of 'mask' stores, chunk by chunk (torch.load keeps a storage's bytes as they are)."""
    ix = CheckpointIndex.open(ckpt)
    return [dcp_io.load_item(ix.root, c.location, key="mask", tensor=True).view(torch.uint8).tolist()
            for c in ix.entries["mask"].chunks]


@pytest.mark.parametrize("tolerance", [[], ["--atol", "1"]], ids=["bitwise", "within-a-tolerance"])
def test_verify_tells_a_stored_bool_byte_from_true(bools, tolerance):
    """0x02 and 0x01 are different bytes: exit 1, the difference on 'mask' at [0] naming the byte (a tolerance
    changes nothing for a bool); verify said "equal" (bitwise!) once its slow path decoded both as True."""
    assert _stored_mask(bools.odd) == [[2, 0, 1, 1]] and _stored_mask(bools.plain) == [[1, 0, 1, 1]]
    code, out, err = cli(["verify", bools.odd, bools.plain, "--json", *tolerance])
    assert code == 1, out + err
    (d,) = json.loads(out)["differences"]
    assert (d["key"], d["kind"], d["index"], d["a"], d["b"], d["count"]) == ("mask", "value", [0], "0x02", True, 1), d
    code, out, err = cli(["verify", bools.odd, bools.odd_zstd])
    assert code == 0, out + err  # the same bytes, whichever way they are stored


def test_a_conversion_that_decodes_keeps_the_bool_bytes(bools, tmp_path):
    """A zstd source is converted through decoding (read_box, not a byte splice): the output stores 0x02 as
    the source does, and verify finds it equal to the source and different from the plain bools."""
    dst = tmp_path / "out"
    code, out, err = cli(["convert", bools.odd_zstd, dst, "--to", "dp=2", "--quiet"])
    assert code == 0, out + err
    assert _stored_mask(dst) == [[2, 0], [1, 1]]
    assert cli(["verify", bools.odd_zstd, dst])[0] == 0
    assert cli(["verify", dst, bools.plain])[0] == 1


def test_inspect_deep_says_where_a_bool_byte_is_neither_false_nor_true(bools):
    """A warning naming the key, the file, the element and the byte (the checkpoint stays readable: exit 0)."""
    code, out, err = cli(["inspect", bools.odd, "--deep", "--json"])
    assert code == 0, out + err
    (w,) = [p for p in json.loads(out)["problems"] if p["code"] == "bool_bytes"]
    assert w["severity"] == "warning" and w["keys"] == ["mask"] and w["file"] == "__0_0.distcp", w
    assert "0x02 at [0]" in w["message"], w
    code, out, _ = cli(["inspect", bools.plain, "--deep", "--json"])
    assert code == 0 and not [p for p in json.loads(out)["problems"] if p["code"] == "bool_bytes"]


# ---------------------------------------------------------------------- (c) memo tricks

def _unframed(data: bytes) -> bytes:
    """The pickle without its FRAME opcodes (a hint only), so that opcodes may be replaced by longer ones."""
    ops = list(pickletools.genops(data))
    out = bytearray()
    for i, (op, _arg, pos) in enumerate(ops):
        if op.name != "FRAME":
            out += data[pos:ops[i + 1][2] if i + 1 < len(ops) else len(data)]
    return bytes(out)


def _pickled(md) -> bytes:
    return _unframed(pickle.dumps(md, protocol=4))


def _with_planner(base: Path, planner: dict) -> bytes:
    md = _metadata(base)
    md.planner_data = planner
    return _pickled(md)


def _value(base: Path, ops: bytes) -> bytes:
    """`.metadata` whose planner_data value for "a" is what ``ops`` push (its MEMOIZE, which follows, kept:
    every later memo index still names what it named)."""
    marker = "MEMO-TRICK-VALUE"
    data = _with_planner(base, {"a": marker})
    s = b"\x8c" + bytes([len(marker)]) + marker.encode()
    assert data.count(s) == 1 and data[data.index(s) + len(s)] == 0x94
    return data.replace(s, ops)


SECOND = b"\x8c\x0asecond-ref\x94"  # the key "second-ref" and its MEMOIZE


def _shared(base: Path, value: object) -> tuple[bytes, int]:
    """planner_data ``{"first-ref": value, "second-ref": value}``: the pickle, and where the key "second-ref"
    starts (its string and MEMOIZE, then the BINGET that fetches ``value`` for it)."""
    data = _with_planner(base, {"first-ref": value, "second-ref": value})
    at = data.index(SECOND)
    assert data.count(SECOND) == 1 and data[at + len(SECOND)] == 0x68  # BINGET of the memoised value
    return data, at


def _memo_kinds(data: bytes) -> dict[int, str]:
    """Memo index -> the opcode that built what it holds (the pickle memoises with MEMOIZE only)."""
    ops = list(pickletools.genops(data))
    kinds: dict[int, str] = {}
    for i, (op, _arg, _pos) in enumerate(ops):
        if op.name == "MEMOIZE":
            kinds[len(kinds)] = ops[i - 1][0].name
    return kinds


def _get_of_a_global_module(base: Path) -> bytes:
    """A global whose module name is fetched from the memo, fetching the first class memoised instead."""
    data = _pickled(_metadata(base))
    kinds = _memo_kinds(data)
    module = next(k for k, v in kinds.items() if v == "SHORT_BINUNICODE")
    cls = next(k for k, v in kinds.items() if v == "STACK_GLOBAL")
    ops = list(pickletools.genops(data))
    at = next(pos for i, (op, arg, pos) in enumerate(ops) if op.name == "BINGET" and arg == module
              and ops[i + 1][0].name == "SHORT_BINUNICODE"  # the class name, memoised, then STACK_GLOBAL
              and "STACK_GLOBAL" in (ops[i + 2][0].name, ops[i + 3][0].name))
    return data[:at] + b"h" + bytes([cls]) + data[at + 2:]


def _newobj_of_a_string(base: Path) -> bytes:
    """A record built by NEWOBJ from a memo fetch of a string (the module name) instead of its class."""
    data = _pickled(_metadata(base))
    kinds = _memo_kinds(data)
    string = next(k for k, v in kinds.items() if v == "SHORT_BINUNICODE")
    ops = list(pickletools.genops(data))
    at = next(pos for i, (op, arg, pos) in enumerate(ops) if op.name == "BINGET"
              and kinds.get(arg) == "STACK_GLOBAL" and ops[i + 1][0].name == "EMPTY_TUPLE"
              and ops[i + 2][0].name == "NEWOBJ")
    return data[:at] + b"h" + bytes([string]) + data[at + 2:]


def _never_set(base: Path) -> bytes:
    data = _value(base, b"h\xfa")  # BINGET 250
    assert len(_memo_kinds(data)) < 250
    return data


def _self_list(base: Path) -> bytes:
    loop: list = []
    loop.append(loop)
    return _with_planner(base, {"a": loop})


def _self_dict(base: Path) -> bytes:
    loop: dict = {}
    loop["x"] = loop
    return _with_planner(base, {"a": loop})


def _changed_after_second_reference(base: Path) -> bytes:
    data, at = _shared(base, ["x"])  # no cycle: a list in two places, appended to through the second
    end = at + len(SECOND) + 2
    return data[:end] + b"\x8c\x01ya" + data[end:]


def _as_key(base: Path, value: object) -> bytes:
    data, at = _shared(base, value)  # {..., value: "second-ref"}: the memoised value fetched as a key
    key, get = data[at:at + len(SECOND)], data[at + len(SECOND):at + len(SECOND) + 2]
    return data[:at] + get + key + data[at + len(SECOND) + 2:]


def _called(base: Path) -> bytes:
    data, at = _shared(base, ["x"])  # the memoised list fetched and called: REDUCE with ()
    end = at + len(SECOND) + 2
    return data[:end] + b")R" + data[end:]


# name -> (the `.metadata`, what the refusal says, a memo misuse rather than a value of the wrong kind)
TRICKS = {
    "get-of-an-index-never-set": (lambda b: _never_set(b), "memo index 250 was never set", True),
    "long-binget-2**32-1": (lambda b: _value(b, b"j\xff\xff\xff\xff"), "memo index 4294967295 was never set", True),
    "long-binput-2**32-1": (lambda b: _value(b, b"Nr\xff\xff\xff\xff"),
                            "memo index 4294967295 is larger than the pickle", True),
    "binput-rebinds-index-0": (lambda b: _value(b, b"]r\x00\x00\x00\x00"), "memo index 0 is set twice", True),
    "list-containing-itself": (_self_list, "contains itself", False),
    "dict-containing-itself": (_self_dict, "contains itself", False),
    "shared-list-changed-after-its-second-reference": (
        _changed_after_second_reference, "changes a list, dict or record after taking a second reference", False),
    "memoised-list-as-a-dict-key": (lambda b: _as_key(b, ["x"]), "it uses a list", False),
    "memoised-dict-as-a-dict-key": (lambda b: _as_key(b, {"x": 1}), "it uses a dict", False),
    "memoised-list-called": (_called, "it calls a list as if it were a class", False),
    "memoised-class-as-a-module-name": (_get_of_a_global_module, "names a global by a value that is not a string", False),
    "memoised-string-as-a-class": (_newobj_of_a_string, "builds an object from a str where a class belongs", False),
}


@pytest.fixture(params=["native", "python"])
def decoders(request, monkeypatch) -> str:
    """``native``: the decoder and cost scan built from C; ``python``: both as written in Python."""
    if request.param == "python":
        monkeypatch.setattr(metadata_columns, "native", None)
        monkeypatch.setattr(safe_pickle, "native_scan", None)
    else:
        assert metadata_columns.native is not None and safe_pickle.native_scan is not None
    return request.param


@pytest.mark.parametrize("trick", list(TRICKS))
def test_memo_tricks_are_refused_by_name(base, tmp_path, decoders, trick):
    """Each trick: the native decoder declines it, and ``inspect`` exits 2 with one paragraph naming the
    file and what the pickle does (never the cost budget's words for a memo misuse, never an exception's)."""
    build, says, memo = TRICKS[trick]
    ck = _beside(base, tmp_path / "ck", build(base))
    if decoders == "native":
        assert _native_decode(ck) is None
    text = _refusal(*cli(["inspect", ck]), ck)
    assert says in text, text
    if memo:
        assert "misuses the pickle memo" in text and not any(w in text for w in COST_WORDS), text


@pytest.mark.parametrize("body, says", [
    (b"\x80\x04N\x94Nr\x00\x00\x00\x00N.", "memo index 0 is set twice"),   # MEMOIZE 0, then LONG_BINPUT 0
    (b"\x80\x02Nq\x01N\x94N.", "memo index 1 is set twice"),               # BINPUT 1, then MEMOIZE takes 1
    (b"\x80\x02Nq\x00Np0\n.", "memo index 0 is set twice"),             # BINPUT 0, then text PUT 0 (Python scan)
    (b"\x80\x04N\x94h\x07.", "memo index 7 was never set"),
])
def test_both_scans_refuse_a_memo_misuse_in_the_same_words(body, says):
    """The native cost scan and the Python one: the same `PickleMemoFault`, the index named (a rebinding
    was not refused at all; a fetch of nothing did not name the index in the native scan)."""
    for scan in (pickle_cost, python_pickle_cost):
        with pytest.raises(PickleTooCostly, match=says) as refused:
            scan(body, limit=pickle_budget(len(body)))
        assert type(refused.value).__name__ == "PickleMemoFault", (scan.__name__, refused.value)
