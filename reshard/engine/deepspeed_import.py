"""A DeepSpeed ZeRO checkpoint (stage 1, 2 or 3) read as consolidated parameters and Adam state, for `reshard import`.

``reshard import DS_DIR DST --to SPEC --format deepspeed`` reads the folder
``engine.save_checkpoint`` writes: the save directory with its ``latest`` file (the tag, e.g.
``global_step2``), or the tag folder itself, holding ``mp_rank_00_model_states.pt`` (ZeRO-1/2) or
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (ZeRO-3) and one
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank. The output is what torch's
``get_state_dict(model, optimizer)`` saves and ``set_state_dict`` loads: ``model.<fqn>`` (parameters
and persistent buffers), ``optim.state.<fqn>.{exp_avg,exp_avg_sq,step}`` (``step`` a 0-d float32, as
``torch.optim.AdamW`` holds it) and ``optim.param_groups.<i>.<name>``: each group's
hyper-parameters and ``params``, the FQNs it steps (`param_groups`), so that inspect (and torch)
know that a buffer, listed in no group, expects no moments. The manifest's step is the run's
``global_steps`` and its optimizer the torch class (`optimizer_kind`).

The universal checkpoint folder ``ds_to_universal`` writes of such a checkpoint (``zero/<fqn>/fp32.pt``,
``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``, ``zero/optimizer_state.pt`` and the model-states files;
`consolidate_universal`) is read by the same ``--format deepspeed``, recognised by its
``zero/optimizer_state.pt``, into the same parameters, moments, step and param groups: its import
equals the ZeRO checkpoint's (`read_checkpoint`; everything after the reading is shared).

Layout (`reshard.engine.importing` writes it): FSDP ``Shard(0)`` over ``dp_shard`` for parameters
and moments; buffers and steps replicated, whole (FSDP2 and TP leave buffers plain tensors).
``tp > 1``: DeepSpeed records no tensor-parallel plan, so each parameter's TP dim comes from the
shipped partition rules (``formats/models/``) whose markers the parameter names match, as an
import of a Hugging Face directory does (`reshard.engine.import_sources.rule_placement`); for a
model no shipped family describes, the import is refused with the way out: import at ``dp`` and
``reshard convert --to tp=N --rules FILE`` with the model's own rules.

No code from the checkpoint runs
--------------------------------
These files are ``torch.save`` pickles. Each is opened through `reshard.safefs` (a regular file
inside the folder) and loaded with ``torch.load(weights_only=True)``, with exactly three DeepSpeed
globals admitted, each replaced by a stand-in that holds plain data: ``LossScaler`` and
``fragment_address`` become attribute records (the pickle's state dict set on an object with no
methods), ``ZeroStageEnum(n)`` becomes the int ``n``. Any other global is refused by torch's
weights-only unpickler, and the refusal (exit 2) names it. DeepSpeed need not be installed.

From flat partitions to parameters (DeepSpeed's ``zero_to_fp32.py`` is the reference)
--------------------------------------------------------------------------------------
* ZeRO-1/2: each rank holds, per parameter group, one contiguous slice of the group's flat fp32
  vector (``single_partition_of_fp32_groups``) and of its moments
  (``base_optimizer_state.state[g]``); the ranks' slices concatenated are the flat group, in which
  the parameters of ``param_shapes[g]`` lie one after the other, followed by at most
  ``2 * world - 1`` elements of alignment padding.
* ZeRO-3: every parameter is itself cut over the ranks: rank ``r`` holds elements
  ``[r * k, (r + 1) * k)`` of it, ``k = ceil(numel / world)``, at consecutive offsets of its flat
  vector (``fp32_flat_groups`` concatenated, the moments of ``optimizer_state_dict.state``
  concatenated in the same order); the last rank's tail is padding.
* Frozen parameters (``frozen_param_fragments``) are taken whole (ZeRO-1/2) or concatenated over
  ranks (ZeRO-3) and get no moments; persistent buffers (``buffer_names``) come from ``module``;
  ``shared_params`` are written under both names, as ``zero_to_fp32`` returns them.

Any size that does not add up (a rank missing, a partition of the wrong length, more padding
than the alignment allows, moments whose length differs from the weights') is refused naming
the file and the parameter group. A checkpoint of a tensor-parallel DeepSpeed run
(``mp_rank_01``...) or of pipeline stages (``layer_*``) is refused by name.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.engine.import_sources import Source, SourceTensor, rule_placement
from reshard.errors import BadInput, Incomplete

LATEST = "latest"
OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
HINT = ("Point `reshard import --format deepspeed` at the folder `engine.save_checkpoint(DIR)` wrote "
        "(DIR with its `latest` file, or DIR/global_stepN), unchanged.")


class DeepSpeedRecord:
    """A DeepSpeed object that is plain data: the pickle's BUILD sets its attributes; it has no methods to run."""


class LossScalerRecord(DeepSpeedRecord):
    """Stands for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (``cur_scale``, ``dynamic``, ...)."""


class FragmentAddressRecord(DeepSpeedRecord):
    """Stands for ``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``)."""


def zero_stage_enum(value: Any) -> int:
    """Stands for ``deepspeed.runtime.zero.config.ZeroStageEnum(value)``: the stage number."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 3:
        raise ValueError(f"ZeroStageEnum({value!r}) is not a ZeRO stage")
    return value


SAFE_GLOBALS = (
    (LossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (FragmentAddressRecord, "deepspeed.utils.tensor_fragment.fragment_address"),
    (zero_stage_enum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
)
"""The only DeepSpeed globals a checkpoint file may name, each with its plain-data stand-in."""


def load_pt(path: Path, root: Path, hint: str = HINT) -> Any:
    """``torch.load(weights_only=True)`` of one file inside ``root``, with `SAFE_GLOBALS` and nothing else admitted."""
    import torch

    from reshard.safefs import open_read
    from reshard.storage.checkpoints.fastread import check_file_crcs

    try:
        fd = open_read(path, root=root)
    except FileNotFoundError:
        raise Incomplete("file is missing", where=str(path), hint=hint) from None
    with os.fdopen(fd, "rb") as fh:
        check_file_crcs(fd, where=str(path))
        try:
            with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
                return torch.load(fh, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - whatever the weights-only unpickler refuses is not run
            text = str(exc)
            named = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
            why = (f"it names the global {named.group(1)}, which is not admitted" if named
                   else next((ln.strip() for ln in text.splitlines() if "WeightsUnpickler error" in ln),
                             text.splitlines()[0] if text else type(exc).__name__)[:300])
            raise BadInput(f"refused: not loadable with torch.load(weights_only=True) and the DeepSpeed records "
                           f"reshard admits ({why})", where=str(path),
                           hint="reshard never runs code from a pickle; only "
                                + ", ".join(n for _, n in SAFE_GLOBALS) + " are admitted, as plain data.") from None


@dataclass
class ZeroCheckpoint:
    """The files of one ZeRO checkpoint tag folder."""

    folder: Path
    root: Path
    model_files: list[str]
    optim_files: list[str]          # by data-parallel rank
    notes: list[str] = field(default_factory=list)


def find_checkpoint(src: Path) -> ZeroCheckpoint:
    """The tag folder (through ``latest`` when ``src`` is the save directory) and its model and optimizer files."""
    from reshard.safefs import check_name, read_bounded, resolve_root

    root = resolve_root(src)
    if not root.is_dir():
        raise BadInput("not a DeepSpeed checkpoint folder", where=str(src), hint=HINT)
    folder = root
    if os.path.lexists(root / LATEST):
        tag = read_bounded(root / LATEST, limit=4096, root=root, what="DeepSpeed 'latest' file").decode("utf-8", "replace").strip()
        check_name(tag, where=str(root / LATEST))
        if not tag or "/" in tag or tag in (".", ".."):
            raise BadInput(f"'latest' names {tag!r}, not a tag folder", where=str(root / LATEST), hint=HINT)
        folder = root / tag
        if not folder.is_dir() or folder.is_symlink():
            raise Incomplete(f"'latest' names the tag '{tag}', which is not a folder here", where=str(root), hint=HINT)
    names = sorted(os.listdir(folder))
    optim = {int(m.group(1)): (n, int(m.group(2))) for n in names if (m := OPTIM_FILE.match(n))}
    model = [n for n in names if MODEL_FILE.match(n)]
    mp = {r for _, r in optim.values()} | {int(MODEL_FILE.match(n).group(2)) for n in model}
    if not optim or not model:
        layers = [n for n in names if n.startswith("layer_")]
        raise BadInput("no ZeRO optimizer states (zero_pp_rank_*_optim_states.pt) and model states found"
                       + (" (pipeline layer files are not read)" if layers else ""), where=str(folder), hint=HINT)
    if mp != {0}:
        raise BadInput(f"tensor-parallel ranks {sorted(mp)} (mp_rank_NN): only a checkpoint without model parallelism "
                       "is imported", where=str(folder),
                       hint="Consolidate it with DeepSpeed first, or import a tp=1 run and convert with --to tp=N.")
    ranks = sorted(optim)
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise Incomplete(f"the optimizer states of rank(s) {missing} are missing", where=str(folder), hint=HINT)
    return ZeroCheckpoint(folder, root, model, [optim[r][0] for r in ranks])


def _numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


def _group_shapes(model_state: dict, where: str) -> list[dict[str, tuple[int, ...]]]:
    groups = model_state.get("param_shapes")
    if isinstance(groups, dict):
        groups = [groups]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise BadInput("model states hold no 'param_shapes' list (a DeepSpeed ZeRO checkpoint has one)", where=where, hint=HINT)
    return [{str(k): tuple(int(d) for d in v) for k, v in g.items()} for g in groups]


def _inner_state(osd: dict, stage: int, where: str) -> dict:
    key = "base_optimizer_state" if stage <= 2 else "optimizer_state_dict"
    st = osd.get(key)
    if not isinstance(st, dict) or not isinstance(st.get("state"), dict):
        raise BadInput(f"optimizer states hold no '{key}.state'", where=where, hint=HINT)
    return st


def _step(states: dict, where: str) -> float | None:
    steps = set()
    for s in states.values():
        if isinstance(s, dict) and "step" in s:
            v = s["step"]
            steps.add(float(v.item() if hasattr(v, "item") else v))
    if len(steps) > 1:
        raise BadInput(f"parameter groups hold different Adam steps {sorted(steps)}", where=where)
    return steps.pop() if steps else None


@dataclass
class Consolidated:
    """Full fp32 parameters, their moments and step, as DeepSpeed's consolidation would give them."""

    params: dict[str, Any]
    moments: dict[str, dict[str, Any]]     # fqn -> {"exp_avg": t, "exp_avg_sq": t}
    step: float | None
    buffers: dict[str, Any]
    shared: dict[str, str]                 # alias fqn -> the fqn that holds the tensor
    stage: int
    world: int
    essentials: dict[str, Any]
    groups: list[dict[str, Any]] = field(default_factory=list)  # torch's param_groups: hyper-parameters, params as FQNs
    optimizer: str = "unknown"             # the torch.optim class the state is the state of (`optimizer_kind`)


def consolidate(ck: ZeroCheckpoint) -> Consolidated:
    """Every rank's flat partitions mapped back to parameters (see the module docstring for the layouts)."""
    import torch

    optims = [load_pt(ck.folder / n, ck.root) for n in ck.optim_files]
    world = len(optims)
    osds = []
    for n, o in zip(ck.optim_files, optims):
        osd = o.get("optimizer_state_dict") if isinstance(o, dict) else None
        if not isinstance(osd, dict) or not isinstance(osd.get("zero_stage"), int):
            raise BadInput("not a ZeRO optimizer-states file (no optimizer_state_dict.zero_stage)", where=str(ck.folder / n), hint=HINT)
        osds.append(osd)
    stage = osds[0]["zero_stage"]
    where0 = str(ck.folder / ck.optim_files[0])
    if any(o["zero_stage"] != stage for o in osds):
        raise BadInput("the ranks' optimizer states name different ZeRO stages", where=str(ck.folder))
    counts = osds[0].get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    if any(c != world for c in counts):
        raise Incomplete(f"written by {counts} data-parallel ranks, {world} optimizer-states files found",
                         where=str(ck.folder), hint=HINT)
    models, model_files = model_states(ck.folder, ck.root, ck.model_files, stage, world)
    shapes = _group_shapes(models[0], str(ck.folder / model_files[0]))
    inner = [_inner_state(o, stage, str(ck.folder / n)) for o, n in zip(osds, ck.optim_files)]
    params: dict[str, Any] = {}
    moments: dict[str, dict[str, Any]] = {}

    def flat(o: dict, what: str, n: str) -> list:
        v = o.get(what)
        if not isinstance(v, list) or not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in v):
            raise BadInput(f"'{what}' is not a list of flat tensors", where=str(ck.folder / n), hint=HINT)
        return v

    names = {"exp_avg", "exp_avg_sq"}
    if stage <= 2:
        parts = [flat(o, "single_partition_of_fp32_groups", n) for o, n in zip(osds, ck.optim_files)]
        if any(len(p) != len(shapes) for p in parts):
            raise BadInput(f"{len(shapes)} parameter groups in param_shapes, other counts of fp32 partitions",
                           where=str(ck.folder), hint=HINT)
        for g, group in enumerate(shapes):
            full = torch.cat([p[g] for p in parts])
            mom = {}
            for m in sorted(names):
                pieces = []
                for r, st in enumerate(inner):
                    s = st["state"].get(g)
                    t = s.get(m) if isinstance(s, dict) else None
                    if not isinstance(t, torch.Tensor) or t.shape != parts[r][g].shape:
                        raise BadInput(f"rank {r}'s '{m}' of parameter group {g} is not the shape of its fp32 partition",
                                       where=str(ck.folder / ck.optim_files[r]), hint=HINT)
                    pieces.append(t)
                mom[m] = torch.cat(pieces)
            offset = 0
            for fqn, shape in group.items():
                n = _numel(shape)
                if offset + n > full.numel():
                    raise BadInput(f"parameter group {g}: '{fqn}' ends at {offset + n}, past the {full.numel()} "
                                   "elements of the ranks' partitions", where=str(ck.folder), hint=HINT)
                params[fqn] = full[offset:offset + n].view(shape)
                moments[fqn] = {m: mom[m][offset:offset + n].view(shape) for m in names}
                offset += n
            if full.numel() - offset >= 2 * world:
                raise BadInput(f"parameter group {g}: {full.numel() - offset} elements past the last parameter, more "
                               f"than ZeRO's alignment padding (< {2 * world})", where=str(ck.folder), hint=HINT)
    else:
        parts = [torch.cat(flat(o, "fp32_flat_groups", n)) for o, n in zip(osds, ck.optim_files)]
        mom_parts = []
        for r, st in enumerate(inner):
            keys = sorted(st["state"])
            mom_parts.append({m: torch.cat([st["state"][k][m] for k in keys]) for m in names})
            if any(mom_parts[-1][m].shape != parts[r].shape for m in names):
                raise BadInput(f"rank {r}'s moments are not the length of its fp32 partition",
                               where=str(ck.folder / ck.optim_files[r]), hint=HINT)
        if len({p.numel() for p in parts}) != 1:
            raise BadInput(f"the ranks' fp32 partitions differ in length ({[p.numel() for p in parts]})",
                           where=str(ck.folder), hint=HINT)
        offset = 0
        for group in shapes:
            for fqn, shape in group.items():
                n = _numel(shape)
                k = math.ceil(n / world)
                if offset + k > parts[0].numel():
                    raise BadInput(f"'{fqn}' ends past the {parts[0].numel()} elements of each rank's partition",
                                   where=str(ck.folder), hint=HINT)
                params[fqn] = torch.cat([p[offset:offset + k] for p in parts])[:n].view(shape)
                moments[fqn] = {m: torch.cat([mp[m][offset:offset + k] for mp in mom_parts])[:n].view(shape)
                                for m in names}
                offset += k
    return assemble(ck.folder, models, model_files, shapes, params, moments, stage, world,
                    optims[0].get("ds_config"), inner[0], where0)


def model_states(folder: Path, root: Path, names: list[str], stage: int, world: int,
                 hint: str = HINT) -> tuple[list[dict], list[str]]:
    """The model-states file(s) a ZeRO stage needs (ZeRO-1/2: ``mp_rank_00``, ZeRO-3: one per rank, by rank), loaded."""
    if stage <= 2:
        files = [n for n in names if n.startswith("mp_rank_")]
    else:
        files = sorted(names, key=lambda n: int(MODEL_FILE.match(n).group(1) or 0))
    if not files or (stage == 3 and len(files) != world):
        raise Incomplete(f"ZeRO-{stage} needs {'one' if stage <= 2 else world} model-states file(s), found {names}",
                         where=str(folder), hint=hint)
    models = [load_pt(folder / n, root, hint) for n in files]
    if not isinstance(models[0], dict):
        raise BadInput("model states are not a dict", where=str(folder / files[0]), hint=hint)
    return models, files


def assemble(folder: Path, models: list[dict], model_files: list[str], shapes: list[dict[str, tuple[int, ...]]],
             params: dict[str, Any], moments: dict[str, dict[str, Any]], stage: int, world: int, ds_config: Any,
             inner: dict, where: str) -> Consolidated:
    """What both DeepSpeed layouts (ZeRO partitions, the universal folder) take the same way from the model states
    and the optimizer's param groups, once the trainable parameters and their moments are read: frozen
    parameters, buffers, shared names, the run's step and config, the param groups by FQN."""
    import torch

    ms = models[0]
    mwhere = str(folder / model_files[0])
    frozen = ms.get("frozen_param_shapes") or {}
    for fqn, shape in frozen.items():
        frags = [m.get("frozen_param_fragments", {}).get(fqn) for m in models]
        if any(not isinstance(f, torch.Tensor) for f in frags):
            raise Incomplete(f"frozen parameter '{fqn}' has no fragment in every model-states file", where=str(folder))
        n = _numel(shape)
        t = frags[0] if stage <= 2 else torch.cat([f.reshape(-1) for f in frags])
        params[str(fqn)] = t.reshape(-1)[:n].view(tuple(int(d) for d in shape))
    module = ms.get("module") if isinstance(ms.get("module"), dict) else {}
    buffers = {}
    for b in ms.get("buffer_names") or []:
        if isinstance(module.get(b), torch.Tensor):
            buffers[str(b)] = module[b]
    shared = {str(k): str(v) for k, v in (ms.get("shared_params") or {}).items()}
    for alias, real in shared.items():
        if real not in params:
            raise BadInput(f"shared parameter '{alias}' names '{real}', which the checkpoint does not hold", where=mwhere)
    ess = {"step": ms.get("global_steps") if isinstance(ms.get("global_steps"), int) else None,
           "topology": {"dp_shard": world}, "deepspeed_version": ms.get("ds_version"), "zero_stage": stage,
           "model_family": "unknown"}
    kind = optimizer_kind(ds_config)
    groups = param_groups(inner, shapes, kind, where)
    return Consolidated(params, moments, _step(inner.get("state") or {}, where), buffers, shared, stage, world, ess,
                        groups, kind)


UNIVERSAL_STATE = Path("zero") / "optimizer_state.pt"
UNIVERSAL_HINT = ("Point `reshard import --format deepspeed` at the folder `ds_to_universal --output_folder DIR` "
                  "wrote (DIR holds zero/ and the model-states files), unchanged.")
UNIVERSAL_FILES = {"fp32": "fp32.pt", "exp_avg": "exp_avg.pt", "exp_avg_sq": "exp_avg_sq.pt"}
"""Per parameter, the files of ``zero/<fqn>/`` that are read (``step.pt`` too, when the converter wrote one)."""


def is_universal(src: Path) -> bool:
    """A folder ``ds_to_universal`` wrote: ``zero/optimizer_state.pt`` beside the model-states files."""
    return src.is_dir() and os.path.lexists(src / UNIVERSAL_STATE)


def consolidate_universal(src: Path) -> Consolidated:
    """DeepSpeed's universal checkpoint folder read back into what `consolidate` gives for the ZeRO checkpoint.

    ``ds_to_universal`` writes, per trainable parameter, ``zero/<fqn>/fp32.pt``, ``exp_avg.pt`` and
    ``exp_avg_sq.pt`` (a tensor, or a dict whose ``param`` is the tensor; ZeRO-3's flat, ZeRO-1/2's
    shaped), ``step.pt`` for ZeRO-1/2, ``zero/optimizer_state.pt`` (the stage, the param groups and,
    for ZeRO-3, rank 0's inner optimizer state, whose ``step`` is the run's), and copies the
    model-states file(s): the parameter names and shapes (``param_shapes``), buffers, frozen
    parameters and the run's config come from those, as for the ZeRO checkpoint. Every file is
    loaded by `load_pt` (weights only). A parameter's file missing, of another size than
    ``param_shapes`` says, or a folder under ``zero/`` that is no parameter or buffer of the model,
    is refused naming it.
    """
    import torch

    from reshard.safefs import check_name, resolve_root

    root = resolve_root(src)
    zero = root / "zero"
    opt = load_pt(root / UNIVERSAL_STATE, root, UNIVERSAL_HINT)
    where = str(root / UNIVERSAL_STATE)
    stage = opt.get("zero_stage") if isinstance(opt, dict) else None
    if not isinstance(stage, int) or not isinstance(opt.get("param_groups"), list):
        raise BadInput("not ds_to_universal's optimizer state (no zero_stage and param_groups)", where=where,
                       hint=UNIVERSAL_HINT)
    names = sorted(os.listdir(root))
    model_files = [n for n in names if MODEL_FILE.match(n)]
    if {int(MODEL_FILE.match(n).group(2)) for n in model_files} - {0}:
        raise BadInput("tensor-parallel ranks (mp_rank_NN > 0): only a checkpoint without model parallelism is "
                       "imported", where=str(root), hint=UNIVERSAL_HINT)
    first = load_pt(root / model_files[0], root, UNIVERSAL_HINT) if model_files else {}
    world = first.get("dp_world_size") if isinstance(first, dict) else None
    if not isinstance(world, int) or world < 1:
        raise BadInput("no model-states file with the run's dp_world_size", where=str(root), hint=UNIVERSAL_HINT)
    models, model_files = model_states(root, root, model_files, stage, world, UNIVERSAL_HINT)
    shapes = _group_shapes(models[0], str(root / model_files[0]))
    known = {f for g in shapes for f in g} | set(models[0].get("buffer_names") or []) \
        | set(models[0].get("frozen_param_shapes") or {})
    strays = sorted(set(os.listdir(zero)) - known - {UNIVERSAL_STATE.name})
    if strays:
        raise BadInput(f"zero/ holds {strays[:3]}, which the model states name as no parameter or buffer",
                       where=str(zero), hint=UNIVERSAL_HINT)

    def tensor(fqn: str, what: str, shape: tuple[int, ...]) -> Any:
        path = zero / fqn / UNIVERSAL_FILES[what]
        v = load_pt(path, root, UNIVERSAL_HINT)
        t = v.get("param") if isinstance(v, dict) else v
        if not isinstance(t, torch.Tensor) or t.numel() != _numel(shape):
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise BadInput(f"holds {got}, not the {_numel(shape)} elements of '{fqn}' {list(shape)} (param_shapes)",
                           where=str(path), hint=UNIVERSAL_HINT)
        return t.detach().reshape(shape)

    params: dict[str, Any] = {}
    moments: dict[str, dict[str, Any]] = {}
    steps: dict[Any, dict] = {}
    for group in shapes:
        for fqn, shape in group.items():
            check_name(fqn, where=str(root / model_files[0]))
            params[fqn] = tensor(fqn, "fp32", shape)
            moments[fqn] = {m: tensor(fqn, m, shape) for m in ("exp_avg", "exp_avg_sq")}
            if os.path.lexists(zero / fqn / "step.pt"):
                steps[fqn] = {"step": load_pt(zero / fqn / "step.pt", root, UNIVERSAL_HINT)}
    inner = opt.get("optimizer_state_dict") if isinstance(opt.get("optimizer_state_dict"), dict) else {}
    steps.update({("rank0", k): v for k, v in (inner.get("state") or {}).items()})
    state = {"param_groups": opt["param_groups"], "state": steps}
    return assemble(root, models, model_files, shapes, params, moments, stage, world, models[0].get("ds_config"),
                    state, where)


def read_checkpoint(src: Path) -> Consolidated:
    """A ZeRO checkpoint folder (through its ``latest``) or the universal folder ``ds_to_universal`` made of one."""
    return consolidate_universal(src) if is_universal(src) else consolidate(find_checkpoint(src))


def optimizer_kind(ds_config: Any) -> str:
    """The torch.optim class whose state DeepSpeed's optimizer keeps, from the run's config (saved in every
    optimizer-states file): ``"AdamW"`` for ``type: AdamW``, and for ``type: Adam`` unless
    ``adam_w_mode: false`` (DeepSpeed's default is decoupled weight decay, torch's AdamW); ``"Adam"``
    then; ``"unknown"`` for any other optimizer or a client optimizer (no ``optimizer`` in the config)."""
    opt = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    if not isinstance(opt, dict):
        return "unknown"
    kind = str(opt.get("type", "")).lower()
    params = opt.get("params") if isinstance(opt.get("params"), dict) else {}
    if kind == "adamw":
        return "AdamW"
    if kind == "adam":
        return "AdamW" if params.get("adam_w_mode", True) else "Adam"
    return "unknown"


HYPER = ("lr", "betas", "eps", "weight_decay")
"""The hyper-parameters DeepSpeed's Adam groups and torch's share (DeepSpeed's own ``step`` and
``bias_correction`` have no torch counterpart: torch keeps the step per parameter and always corrects)."""


def param_groups(inner: dict, shapes: list[dict[str, tuple[int, ...]]], kind: str, where: str) -> list[dict[str, Any]]:
    """The optimizer's param groups as torch's ``get_state_dict`` writes them: each DeepSpeed group's
    hyper-parameters, ``params`` the FQNs of the parameters it steps, in order.

    DeepSpeed's inner optimizer lists, per group, the indices of its flat partitions (ZeRO-1/2:
    one per group; ZeRO-3: its sub-groups), and ``param_shapes[i]`` names the parameters of flat
    partition ``i``. For an Adam or AdamW run the group is the one ``torch.optim.<kind>`` makes
    with these hyper-parameters (its other entries, ``amsgrad``, ``foreach``, ..., its defaults,
    which compute what DeepSpeed's Adam computes), so that a torch optimizer's state dict asks for
    exactly these keys. A group with ``bias_correction: false`` has no torch equivalent: refused.
    """
    import torch

    groups = inner.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise BadInput("the inner optimizer state holds no 'param_groups' list", where=where, hint=HINT)
    out = []
    for g, group in enumerate(groups):
        idx = group.get("params")
        if not isinstance(idx, list) or not all(isinstance(i, int) and 0 <= i < len(shapes) for i in idx):
            raise BadInput(f"parameter group {g} lists flat partitions {idx!r}, not indices of the {len(shapes)} "
                           "groups of param_shapes", where=where, hint=HINT)
        fqns = [fqn for i in idx for fqn in shapes[i]]
        hyper = {k: group[k] for k in HYPER if k in group}
        if kind in ("Adam", "AdamW"):
            missing = [k for k in HYPER if k not in hyper]
            if missing or group.get("bias_correction", True) is not True:
                raise BadInput(f"parameter group {g} of a DeepSpeed {kind} run "
                               + (f"lacks {missing}" if missing else "has bias_correction=false, which torch.optim."
                                  f"{kind} cannot express"), where=where,
                               hint="Import the weights only: consolidate with DeepSpeed's zero_to_fp32 and "
                                    "`reshard import FP32.pt DST --to SPEC`.")
            opt_cls = getattr(torch.optim, kind)
            made = opt_cls([torch.nn.Parameter(torch.zeros(1))], lr=float(hyper["lr"]),
                           betas=tuple(float(b) for b in hyper["betas"]), eps=float(hyper["eps"]),
                           weight_decay=float(hyper["weight_decay"]))
            hyper = {k: v for k, v in made.state_dict()["param_groups"][0].items() if k != "params"}
        out.append({**hyper, "params": fqns})
    return out


def deepspeed_source(src: Path, rename: Any = None, topo: Any = None) -> Source:
    """What the import takes from a ZeRO checkpoint: a `SourceTensor` for every ``model.*`` and
    ``optim.state.*`` key (see the module docstring), what the run recorded, the tied names, nothing
    skipped, and the param groups as objects (``optim.param_groups.<i>.<name>`` -> (state-dict path, value)).
    ``rename`` must be None: the model's own parameter names are kept.

    ``topo`` with ``tp > 1``: each parameter (and its moments) gets its TP dim from the shipped partition
    rules whose markers its names match (`reshard.semantics.rules.select`). Buffers (and the 0-d steps) are
    written replicated, one whole chunk, at any layout: FSDP2's ``fully_shard`` and TP's
    ``parallelize_module`` leave buffers plain tensors, which every rank saves whole. DeepSpeed records no tensor-parallel plan,
    so a model no shipped family describes is refused, with the way out.
    """
    import torch

    from reshard.model.dtypes import from_torch
    from reshard.model.layout import Placement

    if not src.exists():
        raise BadInput("no such file or directory", where=str(src))
    if rename is not None:
        raise BadInput("--format deepspeed keeps the model's own parameter names; --rename does not apply")
    c = read_checkpoint(src)
    placement = _tp_placements(c, topo, src) if topo is not None and topo.tp > 1 else {}
    ess = dict(c.essentials, adam_step=c.step, optimizer=c.optimizer)
    if placement:
        ess["model_family"] = placement.pop("")

    def tensor(name: str, key: str, t: Any, fqn: str | None) -> SourceTensor:
        where = placement.get(fqn) if fqn is not None else Placement.replicated()
        return SourceTensor(name, key, tuple(t.shape), from_torch(t.dtype),
                            (lambda b, t=t: (t[b.slices()] if t.dim() else t).clone()), where)

    out = [tensor(fqn, f"model.{fqn}", t, fqn) for fqn, t in c.params.items()]
    out += [tensor(alias, f"model.{alias}", c.params[real], real) for alias, real in c.shared.items()]
    out += [tensor(fqn, f"model.{fqn}", t, None) for fqn, t in c.buffers.items()]
    for fqn, mom in c.moments.items():
        for m, t in sorted(mom.items()):
            out.append(tensor(f"{fqn}.{m}", f"optim.state.{fqn}.{m}", t, fqn))
        if c.step is not None:
            out.append(tensor(f"{fqn}.step", f"optim.state.{fqn}.step", torch.tensor(c.step, dtype=torch.float32), None))
    objects = {f"optim.param_groups.{i}.{k}": (("optim", "param_groups", i, k), v)
               for i, g in enumerate(c.groups) for k, v in g.items()} if c.moments else {}
    tied = [[alias, real] for alias, real in c.shared.items()]
    return Source("deepspeed", out, ess, tied, [], objects)


def _tp_placements(c: Consolidated, topo: Any, src: Path) -> dict[str, Any]:
    """Parameter FQN -> its placement for ``topo`` by the shipped rules its names match (key ``""``: the family)."""
    from reshard.semantics.rules import select

    names = sorted(c.params)
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    try:
        rules = select(names)
    except BadInput:
        raise BadInput(f"import to tp={topo.tp}: DeepSpeed records no tensor-parallel plan, and no shipped model "
                       f"family's partition rules match this model's parameter names ({shown})", where=str(src),
                       hint=f"Import to dp={topo.dp_shard} (`--to dp={topo.dp_shard}`), then `reshard convert DST OUT "
                            f"--to {topo.spec()} --rules FILE` with "
                            "the model's partition rules (formats/models/*.toml shows the format).") from None
    out: dict[str, Any] = {"": rules.family}
    for fqn, t in c.params.items():
        out[fqn] = rule_placement(rules, fqn, tuple(t.shape), topo, str(src))
    return out


__all__ = ["deepspeed_source", "consolidate", "consolidate_universal", "find_checkpoint", "read_checkpoint",
           "load_pt", "SAFE_GLOBALS"]
