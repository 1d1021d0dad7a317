#!/usr/bin/env python
"""Fuzz reshard's inputs: byte-level mutations of a real checkpoint, every command, hard properties.

Each case copies a small real DCP checkpoint, mutates one of its inputs at the byte level
(flip / insert / delete bytes, truncate), then runs ``inspect``, ``inspect --deep``,
``plan --to dp=2``, ``convert --to dp=2`` (into a fresh directory) and ``verify ORIGINAL
MUTATED`` and checks:

* the exit code is 0, 1 or 2; never a Python traceback; an error on stderr is one paragraph
  starting with ``error:``;
* a failed ``convert`` commits nothing (no ``.metadata`` / ``manifest.json`` anywhere
  under the destination's parent);
* exit 2 (for inspect, inspect --deep, plan, convert; verify may say 1 or 2) whenever the
  mutation makes the input structurally invalid, as decided *independently* of reshard:
  ``.metadata`` that stock ``pickle`` cannot load into the DCP classes; a data file cut
  shorter than the byte ranges its items need (inspect without --deep); a damaged zip
  signature of an item (``--deep``); ``manifest.json`` that is not JSON or breaks
  ``formats/manifest.schema.json`` (a small draft-2020-12 subset validator below).

Mutations of tensor payload bytes can be undetectable (DCP has no checksums): only the
general properties are asserted for them.

Targets: ``metadata``, ``zip_header`` (zip structure of one item: local headers,
``data.pkl``, central directory), ``zip_signature`` (the PK signatures only), ``payload``
(the storage bytes of one item), ``truncate`` (a data file cut short), ``manifest``.

Usage::

    python scripts/fuzz_inputs.py --cases 200 [--ckpt DIR] [--seed N] [--subprocess] [--keep-going]

Without ``--ckpt`` a 4-rank reference checkpoint is trained first (about 15 s). Prints
tried/failed counts; exit 1 on any failure. ``tests/test_fuzz.py`` imports this module.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

TARGETS = ("metadata", "zip_header", "zip_signature", "payload", "truncate", "manifest")
COMMANDS = ("inspect", "inspect_deep", "plan", "convert", "verify")
TO = "dp=2"
# "error: unexpected ..." is the CLI's last-resort handler: an exception reshard did not turn into
# a finding. Still exit 2 and one paragraph, so not a property violation by itself; counted as a
# failure unless it is a known, reported bug listed here.
KNOWN_UNEXPECTED: tuple[str, ...] = ()  # none known; a reported bug is listed here until it is fixed

Runner = Callable[[list[str]], tuple[int, str, str]]


# ----------------------------------------------------------------------------- regions

@dataclass(frozen=True)
class Item:
    key: str
    file: str
    offset: int
    length: int
    payload: tuple[tuple[int, int], ...]      # absolute [lo, hi) spans of storage bytes
    header: tuple[tuple[int, int], ...]       # absolute spans of everything else in the item
    signatures: tuple[tuple[int, int], ...]   # PK signatures a reader must check (read members, central directory, end record)


def _spans_complement(lo: int, hi: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, cur = [], lo
    for a, b in sorted(taken):
        if a > cur:
            out.append((cur, a))
        cur = max(cur, b)
    if cur < hi:
        out.append((cur, hi))
    return out


def item_regions(ckpt: Path) -> list[Item]:
    """Every item of the checkpoint with its zip structure, from the unmutated original."""
    from reshard.storage.checkpoints.dcp import read_raw_metadata

    raw = read_raw_metadata(ckpt)
    items = []
    for (key, _off), loc in sorted(raw.locations.items(), key=lambda kv: (kv[1].file, kv[1].offset)):
        if loc.transforms:
            continue
        with open(ckpt / loc.file, "rb") as f:
            f.seek(loc.offset)
            blob = f.read(loc.length)
        zf = zipfile.ZipFile(io.BytesIO(blob))
        payload, sigs = [], []
        for info in zf.infolist():
            h = info.header_offset
            n, m = struct.unpack("<HH", blob[h + 26:h + 30])
            start = h + 30 + n + m
            if info.filename.endswith("/data.pkl") or "/data/" in info.filename:
                sigs.append((h, h + 4))  # members torch.load must read (others, e.g. serialization_id, it may skip)
            if "/data/" in info.filename and info.compress_size:
                payload.append((start, start + info.compress_size))
        eocd = blob.rfind(b"PK\x05\x06")
        if eocd >= 0:
            sigs.append((eocd, eocd + 4))
            cd = struct.unpack("<I", blob[eocd + 16:eocd + 20])[0]
            if blob[cd:cd + 4] == b"PK\x01\x02":
                sigs.append((cd, cd + 4))
        # (a zip64 end record is not listed: with small archives the plain end record suffices)
        header = _spans_complement(0, len(blob), payload)
        shift = lambda spans: tuple((loc.offset + a, loc.offset + b) for a, b in spans)  # noqa: E731
        items.append(Item(key, loc.file, loc.offset, loc.length, shift(payload), shift(header), shift(sigs)))
    return items


# ----------------------------------------------------------------------------- mutations

@dataclass
class Mutation:
    target: str
    file: str
    ops: list[tuple]                 # ("flip", pos, xor) | ("insert", pos, bytes) | ("delete", pos, n) | ("truncate", size)
    key: str | None = None
    note: str = ""

    def describe(self) -> str:
        ops = ", ".join(f"{o[0]}({', '.join(repr(x) for x in o[1:])})" for o in self.ops)
        return f"{self.target} {self.file}" + (f" [{self.key}]" if self.key else "") + f": {ops}"


def apply_ops(data: bytes, ops: list[tuple]) -> bytes:
    b = bytearray(data)
    for op in ops:
        if op[0] == "flip":
            b[op[1]] ^= op[2]
        elif op[0] == "insert":
            b[op[1]:op[1]] = op[2]
        elif op[0] == "delete":
            del b[op[1]:op[1] + op[2]]
        elif op[0] == "truncate":
            del b[op[1]:]
    return bytes(b)


def _pos_in(rnd: random.Random, spans: tuple[tuple[int, int], ...] | list[tuple[int, int]]) -> int:
    spans = [s for s in spans if s[1] > s[0]]
    a, b = rnd.choice(spans)
    return rnd.randrange(a, b)


def _ops(rnd: random.Random, spans, *, kinds=("flip", "insert", "delete")) -> list[tuple]:
    """1-3 edits at positions inside ``spans``, applied back to front so positions stay valid."""
    out = []
    for _ in range(rnd.choice((1, 1, 2, 3))):
        kind = rnd.choice(kinds)
        pos = _pos_in(rnd, spans)
        if kind == "flip":
            out.append(("flip", pos, rnd.randrange(1, 256)))
        elif kind == "insert":
            out.append(("insert", pos, bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 5)))))
        else:
            out.append(("delete", pos, rnd.randrange(1, 5)))
    return sorted(out, key=lambda o: -o[1])


def draw_mutation(rnd: random.Random, ckpt: Path, items: list[Item], target: str | None = None) -> Mutation:
    target = target or rnd.choice(TARGETS)
    if target == "metadata":
        size = (ckpt / ".metadata").stat().st_size
        if rnd.random() < 0.15:
            return Mutation(target, ".metadata", [("truncate", rnd.randrange(0, size))])
        return Mutation(target, ".metadata", _ops(rnd, [(0, size)]))
    if target == "manifest":
        size = (ckpt / "manifest.json").stat().st_size
        if rnd.random() < 0.15:
            return Mutation(target, "manifest.json", [("truncate", rnd.randrange(0, size))])
        return Mutation(target, "manifest.json", _ops(rnd, [(0, size)]))
    if target == "truncate":
        files = sorted({it.file for it in items})
        f = rnd.choice(files)
        size = (ckpt / f).stat().st_size
        return Mutation(target, f, [("truncate", rnd.randrange(0, size))])
    pool = [it for it in items if (it.payload if target == "payload" else it.header)]
    it = rnd.choice(pool)
    if target == "payload":
        return Mutation(target, it.file, _ops(rnd, it.payload, kinds=("flip",)), key=it.key)
    if target == "zip_signature":
        return Mutation(target, it.file, [("flip", _pos_in(rnd, it.signatures), rnd.randrange(1, 256))], key=it.key)
    return Mutation(target, it.file, _ops(rnd, it.header), key=it.key)


# ----------------------------------------------------------------------------- independent oracles

_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
     ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")} | {
    ("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}


class _StockDcpUnpickler(pickle.Unpickler):
    """Stock pickle, restricted to the classes a DCP `.metadata` names (an oracle, not reshard's reader)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            import torch

            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent id")


def metadata_loads(data: bytes) -> Any:
    """The DCP Metadata a pickle decodes to, or None when it cannot be a DCP Metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _StockDcpUnpickler(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - any failure means "not loadable"
        return None
    return md if isinstance(md, Metadata) else None


def _type_ok(v: Any, t: str) -> bool:
    return {"object": isinstance(v, dict), "array": isinstance(v, list), "string": isinstance(v, str),
            "integer": isinstance(v, int) and not isinstance(v, bool),
            "number": isinstance(v, (int, float)) and not isinstance(v, bool),
            "boolean": isinstance(v, bool), "null": v is None}[t]


def schema_errors(v: Any, node: dict, root: dict, path: str = "$") -> list[str]:
    """A draft-2020-12 subset validator: exactly the keywords manifest.schema.json uses."""
    if "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/$defs/"), ref
        node = {**root["$defs"][ref.split("/")[-1]], **{k: x for k, x in node.items() if k != "$ref"}}
    errs: list[str] = []
    if "type" in node:
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        if not any(_type_ok(v, t) for t in types):
            return [f"{path}: type"]
    if "const" in node and not (v == node["const"] and type(v) is type(node["const"])):
        errs.append(f"{path}: const")
    if "enum" in node and not any(v == e and type(v) is type(e) for e in node["enum"]):
        errs.append(f"{path}: enum")
    if "minimum" in node and isinstance(v, (int, float)) and not isinstance(v, bool) and v < node["minimum"]:
        errs.append(f"{path}: minimum")
    if "oneOf" in node:
        ok = sum(1 for sub in node["oneOf"] if not schema_errors(v, sub, root, path))
        if ok != 1:
            errs.append(f"{path}: oneOf matched {ok}")
    if isinstance(v, dict):
        props = node.get("properties", {})
        for r in node.get("required", []):
            if r not in v:
                errs.append(f"{path}.{r}: required")
        for k, x in v.items():
            if k in props:
                errs.extend(schema_errors(x, props[k], root, f"{path}.{k}"))
            elif node.get("additionalProperties") is False:
                errs.append(f"{path}.{k}: additional")
            elif isinstance(node.get("additionalProperties"), dict):
                errs.extend(schema_errors(x, node["additionalProperties"], root, f"{path}.{k}"))
    if isinstance(v, list):
        if "minItems" in node and len(v) < node["minItems"]:
            errs.append(f"{path}: minItems")
        if node.get("uniqueItems") and len({json.dumps(x, sort_keys=True) for x in v}) != len(v):
            errs.append(f"{path}: uniqueItems")
        if isinstance(node.get("items"), dict):
            for i, x in enumerate(v):
                errs.extend(schema_errors(x, node["items"], root, f"{path}[{i}]"))
    return errs


def manifest_invalid(data: bytes) -> str | None:
    """Why ``data`` is not a valid manifest (not UTF-8 JSON, or schema violations), else None."""
    from reshard.paths import formats_root

    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return f"not JSON ({type(exc).__name__})"
    schema = json.loads((formats_root() / "manifest.schema.json").read_text())
    errs = schema_errors(doc, schema, schema)
    return "; ".join(errs[:3]) if errs else None


def _needed_end(items: list[Item], file: str) -> int:
    return max(it.offset + it.length for it in items if it.file == file)


def expect_two(m: Mutation, original: bytes, mutated: bytes, items: list[Item]) -> dict[str, str]:
    """Commands that must exit 2 for this mutation -> why (decided without reshard's reader)."""
    if mutated == original:
        return {}
    why: dict[str, str] = {}
    if m.target == "metadata":
        if metadata_loads(mutated) is None:
            for c in ("inspect", "inspect_deep", "plan", "convert", "verify"):
                why[c] = ".metadata no longer decodes to a DCP Metadata"
    elif m.target == "truncate":
        if len(mutated) < _needed_end(items, m.file):
            for c in ("inspect", "inspect_deep", "plan", "convert"):
                why[c] = f"{m.file} cut below the byte ranges its items need"
    elif m.target == "zip_signature":
        why["inspect_deep"] = f"zip signature of item '{m.key}' damaged"
    elif m.target == "manifest":
        bad = manifest_invalid(mutated)
        if bad:
            for c in ("inspect", "inspect_deep", "plan", "convert"):
                why[c] = f"manifest.json invalid: {bad}"
    elif m.target in ("zip_header",) and len(mutated) != len(original):
        # bytes inserted/deleted inside an item: the file is shorter than the items need, or
        # the item's own zip no longer ends where its byte range does
        if len(mutated) < _needed_end(items, m.file):
            for c in ("inspect", "inspect_deep", "plan", "convert"):
                why[c] = f"{m.file} shorter than its items need"
        else:
            why["inspect_deep"] = f"item '{m.key}' shifted inside its byte range"
    return why


# ----------------------------------------------------------------------------- running

def subprocess_runner(timeout: float = 60.0, python: str = sys.executable) -> Runner:
    env = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}

    def run(args: list[str]) -> tuple[int, str, str]:
        try:
            p = subprocess.run([python, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                               timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return -999, "", f"TIMEOUT after {timeout} s"
        return p.returncode, p.stdout, p.stderr

    return run


def inprocess_runner() -> Runner:
    from reshard.cli import main

    def run(args: list[str]) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([str(a) for a in args])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        return code, out.getvalue(), err.getvalue()

    return run


def command_args(cmd: str, src: Path, mutated: Path, dst: Path) -> list[str]:
    return {"inspect": ["inspect", mutated], "inspect_deep": ["inspect", "--deep", mutated],
            "plan": ["plan", mutated, "--to", TO], "convert": ["convert", mutated, dst, "--to", TO],
            "verify": ["verify", src, mutated]}[cmd]


def _committed(parent: Path) -> list[str]:
    return sorted(str(p.relative_to(parent)) for p in parent.rglob("*") if p.name in (".metadata", "manifest.json"))


def check_result(cmd: str, code: int, out: str, err: str, *, need_two: str | None, dst_parent: Path | None) -> list[str]:
    """Property violations of one command run (empty = fine)."""
    bad = []
    if code == -999:
        return [f"{cmd}: {err}"]
    if code not in (0, 1, 2):
        bad.append(f"{cmd}: exit {code} not in {{0,1,2}}")
    if "Traceback" in err or "Traceback" in out:
        bad.append(f"{cmd}: traceback printed")
    text = err.strip()
    if text:
        if not text.startswith("error:"):
            bad.append(f"{cmd}: stderr does not start with 'error:': {text[:200]!r}")
        if "\n\n" in text or "\n \n" in text:
            bad.append(f"{cmd}: stderr error is more than one paragraph")
    if need_two and code != 2:
        bad.append(f"{cmd}: exit {code}, expected 2 ({need_two}); stderr: {text[:300]!r}")
    if cmd == "convert" and dst_parent is not None and code != 0:
        left = _committed(dst_parent)
        if left:
            bad.append(f"convert: exit {code} but committed output left behind: {left}")
    return bad


@dataclass
class CaseResult:
    mutation: Mutation
    codes: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)  # "error: unexpected ..." (last-resort handler)
    need_two: dict[str, str] = field(default_factory=dict)


def run_case(src: Path, items: list[Item], mutation: Mutation, work: Path, runner: Runner,
             commands: tuple[str, ...] = COMMANDS) -> CaseResult:
    """Copy ``src``, apply ``mutation``, run ``commands``; ``work`` must be an empty scratch directory."""
    ck = work / "mutated"
    shutil.copytree(src, ck)
    original = (src / mutation.file).read_bytes()
    mutated = apply_ops(original, mutation.ops)
    (ck / mutation.file).write_bytes(mutated)
    res = CaseResult(mutation, need_two=expect_two(mutation, original, mutated, items))
    for cmd in commands:
        parent = work / f"out_{cmd}"
        parent.mkdir()
        dst = parent / "dst"
        code, out, err = runner(command_args(cmd, src, ck, dst))
        res.codes[cmd] = code
        res.failures += check_result(cmd, code, out, err, need_two=res.need_two.get(cmd),
                                     dst_parent=parent if cmd == "convert" else None)
        if "error: unexpected" in err and not any(k in err for k in KNOWN_UNEXPECTED):
            res.unexpected.append(f"{cmd}: {err.strip()[:300]}")
    return res


# ----------------------------------------------------------------------------- hostile structures
# Inputs an attacker builds rather than flips (issue 13): files that are not what their names
# say (FIFOs, /dev/zero, symlinks out of or inside the checkpoint), chunk layouts that cost a
# naive checker quadratic time, item lengths that contradict their chunks, nesting that
# exhausts a recursive parser, and `.metadata` that amplifies in memory. Each builder plants
# one structure into a checkpoint directory and says what a safe reader must do with it.
# tests/test_fuzz.py draws them with hypothesis; scripts/bench_hostile.py grows them.

INPUT_FILES = (".metadata", "__0_0.distcp", "manifest.json", "reshard-report.json")
SPECIAL_KINDS = ("fifo", "dev_zero", "symlink_out", "symlink_out_relative", "symlink_in", "symlink_in_chain")
NOT_READ = ("reshard-report.json",)  # a report is never evidence: no command reads a source's report
STAIR_KEY = "model.stair.weight"


@dataclass(frozen=True)
class Structure:
    """One planted structure: what it is, the file a refusal must name, the exit code a safe
    ``inspect`` gives (0 benign, 2 refused), and the key a refusal must name (if any)."""

    what: str
    file: str
    expect: int
    key: str | None = None
    fifo: Path | None = None  # a FIFO planted in the checkpoint (a runner may need to unblock it)


def plant_special(ck: Path, name: str, kind: str, *, outside: Path) -> Structure:
    """Replace input file ``name`` of checkpoint ``ck`` by a special file of ``kind``.

    ``outside`` is a directory outside ``ck`` (another, private checkpoint): a symlink out
    points at a real copy of the same file there, so only the symlink check can refuse it.
    A missing ``reshard-report.json`` is created first (a converted checkpoint has one).
    """
    p = ck / name
    if not p.exists() and name == "reshard-report.json":
        p.write_text(json.dumps({"format_version": 1, "source": str(ck), "keys": {}}) + "\n")
    read = name not in NOT_READ
    fifo = None
    if kind == "fifo":
        p.unlink()
        os.mkfifo(p)
        fifo = p
    elif kind == "dev_zero":
        p.unlink()
        os.symlink("/dev/zero", p)
    elif kind in ("symlink_out", "symlink_out_relative"):
        outside.mkdir(parents=True, exist_ok=True)
        shutil.move(str(p), str(outside / name))
        os.symlink(outside / name if kind == "symlink_out" else os.path.relpath(outside / name, ck), p)
    elif kind in ("symlink_in", "symlink_in_chain"):
        store = ck / "store"
        store.mkdir(exist_ok=True)
        shutil.move(str(p), str(store / name))
        if kind == "symlink_in":
            os.symlink(os.path.join("store", name), p)
        else:
            os.symlink(name, store / ("link-" + name))          # store/link-X -> store/X
            os.symlink(os.path.join("store", "link-" + name), p)
        return Structure(f"{name} is a symlink inside the checkpoint ({kind})", name, 0)
    else:
        raise ValueError(kind)
    return Structure(f"{name} is {kind}", name, 2 if read else 0, fifo=fifo)


def rewrite_metadata(ck: Path, change: Callable[[Any], None]) -> None:
    """Load ``ck/.metadata`` with torch's own reader, let ``change`` edit the Metadata, write it back."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ck)).read_metadata()
    change(md)
    tmp = ck / ".metadata.new"
    tmp.write_bytes(pickle.dumps(md))
    os.replace(tmp, ck / ".metadata")


def staircase_chunks(n: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """``2n`` chunks tiling an ``(n + 1, n)`` tensor: column ``i`` cut after row ``i``.

    Every upper chunk starts at row 0 and spans a different number of rows, so a sweep along
    dim 0 keeps ``n`` chunks active at once: a pairwise check is quadratic."""
    out = []
    for i in range(n):
        out += [((0, i), (i + 1, 1)), ((i + 1, i), (n - i, 1))]
    return out


def _damage_chunks(md: Any, key: str, damage: str) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    tm = md.state_dict_metadata[key]
    chunks = tm.chunks
    k = len(chunks) // 2 + 1  # an upper... or lower chunk near the middle
    c = chunks[k]
    if damage == "gap":
        del chunks[k]
        md.storage_data.pop(MetadataIndex(key, c.offsets), None)
        return
    if damage == "overlap":  # a chunk one row longer runs into the chunk below it
        new = ChunkStorageMetadata(offsets=c.offsets, sizes=type(c.sizes)((c.sizes[0] + 1, c.sizes[1])))
        if c.offsets[0] + new.sizes[0] > tm.size[0]:
            new = ChunkStorageMetadata(offsets=type(c.offsets)((c.offsets[0] - 1, c.offsets[1])), sizes=new.sizes)
    elif damage == "out_of_bounds":
        new = ChunkStorageMetadata(offsets=type(c.offsets)((c.offsets[0], tm.size[1])), sizes=c.sizes)
    else:
        raise ValueError(damage)
    chunks[k] = new
    info = md.storage_data.pop(MetadataIndex(key, c.offsets))
    md.storage_data[MetadataIndex(key, new.offsets)] = info


def write_staircase(out: Path, n: int, *, damage: str | None = None, ranks: int = 1) -> Structure:
    """A real checkpoint (`reshard.storage.checkpoints.dcp_writer.DcpWriter`, DCP's on-disk format) of one uint8
    tensor in a staircase of ``2n`` chunks over ``ranks`` files; ``damage`` (``gap``,
    ``overlap``, ``out_of_bounds``) then edits its `.metadata` with torch's own classes."""
    import torch

    from reshard.storage.checkpoints.dcp_writer import DcpWriter

    out.mkdir(parents=True, exist_ok=True)
    w = DcpWriter(out)
    w.declare_tensor(STAIR_KEY, (n + 1, n), torch.uint8)
    for j, (o, s) in enumerate(staircase_chunks(n)):
        w.write_chunk(j % ranks, STAIR_KEY, o, torch.full(s, j % 251, dtype=torch.uint8))
    w.finish(sync_data=False)
    if damage is None:
        return Structure(f"a staircase of {2 * n} chunks", ".metadata", 0)
    rewrite_metadata(out, lambda md: _damage_chunks(md, STAIR_KEY, damage))
    return Structure(f"a staircase of {2 * n} chunks with {damage}", ".metadata", 2, key=STAIR_KEY)


def forge_staircase(out: Path, n: int, *, damage: str | None = None) -> Structure:
    """A forged `.metadata` (torch's classes, pickled as DCP does) declaring a uint8 staircase
    of ``2n`` chunks whose items all alias one ``n + 1``-byte range of a tiny data file:
    declares ~n^2 bytes in n bytes on disk, for measuring the coverage check at 20,000 chunks
    without writing the data. Not a valid checkpoint for ``--deep``."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

    out.mkdir(parents=True, exist_ok=True)
    (out / "__0_0.distcp").write_bytes(bytes(n + 1))
    chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in staircase_chunks(n)]
    storage = {MetadataIndex(STAIR_KEY, c.offsets): _StorageInfo("__0_0.distcp", 0, n + 1) for c in chunks}
    md = Metadata(state_dict_metadata={STAIR_KEY: TensorStorageMetadata(TensorProperties(dtype=torch.uint8),
                                                                         torch.Size((n + 1, n)), chunks)},
                  storage_data=storage, planner_data={STAIR_KEY: ("model", "stair.weight")})
    if damage is not None:
        _damage_chunks(md, STAIR_KEY, damage)
    (out / ".metadata").write_bytes(pickle.dumps(md))
    return Structure(f"a forged staircase of {2 * n} chunks" + (f" with {damage}" if damage else ""), ".metadata",
                     0 if damage is None else 2, key=STAIR_KEY if damage else None)


def forge_item_lengths(ck: Path, factor: int, *, key: str | None = None) -> Structure:
    """Declare tensor ``key`` (default: the one with the most elements) ``factor`` times longer
    along dim 0, chunks scaled with it (still an exact tiling), items left as they are: each
    item is then shorter than the elements its chunk declares (the 128 GiB in 8 KiB items)."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    chosen: list[str] = []

    def change(md: Any) -> None:
        tensors = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata) and len(v.size)}
        k = key or max(tensors, key=lambda q: (tensors[q].size.numel(), q))
        chosen.append(k)
        tm = tensors[k]
        scale = lambda t: torch.Size((t[0] * factor,) + tuple(t[1:]))  # noqa: E731
        tm.size = scale(tm.size)
        new = []
        for c in tm.chunks:
            info = md.storage_data.pop(MetadataIndex(k, c.offsets))
            nc = ChunkStorageMetadata(offsets=scale(c.offsets), sizes=scale(c.sizes))
            md.storage_data[MetadataIndex(k, nc.offsets)] = info
            new.append(nc)
        tm.chunks = new

    rewrite_metadata(ck, change)
    return Structure(f"'{chosen[0]}' declared {factor}x longer than its items", ".metadata", 2, key=chosen[0])


def nested_json(depth: int, *, form: str = "list", inside: dict | None = None) -> bytes:
    """JSON nested ``depth`` levels (``list``: ``[[[...]]]``, ``dict``: ``{"a": {"a": ...}}``),
    alone or as the value of one field of the document ``inside``."""
    opener, closer = ("[", "]") if form == "list" else ('{"a": ', "}")
    core = opener * depth + "0" + closer * depth
    if inside is None:
        return core.encode()
    doc = json.dumps(dict(inside, notes="@@"))
    return doc.replace('"@@"', core).encode()


def plant_nested_manifest(ck: Path, depth: int, *, form: str = "list", wrap: bool = False) -> Structure:
    """``manifest.json`` made of (or, with ``wrap``, holding one field of) ``depth``-deep nesting."""
    p = ck / "manifest.json"
    inside = json.loads(p.read_text()) if wrap and p.exists() else None
    p.write_bytes(nested_json(depth, form=form, inside=inside))
    return Structure(f"manifest.json nested {depth} deep ({form}{', inside the manifest' if wrap else ''})",
                     "manifest.json", 2)


def amplifying_metadata(out: Path, target_bytes: int) -> Structure:
    """A `.metadata` of about ``target_bytes``, built only from the globals DCP's pickles use
    (the allow-list), whose tensors all share one memoised chunk list: ``K`` tensors and ``M``
    chunks cost ``K + M`` records in the file but ``K * M`` chunks to a reader that decodes
    each tensor's list. Every chunk points at a missing storage entry, so a reader that does
    not amplify still refuses it (exit 2)."""
    import torch
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    out.mkdir(parents=True, exist_ok=True)
    # ~60 bytes per chunk record, ~45 per tensor entry: K = M fills the target
    m = max(1, target_bytes // 105)
    chunks = [ChunkStorageMetadata(offsets=torch.Size((i, 0)), sizes=torch.Size((1, 4))) for i in range(m)]
    props = TensorProperties(dtype=torch.float32)
    size = torch.Size((m, 4))
    sdm = {f"t{i}": TensorStorageMetadata(props, size, chunks) for i in range(m)}
    data = pickle.dumps(Metadata(state_dict_metadata=sdm, storage_data={}, planner_data={}), protocol=2)
    (out / ".metadata").write_bytes(data)
    return Structure(f"an amplifying .metadata of {len(data):,} bytes ({m} tensors x {m} shared chunks)", ".metadata", 2)


def check_structure(s: Structure, code: int, out: str, err: str) -> list[str]:
    """Property violations of ``inspect`` on a planted structure (empty = safe)."""
    bad = check_result("inspect", code, out, err, need_two=s.what if s.expect == 2 else None, dst_parent=None)
    if s.expect == 0 and code != 0:
        bad.append(f"inspect: exit {code} on a benign structure ({s.what}); stderr: {err.strip()[:300]!r}")
    if s.expect == 2:
        text = out + err
        if s.file not in text:
            bad.append(f"inspect: the output does not name {s.file}: {text.strip()[:300]!r}")
        if s.key and s.key not in text:
            bad.append(f"inspect: the output does not name the key {s.key}: {text.strip()[:300]!r}")
        if "error: unexpected" in err:
            bad.append(f"inspect: the last-resort handler answered: {err.strip()[:300]!r}")
    return bad


def make_source(out: Path) -> Path:
    from reshard.reference import TrainConfig, run_reference

    cfg = TrainConfig(dp=4, tp=1, steps=3, save_at=[3], out=str(out), log=str(out / "steps.jsonl"),
                      experiment_id="fuzz")
    return run_reference(cfg)[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt", type=Path, default=None, help="a committed checkpoint with manifest.json (default: train one)")
    ap.add_argument("--target", choices=TARGETS, default=None, help="mutate only this input")
    ap.add_argument("--subprocess", action="store_true", help="run every command as `python -m reshard` (slow)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--allow-unexpected", action="store_true",
                    help="do not count 'error: unexpected ...' (the CLI's last-resort handler) as a failure")
    ap.add_argument("--verbose", "-v", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="reshard-fuzz-") as tmp:
        tmp = Path(tmp)
        src = a.ckpt if a.ckpt else make_source(tmp / "source")
        items = item_regions(src)
        runner = subprocess_runner(a.timeout) if a.subprocess else inprocess_runner()
        rnd = random.Random(a.seed)
        tried = failed = unexpected = 0
        by_target: dict[str, list[int]] = {}
        t0 = time.time()
        for i in range(a.cases):
            m = draw_mutation(rnd, src, items, a.target)
            work = tmp / f"case{i}"
            work.mkdir()
            r = run_case(src, items, m, work, runner)
            shutil.rmtree(work, ignore_errors=True)
            tried += 1
            fails = r.failures + ([] if a.allow_unexpected else r.unexpected)
            unexpected += bool(r.unexpected)
            st = by_target.setdefault(m.target, [0, 0])
            st[0] += 1
            st[1] += bool(fails)
            if fails:
                failed += 1
                print(f"FAIL case {i}: {m.describe()}\n  " + "\n  ".join(fails), flush=True)
            elif r.unexpected:
                print(f"note case {i}: last-resort handler: {m.describe()}\n  " + "\n  ".join(r.unexpected), flush=True)
            elif a.verbose:
                print(f"ok   case {i}: {m.describe()} -> {r.codes}", flush=True)
        print(f"tried {tried} failed {failed} (unexpected-error cases {unexpected}) in {time.time() - t0:.0f} s; "
              + ", ".join(f"{k}: {v[0]} tried {v[1]} failed" for k, v in sorted(by_target.items())))
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
