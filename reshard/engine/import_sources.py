"""What an import reads: consolidated weights (safetensors, torch.save, a Hugging Face model directory) as a
list of source tensors, each with the reshard key it becomes and a function that reads any box of it.

The import run (`reshard.engine.importing`) lays these tensors out for a target and writes
them; how each kind of source is found, opened safely and named is here, apart from the
writing, so that each stays readable on its own.

Sources
-------
* safetensors: a single ``.safetensors`` file, a directory with
  ``model.safetensors.index.json``, a directory with ``model.safetensors`` or with
  Hugging Face shards (read through `reshard.storage.checkpoints.safetensors_format.ExportIndex`, box by box
  with ``get_slice``: memory is bounded by the largest target chunk);
* torch: a ``torch.save`` file (``.pt``, ``.pth``, ``.bin``) holding a flat dict of tensors,
  or a directory with ``model.pt.index.json`` / ``pytorch_model.bin.index.json``
  (``weight_map``) or a single ``model.pt`` / ``pytorch_model.bin``. Loaded with
  ``torch.load(weights_only=True, mmap=True)`` only: a file that needs arbitrary unpickling
  is refused, never executed. Non-tensor values are listed in the report and not imported.

Anything else is refused (`BadInput`).

Every name accounted for
------------------------
An index is the list of what the source holds, and the import takes nothing else and drops
nothing of it: every ``weight_map`` entry is loaded from a file inside the source (a name with
``/`` is a file in a subdirectory; ``..``, an absolute name, or a symlink leading out is
refused naming the entry), every tensor of every file the index names must be listed for
that file, and every listed name must be found in the file it is listed in. Any difference
is an error (exit 2) naming the index, the name and the shard, with the way out (fix or
regenerate the index). Every file is opened through `reshard.safefs` under the source
directory (the index JSON with `read_json`, capped in size and depth), so a FIFO, a device or
a link out is refused before torch or the safetensors reader opens anything.

Names
-----
A file written by `reshard export` carries its ``export_map`` (exported name -> source
key) and source key convention: names are mapped back through it, so renamed weights get
their original FQNs again. Otherwise (or with ``rename``) the stored name is used, after the
**inverse** of the ``rename`` rules (the same file that `reshard export --rename` used, e.g.
``formats/renames/torchtitan-to-hf-llama.toml`` turns HF names back into torchtitan ones);
``optim.<fqn>.<moment>`` becomes ``optim.state.<fqn>.<moment>``, every other name ``N``
becomes ``model.N``. Output keys follow the "reshard" convention: ``model.<fqn>``,
``optim.state.<fqn>.<moment>``. Tied copies recorded by the export (``tied``) are written
under every name of the group again (the trainer's state dict has both).

Hugging Face model directories (`hf_source`)
--------------------------------------------
A directory transformers writes (``config.json`` + safetensors) is read through the family's
mapping backwards (`reshard.semantics.hf`, `native_mapping`): every stored name must be one it
knows (strict), each weight gets the inverse of the declared transform (the rotary row order
back to torchtitan's, with the head counts of ``config.json``), tied embeddings are written
under both native names, and each parameter's TP dim comes from the family's partition rules
(``formats/models/``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from reshard.model.dtypes import DType, from_torch
from reshard.errors import BadInput, Incomplete
from reshard.model.geometry import Box
from reshard.model.topology import Topology

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
TORCH_INDEXES = ("model.pt.index.json", "pytorch_model.bin.index.json")
TORCH_SINGLES = ("model.pt", "pytorch_model.bin")


@dataclass
class SourceTensor:
    """One tensor of the source: its stored name, the key it becomes, and how any box of it is read."""

    name: str                 # as stored
    key: str                  # reshard key it becomes
    shape: tuple[int, ...]
    dtype: DType
    read: Callable[[Box], torch.Tensor]
    placement: Any = None     # the target placement when the model's partition rules decide it (--format FAMILY)


# ===================================================================================== sources
def _safetensors_source(src: Path, rename) -> tuple[list[SourceTensor], dict[str, Any], list[list[str]], list[dict]]:
    from reshard.storage.checkpoints.safetensors_format import ExportIndex

    ex = ExportIndex(src, keys="reshard", rename=rename)
    out = []
    for key, e in ex.entries.items():
        out.append(SourceTensor(ex.names[key], key, tuple(e.shape), e.dtype, (lambda b, k=key: ex.read_box(k, b))))
    return out, ex.source_essentials(), ex.tied, []


@dataclass
class _TorchFiles:
    """The torch.save files of a source and, for an indexed directory, what the index lists in each."""

    root: Path                        # real directory every file must lie in
    files: list[str]                  # relative to root
    index: dict[str, Any]             # the index JSON ({} without one)
    index_path: Path | None = None
    weight_map: dict[str, str] | None = None   # name -> file (normalised), None without an index


def _torch_files(src: Path) -> _TorchFiles:
    from reshard.safefs import resolve_root
    from reshard.storage.checkpoints.safetensors_format import read_index

    if src.is_file():
        if src.suffix not in TORCH_SUFFIXES:
            raise BadInput("not a safetensors or torch.save file", where=str(src),
                           hint="reshard import reads .safetensors files and torch.save files (.pt, .pth, .bin).")
        real = resolve_root(src)  # a file named on the command line may itself be a link: the user's choice
        return _TorchFiles(real.parent, [real.name], {})
    root = resolve_root(src)
    for name in TORCH_INDEXES:
        if os.path.lexists(src / name):  # present, whatever it is: refused by name if not a regular file inside
            ix, wm = read_index(root / name, root=root, what="torch weight map index")
            return _TorchFiles(root, sorted(set(wm.values())), ix, root / name, wm)
    for name in TORCH_SINGLES:
        if os.path.lexists(src / name):
            return _TorchFiles(root, [name], {})
    raise BadInput("no safetensors or torch weights found", where=str(src),
                   hint="Expected a .safetensors file, a directory with model.safetensors(.index.json), "
                        "or a torch.save file (model.pt, pytorch_model.bin, ...).")


def _torch_load(path: Path, root: Path) -> Any:
    """``torch.load(weights_only=True, mmap=True)`` of a file opened through `reshard.safefs`.

    The descriptor is opened first (regular file inside ``root``: a symlink out, a FIFO or a
    device is refused before torch opens anything). torch's ``mmap=True`` takes a path, not a
    file object, so torch is given ``/proc/self/fd/N``, which names the very file already
    opened and checked (a rename or a new symlink at ``path`` in between changes nothing).
    Without ``/proc``, or for the legacy (non-zip) format that cannot be mapped, torch reads the
    file object ``os.fdopen(fd)`` instead.
    """
    from reshard.safefs import open_read

    try:
        fd = open_read(path, root=root)
    except FileNotFoundError:
        raise Incomplete("weights file is missing", where=str(path)) from None
    with os.fdopen(fd, "rb") as fh:
        from reshard.storage.checkpoints.fastread import check_file_crcs

        check_file_crcs(fd, where=str(path))  # every member against its writer's CRC-32 (CorruptItem, exit 2)
        proc = f"/proc/self/fd/{fd}"
        try:
            try:
                if not os.path.exists(proc):
                    raise RuntimeError("mmap needs a path")
                return torch.load(proc, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                fh.seek(0)
                return torch.load(fh, map_location="cpu", weights_only=True)  # legacy (non-zip) torch.save format
        except Exception as exc:  # noqa: BLE001 - anything torch.load refuses: not ours to execute
            raise BadInput(f"refused: not loadable with torch.load(weights_only=True) ({str(exc).splitlines()[0][:200]})",
                           where=str(path), hint="Only plain tensor state dicts (or safetensors) are imported; "
                                                 "reshard never runs code from a pickle.") from None


def _torch_source(src: Path, rename) -> tuple[list[SourceTensor], dict[str, Any], list[list[str]], list[dict]]:
    from reshard.semantics.conventions import get_convention
    from reshard.storage.checkpoints.safetensors_format import INDEX_HINT, check_index_found, check_shard_listed, default_key

    tf = _torch_files(src)
    meta = (tf.index.get("metadata") or {}).get("reshard") or {}
    if not isinstance(meta, dict):
        meta = {}
    export_map = meta.get("export_map") if rename is None and isinstance(meta.get("export_map"), dict) else {}
    export_map = {k: v for k, v in export_map.items() if isinstance(v, str)}
    conv = get_convention(meta.get("source_convention") or "reshard") if export_map else None
    tied = [list(g) for g in (meta.get("tied") if isinstance(meta.get("tied"), list) else [])
            if isinstance(g, list) and all(isinstance(n, str) for n in g)]
    out: list[SourceTensor] = []
    skipped: list[dict] = []
    stored: dict[str, torch.Tensor] = {}
    for fname in tf.files:
        f = tf.root / fname
        try:
            d = _torch_load(f, tf.root)
        except Incomplete:
            if tf.weight_map is None:
                raise
            names = sorted(n for n, x in tf.weight_map.items() if x == fname)
            raise Incomplete(f"shard '{fname}' named by the index is missing; {len(names)} tensors lose their bytes "
                             f"(first: {names[:3]})", where=str(tf.index_path),
                             hint="Copy the missing shard in, or " + INDEX_HINT[0].lower() + INDEX_HINT[1:]) from None
        if not isinstance(d, dict):
            raise BadInput(f"holds a {type(d).__name__}, not a dict of tensors", where=str(f))
        held: set[str] = set()     # the tensors the file holds
        others: dict[str, str] = {}   # its other values -> their type (reported, not imported)
        for name, v in d.items():
            name = str(name)
            if name in held or name in others:
                raise BadInput(f"holds two values named '{name}'", where=str(f),
                               hint="Save the state dict with string keys, one per tensor.")
            if not isinstance(v, torch.Tensor):
                others[name] = type(v).__name__
                skipped.append({"name": name, "file": fname, "reason": f"{type(v).__name__}, not a tensor: not imported"})
                continue
            held.add(name)
            stored[name] = v
        if tf.weight_map is not None:  # every tensor the file holds listed by the index for it, and no listed non-tensor
            check_shard_listed(str(tf.index_path), fname, held, tf.weight_map)
            not_tensors = sorted(n for n in others if tf.weight_map.get(n) == fname)
            if not_tensors:
                raise BadInput(f"the index lists '{not_tensors[0]}' in shard '{fname}' as a weight, but it holds a "
                               f"{others[not_tensors[0]]} there, not a tensor", where=str(tf.index_path),
                               hint=INDEX_HINT)
    if tf.weight_map is not None:  # every name the index lists found, in the file it is listed in
        check_index_found(str(tf.index_path), tf.weight_map, stored)

    def key_for(name: str) -> str:
        if conv is not None and name in export_map:
            r = conv.classify(export_map[name], "tensor")
            if r.role == "parameter" and r.param:
                return "model." + r.param
            if r.role in ("optimizer_moment", "optimizer_step") and r.param:
                return f"optim.state.{r.param}.{r.name or 'step'}"
            return export_map[name]
        if rename is not None:
            if name.startswith("optim."):
                body, _, moment = name[len("optim."):].rpartition(".")
                name = f"optim.{rename.apply(body)}.{moment}"
            else:
                name = rename.apply(name)
        return default_key(name)

    names = dict(stored)
    for g in tied:
        real = next((n for n in g if n in stored), None)
        if real is not None:
            for n in g:
                names.setdefault(n, stored[real])
    for name, t in names.items():
        out.append(SourceTensor(name, key_for(name), tuple(t.shape), from_torch(t.dtype),
                        (lambda b, t=t: (t[b.slices()] if t.dim() else t).clone())))
    return out, meta, tied, skipped


# ===================================================================================== --format torchtitan
HF_CONFIG = "config.json"


def native_mapping(fmt: str):
    """The Hugging Face mapping an import to ``fmt`` reads backwards: a family name, or a trainer's convention name."""
    from reshard.semantics import hf

    if fmt in hf.shipped_families():
        return hf.mapping_for(fmt)
    found = [hf.mapping_for(f) for f in hf.shipped_families() if hf.mapping_for(f).native_convention == fmt]
    if len(found) == 1:
        return found[0]
    raise BadInput(f"unknown import format '{fmt}'" + (" (several families write it: name one)" if found else ""),
                   hint="Use --format reshard (the default), torchtitan, or a family with a Hugging Face mapping: "
                        + ", ".join(hf.shipped_families()) + ".")


class _OneTensor:
    """The last whole tensor read, so the chunks of one tensor share one read and one inverse transform."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.value: torch.Tensor | None = None

    def get(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.key != key:
            self.key, self.value = None, None
            self.value, self.key = make(), key
        assert self.value is not None
        return self.value


def hf_source(src: Path, mapping, topo: Topology) -> tuple[list[SourceTensor], dict[str, Any], list[list[str]], list[dict]]:
    """A Hugging Face model directory (``config.json`` + safetensors) under the native names of ``mapping``.

    Every stored name must be one the mapping knows (strict, as the export); the weights get the
    inverse of the declared transforms, with the head counts of ``config.json``. Tied embeddings
    (``tie_word_embeddings``, no stored ``lm_head``) are written under both native names, since
    the native model holds both. Placements come from the family's partition rules (TP dims).
    """
    from reshard import safefs
    from reshard.semantics.rules import select
    from reshard.storage.checkpoints.safetensors_format import ExportIndex, is_export

    if not src.is_dir() or not is_export(src):
        raise BadInput("not a Hugging Face model directory (safetensors weights and config.json)", where=str(src))
    root = safefs.resolve_root(src)
    if not os.path.lexists(src / HF_CONFIG):
        raise BadInput(f"no {HF_CONFIG}: the head counts the inverse rotary permutation needs are unknown",
                       where=str(src), hint="Import a directory transformers' from_pretrained loads (it has config.json).")
    cfg = safefs.read_json(root / HF_CONFIG, root=root, what="Hugging Face config.json")
    if not isinstance(cfg, dict):
        raise BadInput(f"{HF_CONFIG} is not a JSON object", where=str(src / HF_CONFIG))
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and mapping.architecture not in archs:
        raise BadInput(f"{HF_CONFIG} names {archs}, not {mapping.architecture} (the class the mapping of "
                       f"'{mapping.family}' reads)", where=str(src / HF_CONFIG))
    ex = ExportIndex(src, keys="stored")
    by_native: dict[str, tuple[str, Any]] = {}
    for name in ex.entries:
        rule, native = mapping.from_hf_name(name)
        if native in by_native:
            raise BadInput(f"'{by_native[native][0]}' and '{name}' both map to '{native}'", where=str(src))
        by_native[native] = (name, rule)
    sized = _check_config_sizes(cfg, mapping, {n: tuple(ex.entries[h].shape) for n, (h, _) in by_native.items()},
                                {n: h for n, (h, _) in by_native.items()}, str(src / HF_CONFIG))
    values = mapping.values_from_config(cfg, where=str(src / HF_CONFIG))
    if mapping.tie and cfg.get("tie_word_embeddings") and mapping.tie[1] not in ex.entries and mapping.tie[0] in ex.entries:
        rule, native = mapping.from_hf_name(mapping.tie[1])
        by_native.setdefault(native, (mapping.tie[0], rule))
    rules = select(sorted(by_native), family=mapping.family)
    cache = _OneTensor()
    out: list[SourceTensor] = []
    for native, (name, rule) in sorted(by_native.items()):
        e = ex.entries[name]
        placement = rule_placement(rules, native, tuple(e.shape), topo, str(src))

        def read(box: Box, name=name, rule=rule, native=native) -> torch.Tensor:
            t = cache.get(name, lambda: rule.from_hf(ex.read_tensor(name), values, name))
            return (t[box.slices()] if t.dim() else t).clone()

        key = native if mapping.native_convention != "reshard" else "model." + native
        out.append(SourceTensor(name, key, tuple(e.shape), e.dtype, read, placement))
    ess = {"hf_config": {k: v for k, v in cfg.items() if isinstance(v, (int, float, str, bool))},
           "hf_mapping": mapping.describe(), "model_family": mapping.family, "hf_values": values,
           "hf_values_unchecked": sized.unchecked}
    return out, ess, [], []


def rule_placement(rules, fqn: str, shape: tuple[int, ...], topo: Topology, where: str):
    """A parameter's target placement by its family's partition rules (``formats/models/``): FSDP ``Shard(0)``
    over ``dp_shard``, and the rule's TP dim when it shards and ``tp > 1``. A parameter no rule matches,
    a fused one (this import writes the native split layout), or a dim ``tp`` does not divide is refused."""
    from reshard.model.layout import Placement

    pr = rules.rule_for(fqn)
    if pr is None:
        raise BadInput(f"'{fqn}' matches no partition rule of '{rules.family}'", where=rules.source)
    if pr.tp == "fused":
        raise BadInput(f"'{fqn}' is fused in the native layout, which this import does not write", where=rules.source)
    tp_dim = pr.dim if pr.tp == "shard" and topo.tp > 1 else None
    if tp_dim is not None and tp_dim < len(shape) and shape[tp_dim] % topo.tp:
        raise BadInput(f"tp={topo.tp} does not divide dim {tp_dim} of '{fqn}' ({list(shape)})", where=where)
    return Placement(dp_shard=bool(shape), tp_dim=tp_dim) if shape else Placement.replicated()


def _check_config_sizes(cfg: dict[str, Any], mapping, shapes: dict[str, tuple[int, ...]], stored: dict[str, str],
                        where: str):
    """Every size ``config.json`` states, against the native tensors' shapes (`reshard.semantics.sizes`): a
    contradiction, a non-positive or non-integer size, or an absurd model is refused (exit 2) naming
    the key and the tensor, before any tensor is read; the sizes no tensor carries are returned as
    ``unchecked`` (the report says so, rather than record them as facts)."""
    import math

    from reshard.semantics import sizes

    stated = []
    for key, name in mapping.config_from.items():
        v: Any = cfg
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if v is not None:
            stated += sizes.stated_from({name: v}, "config.json", keys={name: key})
    found = sizes.check(stated, shapes, sizes.carriers_from_hf(mapping),
                        parameters=sum(math.prod(s) for s in shapes.values()), names=stored)
    found.refuse(where=where, hint="Fix config.json to the sizes of the weights beside it (transformers' "
                                   "from_pretrained would refuse it too), then import again; nothing was written.")
    return found


def open_source(src: Path, rename):
    """A consolidated-weights source (safetensors or torch.save); a DeepSpeed folder is opened by
    `reshard.engine.deepspeed_import` (which builds on this module, not the other way round)."""
    from reshard.storage.checkpoints.hf_dcp import is_hf_dcp
    from reshard.storage.checkpoints.safetensors_format import is_export

    if not src.exists():
        raise BadInput("no such file or directory", where=str(src))
    if is_hf_dcp(src):  # sharded, not consolidated: convert lays it out (import takes full tensors)
        raise BadInput("torch's safetensors-backed DCP (per-rank shards with DCP_SHARDING_INFO), not consolidated "
                       "weights: import reads full tensors", where=str(src),
                       hint=f"`reshard convert {src} DST --to SPEC` reads it directly and keeps its keys.")
    if is_export(src):
        return "safetensors", *_safetensors_source(src, rename)
    return "torch", *_torch_source(src, rename)


@dataclass
class Source:
    """What the source holds, as the import reads it."""

    format: str                   # "safetensors" | "torch"
    tensors: list[SourceTensor]
    essentials: dict[str, Any]    # what an export recorded of the run it came from ({} otherwise)
    tied: list[list[str]]         # groups of stored names that are one tensor
    skipped: list[dict]           # values that are not tensors: reported, not imported
    objects: dict[str, tuple[tuple, Any]] = field(default_factory=dict)  # key -> (state-dict path, value): written as is

    @property
    def with_moments(self) -> bool:
        return any(s.key.startswith("optim.state.") and s.shape for s in self.tensors)

    def orphans(self) -> list[str]:
        """Optimizer state whose parameter the source does not hold (imported, and named in the report)."""
        params = {s.key[len("model."):] for s in self.tensors if s.key.startswith("model.")}
        return sorted(s.key for s in self.tensors if s.key.startswith("optim.state.")
                      and not any(s.key[len("optim.state."):].startswith(p + ".") for p in params))

    def tied_fqns(self) -> list[list[str]]:
        return _tied_fqns(self.tied, self.tensors)


def _tied_fqns(tied: list[list[str]], srcs: list[SourceTensor]) -> list[list[str]]:
    by_name = {s.name: s.key for s in srcs}
    out = []
    for g in tied:
        fqns = [by_name[n][len("model."):] for n in g if by_name.get(n, "").startswith("model.")]
        if len(fqns) >= 2:
            out.append(fqns)
    return out
