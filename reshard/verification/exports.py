"""An export compared with its source: `reshard verify SRC HF_EXPORT`.

A Hugging Face export holds other names, transformed weights and a ``config.json``, so it
cannot be compared key for key like two checkpoints (`reshard.verification.checkpoints`):
what it should hold is re-derived from the source with the same plan the export made
(`reshard.planning.export`), never read from what the export says of itself. This module is
that comparison; `hf_export_sides` tells `reshard.verification.checkpoints` when to run it.
`read_cast` is the one way an exported item's value is derived from the source, used by the
writer (`reshard.engine.export`) and by this comparison alike.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.errors import BadInput, Incomplete, Infeasible
from reshard.storage.source import Source
from reshard.planning.export import (DTYPES, HF_CONFIG, ExportItem, dtype_arg, hf_plan, plan_export, source_report,
                                     tied_groups)

if TYPE_CHECKING:
    import torch


def hf_export_sides(a: Path, b: Path) -> tuple[Path, Path] | None:
    """(source, export) when exactly one side is a Hugging Face model directory and the other a checkpoint.

    A Hugging Face directory is safetensors weights with a ``config.json`` beside them (what
    ``--format hf`` writes and ``from_pretrained`` reads); a plain safetensors export has none
    and is compared by `reshard.verification.checkpoints` as before.
    """
    from reshard.storage.checkpoints.safetensors_format import is_export

    def hf(p: Path) -> bool:
        return p.is_dir() and is_export(p) and os.path.lexists(p / HF_CONFIG)

    ha, hb = hf(Path(a)), hf(Path(b))
    if ha == hb:
        return None
    return (Path(b), Path(a)) if ha else (Path(a), Path(b))


def compare_hf_export(src: Source | Path, exp: Path, *, a: Path | str, b: Path | str, rtol: float = 0.0,
                      atol: float = 0.0) -> dict[str, Any]:
    """`reshard verify SRC HF_EXPORT`: the export re-derived from SRC through the same declared transforms.

    Nothing the export says about itself is evidence of what it should hold: the names, the
    transforms, the trimmed rows and the tied copies are recomputed from the source with the
    family's mapping (`hf_plan`, exactly as `export` does). What the source cannot know (head
    counts, norm epsilon, RoPE values) is taken from the export's ``config.json``, the values the
    weights are then checked under, and listed in ``notes``; the recomputed ``config.json``
    fields must equal the export's. The dtype is the export's recorded ``--dtype`` (an option,
    like a conversion's plan options), else the source's. Then every tensor is compared bit for
    bit (or within ``rtol``/``atol``). The result has `reshard.verification.checkpoints`'s shape.
    """
    from reshard import safefs
    from reshard.semantics.conventions import classify, reshard_key
    from reshard.semantics.hf import mapping_for
    from reshard.semantics.manifest import read_manifest
    from reshard.semantics.rules import select
    from reshard.storage.checkpoints.local_format import open_any
    from reshard.storage.checkpoints.safetensors_format import ExportIndex

    import torch  # an export's values are compared decoded

    diffs: list[dict[str, Any]] = []
    notes: list[str] = []
    source = Source.of(src)  # a store's reader handed its own `RemoteCheckpoint`
    src = source.root
    ix = open_any(src, source_key=reshard_key, remote=source.remote)
    errors = [f for f in ix.findings if f.severity == "error"]
    if errors:
        raise Incomplete(f"the checkpoint is incomplete: {errors[0].message}", where=str(src))
    m = read_manifest(src)
    mdict = m.to_dict() if m is not None else {}
    cls = classify(((k, e.kind) for k, e in ix.entries.items()), prefer=mdict.get("key_convention"))
    ex = ExportIndex(exp, keys="stored")
    root = safefs.resolve_root(exp)
    cfg = safefs.read_json(root / HF_CONFIG, root=root, what="Hugging Face config.json")
    if not isinstance(cfg, dict):
        raise BadInput(f"{HF_CONFIG} is not a JSON object", where=str(exp / HF_CONFIG))
    params = sorted(r.param for k, r in cls.roles.items() if r.role == "parameter" and r.param and ix.entries[k].is_tensor)
    family = (mdict.get("model") or {}).get("family")
    mapping = mapping_for(select(params, family=family if isinstance(family, str) else None).family)
    from_config = mapping.values_from_config(cfg, where=str(exp / HF_CONFIG))
    asked = {a.name: from_config[a.name] for a in mapping.asks if a.name in from_config}
    notes.append("checked under the export's config.json values the checkpoint cannot hold: "
                 + ", ".join(f"{k}={v}" for k, v in sorted(asked.items())))
    recorded = ex.source_essentials().get("dtype")
    dtype = dtype_arg(recorded) if isinstance(recorded, str) and recorded.lower() in DTYPES else None
    given = ex.source_essentials().get("ties_given")  # an option of the export (the profile's tie), checked again here
    plan = plan_export(ix, cls, mdict, only="model", dtype=dtype, rules=None, found=tied_groups(source_report(source)),
                       given=given if isinstance(given, list) else [], given_where="the export's recorded ties_given")
    hf = hf_plan(src, ix, cls, mdict, plan, asked, dtype)
    for k in sorted(set(hf.config) | set(cfg)):
        if k == "dtype":
            continue
        if hf.config.get(k) != cfg.get(k):
            diffs.append({"key": f"{HF_CONFIG}:{k}", "kind": "config",
                          "detail": f"recomputed from the source {hf.config.get(k)!r}, export has {cfg.get(k)!r}",
                          "a": hf.config.get(k), "b": cfg.get(k)})
    expected = {it.name: it for it in plan.items}
    elements = nbytes = 0
    for name, it in expected.items():
        if name not in ex.entries:
            diffs.append({"key": name, "kind": "missing", "detail": f"the export of '{it.key}' is not in the export"})
            continue
        want = read_cast(ix, it)
        got = ex.read_tensor(name)
        if tuple(got.shape) != tuple(want.shape):
            diffs.append({"key": name, "kind": "shape", "detail": f"{list(want.shape)} expected, {list(got.shape)} stored",
                          "a": list(want.shape), "b": list(got.shape)})
        elif got.dtype != want.dtype and not (rtol or atol):
            diffs.append({"key": name, "kind": "dtype", "detail": f"{want.dtype} expected, {got.dtype} stored",
                          "a": str(want.dtype), "b": str(got.dtype)})
        else:
            if rtol or atol:
                close = torch.isclose(want.double(), got.double(), rtol=rtol, atol=atol, equal_nan=True)
            else:
                close = want.reshape(-1).view(torch.uint8).reshape(want.numel(), -1) == \
                    got.reshape(-1).view(torch.uint8).reshape(got.numel(), -1)
                close = close.all(dim=-1).reshape(want.shape) if want.numel() else close
            bad = int((~close).sum()) if want.numel() else 0
            if bad:
                first = tuple(int(i) for i in (~close).nonzero()[0])
                diffs.append({"key": name, "kind": "value", "detail": f"{bad} of {want.numel()} elements differ "
                              f"(first at {list(first)}: {want[first].item()!r} expected, {got[first].item()!r} stored)",
                              "index": list(first), "a": want[first].item(), "b": got[first].item(), "count": bad,
                              "numel": want.numel()})
            elements += want.numel()
            nbytes += want.numel() * want.element_size()
        del want, got
    for name in sorted(set(ex.entries) - set(expected)):
        if name in plan.copies:
            stored_as = ex.stored.get(name, ("", name))[1]  # a copy the header ties reads the stored tensor
            notes.append(f"{name}: a tied copy of '{plan.copies[name][1]}', "
                         + ("stored although the export writes it once" if stored_as == name else "not stored (written once)"))
            continue
        diffs.append({"key": name, "kind": "unexpected", "detail": "stored in the export, not an export of any source parameter"})
    return {
        "equal": not diffs, "a": str(a), "b": str(b),
        "compared": {"tensors": len(expected), "objects": 0, "elements": elements, "bytes": nbytes},
        "differences": diffs, "rewritten": [], "notes": notes,
        "evidence": f"the export of {src} re-derived with {mapping.source} (names, transforms, config.json)",
        "tolerance": {"rtol": rtol, "atol": atol}, "exit_code": 0 if not diffs else 1,
    }


def read_cast(ix, it: ExportItem) -> "torch.Tensor":
    """The exported value of ``it``: read from ``ix``, checked against the planned source dtype and shape,
    transformed (``make``) and cast; what the export writes and what `reshard verify` compares it with."""
    t = ix.read_tensor(it.key)
    src_shape = it.src_shape if it.src_shape is not None else it.shape
    if t.dtype != it.src_dtype.torch or tuple(t.shape) != src_shape:
        raise Infeasible(f"'{it.key}' reads as {t.dtype}{tuple(t.shape)}, expected {it.src_dtype}{list(src_shape)}",
                         where=str(ix.root), hint="The checkpoint is corrupt.")
    if it.make is not None:
        t = it.make(t)
    if t.dtype != it.dtype.torch:
        t = t.to(it.dtype.torch)
    return t.contiguous()
