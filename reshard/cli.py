"""The `reshard` command line: parse arguments, call the public API (reshard.api), render. No logic here."""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

import typer
from typer.exceptions import TyperException

from reshard import arguments as args
from reshard import cli_parse
from reshard.cli_parse import choice, takes_options


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Move distributed-training checkpoints between parallel layouts without changing what the run means.")

_state = {"debug": False}


def _show_version(value: bool) -> None:
    if value:
        from reshard import __version__

        _echo(f"reshard {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors (anywhere on the line)."),
          version: bool = typer.Option(False, "--version", is_eager=True, callback=_show_version,
                                       help="Print the version and exit.")) -> None:
    """Exit codes: 0 ok, 1 a check found a difference or a plan is infeasible, 2 bad input.

    --debug and --json may be given anywhere on the line; under --json an error is a JSON
    object (error, code, exit_code, file, keys) on stdout as well as the paragraph on stderr.
    """
    _state["debug"] = debug or _state["debug"] or bool(os.environ.get("RESHARD_DEBUG"))


def _warn(lines: list[str]) -> None:
    for line in lines:
        _echo(f"warning: {line}", err=True)


def _progress(first_line: str, *, json_out: bool, quiet: bool, shown: bool = True, mode: str = "auto"):
    """A command's progress on stderr (reshard.render.progress), its first line printed at once,
    before any heavy import; nothing on a pipe, under --json or --quiet, or where not ``shown``
    (``mode`` json: JSON events on stderr wherever it goes)."""
    from reshard.render.progress import Progress

    progress = Progress.for_terminal(quiet=quiet or not shown, json_out=json_out, mode=mode)
    progress.say(first_line)
    _stop_waiting()
    # the waiting row for the whole command, not only in the blocks that ask for it: whatever runs
    # (an import, a plan, a trainer, a commit), a terminal is never still for more than 2 s (issue 47)
    held = contextlib.ExitStack()
    held.enter_context(progress.waiting())
    _state.update(waiting=held, progress=progress)
    return progress


def _stop_waiting() -> None:
    """End the command-long waiting row (`_progress`) before the result or an error is printed."""
    held = _state.pop("waiting", None)
    _state.pop("progress", None)
    if held is not None:
        held.close()


def _render(data: object, *, json_out: bool, text: Callable[[], str]) -> None:
    """A verb's result on stdout: the JSON ``--json`` prints (reshard.render.report), else ``text()``,
    the verb's own rendering of it: each verb is parse, call, then this."""
    from reshard.render.report import to_json

    _stop_waiting()
    _echo(to_json(data) if json_out else text())


_QUIET = typer.Option(False, "--quiet", "-q", help="No progress on stderr (it is shown only on a terminal, and never with --json).")
_PROGRESS = typer.Option("auto", "--progress", **choice(("auto", "json", "none")), help="auto: bars on a terminal only; json: one JSON event per line on stderr (phase, bytes_done, bytes_total, rate, eta_s), for schedulers; none: nothing (as --quiet).")
_FORCE = typer.Option(False, "--force", help="Go ahead even when the destination's file system has less free space than the output needs (checked before anything is written; a full disk then stops the run with nothing committed).")
_TRUST, _PROFILE, _NOPROF, _MB, _GA = (cli_parse.named_option(name) for name in (
    "trust_pickle", "profile", "no_profile", "micro_batch", "grad_accum"))  # verbs beyond the table take these too
_TABLE: dict = {}  # where a verb's options of the table stand (`cli_parse.takes_options`)
_CLI_CALL = {"warn": lambda line: _warn([line]), "map_os_errors": False}
"""How the CLI calls the API (reshard.api): a warning is a ``warning:`` line on stderr as it arises (the
trusted items the last line, `_warn_trusted`), an OSError is rendered as itself (``code: os_error``)."""


@takes_options("inspect")
def inspect(
    ckpt: str = typer.Argument(..., help="DCP checkpoint directory, or its URL (s3://bucket/prefix: the s3 extra)."),
    json_out: bool = typer.Option(False, "--json", help="Print the stable JSON shape (see README)."),
    deep: bool = typer.Option(False, "--deep", help="Also load every item and report the ones that fail."),
    flags: dict = _TABLE, quiet: bool = _QUIET,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also how an inferred topology was read from the chunks."),
) -> None:
    """Is a checkpoint complete, what does it hold, and which topology wrote it.

    Exit 0: complete and consistent; 1: readable but inconsistent; 2: incomplete, unsafe or unreadable.
    """
    from reshard import api

    result = api.inspect(ckpt, deep=deep, **flags, **_CLI_CALL,
                         progress=lambda: _progress(f"reading {ckpt} …", json_out=json_out, quiet=quiet))
    from reshard.render.report import render_inspect

    _render(result.report, json_out=json_out, text=lambda: render_inspect(result.report, verbose=verbose))
    raise typer.Exit(result.exit_code)


def _options(ckpt: Path, flags: dict) -> object:
    """The plan options: these flags, completed by a profile and a trainer config (reshard.planning.options)."""
    from reshard.planning.options import build_options, given_from

    return build_options(given_from(flags), ckpt)


@takes_options("plan")
def plan(
    ckpt: str = typer.Argument(..., help="Source DCP checkpoint, or its URL (s3://bucket/prefix: the s3 extra)."),
    flags: dict = _TABLE,
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON (the input of convert --plan)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also the per-tensor placement table, per-rank memory and what each rank would read after --data link."),
    dst: Optional[Path] = typer.Option(None, "--dst", help="Where convert would write: warn now if it lacks the space."),
    tensors_out: Optional[Path] = typer.Option(None, "--tensors-out", help="Write every tensor's placement and chunks to this file (JSON lines), however large."),
    quiet: bool = _QUIET,
) -> None:
    """Dry run: what a conversion to --to would do, and whether the run stays the same run.

    Exit 0 feasible, 1 infeasible (reasons listed), 2 bad input or a policy must be chosen.
    """
    from reshard import api

    to = flags.pop("to")
    p = api.plan(ckpt, to=to, dst=dst, tensors_out=tensors_out, **flags, **_CLI_CALL,
                 progress=lambda: _progress(f"reading {ckpt} to plan --to {to} …", json_out=json_out, quiet=quiet))
    from reshard.commands.plan import report
    from reshard.render.report import render_plan

    d = report(p, verbose=verbose, json_out=json_out)
    _render(d, json_out=json_out, text=lambda: render_plan(d, verbose=verbose) + _estimate_text(d.get("space")))
    if dst is not None and d["space"]["warning"]:
        _echo(f"warning: {d['space']['warning']}", err=True)
    raise typer.Exit(0 if p.feasible else 1)


@takes_options("convert")
def convert(
    src: str = typer.Argument(..., help="Source DCP checkpoint (never modified): a directory, or s3://bucket/prefix (the s3 extra)."),
    dst: str = typer.Argument(..., help="Destination directory (appears atomically), or s3://bucket/prefix (published with .metadata last)."),
    flags: dict = _TABLE,
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="Execute exactly this plan (from `plan --json`)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a destination holding a checkpoint or an earlier reshard output (atomically); anything else is refused."),
    json_out: bool = typer.Option(False, "--json", help="Print the conversion report as JSON."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Run as M processes on this machine (torchrun), each writing its share of the target files."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="I/O threads per process (default: 4-8 by CPU count)."),
    window: Optional[str] = typer.Option(None, "--buffer-memory", help="Memory for copy buffers per process, e.g. 256MiB (default: 1/16 of available memory, 64 MiB-1 GiB)."),
    old_window: Optional[str] = typer.Option(None, "--window", hidden=True, help="Renamed --buffer-memory."),
    buffered: bool = typer.Option(False, "--buffered", help="Copy through the page cache (copy_file_range) and read every copied item back, instead of direct I/O checked against the source's CRC-32 records."),
    data: str = typer.Option("copy", "--data", **choice(args.DATA_MODES), help="copy (write every tensor byte new) or link (share the source's data files by reflink, else hard link, and write only what changes; DST on the source's file system)."),
    restart: bool = typer.Option(False, "--restart", help="Discard what an interrupted conversion into DST left (by default a rerun keeps every item its journal records whose bytes still match their CRC-32)."),
    quiet: bool = _QUIET, force: bool = _FORCE, progress_mode: str = _PROGRESS,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also the full note on data files shared with the source (--data link)."),
) -> None:
    """Execute a plan: reshard tensors, rewrite trainer state, verify, commit atomically.

    Under torchrun (or with --workers M) the target files are divided among the processes;
    worker 0 commits once every worker has written and verified its part.

    Exit 0 converted and verified equal, 1 the verification found a difference or the plan is
    infeasible, 2 bad input (options, plan file, source, destination).
    """
    to, output_format = flags["to"], flags["output_format"]
    args.check_conflicts(profile=flags["profile"], no_profile=flags["no_profile"], quiet=quiet, progress=progress_mode,
                         buffered=buffered, data=data)
    _numpy_with_one_blas_thread()  # the plan flags' check below is the first to need numpy
    _state["output"] = dst if args.is_url(dst) else Path(dst)  # what the last line of a Ctrl-C speaks of (_interrupted)
    if plan_file is not None:
        args.check_beside_plan(str(plan_file), flags)
    else:
        _warn(args.check_plan_flags(to, **args.plan_flag_values(flags)))
    if old_window is not None:  # rehearse's --window counts steps: one name must not mean two units
        from reshard.errors import BadInput

        raise BadInput("convert --window is now called --buffer-memory (rehearse's --window counts steps)",
                       hint=f"Write --buffer-memory {old_window}.")
    window_bytes = _size(window, "--buffer-memory")
    args.check_slice(layers=flags["layers"], experts=flags["experts"])
    args.check_restart(restart=restart, output_format=output_format, data=data)
    args.check_remote_source(src, data=data, workers=workers)
    args.check_remote_destination(dst, data=data, workers=workers, output_format=output_format)
    args.check_overlap(src, dst)
    if not args.is_url(dst):
        dst = Path(dst)
    from reshard.engine.distributed import ERRORS_ENV, in_torchrun

    if not in_torchrun():  # a worker's errors go through its launcher's relay
        args.check_source(src)
        args.check_destination(dst, overwrite=overwrite)
        if workers not in (None, 1):  # worker 0 commits, in another process: a Ctrl-C looks at dst itself
            from reshard.commands.convert import watch_output

            _state["output_before"] = watch_output(dst)
    # one process shows progress: this one, or worker 0 of a torchrun (whose launcher, if
    # --workers, has already said the first line)
    lead = not in_torchrun() or os.environ.get("RANK", "0") == "0"
    progress = _progress("" if in_torchrun() and os.environ.get(ERRORS_ENV) else f"reading {src} …",
                         json_out=json_out, quiet=quiet, shown=lead, mode=progress_mode)
    from reshard.commands.convert import run_convert
    from reshard.render.report import render_convert

    if not json_out:  # the estimate on stdout before the work, even on a pipe (not after the result)
        progress.on_estimate = lambda figures: _echo(_estimate_text(figures).lstrip("\n"))
    from reshard.planning.options import opened_source

    with opened_source(src) as source:  # the Source the conversion reads (a URL: staged)
        opts = None
        if plan_file is None and to is not None:
            opts = _options(source.root, flags)
        done = run_convert(source, dst, opts, to=to, plan_file=plan_file, output_format=output_format, data=data,
                           workers=workers, threads=threads, window=window_bytes, buffered=buffered, overwrite=overwrite,
                           restart=restart, force=force, progress=progress, argv=_state.get("argv") or sys.argv[1:],
                           debug=_state["debug"])
    report = done.report
    if report is None:  # the workers it launched printed theirs, or a torchrun worker other than 0
        raise typer.Exit(done.exit_code)
    _render(report, json_out=json_out, text=lambda: render_convert(report, verbose=verbose))
    if done.resume_note:  # kept K of N items, or started over and why
        _echo(done.resume_note, err=True)
    raise typer.Exit(done.exit_code)


def _numpy_with_one_blas_thread() -> None:
    """Import numpy with its OpenBLAS told to start no thread pool.

    OpenBLAS starts (cores - 1) threads when numpy loads, and they spin a while waiting for work:
    0.04-0.05 s of CPU per process on the 2-core benchmark machine (``python -c "import numpy"``:
    0.15 s of CPU, 0.10 s with ``OPENBLAS_NUM_THREADS=1``), for linear algebra a conversion never
    does (it moves and compares bytes). The variable is set only while numpy loads (OpenBLAS reads
    it then), so the processes a command starts get the environment as the user left it, and a
    value the user set is left alone.
    """
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        importlib.import_module("numpy")
    finally:
        os.environ.pop("OPENBLAS_NUM_THREADS", None)


def _estimate_text(figures: Optional[dict]) -> str:
    """The size, free-space and time estimate under a text plan or report (reshard.engine.space)."""
    if not figures:
        return ""
    from reshard.render.space import estimate_lines

    return "\n" + "\n".join(estimate_lines(figures))


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30}


def _size(text: Optional[str], flag: str) -> Optional[int]:
    """``256MiB`` / ``1g`` / ``1048576`` -> bytes."""
    from reshard.errors import BadInput

    if text is None:
        return None
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise BadInput(f"{flag} {text!r} is not a size", hint="Write e.g. 256MiB, 1GiB or a number of bytes.")
    return int(value * _UNITS[unit])


def verify(
    a: str = typer.Argument(..., help="First checkpoint (a directory, or s3://bucket/prefix: the s3 extra)."),
    b: str = typer.Argument(..., help="Second checkpoint (likewise)."),
    rtol: float = typer.Option(0.0, "--rtol", min=0.0, help="Relative tolerance (default: bitwise)."),
    atol: float = typer.Option(0.0, "--atol", min=0.0, help="Absolute tolerance (default: bitwise)."),
    trust_pickle: bool = _TRUST,
    strict: bool = typer.Option(False, "--strict", help="Excuse no conversion change: every key a conversion rewrote counts as a difference (by default the changes are re-derived from A and excused only where B holds exactly them)."),
    buffered: bool = typer.Option(False, "--buffered", help="Read through the page cache instead of with direct I/O (faster when both checkpoints are already cached)."),
    json_out: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
    quiet: bool = _QUIET, progress_mode: str = _PROGRESS,
) -> None:
    """Compare two checkpoints in global terms, whatever their chunking. Exit 0 equal, 1 different, 2 bad input."""
    args.check_conflicts(quiet=quiet, progress=progress_mode)
    from reshard import api

    r = api.verify(a, b, rtol=rtol, atol=atol, trust_pickle=trust_pickle, strict=strict, buffered=buffered, **_CLI_CALL,
                   progress=lambda: _progress(f"reading {a} and {b} …", json_out=json_out, quiet=quiet, mode=progress_mode))
    from reshard.render.verify import render_verify

    _render(r, json_out=json_out, text=lambda: render_verify(r))
    raise typer.Exit(r.exit_code)


def export(
    src: str = typer.Argument(..., help="Source DCP checkpoint: a directory, or s3://bucket/prefix (the s3 extra)."),
    dst: str = typer.Argument(..., help="Output directory (appears atomically), or s3://bucket/prefix (made locally, then uploaded; the s3 extra)."),
    fmt: str = typer.Option("safetensors", "--format", **choice(args.EXPORT_FORMATS), help="safetensors (reshard's names, HF file layout), torch, or hf (a directory transformers' from_pretrained loads: names, transforms and config.json from formats/hf/)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", **choice(args.DTYPES), help="Cast floating tensors."),
    only: str = typer.Option("model", "--only", **choice(args.ONLY), help="What to export."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest shard file, e.g. 5GB or 256MB."),
    rename: Optional[Path] = typer.Option(None, "--rename", help="Key renaming rules (formats/renames/*.toml)."),
    model_config: Optional[list[str]] = typer.Option(None, "--model-config", help="--format hf: a config value the checkpoint cannot hold, name=value (repeatable), e.g. n_heads=32, rms_norm_eps=1e-5, rope_theta=500000."),
    profile: Optional[Path] = _PROFILE, no_profile: bool = _NOPROF,
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a destination holding a checkpoint or an earlier reshard output (atomically); anything else is refused."),
    json_out: bool = typer.Option(False, "--json", help="Print the export report as JSON."),
    quiet: bool = _QUIET, force: bool = _FORCE, progress_mode: str = _PROGRESS,
) -> None:
    """Export consolidated weights (and optionally optimizer state), streamed tensor by tensor.

    With --format hf, a profile's [model] values fill what --model-config does not give.

    Exit 0 exported, 2 bad input (options, source, destination).
    """
    args.check_conflicts(profile=profile, no_profile=no_profile, quiet=quiet, progress=progress_mode)
    out = _state["output"] = dst if args.is_url(dst) else Path(dst)  # what the last line of a Ctrl-C speaks of (_interrupted)
    from reshard import api

    r = api.export(src, dst, format=fmt, dtype=dtype, only=only, max_shard_size=max_shard_size, rename=rename,
                   model_config=model_config, profile=profile, no_profile=no_profile, overwrite=overwrite, force=force,
                   **_CLI_CALL, progress=lambda: _progress(f"reading {src} …", json_out=json_out, quiet=quiet,
                                                           mode=progress_mode))
    _render(r, json_out=json_out, text=lambda: _summary_line("exported", r, out))


def import_(
    src: Path = typer.Argument(..., help="safetensors file or directory (HF shards), or a torch.save file."),
    dst: Path = typer.Argument(..., help="Output DCP checkpoint (appears atomically)."),
    to: str = typer.Option("dp=1", "--to", help="Target layout, e.g. dp=8."),
    rename: Optional[Path] = typer.Option(None, "--rename", help="Key renaming rules, applied in reverse."),
    fmt: str = typer.Option("reshard", "--format", help="Output key convention: reshard (default), or torchtitan / a family of formats/hf/ (SRC is then a Hugging Face model directory; names, inverse transforms and TP layout from the family's files); deepspeed (SRC is a DeepSpeed ZeRO-1/2/3 checkpoint folder, or the universal checkpoint folder ds_to_universal wrote of one: parameters, buffers, Adam moments, step and param groups in torch's get_state_dict layout; tp > 1 by the shipped rules the parameter names match)."),
    experiment_id: Optional[str] = typer.Option(None, "--experiment-id", help="Identity of the new (warm-start) run."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a destination holding a checkpoint or an earlier reshard output (atomically); anything else is refused."),
    json_out: bool = typer.Option(False, "--json", help="Print the import report as JSON."),
    quiet: bool = _QUIET, force: bool = _FORCE, progress_mode: str = _PROGRESS,
) -> None:
    """Import weights into a DCP checkpoint for a layout: a warm start with a new experiment id.

    Exit 0 imported, 2 bad input (options, source, destination).
    """
    args.check_conflicts(quiet=quiet, progress=progress_mode)
    _state["output"] = dst  # what the last line of a Ctrl-C speaks of (_interrupted)
    from reshard import api

    r = api.import_(src, dst, to=to, rename=rename, format=fmt, experiment_id=experiment_id, overwrite=overwrite,
                    force=force, **_CLI_CALL,
                    progress=lambda: _progress(f"reading {src} …", json_out=json_out, quiet=quiet, mode=progress_mode))
    _render(r, json_out=json_out, text=lambda: _summary_line("imported", r, dst))


def _summary_line(verb: str, r: dict, dst: Path | str) -> str:
    from reshard.render.report import store_lines

    keys = r.get("keys") or r.get("summary") or {}
    n = len(keys) if isinstance(keys, (list, dict)) else keys
    return "\n".join([f"{verb}    {dst} ({n} keys accounted for; report in {dst})", *store_lines(r)])


def rehearse(
    from_spec: str = typer.Option(..., "--from", help="Source layout of the rehearsal, e.g. dp=4."),
    to: str = typer.Option(..., "--to", help="Target layout, e.g. dp=2."),
    trainer: Optional[str] = typer.Option(
        None, "--trainer", help="Your trainer's command with placeholders ({world} {layout} {ckpt_in} {save_at} "
        "{ckpt_out} {steps} {log} {micro_batch} {grad_accum} ...; formats/trainer_contract.md). Default: the "
        "reference trainer."),
    steps: int = typer.Option(24, "--steps", min=2, help="Total optimizer steps of the baseline."),
    switch_at: int = typer.Option(4, "--switch-at", min=1, help="Step at which the rehearsal checkpoints and converts."),
    window: int = typer.Option(20, "--window", min=1, help="Steps after the switch that are compared."),
    micro_batch: Optional[int] = _MB, grad_accum: Optional[int] = _GA,
    source_micro_batch: Optional[int] = typer.Option(
        None, "--source-micro-batch", help="The source run's micro-batch (default 2)."),
    source_grad_accum: Optional[int] = typer.Option(
        None, "--source-grad-accum", help="The source run's accumulation (default: picked so both layouts divide "
        "the global batch)."),
    control: Optional[str] = typer.Option(
        None, "--control", **choice(args.CONTROLS), help="The naive control: relaunch (default with --trainer), naive-state (reference "
        "default) or none."),
    dataset_len: Optional[int] = typer.Option(None, "--dataset-len", min=1, help="Samples asked of the trainer's data."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the weights and the data order ({seed})."),
    reuse_baseline: Optional[Path] = typer.Option(
        None, "--reuse-baseline", help="An earlier rehearsal's --out whose baseline (same layout, recipe, steps) "
        "is reused."),
    like: Optional[Path] = typer.Option(None, "--like", help="Copy structure, recipe and policies from this real checkpoint; with --trainer, a slice of it (convert --layers) that the baseline resumes."),
    timeout: Optional[float] = typer.Option(None, "--timeout", min=0.001, help="Seconds one trainer run may take (default: no limit)."),
    out: Path = typer.Option(Path("rehearsal-out"), "--out", help="Where the report, logs and figure go."),
    json_out: bool = typer.Option(False, "--json", help="Print the rehearsal result as JSON."),
    quiet: bool = _QUIET,
) -> None:
    """Rehearse a transition with your trainer (or the reference one): baseline, converted resume, naive control.

    Exit 0 within tolerances with exact coverage, 1 otherwise, 2 bad input.
    """
    _warn(args.check_rehearse(steps=steps, switch_at=switch_at, window=window, trainer=trainer))
    progress = _progress(f"rehearsing {from_spec} -> {to} in {out}: baseline, converted resume, control …",
                         json_out=json_out, quiet=quiet)
    from reshard.commands.rehearse import rehearse as run_rehearse
    from reshard.render.rehearsal import render_rehearsal

    r = run_rehearse(from_spec=from_spec, to=to, trainer=trainer, steps=steps, switch_at=switch_at, window=window,
                     micro_batch=micro_batch, grad_accum=grad_accum, source_micro_batch=source_micro_batch,
                     source_grad_accum=source_grad_accum, control=control, dataset_len=dataset_len, seed=seed,
                     reuse_baseline=reuse_baseline, like=like, out=out, timeout=timeout, progress=progress)
    _render(r, json_out=json_out, text=lambda: render_rehearsal(r))
    raise typer.Exit(int(r["exit_code"]))


def window(
    before: Path = typer.Argument(..., help="Step log (JSON lines) before the transition."),
    after: Path = typer.Argument(..., help="Step log after the transition."),
    manifest: Optional[Path] = typer.Option(None, "--manifest", help="Checkpoint (or manifest.json) whose lineage names the transition."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write window.json, window.md and window.png here."),
    json_out: bool = typer.Option(False, "--json", help="Print the judgement as JSON."),
    quiet: bool = _QUIET,
) -> None:
    """Judge the verification window after a real transition: loss, grad norm, throughput, coverage.

    Exit 0 within tolerances, 1 outside them, 2 bad input (unreadable logs or manifest).
    """
    _progress(f"reading the step logs {before} and {after} …", json_out=json_out, quiet=quiet)
    from reshard.commands.window import judge
    from reshard.render.window import render_window

    r = judge(before, after, manifest=manifest, out=out)
    _render(r, json_out=json_out, text=lambda: render_window(r))
    raise typer.Exit(int(r["exit_code"]))


def demo(
    out: Path = typer.Option(Path("demo-out"), "--out", help="Where the demo writes its checkpoints."),
    steps: int = typer.Option(6, "--steps", min=1, help="Optimizer steps the reference trainer runs."),
    quiet: bool = _QUIET,
) -> None:
    """The canonical transition in miniature: train on 4 CPU ranks, inspect, plan, convert to 2, verify, resume, rehearse.

    Exit 0 every step as expected, 1 a step found a difference, 2 bad input. The transcript
    goes to stdout; on a terminal, stderr also shows a line per training step.
    """
    progress = _progress(f"demo into {out}: train on 4 CPU ranks, convert to 2, resume, rehearse …",
                         json_out=False, quiet=quiet)
    from reshard.commands.demo import run_demo

    raise typer.Exit(run_demo(out, steps=steps, progress=progress))


VERBS = (("inspect", inspect), ("plan", plan), ("convert", convert), ("verify", verify), ("export", export),
         ("import", import_), ("rehearse", rehearse), ("window", window), ("demo", demo))
"""The verbs, in the order ``reshard --help`` lists them: each function parses (its signature is
its options), calls the API (reshard.api; ``convert``, ``rehearse``, ``window`` and ``demo`` their
command, reshard.commands) and renders (`_render`)."""
for _name, _verb in VERBS:
    app.command(name=_name)(_verb)
del _name, _verb


def main(argv: list[str] | None = None) -> None:
    """Entry point: typer handles usage errors (exit 2); our errors become one paragraph.

    A worker of a distributed conversion (under torchrun) leaves with ``os._exit`` after
    flushing its output: interpreter teardown with a live gloo process group can abort
    (SIGABRT) on small machines, which would turn a clean exit code into a crash.
    """
    from reshard.engine.distributed import bind_to_launcher, in_torchrun

    if in_torchrun():
        bind_to_launcher()  # a worker of `convert --workers` dies with the command that started it
        code = 0
        try:
            _main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    if argv is not None:  # a caller's own process (the tests, a script): its exit is its own
        _main(argv)
        return
    try:
        _main(argv)
    except SystemExit as exc:
        _leave(exc.code)


def _leave(code: object) -> None:
    """The command's own process ends as soon as its result is out, without the interpreter's teardown.

    Freeing every module's objects (torch's among them) takes 0.3-0.6 s of CPU after the last
    line: on a loaded machine, seconds of a terminal still with no prompt (issue 47 saw `export`
    and `rehearse` still for 4-15 s). What that teardown does that matters is done here first:
    the atexit handlers (weakref finalizers, temporary directories, multiprocessing's children)
    run and both streams are flushed. While a thread that is no daemon still runs, the
    interpreter's own exit waits for it as always.
    """
    import atexit
    import threading

    if isinstance(code, str):
        print(code, file=sys.stderr)  # what sys.exit("...") does
        code = 1
    code = 0 if code is None else code if isinstance(code, int) else 1
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()  # noqa: SLF001 - what multiprocessing's children run before their os._exit
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (`| head`): nothing more to say
            stream.flush()
    os._exit(code)


def _main(argv: list[str] | None = None) -> None:
    _state.update(debug=False, json=False, output=None, output_before=None)  # main() may run many times in one process (the tests)
    atomic = sys.modules.get("reshard.storage.files.atomic")  # not imported: nothing committed yet (no import for it)
    if atomic is not None:  # an earlier command's commits are not this one's (a Ctrl-C's last line)
        atomic.forget_commits()
    line = _normalise(list(argv) if argv is not None else sys.argv[1:])
    _state["argv"] = line
    try:
        code = cli_parse.click_command(app, line)(args=line, prog_name="reshard", standalone_mode=False)
        if code == 130:  # typer's own return for a KeyboardInterrupt in a command (typer.core); no command exits 130
            raise KeyboardInterrupt
    except (KeyboardInterrupt, typer.Abort):
        sys.exit(_interrupted())
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except TyperException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `reshard` alone: the help, as typer shows it
            exc.show()
            sys.exit(exc.exit_code)
        _fail(exc, exc.exit_code, _usage_paragraph(exc), usage=True)
    except Exception as exc:  # noqa: BLE001 - one paragraph and its exit code (errors.render_error), whatever it is
        from reshard.errors import render_error

        _fail(exc, *render_error(exc))
    finally:
        _stop_waiting()
        _warn_trusted()
    sys.exit(code if isinstance(code, int) else 0)


def _interrupted() -> int:
    """Ctrl-C: one line saying what is left of the command's output, and the exit code
    (`reshard.commands.convert.interruption`: 130, or 0 once the output is committed). A worker
    of ``--workers`` says nothing: its launcher speaks for the run."""
    from reshard.engine.distributed import ERRORS_ENV, in_torchrun

    _stop_waiting()
    if in_torchrun() and os.environ.get(ERRORS_ENV):
        return 130
    dst = _state.get("output")
    if dst is None:
        _echo("interrupted", err=True)
        return 130
    from reshard.commands.convert import interruption

    line, code = interruption(dst, _state.get("output_before"))
    _echo(line, err=True)
    return code


def _echo(text: str, *, err: bool = False) -> None:
    """Every line the CLI prints, with anything that looks like a credential redacted
    (`reshard.render.redaction.redact`: a URL's userinfo, access key ids, the values of secret
    environment variables): the last defence; nothing reads or records credentials at all."""
    from reshard.render.redaction import redact

    progress = _state.get("progress")
    with progress.cleared() if progress is not None else contextlib.nullcontext():  # no waiting row mid-line
        # the text, then its newline: ``echo``'s own newline is ``text + "\n"``, a copy of an 18 MB plan
        typer.echo(redact(text), err=err, nl=False)
        typer.echo("", err=err)


def _fail(exc: BaseException, code: int, paragraph: str, *, usage: bool = False) -> None:
    """Print the error once, one paragraph on stderr, and exit; under --json also a JSON object on stdout.

    The object goes where the command's report would have gone, so a script parsing stdout
    gets the error as data; the paragraph stays on stderr for the person watching.
    """
    _stop_waiting()
    if _state["debug"]:
        traceback.print_exc()
    if _say_error(exc, code, paragraph):
        if _state.get("json"):
            import json

            from reshard.errors import error_object

            _echo(json.dumps(error_object(exc, code, paragraph, usage=usage), ensure_ascii=False))
        _echo(f"error: {paragraph}", err=True)
    sys.exit(code)


def _normalise(line: list[str]) -> list[str]:
    """``--debug`` and ``--json`` anywhere on the line: --debug moves first (the app's), --json after the subcommand.

    Only tokens before a ``--`` are moved; a value that merely contains them (a quoted
    --trainer command) is one token and is left alone.
    """
    end = line.index("--") if "--" in line else len(line)
    head, tail = line[:end], line[end:]
    if "--debug" in head:
        _state["debug"] = True
        head = ["--debug"] + [a for a in head if a != "--debug"]  # the app's option, so before the subcommand
    if "--json" in head:
        _state["json"] = True
        sub = next((i for i, a in enumerate(head) if not a.startswith("-")), None)
        if sub is not None and "--json" in head[:sub]:
            head = [a for a in head[:sub] if a != "--json"] + [head[sub], "--json"] + head[sub + 1:]
    return head + tail


def _usage_paragraph(exc: TyperException) -> str:
    """A usage error as one paragraph: what is wrong, then where the command's options are listed."""
    from reshard.errors import sentence

    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "reshard"
    return f"{sentence(exc.format_message())} See `{where} --help` for the options and their values."


def _warn_trusted() -> None:
    """The one stderr line naming every object item --trust-pickle let unpickle (reshard.storage.checkpoints.dcp collects them).

    A worker of a distributed run hands its items to the one process that prints the run's
    line (`reshard.engine.distributed.pass_on_trusted`: the --workers command, or worker 0
    of a plain torchrun), so a command warns once however many processes ran it.
    """
    from reshard.engine.distributed import in_torchrun, pass_on_trusted

    if in_torchrun() and pass_on_trusted():
        return
    dcp = sys.modules.get("reshard.storage.checkpoints.dcp")
    line = dcp.TRUSTED_UNPICKLES.warning() if dcp is not None else None
    if line:
        _echo(line, err=True)


def _say_error(exc: BaseException, code: int, paragraph: str) -> bool:
    """Whether this process prints its error: a worker of a distributed run may leave it to its launcher."""
    from reshard.engine.distributed import in_torchrun, report_worker_error

    return not in_torchrun() or report_worker_error(exc, code, paragraph)


if __name__ == "__main__":
    main()
