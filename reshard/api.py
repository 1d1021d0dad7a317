"""The public Python API: what the command line does, as functions of plain values (docs/api.md).

A plan inside a notebook, a launcher that decides whether a resume needs a conversion, a
training script's resume path: none of them should shell out to ``reshard`` and parse its
output. Each function here is one command of the CLI with the parsing taken off:

* it takes plain Python values: paths as ``str`` or `pathlib.Path` (or an ``s3://bucket/prefix``
  URL where the CLI takes one), ``to="dp=2"``, and the CLI's options as keyword arguments named
  as its long flags in snake_case (``--micro-batch 4`` is ``micro_batch=4``, ``--keep P`` is
  ``keep=["P"]``; ``--from`` is ``from_spec``, since ``from`` is a Python keyword);
* it returns the typed objects the layers below pass around (an `Inspection`, a `Plan`, a
  report as the JSON data ``--json`` prints);
* it raises the `reshard.errors.ReshardError` hierarchy (`BadInput`, exit code 2; `Infeasible`,
  exit code 1; ...), never ``SystemExit``; an ``OSError`` nothing mapped becomes the `BadInput`
  the CLI would print (`reshard.errors.from_os_error`; ``map_os_errors=False``: it stays itself);
* it prints nothing: progress goes to the ``progress`` object the caller passes (a
  `reshard.render.progress.Progress`), and a flag that has no effect as given is a
  `ReshardWarning` (Python's ``warnings``, which the caller filters), where the CLI prints a
  ``warning:`` line (``warn=``, a callable, takes them instead: `_api_call`).

It checks what the CLI checks before any work (`reshard.arguments`: conflicts, choices, the
target spec, a missing source), in the same words, so an error reads the same from either.
It imports no torch on the paths where the CLI imports none (inspect, plan, verify of bytes,
``convert(data="link")``): every heavy import is inside the function that needs it.

The CLI is "parse, call, render" over these functions (`reshard.cli`; ``convert`` still calls its
command): its parsing gives these keyword arguments, it passes ``warn=``, ``map_os_errors=False``
and a ``progress`` callable (called once the arguments are checked: the command's first line), and
the renderers (`reshard.render.report`) print what these functions return.
"""
from __future__ import annotations

import contextvars
import functools
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable, Literal, TypedDict, TypeVar, Union

from reshard import arguments as args
from reshard.errors import BadInput, Incomplete, Infeasible, ReshardError, UnsafeInput, from_os_error
from reshard.model import option_table
from reshard.model.inspection import Inspection
from reshard.model.option_table import OptionSpec
from reshard.model.plan import PLAN_VERSION, Options, Plan
from reshard.render.progress import Progress

try:  # ``**options: Unpack[PlanOptions]``: keyword options typed by a TypedDict (PEP 692)
    from typing import Unpack
except ImportError:  # Python 3.10
    from typing_extensions import Unpack

__all__ = ["inspect", "plan", "convert", "verify", "export", "import_", "estimate", "Inspection", "Plan", "Options",
           "PlanOptions", "ReshardError", "BadInput", "Incomplete", "UnsafeInput", "Infeasible", "ReshardWarning"]

PathLike = Union[str, "os.PathLike[str]"]
"""A checkpoint or file: a path (``str`` or `pathlib.Path`), or where the CLI takes one, an ``s3://`` URL."""


class ReshardWarning(UserWarning):
    """A flag that has no effect as given (the CLI's ``warning:`` lines), e.g. ``seed`` with
    ``rng_policy="carry"``. Filter it as any warning: ``warnings.simplefilter("error", ReshardWarning)``."""


_API_TYPES: dict[str, Any] = {
    "model_config": Union[Mapping[str, int], list[str]],  # name=integer, or a mapping
    "tie": Union[str, list[str], list[tuple[str, str]]],   # A=B, or ("A", "B")
}
"""The keyword options whose Python values go beyond what the flag takes (`_as_list` writes them as the CLI takes them)."""


def _api_type(spec: OptionSpec) -> Any:
    """The Python type an option of the table takes as a keyword: its choices as a ``Literal``, a path
    as `PathLike`, a repeatable option as one value or a list."""
    if spec.name in _API_TYPES:
        return _API_TYPES[spec.name]
    one: Any = PathLike if spec.type is Path else Literal[spec.choices] if spec.choices else spec.type
    return Union[one, list[one]] if spec.repeatable else one


PlanOptions = TypedDict("PlanOptions", {spec.name: _api_type(spec) for spec in option_table.PLAN_OPTIONS},  # type: ignore[misc]
                        total=False)
PlanOptions.__doc__ = """The plan options of `plan` and `convert`, one per flag of ``reshard plan`` (and ``dtype``,
``only`` of ``reshard convert``), made from `reshard.model.option_table` (each option's flag, choices
and lower bound are there; docs/cli.md says what each does). A list option also takes a single string."""

_INSPECT_OPTIONS = tuple(spec.name for spec in option_table.for_verb("inspect") if spec.plan)
_LISTS = tuple(spec.name for spec in option_table.PLAN_OPTIONS if spec.repeatable)
_PATHS = tuple(spec.name for spec in option_table.PLAN_OPTIONS if spec.type is Path and not spec.repeatable)
_CHOICES: dict[str, tuple[str, ...]] = {
    **{spec.name: spec.choices for spec in option_table.OPTIONS if spec.choices},
    "data": args.DATA_MODES, "format": args.EXPORT_FORMATS}
_AT_LEAST = {**{spec.name: spec.min for spec in option_table.OPTIONS if spec.min is not None}, "threads": 1}

_F = TypeVar("_F", bound=Callable[..., Any])


_WARN: "contextvars.ContextVar[Callable[[str], None] | None]" = contextvars.ContextVar("reshard_api_warn", default=None)
"""Where the call under way sends its warnings (its ``warn=`` keyword), None: `ReshardWarning`."""


def _api_call(fn: _F) -> _F:
    """An API function as the CLI runs its command, with two keywords every function takes:

    * ``warn``: None (default), each warning is a `ReshardWarning`, and the object items
      ``trust_pickle`` let unpickle with arbitrary classes are named once when the call ends
      (as the CLI's last ``warning:`` line names them), whether it succeeded or not; a callable,
      it receives each warning's text as it arises instead (the CLI prints it as a ``warning:``
      line), and the trusted items are left to the caller to name
      (``reshard.storage.checkpoints.dcp.TRUSTED_UNPICKLES.warning()``, the CLI's last line);
    * ``map_os_errors``: True (default), an ``OSError`` nothing below mapped leaves as the
      `BadInput` the CLI prints for it (exit 2); False, it leaves as itself (the CLI renders it,
      ``code: os_error`` under ``--json``).
    """
    @functools.wraps(fn)
    def wrapped(*a: Any, warn: Callable[[str], None] | None = None, map_os_errors: bool = True, **kw: Any) -> Any:
        token = _WARN.set(warn)
        try:
            return fn(*a, **kw)
        except OSError as exc:
            if not map_os_errors:
                raise
            raise from_os_error(exc) from exc
        finally:
            _WARN.reset(token)
            dcp = sys.modules.get("reshard.storage.checkpoints.dcp")  # not imported: nothing was unpickled
            line = dcp.TRUSTED_UNPICKLES.warning() if dcp is not None and warn is None else None
            if line:
                warnings.warn(line.removeprefix("warning: "), ReshardWarning, stacklevel=2)

    return wrapped  # type: ignore[return-value]


def _warn(line: str, stacklevel: int) -> None:
    """A warning of the call under way: to its ``warn=`` callable, else a `ReshardWarning`."""
    to = _WARN.get()
    if to is not None:
        to(line)
    else:
        warnings.warn(line, ReshardWarning, stacklevel=stacklevel + 1)


def _started(progress: Progress | Callable[[], Progress] | None) -> Progress | None:
    """The ``progress`` of a call once its arguments are checked: a callable is called then (the
    CLI's makes its `Progress` and says the command's first line, after any refusal, before any heavy import)."""
    if progress is not None and not isinstance(progress, Progress) and callable(progress):
        return progress()
    return progress


@_api_call
def inspect(path: PathLike, *, deep: bool = False, from_spec: str | None = None, trust_pickle: bool = False,
            convention: PathLike | Iterable[PathLike] = (), tie: str | Iterable[str | tuple[str, str]] = (),
            profile: PathLike | None = None, no_profile: bool = False,
            progress: Progress | Callable[[], Progress] | None = None) -> Inspection:
    """What ``reshard inspect PATH`` says: is the checkpoint complete, what does it hold, which topology wrote it.

    Returns the `Inspection`: ``report`` is the JSON ``inspect --json`` prints (``complete``,
    ``consistent``, ``topology``, ``keys``, ``problems``, ...), ``exit_code`` the command's (0
    complete and consistent, 1 inconsistent, 2 incomplete), ``topology`` the layout that wrote it.
    A checkpoint that cannot be read at all raises `BadInput` (`Incomplete`, `UnsafeInput`).
    ``deep`` also loads every item (torch is imported then). For an ``s3://`` URL the
    inspection's open reader (``index``) reads a private staged copy that is gone once this returns.
    """
    given = _normalised({"from_spec": from_spec, "trust_pickle": trust_pickle, "convention": convention,
                         "tie": tie, "profile": profile, "no_profile": no_profile}, _INSPECT_OPTIONS)
    args.check_conflicts(profile=given.get("profile"), no_profile=no_profile)
    text = _source_text(path)
    args.check_source(text)
    from reshard.commands.inspect import inspect as run_inspect
    from reshard.planning.options import opened_source

    with opened_source(text) as source:
        return run_inspect(source, _plan_options(source.root, None, given), deep=deep, progress=_started(progress))


@_api_call
def plan(path: PathLike, *, to: str, dst: PathLike | None = None, tensors_out: PathLike | None = None,
         progress: Progress | Callable[[], Progress] | None = None, **options: Unpack[PlanOptions]) -> Plan:
    """What ``reshard plan PATH --to TO`` decides, without writing anything: the `Plan`.

    ``options``: `PlanOptions`, the flags of ``reshard plan`` in snake_case. The plan's
    ``feasible`` and ``reasons`` say whether a conversion can run (an infeasible plan is
    returned, not raised: it is an answer); ``verdict`` whether the run stays the same run
    (``kind``: continuation, continuation_with_changes, warm_start, infeasible; ``kept``: what
    becomes of the optimizer state, the LR schedule, the data position, the RNG and the
    accumulation phase, each with a note); ``to_dict()`` is the JSON ``plan --json`` prints, and
    its ``fingerprint`` what `convert` checks the plan against. Torch is not imported.

    ``dst`` (``plan --dst``): the plan's ``space`` is then the figures `estimate` gives for that
    destination; ``tensors_out`` (``plan --tensors-out``): every tensor's placement and chunks
    are written to that file (JSON lines), and the plan's ``tensors_file`` names it and counts them.

    Raises `BadInput` for a missing source, an unknown option value, or a policy the plan
    needs the user to choose (as the CLI exits 2).
    """
    given = _normalised(options, tuple(PlanOptions.__annotations__))
    _check_plan_flags(to, given)
    text = _source_text(path)
    args.check_source(text)
    progress = _started(progress)
    from reshard.commands.plan import plan as run_plan
    from reshard.planning.options import opened_source

    with opened_source(text) as source:
        opts = _plan_options(source.root, to, given)
        return run_plan(source, opts, dst=dst if dst is None or isinstance(dst, Path) else _source_text(dst),
                        tensors_out=Path(_source_text(tensors_out)) if tensors_out is not None else None,
                        progress=progress)


@_api_call
def convert(src: PathLike | Plan, dst: PathLike, *, to: str | None = None,
            plan: Plan | Mapping[str, Any] | PathLike | None = None, output_format: str = "dcp", data: str = "copy",
            threads: int | None = None, buffer_memory: int | None = None, buffered: bool = False,
            overwrite: bool = False, restart: bool = False, force: bool = False, progress: Progress | Callable[[], Progress] | None = None,
            **options: Unpack[PlanOptions]) -> dict[str, Any] | None:
    """What ``reshard convert SRC DST --to TO`` does: plan, write, verify, commit atomically; returns the report.

    Three ways to say what to do:

    * ``convert(src, dst, to="dp=2", **options)``: plan with `PlanOptions`, then convert;
    * ``convert(p, dst)`` with a `Plan` from `plan` (or ``plan=p``): the plan is made again
      from its source and must have the same fingerprint (the source or the files it was made
      with have not changed), as ``convert --plan`` checks; a plan dict (``plan --json``) works too;
    * ``plan="plan.json"``: the file ``reshard plan --json`` wrote, exactly as ``--plan``.

    The conversion options are the CLI's: ``output_format`` (dcp | local), ``data`` (copy |
    link: share the source's files, no torch imported), ``threads``, ``buffer_memory`` (bytes
    for copy buffers, the CLI's ``--buffer-memory``), ``buffered``, ``overwrite``, ``restart``,
    ``force``. ``dst`` may be an ``s3://`` URL (made locally, then published).

    Returns the conversion report, the JSON ``convert --json`` prints (``verification``,
    ``plan``, ``data``, ``resume``, ...). Raises `Infeasible` (exit code 1) for an infeasible
    plan or an output that does not verify equal to its source (nothing committed), `BadInput`
    (exit code 2) for options, plan, source or destination. Run under torchrun (``RANK`` set),
    every process calls it and writes its share of the target files; processes other than
    rank 0 return None. ``convert --workers`` relaunches the command line itself, so it has no
    keyword here: start torchrun (or the CLI) for it.
    """
    if isinstance(src, Plan):
        if plan is not None:
            raise TypeError("convert(plan, dst) takes the plan as its first argument or as plan=, not both")
        plan, src = src, src.source["path"]
    given = _normalised(options, tuple(PlanOptions.__annotations__))
    _check_values({"output_format": output_format, "data": data, "threads": threads})
    args.check_conflicts(profile=given.get("profile"), no_profile=bool(given.get("no_profile")), buffered=buffered,
                         data=data)
    src_text, dst_text = _source_text(src), _source_text(dst)
    plan_file, planned = (None, None) if plan is None else _given_plan(plan)
    if plan is not None:
        where = str(plan_file) if plan_file is not None else "the plan given"
        args.check_beside_plan(where, given)
        if planned is not None and to is not None and to != planned["options"].get("to"):
            raise BadInput(f"--to {to} disagrees with the plan's target {planned['options'].get('to')}", where=where)
    else:
        _check_plan_flags(to, given)
    if buffer_memory is not None and (type(buffer_memory) is not int or buffer_memory <= 0):
        raise BadInput(f"--buffer-memory {buffer_memory!r} is not a size", hint="Give a number of bytes, e.g. 256 << 20.")
    args.check_restart(restart=restart, output_format=output_format, data=data)
    args.check_remote_source(src_text, data=data, workers=None)
    args.check_remote_destination(dst_text, data=data, workers=None, output_format=output_format)
    args.check_overlap(src_text, dst_text)
    from reshard.engine.distributed import in_torchrun

    if not in_torchrun():  # a worker's errors go through its launcher, as under the CLI
        args.check_source(src_text)
        args.check_destination(dst_text, overwrite=overwrite)
    from reshard.commands.convert import run_convert
    from reshard.planning.options import opened_source

    target: Path | str = dst_text if args.is_url(dst_text) else Path(dst_text)
    with opened_source(src_text) as source:
        opts = None
        if planned is not None:
            opts = _checked_plan(source, planned)
        elif plan_file is None and to is not None:
            opts = _plan_options(source.root, to, given)
        done = run_convert(source, target, opts, to=to if planned is None else opts.to, plan_file=plan_file,
                           output_format=output_format, data=data, threads=threads, window=buffer_memory,
                           buffered=buffered, overwrite=overwrite, restart=restart, force=force, progress=progress)
    if done.report is not None and done.exit_code != 0:  # every output kind refuses a difference itself; kept for safety
        raise Infeasible("the converted checkpoint does not match the source", where=str(dst_text),
                         hint="See the report's verification for the differences.")
    return done.report


class Comparison(dict):  # type: ignore[type-arg]
    """What `verify` returns: the JSON ``verify --json`` prints (a dict: ``equal``, ``differences``,
    ...), and the command's ``exit_code`` (0 equal, 1 different), which is not part of the JSON."""

    @property
    def exit_code(self) -> int:
        return 0 if self["equal"] else 1


@_api_call
def verify(a: PathLike, b: PathLike, *, rtol: float = 0.0, atol: float = 0.0, trust_pickle: bool = False,
           strict: bool = False, buffered: bool = False,
           progress: Progress | Callable[[], Progress] | None = None) -> Comparison:
    """What ``reshard verify A B`` finds: the two checkpoints compared in global terms, whatever their chunking.

    Returns the comparison, the JSON ``verify --json`` prints: ``equal`` (the CLI exits 0 when
    true, 1 when not: the result's ``exit_code``), ``differences`` (each with ``key`` and
    ``detail``), and the differences a
    conversion meant, excused only where the plan recomputed from A and B's lineage predicts
    them (``strict=True`` excuses none). A difference is returned, not raised: it is the answer.
    ``rtol``/``atol`` compare values within a tolerance (torch is imported then; bitwise by default).
    """
    for name, value in (("--rtol", rtol), ("--atol", atol)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise BadInput(f"{name} {value!r} is not a tolerance", hint="Give a number at or above 0.")
    a_text, b_text = _source_text(a), _source_text(b)
    args.check_source(a_text, b_text)
    progress = _started(progress)
    from reshard.commands.verify import verify as run_verify
    from reshard.planning.options import opened_source

    with opened_source(a_text) as source_a, opened_source(b_text) as source_b:
        result, _ = run_verify(source_a, source_b, rtol=float(rtol), atol=float(atol), trust_pickle=trust_pickle,
                               strict=strict, buffered=buffered, progress=progress)
    return Comparison(result)  # its exit_code is the command's


@_api_call
def export(src: PathLike, dst: PathLike, *, format: str = "safetensors", dtype: str | None = None,
           only: str = "model", max_shard_size: str | int = "5GB", rename: PathLike | None = None,
           model_config: Mapping[str, Any] | Iterable[str] | None = None, profile: PathLike | None = None,
           no_profile: bool = False, overwrite: bool = False, force: bool = False,
           progress: Progress | Callable[[], Progress] | None = None) -> dict[str, Any]:
    """What ``reshard export SRC DST`` writes: consolidated weights, streamed tensor by tensor; returns its report.

    ``format``: safetensors (reshard's names), torch, or hf (a directory transformers'
    ``from_pretrained`` loads; ``model_config`` gives what the checkpoint cannot hold, e.g.
    ``{"n_heads": 32}``). ``only``: model or model+optim. ``max_shard_size``: ``"5GB"`` or bytes.
    Returns the export report (the JSON ``export --json`` prints). Raises `BadInput` for options,
    source or destination; torch is imported (tensors are cast and written).
    """
    _check_values({"format": format, "dtype": dtype, "only": only})
    configs = _as_list("model_config", model_config)
    args.check_conflicts(profile=Path(profile) if profile is not None else None, no_profile=no_profile)
    args.check_export(fmt=format, model_config=configs or None)
    src_text, dst_text = _source_text(src), _source_text(dst)
    args.check_remote_destination(dst_text, data="copy", workers=None, output_format="dcp")
    args.check_overlap(src_text, dst_text)
    target: Path | str = dst_text if args.is_url(dst_text) else Path(dst_text)
    args.check_source(src_text)
    args.check_destination(dst_text, overwrite=overwrite)
    progress = _started(progress)
    from reshard.commands.export import export as run_export
    from reshard.planning.options import opened_source

    with opened_source(src_text) as source:
        return run_export(source, target, fmt=format, dtype=dtype, only=only, max_shard_size=max_shard_size,
                          rename=Path(rename) if rename is not None else None, model_config=configs or None,
                          profile=Path(profile) if profile is not None else None, no_profile=no_profile,
                          overwrite=overwrite, force=force, progress=progress)


@_api_call
def import_(src: PathLike, dst: PathLike, *, to: str = "dp=1", rename: PathLike | None = None,
            format: str = "reshard", experiment_id: str | None = None, overwrite: bool = False, force: bool = False,
            progress: Progress | Callable[[], Progress] | None = None) -> dict[str, Any]:
    """What ``reshard import SRC DST --to TO`` writes: consolidated weights as a DCP checkpoint for a
    layout, a warm start with a new experiment id; returns the import report (``import --json``).

    ``format``: reshard (default), a family of ``formats/hf/`` or its native convention
    (torchtitan; SRC a Hugging Face model directory), or deepspeed. (Named ``import_`` because
    ``import`` is a Python keyword.) Raises `BadInput` for options, source or destination.
    """
    args.check_import(fmt=format)
    args.check_destination(_source_text(dst), overwrite=overwrite)
    progress = _started(progress)
    from reshard.commands.importer import import_ as run_import

    return run_import(Path(src), Path(dst), to=to, rename=Path(rename) if rename is not None else None, fmt=format,
                      experiment_id=experiment_id, overwrite=overwrite, force=force, progress=progress)


@_api_call
def estimate(plan: Plan, dst: PathLike) -> dict[str, Any]:
    """Whether the conversion ``plan`` describes fits at ``dst``, and about how long it takes (``plan --dst``).

    Reads metadata only, plus, for a conversion moving 64 MiB or more, a probe of the copy's path of
    about 0.25 s (direct reads of the source, CRC-32, direct writes beside ``dst``, removed after).
    Returns the figures ``plan --dst`` prints: ``needed_bytes``, ``free_bytes``, ``enough``, the time
    as a range (``low_s``, ``high_s``, what bounds it: ``bound``), and ``warning`` (one paragraph, or
    None when there is room).
    Never refuses: `convert` refuses a destination without room (unless ``force``). A source in
    object storage is listed again (the plan's own staged copy went when `plan` returned).
    """
    from reshard.engine.space import space_check
    from reshard.planning.options import opened_source
    from reshard.planning.plan import plan_reader

    with opened_source(str(plan.source["path"])) as source:
        return space_check(plan, _source_text(dst), index=plan_reader(plan, source), probe=True)


def _plan_options(root: Path, to: str | None, given: Mapping[str, Any]) -> Options:
    """The plan options from keyword options (already `_normalised`), completed by a profile and a
    trainer config: the one place this API turns options into `Options`, as the CLI's ``_options``
    does (both make the `Given` from the option table: `reshard.planning.options.given_from`)."""
    from reshard.planning.options import build_options, given_from

    return build_options(given_from(given, to=to), root)


def _check_plan_flags(to: str | None, given: Mapping[str, Any]) -> None:
    """What `plan` and `convert --to` check before reading the source (the CLI's order): flags that
    contradict each other, the slice, the target spec and flag combinations (warnings as `ReshardWarning`)."""
    args.check_conflicts(profile=given.get("profile"), no_profile=bool(given.get("no_profile")))
    args.check_slice(layers=given.get("layers"), experts=given.get("experts"))
    if to is not None and not isinstance(to, str):
        raise BadInput(f"--to {to!r} is not a layout", hint="Write it as on the command line, e.g. to=\"dp=2\".")
    for line in args.check_plan_flags(to, **args.plan_flag_values(given)):
        _warn(line, stacklevel=4)


def _normalised(options: Mapping[str, Any], known: tuple[str, ...]) -> dict[str, Any]:
    """The options given (None, False and empty left out), as the CLI's parser hands them on: lists
    of strings, paths as strings, each value checked against its choices and lower bound."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"unexpected option(s) {', '.join(unknown)}; the options are: {', '.join(known)}")
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name in _LISTS:
            value = _as_list(name, value)
        elif name in _PATHS and value is not None:
            value = os.fspath(value)
        if value is not None and value is not False and value != []:  # 0 is a value (seed=0), False is not given
            out[name] = value
    _check_values(out)
    return out


def _check_values(values: Mapping[str, Any]) -> None:
    """Each value one of its choices (``schedule``, ``dtype``, ...) and at or above its lower bound,
    refused as `BadInput` naming the flag (where the CLI's parser refuses it as a usage error)."""
    for name, value in values.items():
        if value is None:
            continue
        if name in _CHOICES and value not in _CHOICES[name]:
            raise BadInput(f"{_flag(name)} {value!r} is not one of {', '.join(_CHOICES[name])}")
        if name in _AT_LEAST and (type(value) is not int or value < _AT_LEAST[name]):
            raise BadInput(f"{_flag(name)} {value!r} is not an integer at or above {_AT_LEAST[name]}")


def _as_list(name: str, value: Any) -> list[str]:
    """A repeatable flag's values as strings: one value or many; ``model_config`` may be a mapping
    and ``tie`` may give pairs, written as the CLI takes them (``name=value``, ``A=B``)."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [f"{k}={v}" for k, v in value.items()]
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    out = []
    for item in value:
        if name == "tie" and isinstance(item, (tuple, list)) and len(item) == 2:
            item = f"{item[0]}={item[1]}"
        if not isinstance(item, (str, os.PathLike)):
            raise BadInput(f"{_flag(name)} {item!r} is not text", hint=f"Give {name} as a string or a list of strings.")
        out.append(os.fspath(item))
    return out


def _flag(name: str) -> str:
    """The CLI flag a keyword option stands for: ``micro_batch`` -> ``--micro-batch``."""
    if name in option_table.BY_NAME:
        return option_table.flag(name)
    return "--" + name.replace("_", "-")


def _source_text(path: Any) -> str:
    """A path or URL argument as the CLI receives it."""
    if isinstance(path, (str, os.PathLike)):
        return os.fspath(path)
    raise BadInput(f"{path!r} is not a path", hint="Give a checkpoint as a str or pathlib.Path (or an s3:// URL).")


def _given_plan(plan: Plan | Mapping[str, Any] | PathLike) -> tuple[Path | None, dict[str, Any] | None]:
    """A plan given to `convert`: (its file, as ``--plan`` reads it) or (its data: what
    ``convert --plan`` checks of a plan file, taken from a `Plan` or a ``plan --json`` dict)."""
    if isinstance(plan, Plan):
        return None, {"plan_version": PLAN_VERSION, "fingerprint": plan.fingerprint(),
                      "options": plan.options.to_dict()}
    if isinstance(plan, Mapping):
        return None, dict(plan)
    return Path(_source_text(plan)), None


def _checked_plan(root: Any, given: dict[str, Any]) -> Options:
    """The options of a plan given as data, once the plan made again from ``root`` is that plan
    (the fingerprint check of ``convert --plan``)."""
    from reshard.planning.options import check_plan_matches, options_from_plan
    from reshard.planning.plan import make_plan

    opts = options_from_plan(given)
    check_plan_matches(given, make_plan(root, opts))
    return opts
