"""`reshard import`: consolidated weights (safetensors or torch.save) -> a DCP checkpoint for a layout.

Sources
-------
* safetensors: a single ``.safetensors`` file, a directory with
  ``model.safetensors.index.json``, a directory with ``model.safetensors`` or with
  Hugging Face shards (read through `reshard.storage.safetensors_format.ExportIndex`, box by box
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

Hugging Face model directories (``fmt="torchtitan"`` or a family of ``formats/hf/``)
-------------------------------------------------------------------------------------
``reshard import HF_DIR DST --to SPEC --format torchtitan`` reads a directory transformers
writes (``config.json`` + safetensors) through the family's mapping backwards
(`reshard.semantics.hf`): every stored name must be one it knows (strict), each weight gets
the inverse of the declared transform (the rotary row order back to torchtitan's, with the
head counts of ``config.json``), tied embeddings are written under both native names, and
the keys follow the trainer's convention (torchtitan: the model's FQNs at the top level,
0.3.0 names, as its CheckpointManager saves a model-only checkpoint). The layout may have
``tp > 1``: each parameter's TP dim comes from the family's partition rules
(``formats/models/``), FSDP's ``Shard(0)`` over ``dp_shard`` on top. The report's
``trainer_must`` says how the trainer starts from it (torchtitan: ``initial_load_path`` with
``initial_load_model_only`` and an empty checkpoint folder).

Layout
------
``to`` is a topology spec. Parameters and optimizer moments are placed FSDP ``Shard(0)``
over ``dp_shard`` exactly as reshard's data-parallel plans place them
(`reshard.model.layout.target_chunks`; 0-d tensors such as step counters are replicated, written
by rank 0). For the reshard convention ``tp > 1`` or ``pp > 1`` is refused for now: import at ``dp`` and
run ``reshard convert --to`` (with the model's partition rules) from there.

Semantics
---------
An import never continues a run: the output gets a new experiment id (``experiment_id`` or
a generated one), ``continuity: "warm_start"``, ``step`` / ``tokens_seen`` /
``samples_seen`` 0, and one lineage entry ``{"event": "import", "kind": "warm_start",
"reason": "weights only from <src>" ...}`` (with moments: "weights and optimizer moments
from <src> ..."; there is still no scheduler, data position or RNG). Without moments,
`reshard inspect` notes "no optimizer moments: resuming from this checkpoint is a warm start".

Resuming it: the reference trainer's `load_checkpoint` (reshard convention) asks DCP for
the full trainer state (optimizer, scheduler, counters, sampler) and fails on the first key
the import does not have; load only ``{"model": get_model_state_dict(model)}`` with
``dcp.load`` and ``set_model_state_dict`` (tests/test_export_import.py shows it).

The output appears atomically, holds ``manifest.json`` (with item checksums) and
``import-report.json`` (every source name, the key it became, its chunks), and is read back
and compared bitwise with the source before it is committed.
"""
from __future__ import annotations

import hashlib
import json
import os
import time as _time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from reshard.errors import BadInput, Incomplete, Infeasible
from reshard.model.geometry import Box, whole
from reshard.model.topology import Topology
from reshard.engine.space import space_errors
from reshard.render.progress import describe_bytes, end_commit, phase_of, start_commit

REPORT = "import-report.json"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
TORCH_INDEXES = ("model.pt.index.json", "pytorch_model.bin.index.json")
TORCH_SINGLES = ("model.pt", "pytorch_model.bin")


@dataclass
class _Src:
    name: str                 # as stored
    key: str                  # reshard key it becomes
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[Box], torch.Tensor]
    placement: Any = None     # the target placement when the model's partition rules decide it (--format FAMILY)


# ===================================================================================== sources
def _safetensors_source(src: Path, rename) -> tuple[list[_Src], dict[str, Any], list[list[str]], list[dict]]:
    from reshard.storage.safetensors_format import ExportIndex

    ex = ExportIndex(src, keys="reshard", rename=rename)
    out = []
    for key, e in ex.entries.items():
        out.append(_Src(ex.names[key], key, tuple(e.shape), e.dtype, (lambda b, k=key: ex.read_box(k, b))))
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
    from reshard.storage.safetensors_format import read_index

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
        from reshard.storage.fastread import check_file_crcs

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


def _torch_source(src: Path, rename) -> tuple[list[_Src], dict[str, Any], list[list[str]], list[dict]]:
    from reshard.semantics.conventions import get_convention
    from reshard.storage.safetensors_format import INDEX_HINT, check_index_found, check_shard_listed, default_key

    tf = _torch_files(src)
    meta = (tf.index.get("metadata") or {}).get("reshard") or {}
    if not isinstance(meta, dict):
        meta = {}
    export_map = meta.get("export_map") if rename is None and isinstance(meta.get("export_map"), dict) else {}
    export_map = {k: v for k, v in export_map.items() if isinstance(v, str)}
    conv = get_convention(meta.get("source_convention") or "reshard") if export_map else None
    tied = [list(g) for g in (meta.get("tied") if isinstance(meta.get("tied"), list) else [])
            if isinstance(g, list) and all(isinstance(n, str) for n in g)]
    out: list[_Src] = []
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
        out.append(_Src(name, key_for(name), tuple(t.shape), t.dtype,
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


def _hf_source(src: Path, mapping, topo: Topology) -> tuple[list[_Src], dict[str, Any], list[list[str]], list[dict]]:
    """A Hugging Face model directory (``config.json`` + safetensors) under the native names of ``mapping``.

    Every stored name must be one the mapping knows (strict, as the export); the weights get the
    inverse of the declared transforms, with the head counts of ``config.json``. Tied embeddings
    (``tie_word_embeddings``, no stored ``lm_head``) are written under both native names, since
    the native model holds both. Placements come from the family's partition rules (TP dims).
    """
    from reshard import safefs
    from reshard.model.layout import Placement
    from reshard.semantics.rules import select
    from reshard.storage.safetensors_format import ExportIndex, is_export

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
    values = mapping.values_from_config(cfg, where=str(src / HF_CONFIG))
    ex = ExportIndex(src, keys="stored")
    by_native: dict[str, tuple[str, Any]] = {}
    for name in ex.entries:
        rule, native = mapping.from_hf_name(name)
        if native in by_native:
            raise BadInput(f"'{by_native[native][0]}' and '{name}' both map to '{native}'", where=str(src))
        by_native[native] = (name, rule)
    if mapping.tie and cfg.get("tie_word_embeddings") and mapping.tie[1] not in ex.entries and mapping.tie[0] in ex.entries:
        rule, native = mapping.from_hf_name(mapping.tie[1])
        by_native.setdefault(native, (mapping.tie[0], rule))
    rules = select(sorted(by_native), family=mapping.family)
    cache = _OneTensor()
    out: list[_Src] = []
    for native, (name, rule) in sorted(by_native.items()):
        e = ex.entries[name]
        pr = rules.rule_for(native)
        if pr is None:
            raise BadInput(f"'{native}' matches no partition rule of '{rules.family}'", where=rules.source)
        if pr.tp == "fused":
            raise BadInput(f"'{native}' is fused in the native layout, which this import does not write", where=rules.source)
        tp_dim = pr.dim if pr.tp == "shard" and topo.tp > 1 else None
        if tp_dim is not None and tp_dim < len(e.shape) and e.shape[tp_dim] % topo.tp:
            raise BadInput(f"tp={topo.tp} does not divide dim {tp_dim} of '{native}' ({list(e.shape)})", where=str(src))

        def read(box: Box, name=name, rule=rule, native=native) -> torch.Tensor:
            t = cache.get(name, lambda: rule.from_hf(ex.read_tensor(name), values, name))
            return (t[box.slices()] if t.dim() else t).clone()

        key = native if mapping.native_convention != "reshard" else "model." + native
        out.append(_Src(name, key, tuple(e.shape), e.dtype, read,
                        Placement(dp_shard=bool(e.shape), tp_dim=tp_dim) if e.shape else Placement.replicated()))
    ess = {"hf_config": {k: v for k, v in cfg.items() if isinstance(v, (int, float, str, bool))},
           "hf_mapping": mapping.describe(), "model_family": mapping.family, "hf_values": values}
    return out, ess, [], []


def _open_source(src: Path, rename):
    from reshard.storage.safetensors_format import is_export

    if not src.exists():
        raise BadInput("no such file or directory", where=str(src))
    if is_export(src):
        return "safetensors", *_safetensors_source(src, rename)
    return "torch", *_torch_source(src, rename)


# ===================================================================================== import
def _placement(s: _Src):
    from reshard.model.layout import Placement

    if s.placement is not None:
        return s.placement
    return Placement(dp_shard=bool(s.shape)) if s.shape else Placement.replicated()


def _new_id(src: Path, srcs: list[_Src], to: str) -> str:
    if os.environ.get("SOURCE_DATE_EPOCH"):  # reproducible outputs: a deterministic id
        h = hashlib.sha256(json.dumps([str(src.resolve()), to, sorted((s.key, list(s.shape), str(s.dtype)) for s in srcs)])
                           .encode()).hexdigest()[:12]
        return f"import-{h}"
    return f"import-{uuid.uuid4()}"


@dataclass
class _Source:
    """What the source holds, as the import reads it."""

    format: str                   # "safetensors" | "torch"
    tensors: list[_Src]
    essentials: dict[str, Any]    # what an export recorded of the run it came from ({} otherwise)
    tied: list[list[str]]         # groups of stored names that are one tensor
    skipped: list[dict]           # values that are not tensors: reported, not imported

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


@dataclass
class _Output:
    """What the output says of itself: a new experiment, a warm start, and why."""

    experiment_id: str
    reason: str
    stamp: str


@dataclass
class _Planned:
    """One source tensor's place in the output: its state-dict path and the chunk each writer rank writes."""

    src: _Src
    path: tuple[str, ...] | None
    chunks: list[tuple[int, Box]]


def import_checkpoint(src: str | Path, dst: str | Path, *, to: str, rename: str | Path | None = None,
                      overwrite: bool = False, experiment_id: str | None = None, progress: Any = None,
                      fmt: str = "reshard", force: bool = False) -> dict[str, Any]:
    """Write ``src`` (consolidated weights) as a DCP checkpoint for layout ``to`` into ``dst``; returns the report.

    ``fmt``: ``"reshard"`` (the reshard key convention, data-parallel layouts), or ``"torchtitan"`` /
    a family name with a Hugging Face mapping (``formats/hf/``): ``src`` is then a Hugging Face model
    directory, read back into the family's native names and key convention with the inverse of the
    declared transforms, laid out for ``to`` (dp and tp) by the family's partition rules.
    Nothing is committed unless the output reads back bitwise equal to the source.
    ``progress``: a `reshard.render.progress.Progress` (or None): the phases "writing" and
    "verifying", by the source's tensor bytes.
    ``force``: go ahead when the destination lacks the space for the output (estimated from
    the planned chunks, `import_preflight`); otherwise refused before anything is written.
    """
    if fmt != "reshard":
        return _import_native(Path(src), Path(dst), to=to, fmt=fmt, rename=rename, overwrite=overwrite,
                              experiment_id=experiment_id, progress=progress, force=force)
    from reshard.commands.export import RenameRules
    from reshard.semantics import manifest as mf
    from reshard.storage.atomic import atomic_directory, check_destination
    from reshard.storage.dcp_writer import CHECKSUM_ALGORITHM
    from reshard.storage.integrity import record as integrity_record

    started = _time.time()
    src, dst = Path(src), Path(dst)
    topo = _target_topology(to)
    check_destination(src, dst)
    rules = RenameRules.load(rename).inverse() if rename is not None else None
    source = _Source(*_open_source(src, rules))
    _check_keys(source.tensors, src)
    output = _output(src, source, to, experiment_id)
    planned = _plan_layout(source.tensors, topo)
    estimate = import_preflight(src, dst, planned, force=force, progress=progress)
    with space_errors(dst, estimate["needed_bytes"], "the import"), atomic_directory(dst, overwrite=overwrite) as tmp:
        checksums = _write_tensors(tmp, planned, progress, to)
        manifest = _manifest(src, source, rules, topo, output)
        manifest.integrity = integrity_record(checksums, algorithm=CHECKSUM_ALGORITHM)
        mf.write_manifest(tmp, manifest)
        verification = _verify_import(source.tensors, tmp, progress)
        report = _report(src, dst, tmp, topo, source, output, planned, verification, started, estimate)
        (tmp / REPORT).write_text(json.dumps(report, indent=2, default=str) + "\n")
        _refuse_unequal(verification, dst)
        commit = start_commit(progress, tmp)  # the fsync and rename as the block exits
    end_commit(progress, commit)
    return report


def _import_native(src: Path, dst: Path, *, to: str, fmt: str, rename, overwrite: bool, experiment_id: str | None,
                   progress: Any, force: bool = False) -> dict[str, Any]:
    """``--format torchtitan`` (or a family): a Hugging Face directory -> the trainer's own DCP layout, a warm start."""
    from reshard.model.topology import parse_spec
    from reshard.semantics import manifest as mf
    from reshard.storage.atomic import atomic_directory, check_destination
    from reshard.storage.dcp_writer import CHECKSUM_ALGORITHM
    from reshard.storage.integrity import record as integrity_record

    started = _time.time()
    if rename is not None:
        raise BadInput(f"--format {fmt} names every weight by the family's mapping (formats/hf/); --rename does not apply")
    mapping = native_mapping(fmt)
    topo = parse_spec(to)
    if topo.pp > 1 or topo.cp > 1:
        raise BadInput(f"import to pp={topo.pp}, cp={topo.cp} is not supported", hint="Import with pp=1 and cp=1.")
    check_destination(src, dst)
    source = _Source("hf", *_hf_source(src, mapping, topo))
    _check_keys(source.tensors, src)
    for s in source.tensors:
        if not s.dtype.is_floating_point:
            raise BadInput(f"parameter '{s.name}' has dtype {s.dtype}", where=str(src))
    output = _output(src, source, to, experiment_id)
    planned = _plan_layout(source.tensors, topo)
    estimate = import_preflight(src, dst, planned, force=force, progress=progress)
    with space_errors(dst, estimate["needed_bytes"], "the import"), atomic_directory(dst, overwrite=overwrite) as tmp:
        checksums = _write_tensors(tmp, planned, progress, to)
        manifest = _manifest(src, source, None, topo, output)
        manifest.key_convention = mapping.native_convention
        manifest.lineage[-1].policies.update(format=fmt, hf_mapping=mapping.source,
                                             trainer_must=_trainer_must(mapping.native_convention, dst))
        manifest.integrity = integrity_record(checksums, algorithm=CHECKSUM_ALGORITHM)
        mf.write_manifest(tmp, manifest)
        verification = _verify_import(source.tensors, tmp, progress)
        report = _report(src, dst, tmp, topo, source, output, planned, verification, started, estimate)
        report["format"] = fmt
        report["hf"] = {"mapping": mapping.describe(), "values": source.essentials.get("hf_values"),
                        "native": mapping.native, "key_convention": mapping.native_convention}
        report["trainer_must"] = _trainer_must(mapping.native_convention, dst)
        (tmp / REPORT).write_text(json.dumps(report, indent=2, default=str) + "\n")
        _refuse_unequal(verification, dst)
        commit = start_commit(progress, tmp)  # the fsync and rename as the block exits
    end_commit(progress, commit)
    return report


def _trainer_must(convention: str, dst: Path) -> list[str]:
    """What the trainer is told so that it starts from the import (model only: no optimizer, schedule or data state)."""
    if convention == "torchtitan":
        return [f'checkpoint.initial_load_path = "{dst.resolve()}"', "checkpoint.initial_load_model_only = true",
                "checkpoint.folder: a new, empty folder (a step-N folder there is resumed instead)"]
    return []


def _target_topology(to: str) -> Topology:
    """The target layout; only data-parallel targets are imported (tp/pp placements need the model's rules)."""
    from reshard.model.topology import parse_spec

    topo = parse_spec(to)
    if topo.tp > 1 or topo.pp > 1:
        raise BadInput(f"import to tp={topo.tp}, pp={topo.pp} is not supported yet",
                       hint=f"Import to dp={topo.dp_shard} first, then `reshard convert DST OUT --to {to}` "
                            "(tensor/pipeline placements come from the model's partition rules).")
    if topo.cp > 1:
        raise BadInput("import to cp > 1 is not supported", hint="Import with cp=1.")
    return topo


def _check_keys(srcs: list[_Src], src: Path) -> None:
    """Something to import, one source name per key, and parameters of a floating-point dtype."""
    if not srcs:
        raise BadInput("the source holds no tensors", where=str(src))
    seen: dict[str, str] = {}
    for s in srcs:
        if s.key in seen:
            raise BadInput(f"'{seen[s.key]}' and '{s.name}' would both be imported as '{s.key}'", where=str(src),
                           hint="Fix the rename rules.")
        seen[s.key] = s.name
        if s.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64) and s.key.startswith("model."):
            raise BadInput(f"parameter '{s.name}' has dtype {s.dtype}", where=str(src))


def _output(src: Path, source: _Source, to: str, experiment_id: str | None) -> _Output:
    """An import never continues a run: a new experiment id, and the reason it is a warm start."""
    from reshard.units import now_text

    stamp = now_text()
    exp_id = experiment_id or _new_id(src, source.tensors, to)
    what = "weights and optimizer moments" if source.with_moments else "weights only"
    reason = f"{what} from {src.resolve()}" + (" (no scheduler, data position or RNG state)" if source.with_moments else "")
    return _Output(exp_id, reason, stamp)


def _plan_layout(srcs: list[_Src], topo: Topology) -> list[_Planned]:
    """Every tensor's state-dict path and target chunks, parameters first (then by key)."""
    from reshard.model.layout import target_chunks

    return [_Planned(s, _state_path(s.key), target_chunks(s.shape, _placement(s), topo))
            for s in sorted(srcs, key=lambda s: (not s.key.startswith("model."), s.key))]


def _state_path(key: str) -> tuple[str, ...] | None:
    """Where a key sits in the trainer's nested state dict (None: the writer's default for the key)."""
    if key.startswith("model."):
        return ("model", key[len("model."):])
    if key.startswith("optim.state."):
        fqn, _, name = key[len("optim.state."):].rpartition(".")
        return ("optim", "state", fqn, name)
    return None


def _write_tensors(tmp: Path, planned: list[_Planned], progress: Any, to: str) -> dict[str, str]:
    """Write every planned chunk, read box by box from the source; returns the items' checksums."""
    from reshard.storage.dcp_writer import DcpWriter

    total = sum(_nbytes(p.src) for p in planned)
    if progress is not None:
        progress.say(f"importing {describe_bytes(total, len(planned), 'tensor')} for {to} …")
    w = DcpWriter(tmp)
    try:
        with phase_of(progress, "writing", total) as bar:
            for p in planned:
                s = p.src
                w.declare_tensor(s.key, s.shape, s.dtype, path=p.path)
                for rank, box in p.chunks:
                    w.write_chunk(rank, s.key, box.offsets, s.read(box))
                if bar is not None:
                    bar.update(_nbytes(s))
        w.finish()
    finally:
        w.close()
    return w.checksums()


def import_preflight(src: Path, dst: Path, planned: list[_Planned], *, force: bool = False,
                     progress: Any = None) -> dict[str, Any]:
    """`reshard.engine.space.preflight` for an import: the DCP output of the planned chunks
    (their bytes, `torch.save` framing, alignment, metadata) against ``dst``'s free space."""
    from reshard.engine.space import estimate_dcp_bytes, preflight

    chunks = [box.numel * p.src.dtype.itemsize for p in planned for _rank, box in p.chunks]
    return preflight(dst, needed=estimate_dcp_bytes(chunks, len(planned)),
                     read_bytes=sum(_nbytes(p.src) for p in planned), sources=[src], force=force, what="the import",
                     progress=progress)


def _nbytes(s: _Src) -> int:
    """A source tensor's bytes (what the progress of an import counts)."""
    return whole(s.shape).numel * s.dtype.itemsize


def _manifest(src: Path, source: _Source, rules, topo: Topology, output: _Output):
    """The output's manifest: step 0 of a new experiment, a warm start, the source recorded in its lineage."""
    from reshard import __version__
    from reshard.semantics import manifest as mf

    ess = source.essentials
    with_moments = source.with_moments
    mtopo = mf.Topology.make(dp_replicate=topo.dp_replicate, dp_shard=topo.dp_shard, cp=topo.cp, tp=topo.tp, pp=topo.pp)
    dtypes = sorted({str(s.dtype).removeprefix("torch.") for s in source.tensors if s.key.startswith("model.")})
    policies = {"source": str(src.resolve()), "format": source.format, "rename": rules.source if rules else None,
                "optimizer_moments": with_moments, "source_experiment_id": ess.get("experiment_id"),
                "source_step": ess.get("step"), "source_tokens_seen": ess.get("tokens_seen"),
                "source_topology": ess.get("topology")}
    return mf.Manifest(
        experiment_id=output.experiment_id, step=0, tokens_seen=0, samples_seen=0, key_convention="reshard",
        topology=mtopo,
        batch=mf.Batch(micro_batch=None, grad_accum=None, seq_len=None, global_batch=None),
        accumulation=mf.Accumulation(micro_step=0, in_flight_grads=False),
        precision=mf.Precision(param_dtype=dtypes[0] if len(dtypes) == 1 else "mixed", reduce_dtype="unknown",
                               loss_scaler=None),
        model=mf.ModelInfo(family=str(ess.get("model_family") or "unknown"),
                           config=ess.get("model_config") if isinstance(ess.get("model_config"), dict) else {},
                           tied=source.tied_fqns()),
        optimizer=mf.OptimizerInfo(name="unknown" if with_moments else "none", config={}),
        scheduler=mf.SchedulerInfo(name="none", config={}, unit="steps"),
        data=mf.DataPosition(sampler="none", seed=0, epoch=0, cursor=0, dataset_len=0,
                             order="none: imported weights carry no data position"),
        rng=mf.RngInfo(policy="none", keyed_by_rank=False, seed=0),
        continuity="warm_start",
        lineage=[mf.LineageEvent(event="import", from_=None, to=mtopo,
                                 at_step=ess.get("step") if isinstance(ess.get("step"), int) else None,
                                 policies=policies, tool=f"reshard {__version__}", time=output.stamp,
                                 kind="warm_start", reason=output.reason)],
        writer=mf.Writer(tool=f"reshard {__version__}", torch=str(torch.__version__), time=output.stamp),
    )


def _key_report(p: _Planned) -> dict[str, Any]:
    """The report's line for one source name: the key it became and its chunks."""
    s = p.src
    return {"name": s.name, "key": s.key, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."),
            "placement": _placement(s).describe(),
            "chunks": [{"rank": r, "offsets": list(b.offsets), "sizes": list(b.sizes)} for r, b in p.chunks]}


def _report(src: Path, dst: Path, tmp: Path, topo: Topology, source: _Source, output: _Output, planned: list[_Planned],
            verification: dict[str, Any], started: float, estimate: dict[str, Any] | None = None) -> dict[str, Any]:
    """``import-report.json``: every source name, the key it became, its chunks, and what was not imported."""
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.name.endswith(".distcp")}
    return {
        "report_version": 1,
        "source": str(src.resolve()),
        "destination": str(dst.resolve()),
        "format": source.format,
        "target": topo.to_dict(),
        "experiment_id": output.experiment_id,
        "continuity": "warm_start",
        "reason": output.reason,
        "optimizer_moments": source.with_moments,
        "moments_without_parameter": source.orphans(),
        "tied": source.tied_fqns(),
        "keys": [_key_report(p) for p in planned],
        "not_imported": source.skipped,
        "verification": verification,
        "files": files,
        "bytes_written": sum(files.values()),
        "seconds": None if os.environ.get("SOURCE_DATE_EPOCH") else round(_time.time() - started, 3),
        # measured figures (free space, probes) vary from run to run: none under SOURCE_DATE_EPOCH either
        "estimate": None if os.environ.get("SOURCE_DATE_EPOCH") else estimate,
    }


def _refuse_unequal(verification: dict[str, Any], dst: Path) -> None:
    """Raised inside the atomic directory, so an output that does not read back as its source is never committed."""
    if not verification["equal"]:
        raise Infeasible("the imported checkpoint does not read back as the source: "
                         + "; ".join(verification["differences"][:5]), where=str(dst),
                         hint="Nothing was committed. This is a bug in reshard; please report it.")


def _tied_fqns(tied: list[list[str]], srcs: list[_Src]) -> list[list[str]]:
    by_name = {s.name: s.key for s in srcs}
    out = []
    for g in tied:
        fqns = [by_name[n][len("model."):] for n in g if by_name.get(n, "").startswith("model.")]
        if len(fqns) >= 2:
            out.append(fqns)
    return out


def _verify_import(srcs: list[_Src], out: Path, progress: Any = None) -> dict[str, Any]:
    """Every written tensor read back through the DCP index (one at a time), bitwise against the source."""
    from reshard.storage.index import CheckpointIndex

    ix = CheckpointIndex.open(out)
    diffs = [f.message for f in ix.findings if f.severity == "error"]
    with phase_of(progress, "verifying", sum(_nbytes(s) for s in srcs)) as bar:
        for s in srcs:
            a = s.read(whole(s.shape))
            b = ix.read_tensor(s.key)
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.reshape(-1).view(torch.uint8),
                                                                           b.reshape(-1).view(torch.uint8)):
                diffs.append(s.key)
            del a, b
            if bar is not None:
                bar.update(_nbytes(s))
    return {"equal": not diffs, "tensors": len(srcs), "differences": diffs}
