"""Rewrite a DCP checkpoint item by item through reshard's own reader/writer.

Used for the rehearsal's *control* checkpoint (the naive resume: fresh Adam moments, a
per-rank local data position replayed on another world size) and by tests that break a
converted checkpoint on purpose. Every item not named is copied byte for byte, in the same
rank files and chunking as the source; the source is never modified.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from reshard.errors import BadInput
from reshard.safefs import loads_json
from reshard.storage.checkpoints.index import RANK_FILE, CheckpointIndex
from reshard.storage.checkpoints import dcp as dcp_io
from reshard.storage.checkpoints.dcp_writer import DcpWriter
from reshard.semantics.manifest import MANIFEST_NAME, Manifest, write_manifest

MOMENT = re.compile(r"^optim\.state\.(?P<param>.+)\.(?P<name>exp_avg|exp_avg_sq)$")
STEP = re.compile(r"^optim\.state\.(?P<param>.+)\.step$")
SIDECARS = (MANIFEST_NAME, "reshard-report.json", "reshard-report.md")


def _rank(file: str) -> int:
    m = RANK_FILE.match(file)
    if not m:
        raise BadInput(f"data file '{file}' does not follow DCP's __<rank>_<n>.distcp naming")
    return int(m.group(1))


def rewrite_checkpoint(src: str | Path, dst: str | Path, *,
                       tensor_fn: Callable[[str], Callable[[torch.Tensor], torch.Tensor] | None] | None = None,
                       objects: dict[str, Any] | None = None, drop: Iterable[str] = (),
                       manifest_fn: Callable[[dict], dict] | None = None) -> Path:
    """Copy ``src`` into the new directory ``dst`` with some items changed.

    ``tensor_fn(key)`` returns a function applied to every stored chunk of that tensor (it
    must keep shape and dtype), or None to copy the key verbatim; ``objects`` maps object
    keys to new values; ``drop`` lists keys left out; ``manifest_fn`` edits the manifest
    (as a dict; the result is validated). Returns ``dst``.
    """
    src, dst = Path(src), Path(dst)
    ix = CheckpointIndex.open(src)
    if not ix.complete:
        raise BadInput("cannot rewrite an incomplete checkpoint", where=str(src))
    objects = dict(objects or {})
    drop = set(drop)
    unknown = (set(objects) | drop) - set(ix.entries)
    if unknown:
        raise BadInput(f"keys not in the checkpoint: {sorted(unknown)}", where=str(src))
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    w = DcpWriter(dst)
    for key, e in ix.entries.items():
        if key in drop:
            continue
        if e.is_tensor:
            fn = tensor_fn(key) if tensor_fn else None
            w.declare_tensor(key, e.shape, e.dtype, path=e.path or None)
            for ch in e.chunks:
                rank = _rank(ch.location.file)
                if fn is None:
                    w.write_chunk_bytes(rank, key, ch.box.offsets, ch.box.sizes,
                                        dcp_io.read_item_bytes(ix.root, ch.location, key=key))
                else:
                    t = dcp_io.load_item(ix.root, ch.location, key=key)
                    new = fn(t)
                    if tuple(new.shape) != tuple(t.shape) or new.dtype != t.dtype:
                        raise BadInput(f"rewriting '{key}' changed its chunk from {t.dtype} {tuple(t.shape)} to "
                                       f"{new.dtype} {tuple(new.shape)}")
                    w.write_chunk(rank, key, ch.box.offsets, new.contiguous())
        else:
            rank = _rank(e.location.file)
            if key in objects:
                w.write_object(rank, key, objects[key], path=e.path or None)
            else:
                w.write_object_bytes(rank, key, dcp_io.read_item_bytes(ix.root, e.location, key=key),
                                     path=e.path or None)
    w.finish()
    for name in SIDECARS:
        if (src / name).exists():
            if name == MANIFEST_NAME:
                # A rewritten checkpoint has other bytes: the source's item checksums do not apply.
                d = loads_json((src / name).read_bytes(), where=str(src / name), what="manifest")
                d.pop("integrity", None)
                if manifest_fn is not None:
                    d = manifest_fn(d)
                write_manifest(dst, Manifest.from_dict(d, source=str(dst / name)))
            else:
                shutil.copy2(src / name, dst / name)
    return dst


def zero_moments(key: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``tensor_fn`` for a fresh Adam: zero exp_avg / exp_avg_sq and the step counters."""
    if MOMENT.match(key) or STEP.match(key):
        return torch.zeros_like
    return None


def naive_cursor(global_cursor: int, source_dp: int, target_dp: int) -> int:
    """Where a strided per-rank sampler lands when its LOCAL count is replayed on another
    world size: each source rank consumed ``global_cursor / source_dp`` samples; on
    ``target_dp`` ranks that count stands for ``local * target_dp`` global samples (fewer
    when shrinking: samples repeat; more when growing: samples are skipped)."""
    return (global_cursor // source_dp) * target_dp


def make_control(src: str | Path, dst: str | Path, *, source_dp: int, target_dp: int) -> dict[str, Any]:
    """The naive-resume checkpoint: model weights, scheduler and counters as saved, Adam
    moments and step counters reset (a fresh optimizer), data cursor replayed per rank."""
    ix = CheckpointIndex.open(src)
    if "data.sampler.cursor" not in ix.entries:
        raise BadInput("the source has no data.sampler.cursor (not the reference trainer's 'reshard' convention)",
                       where=str(src))
    before = int(ix.read_object("data.sampler.cursor"))
    after = naive_cursor(before, source_dp, target_dp)
    moments = sorted(k for k in ix.entries if MOMENT.match(k))

    def edit(m: dict) -> dict:
        m["data"]["cursor"] = after
        return m

    rewrite_checkpoint(src, dst, tensor_fn=zero_moments, objects={"data.sampler.cursor": after}, manifest_fn=edit)
    return {"path": str(dst), "cursor_before": before, "cursor_after": after,
            "moments_reset": len(moments),
            "how": (f"copy of the source checkpoint with every exp_avg/exp_avg_sq and optimizer step counter zeroed "
                    f"(a fresh AdamW) and data.sampler.cursor {before} -> {after} = ({before} / source dp {source_dp}) "
                    f"x target dp {target_dp}, the local position of one source rank replayed on the new world size; "
                    "model weights, LR scheduler and trainer counters as saved; loaded directly by the trainer on the "
                    "target topology (DCP reshards on load)")}
