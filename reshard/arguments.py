"""Options checked before any work, and before torch is imported (a typo must cost milliseconds, not 3 s).

Ranges and choices are declared with the options themselves (`reshard.model.option_table` for
``plan``, ``convert`` and ``inspect``, `cli.py` for the other verbs: ``min=`` and the choices of
`reshard.model.kinds`, checked by typer and listed by ``--help``); this module holds the
choices and the checks that need more than one option: a flag that has no effect where it
is given is an error (the user believes it did something) or, where a profile may still
make it matter, a warning. Nothing here imports torch or reads a checkpoint.
"""
from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Mapping

from reshard.errors import BadInput
from reshard.paths import formats_root
from reshard.storage.objectstore import urls
from reshard.model import option_table
from reshard.model.kinds import (CONTROLS, DATA_POLICIES, DTYPES, EXPORT_FORMATS, ONLY, RNG_POLICIES, DataMode,
                                 OutputFormat)
from reshard.model.kinds import SCHEDULE_POLICIES as SCHEDULES

OUTPUT_FORMATS = tuple(OutputFormat)
DATA_MODES = tuple(DataMode)

__all__ = ["is_url", "check_source", "check_destination", "check_overlap", "check_remote_source", "check_remote_destination", "DATA_POLICIES", "SCHEDULES", "RNG_POLICIES", "DTYPES", "ONLY", "OUTPUT_FORMATS", "DATA_MODES",
           "EXPORT_FORMATS", "CONTROLS", "check_plan_flags", "plan_flag_values", "check_beside_plan", "check_rehearse", "check_export",
           "import_formats", "SOURCE_FORMATS", "check_import", "check_slice", "check_restart", "check_conflicts"]

_STAGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def is_url(text: object) -> bool:
    """A source or destination given as ``scheme://...`` (s3://bucket/prefix), not a local path
    (`reshard.storage.objectstore.urls.looks_like_url`; whether it is one reshard takes is `urls.parse`'s rule)."""
    return urls.looks_like_url(text)


def check_source(*paths: Path | str) -> None:
    """A checkpoint path that does not exist, said before any heavy import (torch takes seconds to
    import, and a typo deserves an answer at once), in the words the checkpoint reader uses."""
    for path in paths:
        if is_url(path):  # an object-store URL: its listing says whether it exists (reshard.storage.objectstore.remote)
            urls.parse(str(path))  # refused before anything (a progress line) could echo a credential
            continue
        if not os.path.exists(path):
            raise BadInput("no such checkpoint directory", where=str(path),
                           hint="Check the path (a checkpoint is the directory that holds `.metadata`).")
        if not os.path.isdir(path):  # the reader's words, said before the heavy start-up
            raise BadInput("a DCP checkpoint is a directory, this is a file", where=str(path),
                           hint=f"Give the directory that holds it: {os.path.dirname(os.path.abspath(path))}."
                           if os.path.basename(str(path)) == ".metadata" else None)


def check_destination(dst: Path | str, *, overwrite: bool) -> None:
    """A local destination that is occupied (without ``--overwrite``) or cannot be written, said
    before torch is imported, a plan is made or the space is probed: these answers need none of it."""
    if is_url(dst):
        return
    from reshard.storage.files import atomic

    atomic.check_vacant(Path(dst), overwrite=overwrite)
    atomic.check_writable(Path(dst))


def check_remote_source(src: str, *, data: str, workers: int | None) -> None:
    """What a conversion from an object-store URL cannot do: share the source's files
    (``--data link`` needs them on the destination's file system). Several ``--workers`` each
    fetch only what their own files need (`reshard.engine.copy`)."""
    if not is_url(src):
        return
    if data == "link":
        raise BadInput("--data link shares the source's data files, and a source in object storage has none on this "
                       "file system", where=src, hint="Drop --data link (the default, --data copy, fetches each item's "
                       "byte range), or download the checkpoint first.")


def check_remote_destination(dst: str, *, data: str, workers: int | None, output_format: str) -> None:
    """What a conversion into object storage does not do yet, refused before any work: linked
    data, per-rank safetensors (``--overwrite`` is checked against the prefix itself). Several
    workers stream their files into it (`reshard.engine.streaming`)."""
    if not is_url(dst):
        return
    urls.parse(dst, what="destination URL")
    for given, why in ((data == "link", "--data link"), (output_format != "dcp", f"--output-format {output_format}")):
        if given:
            raise BadInput(f"{why} with a destination in object storage is not supported yet", where=dst,
                           hint=f"Drop {why.split()[0]}, or convert to a local directory and upload it.")


def check_overlap(src: str, dst: str) -> None:
    """A destination in a store equal to, inside or above its source in the same store is refused
    before any work, as `atomic_directory` refuses it by real path on disk: ``--overwrite`` would
    delete the source, and an output inside it would become part of it (the next listing reads it)."""
    if not (is_url(src) and is_url(dst)):
        return  # a local side and a store side never share a byte
    a, b = urls.parse(src), urls.parse(dst, what="destination URL")
    how = urls.overlaps(a, b)
    if how is not None:
        said = {"equal": "is the source", "inside": "lies inside the source", "above": "holds the source"}[how]
        raise BadInput(f"the destination {b} {said} ({a}): writing it would change or delete the checkpoint "
                       "being read", where=str(b), hint="Choose a destination prefix beside the source, not at, "
                       "above or inside it.")


def check_plan_flags(to: str | None, *, pp_stages: str | None = None, source_seq_len: int | None = None,
                     schedule: str | None = None, seed: int | None = None,
                     rng_policy: str | None = None) -> list[str]:
    """The combinations of `plan`/`convert` flags that cannot work, raised; those that may not matter, returned.

    The target spec is parsed here too, so ``--to dp=0`` fails before any import. Returns
    warnings (one sentence each) for flags that have no effect as given.
    """
    from reshard.model.topology import parse_spec  # here: inspect, verify and export never parse a spec

    warnings: list[str] = []
    target = parse_spec(to) if to is not None else None
    if pp_stages is not None:
        if target is not None and target.pp == 1:
            raise BadInput(f"--pp-stages {pp_stages} has no effect: the target --to {to} has one pipeline stage",
                           hint="Drop --pp-stages, or add pp=N to --to.")
        parts = pp_stages.split(",")
        ranges = [_STAGE.match(p) for p in parts]
        spans = [(int(m.group(1)), int(m.group(2) or m.group(1))) for m in ranges if m]
        if len(spans) != len(parts) or any(b < a for a, b in spans) or spans[0][0] != 0 \
                or any(y[0] != x[1] + 1 for x, y in zip(spans, spans[1:])):
            raise BadInput(f"--pp-stages {pp_stages!r} must cover the layers from 0 contiguously, one inclusive range A-B per stage",
                           hint="Write one range per target stage, e.g. --pp-stages 0-2,3-5.")
        if target is not None and len(parts) != target.pp:
            raise BadInput(f"--pp-stages gives {len(parts)} stages but the target --to {to} has pp={target.pp}",
                           hint="Give one range of layers per target pipeline stage.")
    if source_seq_len is not None and schedule not in (None, "tokens"):
        warnings.append(f"--source-seq-len has no effect with --schedule {schedule}: it only converts a token "
                        "counter for --schedule tokens.")
    if seed is not None and rng_policy in ("carry", "drop"):
        warnings.append(f"--seed has no effect with --rng-policy {rng_policy}: only reseed uses it.")
    return warnings


def plan_flag_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values `check_plan_flags` weighs, taken from all of a command's options (by option name)."""
    return {name: values.get(name) for name in ("pp_stages", "source_seq_len", "schedule", "seed", "rng_policy")}


def check_beside_plan(plan_file: str, values: Mapping[str, Any]) -> None:
    """`convert --plan P.json`: the plan fixes the recipe and policies, so a flag that would change them is an error.

    ``values`` maps option names (``grad_accum``) to their values, None/False/empty when not
    given; every plan option of `reshard.model.option_table` given is named, in ``--help`` order
    (0 is a value: ``--seed 0`` is refused too).
    """
    named = [spec.flag for spec in option_table.PLAN_OPTIONS if spec.given(values.get(spec.name))]
    if named:
        flags = ", ".join(named)
        raise BadInput(f"{flags} {'has' if len(named) == 1 else 'have'} no effect beside --plan: the plan already "
                       "fixes the recipe, policies and options it was made with", where=plan_file,
                       hint=f"Drop {flags}, or make a new plan with them (reshard plan ... --json > P.json) "
                       "and convert that one.")


def check_rehearse(*, steps: int, switch_at: int, window: int, trainer: str | None = None) -> list[str]:
    """`rehearse`: the switch falls inside the run, the ``--trainer`` command's placeholders are known and
    complete (`reshard.rehearsal.contract`, which imports no torch); a window longer than the steps after
    the switch is a warning."""
    if trainer is not None:
        from reshard.rehearsal.contract import TrainerCommand

        TrainerCommand(trainer)
    if switch_at >= steps:
        raise BadInput(f"--switch-at {switch_at} is not before the last step (--steps {steps})",
                       hint="Choose --switch-at between 1 and --steps - 1.")
    if window > steps - switch_at:
        return [f"--window {window} is longer than the {steps - switch_at} steps after the switch: "
                f"only those {steps - switch_at} are compared."]
    return []


def check_export(*, fmt: str, model_config: list[str] | None) -> None:
    """`export`: ``--model-config`` feeds only the config.json of ``--format hf``."""
    if model_config and fmt != "hf":
        raise BadInput(f"--model-config has no effect with --format {fmt}: only --format hf writes a config.json",
                       hint="Drop --model-config, or export with --format hf.")


SOURCE_FORMATS = {"deepspeed": "a DeepSpeed ZeRO checkpoint folder, or the universal checkpoint folder ds_to_universal "
                               "made of one (model.*, optim.state.*, optim.param_groups.*)"}
"""``import --format`` names of a source kind with its own reader (reshard.engine.deepspeed_import), not a
key convention of formats/hf/: the output keeps reshard's convention."""


def import_formats() -> dict[str, str]:
    """``import --format`` names: ``reshard``, every family of ``formats/hf/`` and each family's
    native convention (``torchtitan``), each with what it means. Read from the TOML files
    themselves, so the check costs no torch import (reshard.semantics.hf needs torch).
    `SOURCE_FORMATS` are admitted beside them."""
    names = {"reshard": "reshard's own key names"}
    conventions: dict[str, list[str]] = {}
    for path in sorted((formats_root() / "hf").glob("*.toml")):
        spec = tomllib.loads(path.read_text(encoding="utf-8"))
        family = str(spec.get("family", path.stem))
        names[family] = f"the {family} Hugging Face mapping"
        conventions.setdefault(str(spec.get("native_convention", "reshard")), []).append(family)
    for conv, families in conventions.items():
        if conv not in names and len(families) == 1:
            names[conv] = f"{conv} names (by the {families[0]} mapping)"
    return names


def check_import(*, fmt: str) -> None:
    """`import`: an unknown ``--format`` is refused before the source is read."""
    known = {**import_formats(), **SOURCE_FORMATS}
    if fmt not in known:
        raise BadInput(f"unknown import format '{fmt}'",
                       hint="Use one of: " + ", ".join(known) + ".")


def check_slice(*, layers: str | None, experts: str | None) -> None:
    """``--layers`` / ``--experts``: how they are written (which indices exist is known only from the source).

    The parser is imported only when one is given: it brings the partition rules (~15 ms), which a
    plan without a slice never reads.
    """
    for flag, what, spec in ((option_table.flag("layers"), "layer", layers),
                             (option_table.flag("experts"), "expert", experts)):
        if spec is not None:
            from reshard.semantics.slicing import parse_indices

            parse_indices(spec, None, flag=flag, what=what)


def check_restart(*, restart: bool, output_format: str, data: str) -> None:
    """``--restart`` discards a resumable run's work; local output and linked data are never resumed."""
    if restart and (output_format != "dcp" or data != "copy"):
        given = f"--output-format {output_format}" if output_format != "dcp" else f"--data {data}"
        raise BadInput(f"--restart has no effect with {given}: such a conversion always starts over",
                       hint="Drop --restart (only DCP output copied by convert resumes after a kill).")


def check_conflicts(*, profile: Path | None = None, no_profile: bool = False, quiet: bool = False,
                    progress: str = "auto", buffered: bool = False, data: str = "copy") -> None:
    """Two flags that ask for opposite things are refused, naming both (docs/cli.md, "Flags that conflict").

    Letting one of them win silently would leave the user believing the other did what it says:
    ``--profile F --no-profile`` used to read F; ``--quiet --progress json`` has to drop one of them.
    ``--quiet`` agrees with ``--progress none`` and with the default ``auto``.
    """
    if profile is not None and no_profile:
        raise BadInput(f"--profile {profile} and --no-profile contradict each other: one reads that profile, "
                       "the other reads none", hint="Drop --no-profile to use the profile, or drop --profile "
                       "to read no reshard.toml at all.")
    if quiet and progress == "json":
        raise BadInput("--quiet and --progress json contradict each other: one asks for no progress on stderr, "
                       "the other for a JSON event per line there", hint="Drop --quiet to get the JSON events, "
                       "or drop --progress json (or write --progress none) for silence.")
    if buffered and data == "link":
        raise BadInput("--buffered and --data link contradict each other: --buffered copies the tensor bytes "
                       "through the page cache, --data link copies none (it shares the source's files)",
                       hint="Drop --buffered to link, or drop --data link to copy.")
