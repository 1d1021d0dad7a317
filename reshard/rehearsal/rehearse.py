"""`rehearse`: a deterministic restore test of a topology transition, run for real.

With the user's trainer (``trainer``: a command under the trainer contract,
formats/trainer_contract.md) or, by default, the built-in reference trainer run through the
same contract (``contract.reference_command``): one engine, whichever trainer.

1. baseline  the source layout runs uninterrupted for ``steps`` steps, saving at
             ``switch_at`` and ``switch_at + 1`` (optimizer state after one more step);
             a tp/pp change adds a noise-floor run (the same sums in another order);
2. resumed   the step-``switch_at`` checkpoint is planned and converted by reshard with the
             options a real transition uses, then the trainer resumes it on the target
             layout with the plan's batch recipe;
3. control   the naive resume, one of: ``relaunch`` (the trainer resumed on the target from
             the unconverted checkpoint with its unchanged recipe: what relaunching without
             reshard does; the default for a user's trainer) or ``naive-state`` (fresh Adam
             moments and one rank's LOCAL data position replayed on the new world size, see
             ``reshard.rehearsal.ckpt.make_control``; the reference's default);
4. compare   over steps switch_at+1 .. switch_at+window: losses, grad norms, throughput,
             sample coverage, Adam moments after the first resumed step, step counters;
             plus the control's repeats/skips and loss jump; a diagnosis names the likely
             trainer mistake (optimizer re-initialised, data order tied to the world size);
5. verdict   exit 0 when the resumed run is within tolerance and coverage is exact.

The reference's dropout is 0 by default, so no randomness depends on the topology (dropout
masks come from per-dp-rank RNG streams, which a new world size necessarily reseeds).

This module runs (1-3) and writes the outputs; the comparison, the tolerances, the verdict
and the report (4-5) are `reshard.rehearsal.judge`.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.errors import BadInput, Infeasible
from reshard.safefs import loads_json
from reshard.rehearsal import judge
from reshard.rehearsal.ckpt import make_control
from reshard.rehearsal.contract import (CONTRACT_DOC, RunResult, RunSpec, TrainerCommand, layout_spec,
                                        reference_command, run)
from reshard.rehearsal.follow import follow_steps
from reshard.rehearsal.recipe import RecipeChoice, pick_recipe
from reshard.model.topology import Topology, parse_spec
from reshard.model.kinds import EXPECTED_DIFFERENCES

if TYPE_CHECKING:  # annotations only: the planner loads torch, imported where it runs
    from reshard.model.plan import Options, Plan
    from reshard.semantics.batch import Recipe

REFERENCE_FAMILIES = ("reshard-reference-gpt", "reference-gpt")
CONTROLS = ("relaunch", "naive-state", "none")
RUN_NAMES = ("baseline", "floor", "resumed", "control")


def _topology(spec: str, what: str) -> Topology:
    t = parse_spec(spec)
    if t.dp_replicate != 1 or t.cp != 1:
        raise BadInput(f"--{what} {spec}: the trainer contract has no dp_replicate or cp placeholder",
                       hint="Rehearse with dp (= dp_shard), tp and pp only.")
    return t


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def _from_like(like: Path, src: Topology) -> dict[str, Any]:
    """Batch recipe, schedule, data policy and model shape copied (scaled down) from a real checkpoint."""
    from reshard.storage.checkpoints.index import CheckpointIndex
    from reshard.semantics.manifest import read_manifest
    from reshard.semantics.rules import select

    like = Path(like)
    m = read_manifest(like)
    if m is None:
        raise BadInput("--like needs a checkpoint with a manifest (manifest.json)", where=str(like))
    prefix = "model." if m.key_convention == "reshard" else ""
    opened: list[Any] = []

    def params() -> list[str]:
        if not opened:
            opened.append(CheckpointIndex.open(like))
        return sorted(k[len(prefix):] for k in opened[0].entries if k.startswith(prefix) and not k.startswith("optim"))

    family, found_by = like_family(m, params)
    if family not in REFERENCE_FAMILIES:
        slice_ = any(isinstance(e.policies, dict) and e.policies.get("slice") for e in m.lineage)
        raise BadInput(f"model family '{family}' ({found_by}): the reference trainer cannot build that family yet, so "
                       "a rehearsal cannot exercise its partition rules", where=str(like / "manifest.json"),
                       hint="Rehearse with your own trainer instead: --trainer CMD (" + CONTRACT_DOC + ")"
                            + (", which resumes this slice (--like SLICE)." if slice_ else "."))
    names = params()
    ix = opened[0]
    rules = select(names, family=family)
    rules_family = rules.family
    cfg = dict(m.model.config or {})
    _check_like_sizes(cfg, {p: tuple(ix.entries[prefix + p].shape) for p in names if ix.entries[prefix + p].is_tensor},
                      rules, str(like / "manifest.json"), prefix)
    copied: dict[str, Any] = {"from": str(like), "model_family": family, "rules_family": rules_family}
    kw: dict[str, Any] = {}
    n_heads = int(cfg.get("n_heads", 2))
    n_layers = min(int(cfg.get("n_layers", 2)), 4)
    n_layers = max(src.pp, n_layers - n_layers % src.pp)
    kw.update(n_heads=n_heads, n_layers=n_layers, dim=max(32, 4 * n_heads) // n_heads * n_heads)
    if "vocab_size" in cfg:
        kw["vocab_size"] = min(int(cfg["vocab_size"]), 64)
    copied["model"] = {"real": {k: cfg.get(k) for k in ("n_heads", "n_layers", "dim", "vocab_size")},
                       "rehearsal": {k: kw.get(k) for k in ("n_heads", "n_layers", "dim", "vocab_size")},
                       "rule": "n_heads kept, n_layers min(real, 4) (a multiple of pp), dim small (4 per head, >= 32)"}
    if m.batch.micro_batch and m.batch.grad_accum:
        kw["micro_batch"], kw["grad_accum"] = min(int(m.batch.micro_batch), 4), min(int(m.batch.grad_accum), 8)
        copied["batch"] = {"real": {"micro_batch": m.batch.micro_batch, "grad_accum": m.batch.grad_accum},
                           "rehearsal": {"micro_batch": kw["micro_batch"], "grad_accum": kw["grad_accum"]},
                           "rule": "micro_batch min(real, 4), grad_accum min(real, 8)"}
    sc = m.scheduler.config or {}
    if sc.get("total_steps") and sc.get("warmup") is not None:
        copied["schedule"] = {"real": {"warmup": sc["warmup"], "total_steps": sc["total_steps"], "unit": m.scheduler.unit},
                              "warmup_fraction": float(sc["warmup"]) / float(sc["total_steps"])}
    copied["data"] = {"sampler": m.data.sampler, "order": m.data.order,
                      "policy": "elastic global cursor carried (the rehearsal trainer's sampler)"}
    prev = [e for e in m.lineage if e.event == "transition"]
    if prev and prev[-1].policies.get("data"):
        copied["data"]["last_transition_policy"] = prev[-1].policies.get("data")
    copied["key_convention"] = {"real": m.key_convention, "rehearsal": "reshard"}
    return {"train": kw, "copied": copied}


def like_family(m: Any, params: Callable[[], list[str]]) -> tuple[str, str]:
    """The model family of a ``--like`` checkpoint, and how it was found.

    The manifest's ``model.family``; where that says "unknown" (reshard's own output of a source
    without a manifest, e.g. a slice of a torchtitan Llama: the plan chose the partition rules by
    their markers, and an older reshard did not record them in ``model``), the family the
    lineage's last slice was cut by, else the shipped family whose markers the parameter names
    match (`reshard.semantics.rules.select`, as a plan chooses; ``params()`` reads them, only then).
    "unknown" only when none does.
    """
    from reshard.semantics.rules import select

    if m.model.family not in (None, "", "unknown"):
        return m.model.family, "the manifest's model.family"
    for e in reversed(m.lineage):
        got = (e.policies.get("slice") or {}).get("family") if isinstance(e.policies, dict) else None
        if got:
            return str(got), "the family the manifest's lineage says its slice was cut by"
    try:
        return select(params()).family, "the partition rules its parameter names match"
    except BadInput:
        return "unknown", "no manifest family, and no shipped partition rules match its parameter names"


def _check_like_sizes(cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]], rules: Any, where: str,
                      prefix: str) -> None:
    """The manifest's model sizes against the checkpoint's tensors (`reshard.semantics.sizes`), before the
    rehearsal model is sized by them: a value that is no positive integer, that a tensor contradicts, that
    does not divide as the model needs (dim % n_heads) or that describes an absurd model is refused (exit 2)
    naming the key and the tensor, instead of building (and allocating) a model from it."""
    from reshard.semantics import sizes

    found = sizes.check(sizes.stated_from(cfg, "the manifest", "model.config."), shapes, sizes.carriers_from_rules(rules),
                        parameters=sum(math.prod(s) for s in shapes.values()), names={p: prefix + p for p in shapes})
    found.refuse(where=where, hint="--like copies the model's shape from the manifest: fix model.config there to the "
                                   "checkpoint's sizes (or rehearse without --like).")


def rehearse(*, from_spec: str, to_spec: str, trainer: str | None = None, steps: int = 24, switch_at: int = 4,
             window: int = 20, micro_batch: int | None = None, grad_accum: int | None = None,
             like: Path | None = None, out: Path, tolerances: dict | None = None, hooks: dict | None = None,
             seed: int = 0, dropout: float = 0.0, data_policy: str | None = None,
             source_micro_batch: int | None = None, source_grad_accum: int | None = None,
             control: str | None = None, dataset_len: int | None = None, reuse_baseline: Path | None = None,
             timeout: float | None = None, say: Callable[[str], None] | None = None) -> dict:
    """Rehearse the transition ``from_spec -> to_spec``; write rehearsal.{json,md,png} into ``out``.

    ``trainer``: the user's command under the trainer contract (formats/trainer_contract.md);
    None runs the reference trainer through the same contract. ``micro_batch`` /
    ``grad_accum`` are the target recipe overrides handed to the planner (by default the plan
    keeps the global batch); ``source_micro_batch`` / ``source_grad_accum`` the source run's
    recipe (default: one both layouts divide, ``recipe.pick_recipe``; ``like`` replaces them
    with the real checkpoint's). ``control``: ``relaunch``, ``naive-state`` or ``none`` (see the
    module docstring; default naive-state for the reference, relaunch for a user's trainer).
    ``dataset_len``: the samples asked of the trainer's data (default: just enough that no run
    crosses an epoch). ``reuse_baseline``: an earlier rehearsal's output directory whose
    baseline (same layout, recipe, steps, seed and data length) is used instead of running one.
    ``hooks["after_convert"](dst)`` runs after conversion, before the resume; if it returns
    a path, that checkpoint is resumed instead of ``dst``. Returns the report (also
    ``rehearsal.json``) with ``exit_code`` (0: within tolerance and coverage exact) and
    ``diverged`` (what diverged, named). ``say``: where a line per phase and per optimizer
    step goes while it runs (the command line's progress on a terminal; None: nothing).
    """
    from reshard.model.plan import Options

    t_start = time.perf_counter()
    src, tgt = _topology(from_spec, "from"), _topology(to_spec, "to")
    _check_arguments(steps, switch_at, window, hooks, control, trainer=trainer, like=like, dropout=dropout)
    out = Path(out)
    reuse = _reused_dir(reuse_baseline, out)
    setup = _make_setup(src, tgt, trainer=trainer, steps=steps, switch_at=switch_at, window=window, out=out,
                        seed=seed, dropout=dropout, like=like, micro_batch=micro_batch, grad_accum=grad_accum,
                        source_micro_batch=source_micro_batch, source_grad_accum=source_grad_accum,
                        control=control, dataset_len=dataset_len, timeout=timeout)
    setup.say = say
    _fresh_outputs(out, keep_baseline=reuse is not None and reuse.resolve() == out.resolve())
    timings: dict[str, float] = {}
    with _timed(timings, "baseline"):
        baseline = _run_baseline(setup, reuse)
    _check_rules_family(setup, baseline.src_ckpt)
    setup.tell(f"converting the step-{switch_at} checkpoint to {to_spec}, then verifying it …")
    with _timed(timings, "plan_convert_verify"):
        switch = _convert_at_switch(setup, baseline.src_ckpt, hooks, Options(
            to=to_spec, micro_batch=micro_batch, grad_accum=grad_accum, data_policy=data_policy,
            source_micro_batch=setup.recipe.source.micro_batch, source_grad_accum=setup.recipe.source.grad_accum))
    control_info = _make_control(setup, baseline, switch)
    with _timed(timings, "resumed_and_control"):
        errors = _run_resumed_and_control(setup, switch, control_info)
    setup.tell("comparing the runs over the window …")
    cmp = judge.compare_runs(setup, baseline)
    tol, derivation = judge.tolerances(setup, baseline, cmp.base, tolerances)
    diverged = judge.diverged(setup, switch, cmp, tol, errors["resumed"])
    report = judge.report(setup, baseline, switch, cmp, tol=tol, derivation=derivation, diverged=diverged,
                          exactness=judge.exactness(setup, switch, cmp, tol),
                          control=judge.control_section(setup, control_info, errors["control"], cmp), errors=errors,
                          diagnosis=judge.diagnosis(setup, switch, cmp, tol))
    _write_outputs(report, out, timings, t_start)
    return report


# ---------------------------------------------------------------------- the shared setup

@dataclass
class _Setup:
    """What every run of one rehearsal shares, fixed before the first rank starts: the two
    layouts, the window, the trainer command, the recipe (picked, given, or scaled from
    ``--like``) and a data length that keeps every run inside one epoch."""

    src: Topology
    tgt: Topology
    steps: int
    switch_at: int
    window: int
    out: Path
    seed: int
    dropout: float
    like: Path | None
    command: TrainerCommand
    recipe: RecipeChoice
    model_kw: dict[str, Any]          # the reference model's shape (from --like; {} otherwise)
    copied: dict[str, Any] | None     # what --like copied from the real checkpoint (None without it)
    warmup: int
    dataset_len: int
    control: str                      # relaunch | naive-state | none
    timeout: float | None
    runs: dict[str, RunResult] = field(default_factory=dict)
    say: Callable[[str], None] | None = None  # progress lines on a terminal (None: nobody is watching)
    start: Path | None = None  # --trainer with --like SLICE: the checkpoint the baseline resumes (None: from scratch)

    def tell(self, line: str) -> None:
        """A progress line, when somebody is watching."""
        if self.say is not None:
            self.say(line)

    @property
    def window_steps(self) -> list[int]:
        """The steps compared: the ``window`` steps after the switch."""
        return list(range(self.switch_at + 1, self.switch_at + self.window + 1))

    @property
    def structural(self) -> bool:
        """tp or pp changes: sums are taken in another order, so the tolerances need a noise floor."""
        return self.src.tp != self.tgt.tp or self.src.pp != self.tgt.pp

    @property
    def g_src(self) -> int:
        """The source run's global batch."""
        return self.recipe.source.global_batch

    def spec(self, name: str, layout: Topology, micro_batch: int, grad_accum: int, *, save_at: list[int],
             ckpt_in: Path | None = None, steps: int | None = None) -> RunSpec:
        """One run's placeholders; outputs under ``out/<name>`` and ``out/<name>.jsonl``."""
        return RunSpec(name=name, layout=layout, micro_batch=micro_batch, grad_accum=grad_accum,
                       steps=steps or self.steps, total_steps=self.steps, save_at=save_at,
                       ckpt_out=self.out / name, log=self.out / f"{name}.jsonl", seed=self.seed,
                       dataset_len=self.dataset_len, ckpt_in=ckpt_in)

    def execute(self, spec: RunSpec) -> RunResult:
        """Run one spec with the trainer command; the result is kept for the report."""
        spec.log.unlink(missing_ok=True)
        start = "from scratch" if spec.ckpt_in is None else f"resuming {Path(spec.ckpt_in).name}"
        self.tell(f"{spec.name} run on {layout_spec(spec.layout)} ({start}, micro-batch {spec.micro_batch} x "
                  f"accumulation {spec.grad_accum}, to step {spec.steps}) …")
        with follow_steps(spec.log, spec.name, spec.steps, self.say):
            result = run(self.command, spec, out_dir=self.out, timeout=self.timeout)
        self.runs[spec.name] = result
        return result


def _check_arguments(steps: int, switch_at: int, window: int, hooks: dict | None, control: str | None, *,
                     trainer: str | None, like: Path | None, dropout: float) -> None:
    """Refuse a window that does not fit in the run, hooks this function would silently ignore,
    and options that only the reference trainer has."""
    if switch_at < 1 or window < 1:
        raise BadInput(f"switch_at ({switch_at}) and window ({window}) must be >= 1")
    if steps < switch_at + window:
        raise BadInput(f"steps ({steps}) must be >= switch_at + window ({switch_at} + {window})")
    unknown_hooks = set(hooks or {}) - {"after_convert"}
    if unknown_hooks:
        raise BadInput(f"unknown hooks {sorted(unknown_hooks)}", hint="Known: after_convert.")
    if control is not None and control not in CONTROLS:
        raise BadInput(f"--control {control}: unknown", hint=f"Known: {', '.join(CONTROLS)}.")
    # with --trainer, --like is a slice of the real checkpoint (convert --layers), checked in `_slice_start`
    if trainer is not None and dropout:
        raise BadInput(f"--dropout {dropout} sets the reference model's dropout; your trainer's randomness is its own",
                       hint="Turn dropout off in your trainer's command for a deterministic rehearsal.")


def _reused_dir(reuse_baseline: Path | None, out: Path) -> Path | None:
    """The earlier rehearsal whose baseline is reused, checked to hold one."""
    if reuse_baseline is None:
        return None
    d = Path(reuse_baseline)
    if not (d / "baseline.json").is_file():
        raise BadInput("no baseline to reuse here (baseline.json missing)", where=str(d),
                       hint="Pass the --out directory of an earlier rehearsal that ran its baseline.")
    return d


def _fresh_outputs(out: Path, *, keep_baseline: bool = False) -> Path:
    """Create ``out`` and remove a previous rehearsal's runs, so no stale log or checkpoint is compared."""
    out.mkdir(parents=True, exist_ok=True)
    for name in RUN_NAMES + ("converted", "control_ckpt"):
        if keep_baseline and name == "baseline":
            continue
        shutil.rmtree(out / name, ignore_errors=True)
        (out / f"{name}.jsonl").unlink(missing_ok=True)
        (out / f"{name}.out").unlink(missing_ok=True)
    if not keep_baseline:
        (out / "baseline.json").unlink(missing_ok=True)
    return out


def _make_setup(src: Topology, tgt: Topology, *, trainer: str | None, steps: int, switch_at: int, window: int,
                out: Path, seed: int, dropout: float, like: Path | None, micro_batch: int | None,
                grad_accum: int | None, source_micro_batch: int | None, source_grad_accum: int | None,
                control: str | None, dataset_len: int | None, timeout: float | None) -> _Setup:
    """The trainer command, the recipe (checked against both layouts) and the data length every run needs."""
    start = None
    if trainer is not None and like is not None:  # your trainer starts from a slice of the real checkpoint
        model_kw, copied, warmup = {}, _slice_start(Path(like), src, switch_at), 2
        start = Path(like)
        sl = copied["slice_start"]
        source_micro_batch = source_micro_batch or sl["micro_batch"]
        source_grad_accum = source_grad_accum or sl["grad_accum"]
        if sl.get("seed") is not None and seed not in (0, sl["seed"]):
            raise BadInput(f"--seed {seed}, but the slice's data order has seed {sl['seed']}", where=str(like),
                           hint="Drop --seed: the rehearsal resumes the slice with its own data order.")
        seed = sl["seed"] if sl.get("seed") is not None else seed
        dataset_len = dataset_len or sl.get("dataset_len")
    else:
        model_kw, copied, warmup = _like_recipe(like, src, steps)
    if copied is not None and "micro_batch" in model_kw:
        source_micro_batch, source_grad_accum = model_kw.pop("micro_batch"), model_kw.pop("grad_accum")
    if trainer is None:
        _check_model_divides(src, tgt, model_kw)
        command = reference_command(dropout=dropout, warmup=warmup, model=model_kw)
    else:
        command = TrainerCommand(trainer)
    recipe = pick_recipe(src.dp, tgt.dp, source_micro_batch=source_micro_batch, source_grad_accum=source_grad_accum,
                         micro_batch=micro_batch, grad_accum=grad_accum)
    kind = control or ("naive-state" if command.reference else "relaunch")
    need = _dataset_need(src, tgt, steps, switch_at, recipe, kind)
    if dataset_len is None:
        unit = _lcm(recipe.source.global_batch, recipe.target.global_batch)
        dataset_len = -(-need // unit) * unit + unit
    elif dataset_len < need:
        raise BadInput(f"--dataset-len {dataset_len}: the runs of this rehearsal read {need} samples",
                       hint=f"Pass at least {need}, or leave it to the rehearsal.")
    return _Setup(src=src, tgt=tgt, steps=steps, switch_at=switch_at, window=window, out=out, seed=seed,
                  dropout=dropout, like=like, command=command, recipe=recipe, model_kw=model_kw, copied=copied,
                  warmup=warmup, dataset_len=dataset_len, control=kind, timeout=timeout, start=start)


def _slice_start(like: Path, src: Topology, switch_at: int) -> dict[str, Any]:
    """``--trainer CMD --like SLICE``: the baseline resumes a slice reshard made (`convert --layers`).

    A slice of the real checkpoint carries its real weights, Adam moments, step, schedule and
    data position: the user's trainer, configured with the slice's layer count, rehearses the
    transition on them instead of on a fresh model. Refused unless the manifest says it is a
    slice, it is laid out for ``--from`` and its step comes before the switch; its recipe,
    seed and data length are the rehearsal's (what the resumed trainer must be given).
    """
    from reshard.semantics.manifest import read_manifest
    from reshard.storage.checkpoints.index import CheckpointIndex

    m = read_manifest(like)
    slices = [e for e in (m.lineage if m is not None else []) if isinstance(e.policies, dict) and e.policies.get("slice")]
    if m is None or not slices:
        raise BadInput("with --trainer, --like takes a slice of the real checkpoint made by reshard (its manifest "
                       "names the slice); this is not one", where=str(like),
                       hint="Make one with `reshard convert SRC SLICE --to SPEC --layers RANGE`, or drop --like "
                            "(your trainer builds its own model).")
    layout = {k: m.topology.dims.get(k, 1) for k in ("dp_shard", "tp", "pp")}
    if layout != {"dp_shard": src.dp_shard, "tp": src.tp, "pp": src.pp}:
        raise BadInput(f"the slice is laid out for {m.topology.dims}, and --from is {layout_spec(src)}",
                       where=str(like / "manifest.json"),
                       hint="Rehearse --from the slice's layout, or make the slice with --to at the --from layout.")
    step = int(m.step or 0)
    if step >= switch_at:
        raise BadInput(f"the slice is at step {step}: the switch (--switch-at {switch_at}) must come after it",
                       where=str(like), hint=f"Pass --switch-at above {step} (and --steps to match): steps are absolute.")
    ix = CheckpointIndex.open(like)

    def obj(key: str) -> Any:
        return ix.read_object(key) if key in ix.entries and not ix.entries[key].is_tensor else None

    seed = obj("data.sampler.seed")
    dataset_len = obj("data.sampler.dataset_len") or (m.data.dataset_len if m.data else None) or None
    info = {"from": str(like), "step": step, "slice": slices[-1].policies["slice"],
            "micro_batch": m.batch.micro_batch, "grad_accum": m.batch.grad_accum,
            "seed": int(seed) if isinstance(seed, int) else (m.data.seed if m.data else None),
            "dataset_len": int(dataset_len) if dataset_len else None,
            "how": f"the baseline resumes the slice at step {step} (its real weights, moments, schedule and data "
                   "position) on --from; the trainer must build the slice's model"}
    return {"from": str(like), "slice_start": info}


def _like_recipe(like: Path | None, src: Topology, steps: int) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
    """(model_kw, copied, warmup): what ``like`` scales down from a real checkpoint (model shape and
    recipe), with its warmup kept as the same fraction of the (shorter) rehearsal."""
    if like is None:
        return {}, None, 2
    got = _from_like(Path(like), src)
    copied = got["copied"]
    warmup = 2
    frac = (copied.get("schedule") or {}).get("warmup_fraction")
    if frac is not None:
        warmup = max(1, round(frac * steps)) if frac > 0 else 0
        copied["schedule"]["rehearsal"] = {"warmup": warmup, "total_steps": steps}
    return dict(got["train"]), copied, warmup


def _check_model_divides(src: Topology, tgt: Topology, model_kw: dict[str, Any]) -> None:
    """Both layouts must split the reference model: tp its heads, pp its layers."""
    n_heads = model_kw.get("n_heads", 2)
    for t, name in ((src, "from"), (tgt, "to")):
        if n_heads % t.tp:
            raise BadInput(f"--{name}: tp={t.tp} does not divide the rehearsal model's n_heads={n_heads}")
        if model_kw.get("n_layers", 2) % t.pp:
            raise BadInput(f"--{name}: pp={t.pp} does not divide the rehearsal model's n_layers={model_kw.get('n_layers', 2)}")


def _dataset_need(src: Topology, tgt: Topology, steps: int, switch_at: int, recipe: RecipeChoice,
                  control: str) -> int:
    """Samples the furthest-reading run consumes: baseline, resumed, and the control (a replayed
    local cursor starts elsewhere; a relaunch keeps the source's per-rank recipe on the target)."""
    k, g_src, g_tgt = switch_at, recipe.source.global_batch, recipe.target.global_batch
    need = max(steps * g_src, k * g_src + (steps - k) * g_tgt)
    if control == "naive-state":
        need = max(need, (k * g_src // src.dp) * tgt.dp + (steps - k) * g_tgt)
    elif control == "relaunch":
        need = max(need, k * g_src + (steps - k) * recipe.source.micro_batch * recipe.source.grad_accum * tgt.dp)
    return need


@contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Record the wall time of the block as ``timings[name]`` (the report's ``timings_s``)."""
    t0 = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - t0


# ---------------------------------------------------------------------- 1. baseline (+ noise floor)

@dataclass
class _Baseline:
    """The source run: its spec, the noise-floor run's (None when none is needed or possible), its
    checkpoints at the switch and one step after (optimizer state to compare), its log, and the
    command that produced it (an earlier rehearsal's, when reused)."""

    spec: RunSpec
    floor_spec: RunSpec | None
    src_ckpt: Path
    next_ckpt: Path
    log: Path
    command: str
    reused_from: Path | None = None


def _run_baseline(setup: _Setup, reuse: Path | None) -> _Baseline:
    """Run the source layout uninterrupted (or take an earlier rehearsal's run), then the noise floor."""
    k, src, r = setup.switch_at, setup.src, setup.recipe.source
    spec = setup.spec("baseline", src, r.micro_batch, r.grad_accum, save_at=[k, k + 1], ckpt_in=setup.start)
    if reuse is not None:
        base = _reused_baseline(setup, spec, reuse)
    else:
        res = setup.execute(spec)
        if res.returncode:
            raise Infeasible(res.error or "baseline run failed", where=str(res.output),
                             hint="The source run itself failed: see its output (the trainer's stderr).")
        base = _Baseline(spec=spec, floor_spec=None, src_ckpt=judge.saved(spec, k),
                         next_ckpt=judge.saved(spec, k + 1), log=spec.log, command=res.command)
        _write_atomic(setup.out / "baseline.json", json.dumps(
            {"identity": spec.identity(), "command": res.command, "template": setup.command.template,
             "checkpoints": {str(k): str(base.src_ckpt), str(k + 1): str(base.next_ckpt)}, "log": str(spec.log)},
            indent=2) + "\n")
    floor = _floor_spec(setup, spec)
    if floor is not None:
        res = setup.execute(floor)
        if res.returncode:
            raise Infeasible(res.error or "noise-floor run failed", where=str(res.output),
                             hint="The source layout with another accumulation split failed: see its output.")
    return replace(base, floor_spec=floor)


def _reused_baseline(setup: _Setup, spec: RunSpec, reuse: Path) -> _Baseline:
    """An earlier rehearsal's baseline, refused unless it ran what this one would."""
    rec = loads_json((reuse / "baseline.json").read_bytes(), where=str(reuse / "baseline.json"),
                     what="earlier rehearsal's baseline")
    want = spec.identity()
    diff = {f: (rec["identity"].get(f), v) for f, v in want.items() if rec["identity"].get(f) != v}
    if diff:
        raise BadInput("the baseline to reuse ran another experiment: " + "; ".join(
            f"{f} {a} there, {b} here" for f, (a, b) in diff.items()), where=str(reuse / "baseline.json"),
            hint="Rehearse with the same --from, recipe, --steps, --switch-at, --seed and --dataset-len, or run "
                 "a baseline of its own (no --reuse-baseline).")
    k = setup.switch_at
    return _Baseline(spec=spec, floor_spec=None, src_ckpt=Path(rec["checkpoints"][str(k)]),
                     next_ckpt=Path(rec["checkpoints"][str(k + 1)]), log=Path(rec["log"]), command=rec["command"],
                     reused_from=reuse)


def _floor_spec(setup: _Setup, base: RunSpec) -> RunSpec | None:
    """For a tp/pp change, the source run again with only the accumulation split changed: the same
    sums in another order, i.e. the fp32 noise floor. None for a dp-only change, or when micro_batch
    and grad_accum are both odd (no split to take)."""
    if not setup.structural:
        return None
    k = setup.switch_at
    mb, ga = base.micro_batch, base.grad_accum
    split = (mb * 2, ga // 2) if ga % 2 == 0 else (mb // 2, ga * 2) if mb % 2 == 0 else None
    if not split:
        return None
    return setup.spec("floor", base.layout, split[0], split[1], save_at=[k + 1], steps=k + setup.window)


def _check_rules_family(setup: _Setup, src_ckpt: Path) -> None:
    """With ``--like``: the rehearsal model must select the real checkpoint's partition rules, or the
    rehearsal would not exercise them. Records the family in ``setup.copied``."""
    from reshard.semantics.rules import select
    from reshard.storage.checkpoints.index import CheckpointIndex

    copied = setup.copied
    if copied is None or "slice_start" in copied:  # your trainer on a slice: its own model, the real rules
        return
    bix = CheckpointIndex.open(src_ckpt)
    rules_family = select(sorted(x[len("model."):] for x in bix.entries if x.startswith("model.")),
                          family="reshard-reference-gpt").family
    copied["rehearsal_rules_family"] = rules_family
    if rules_family != copied["rules_family"]:
        raise BadInput(f"the rehearsal model selects partition rules '{rules_family}', the real checkpoint "
                       f"'{copied['rules_family']}': the rehearsal would not exercise the same rules",
                       where=str(setup.like))


# ---------------------------------------------------------------------- 2. plan, convert, verify, resume

@dataclass
class _Switch:
    """The conversion at the switch: the plan, where it wrote, what is resumed (a hook may substitute
    its own checkpoint), the planned rewrites and verify's comparison of source and resumed state."""

    plan: Plan
    dst: Path
    resume_from: Path
    hooked: bool
    planned: dict[str, str]
    verified: dict[str, Any]

    @property
    def after(self) -> Recipe:
        """The target batch recipe the plan chose (a feasible plan always has one)."""
        return self.plan.batch.after


def _convert_at_switch(setup: _Setup, src_ckpt: Path, hooks: dict | None, options: Options) -> _Switch:
    """Plan and convert the switch checkpoint as a real transition would, run the after_convert
    hook, then verify the resumed checkpoint against the source (only planned rewrites may differ)."""
    from reshard.engine.conversion import convert
    from reshard.planning.plan import make_plan
    from reshard.verification.checkpoints import verify_checkpoints

    plan = make_plan(src_ckpt, options)
    if not plan.feasible:
        raise Infeasible("the plan is infeasible: " + "; ".join(plan.reasons), where=str(src_ckpt))
    if plan.batch.after is None:
        raise Infeasible("the plan chose no target batch recipe", where=str(src_ckpt),
                         hint="Pass --micro-batch and --grad-accum for the target.")
    dst = setup.out / "converted"
    convert(plan, src_ckpt, dst)
    resume_from = dst
    hook = (hooks or {}).get("after_convert")
    if hook is not None:
        ret = hook(dst)
        if ret is not None:
            resume_from = Path(ret)
    planned = {a.key: a.action for a in plan.keys if a.action in EXPECTED_DIFFERENCES}
    v = verify_checkpoints(src_ckpt, resume_from, expected_rewrites=planned)
    return _Switch(plan=plan, dst=dst, resume_from=resume_from, hooked=hook is not None, planned=planned, verified=v)


def _make_control(setup: _Setup, baseline: _Baseline, switch: _Switch) -> dict[str, Any] | None:
    """What the control resumes from, with which recipe, and how it was made (None: no control)."""
    src, tgt, r = setup.src, setup.tgt, setup.recipe.source
    if setup.control == "none":
        return None
    if setup.control == "relaunch":
        g = r.micro_batch * r.grad_accum * tgt.dp
        return {"kind": "relaunch", "ckpt": baseline.src_ckpt, "micro_batch": r.micro_batch,
                "grad_accum": r.grad_accum, "global_batch": g, "cursor_before": None, "cursor_after": None,
                "how": (f"the trainer relaunched on {layout_spec(tgt)} straight from the unconverted checkpoint "
                        f"{baseline.src_ckpt} with its source recipe {r.micro_batch} x {r.grad_accum} per rank "
                        f"(global batch {g} instead of {r.global_batch}): what resuming without reshard does; "
                        "DCP reshards the tensors on load")}
    from reshard.storage.checkpoints.index import CheckpointIndex

    if "data.sampler.cursor" not in CheckpointIndex.open(baseline.src_ckpt).entries:
        raise BadInput("--control naive-state rewrites data.sampler.cursor, which this trainer's checkpoint "
                       "does not hold", where=str(baseline.src_ckpt), hint="Use --control relaunch (or none).")
    info = make_control(baseline.src_ckpt, setup.out / "control_ckpt", source_dp=src.dp, target_dp=tgt.dp)
    return {"kind": "naive-state", "ckpt": Path(info["path"]), "micro_batch": switch.after.micro_batch,
            "grad_accum": switch.after.grad_accum, "global_batch": switch.after.global_batch, **info}


def _run_resumed_and_control(setup: _Setup, switch: _Switch, control: dict[str, Any] | None) -> dict[str, str | None]:
    """Resume the converted checkpoint, then the control, on the target layout, each its own run.
    Returns the report's ``errors``: {"resumed": ..., "control": ...}."""
    k, tgt, after = setup.switch_at, setup.tgt, switch.after
    res = setup.execute(setup.spec("resumed", tgt, after.micro_batch, after.grad_accum, save_at=[k + 1],
                                   ckpt_in=switch.resume_from))
    ctl_err = None
    if control is not None:
        ctl = setup.execute(setup.spec("control", tgt, control["micro_batch"], control["grad_accum"],
                                       save_at=[k + 1], ckpt_in=control["ckpt"]))
        ctl_err = ctl.error
    return {"resumed": res.error, "control": ctl_err}


# ---------------------------------------------------------------------- outputs

def _write_outputs(report: dict[str, Any], out: Path, timings: dict[str, float], t_start: float) -> None:
    """Draw the figure, add it and the timings to the report, write rehearsal.{png,json,md}."""
    from reshard.render.rehearsal import render_markdown, render_png

    tmp = out / ".rehearsal.png.tmp"
    report["plot"] = render_png(tmp, report)
    os.replace(tmp, out / "rehearsal.png")
    timings["total"] = time.perf_counter() - t_start
    report["timings_s"] = {n: round(x, 2) for n, x in timings.items()}
    _write_atomic(out / "rehearsal.json", json.dumps(report, indent=2, default=str) + "\n")
    _write_atomic(out / "rehearsal.md", render_markdown(report))


def _write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and rename: a reader never sees half a report."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
