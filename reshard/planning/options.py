"""What the user said, from three places, as one `Options`: the command line, a profile, a trainer config.

Precedence is per field: a flag on the command line wins over the profile (``reshard.toml``,
`reshard.semantics.profile`), which wins over the trainer's own config (``--trainer-config``
or the profile's ``trainer_config``, `reshard.semantics.trainer_config`). Lists (conventions,
keep/drop patterns, ties) are joined, the command line's first, so its conventions are
offered each key first.

The options record what each file contributed and its sha256 (``profile``, ``trainer_config``):
the plan options are part of the plan, of its fingerprint and of the lineage entry a
conversion writes, so a report says where every fact came from, and `reshard verify`
recomputes a plan from the recorded values without reading the files again.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import field, make_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Optional

from reshard.errors import BadInput
from reshard.model import option_table
from reshard.model.plan import PLAN_VERSION, Options, Plan
from reshard.semantics import profile as profile_mod
from reshard.semantics.conventions import Convention, load_user_convention

if TYPE_CHECKING:  # opened below, on first use (importing the options imports no storage module)
    from reshard.storage.source import Source


def _given_fields() -> list[tuple[str, Any, Any]]:
    """`Given`'s fields, one per option of the table that has one, as the command line hands them on:
    a repeatable flag as a list of strings, a path as a string."""
    out: list[tuple[str, Any, Any]] = []
    for spec in option_table.OPTIONS:
        if spec.field is None:
            continue
        if spec.repeatable:
            out.append((spec.field, list[str], field(default_factory=list)))
        elif spec.type is bool:
            out.append((spec.field, bool, field(default=False)))
        else:
            kind = str if spec.type is Path else spec.type
            out.append((spec.field, Optional[kind], field(default=None)))
    return out


Given = make_dataclass("Given", _given_fields())
Given.__module__ = __name__
Given.__doc__ = """The command line's values (None / empty: not given), one field per option of
`reshard.model.option_table` that has one: made from the table, so a new flag needs no field here."""


def given_from(values: Mapping[str, Any], *, to: str | None = None) -> Any:
    """The `Given` of a command's options, by option name (``convention``, ``tie``: the table says
    which `Given` field each fills), as the CLI's parser or the API hands them: lists of strings,
    paths as strings. Options missing from ``values`` are not given; ``to`` where the caller has it apart."""
    fields: dict[str, Any] = {}
    for spec in option_table.OPTIONS:
        if spec.field is None or spec.name not in values:
            continue
        value = values[spec.name]
        if spec.repeatable:
            value = [str(v) for v in value or []]
        elif spec.type is Path and value is not None:
            value = str(value)
        fields[spec.field] = value
    if to is not None:
        fields["to"] = to
    return Given(**fields)


COPIED = tuple(spec.field for spec in option_table.PLAN_OPTIONS if spec.copied)
"""The `Options` fields `build_options` takes from the command line as given (the others a profile
or a trainer config may complete)."""


def parse_model_config(items: list[str]) -> dict[str, int]:
    """``--model-config name=integer`` (repeatable) as a dict."""
    config: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            config[name.strip()] = int(value)
        except ValueError:
            raise BadInput(f"--model-config expects name=integer, got '{item}'") from None
        if not sep or not name.strip():
            raise BadInput(f"--model-config expects name=integer, got '{item}'")
    return config


def build_options(g: Any, ckpt: str | Path | None) -> Options:
    """The plan options: the command line, completed by the profile and the trainer config."""
    path = profile_mod.find_profile(ckpt, g.profile, enabled=not g.no_profile)
    prof = profile_mod.load_profile(path) if path is not None else None
    tc_path = g.trainer_config or (prof.trainer_config if prof else None)
    tc = _trainer_config(tc_path) if tc_path else None
    from_prof: list[str] = []
    from_tc: list[str] = []

    def pick(name: str, cli: Any, prof_value: Any, tc_value: Any = None) -> Any:
        if cli is not None:
            return cli
        if prof_value is not None:
            from_prof.append(name)
            return prof_value
        if tc_value is not None:
            from_tc.append(name)
            return tc_value
        return None

    recipe = prof.recipe if prof else {}
    tc_recipe = _trainer_recipe(tc)
    source = {opt: pick(opt, getattr(g, opt, None), recipe.get(f), tc_recipe.get(f))
              for f, opt in profile_mod.RECIPE_FIELDS.items()}
    config = _merged_config(parse_model_config(g.model_config), prof, tc, from_prof, from_tc)
    conventions = convention_records(g.conventions) or []
    if prof is not None and (prof.conventions or prof.inline_convention):
        conventions += prof.convention_records()
        from_prof.append("conventions")
    _no_duplicate_names(conventions)
    keep = [profile_mod.parse_choice(k, option_table.flag("keep")) for k in g.keep]
    drop = [profile_mod.parse_choice(d, option_table.flag("drop")) for d in g.drop]
    if prof is not None:
        for name, mine, theirs in (("keep", keep, prof.keep), ("drop", drop, prof.drop)):
            if theirs:
                mine.extend(theirs)
                from_prof.append(name)
    ties = [profile_mod.parse_tie(t) for t in g.ties]
    if prof is not None and prof.ties:
        ties += [t for t in prof.ties if t not in ties]
        from_prof.append("ties")
    reasons = {c.pattern: c.reason for c in keep + drop if c.reason}
    stated_by_config = tc.layout_spec() if tc is not None else None
    if stated_by_config is not None and _manifest_records_topology(ckpt):
        stated_by_config = None
    return Options(
        to=g.to or "", from_spec=pick("from_spec", g.from_spec, prof.from_spec if prof else None, stated_by_config),
        rules=pick("rules", g.rules, prof.rules if prof else None), model_config=config or None,
        conventions=conventions or None,
        keep=[c.pattern for c in keep] or None, drop=[c.pattern for c in drop] or None,
        key_reasons=reasons or None, ties=ties or None,
        profile=_record(prof.file, prof.sha256, from_prof, name=prof.name) if prof else None,
        trainer_config=_record(tc.file, tc.sha256, from_tc, kind=tc.kind, notes=list(tc.notes) or None) if tc else None,
        **{name: getattr(g, name) for name in COPIED}, **source)


def _manifest_records_topology(ckpt: str | Path | None) -> bool:
    """Whether the checkpoint's manifest records the layout it was written at (a converted output does).

    A trainer config describes the run, and a conversion may have moved its checkpoint to
    another layout: its degrees state the source layout only where the checkpoint records none.
    An unreadable manifest counts as none here; `inspect` names it.
    """
    if ckpt is None:
        return False
    from reshard.errors import ReshardError
    from reshard.semantics.manifest import read_manifest

    try:
        manifest = read_manifest(Path(ckpt))
    except (ReshardError, OSError):
        return False
    return bool(manifest is not None and (manifest.to_dict() or {}).get("topology"))


def from_origin(options: Options) -> str:
    """Where the source layout ``options.from_spec`` was stated, in words for a message that names it.

    The command line wins over a profile, which wins over a trainer config's degrees (`build_options`),
    and each file records that it contributed ``from_spec``.
    """
    spec = options.from_spec
    for label, rec in (("the profile", options.profile), ("the trainer config", options.trainer_config)):
        if rec and "from_spec" in (rec.get("contributed") or []):
            if label == "the profile":
                return f'from = "{spec}" in the profile {rec["file"]}'
            return f"the parallelism degrees of the trainer config {rec['file']} ({spec})"
    return f"--from {spec} (command line)"


def _record(file: str, sha256: str, contributed: list[str], **extra: Any) -> dict[str, Any]:
    return {"file": file, "sha256": sha256, **{k: v for k, v in extra.items() if v is not None},
            "contributed": sorted(set(contributed))}


def _merged_config(cli: dict[str, int], prof: Any, tc: Any, from_prof: list[str], from_tc: list[str]) -> dict[str, Any]:
    """Model config values per name: the command line's, then the profile's, then the trainer config's."""
    config = dict(cli)
    for source, names in ((prof.model_config if prof else {}, from_prof), (tc.model_config if tc else {}, from_tc)):
        for k, v in source.items():
            if k not in config:
                config[k] = v
                names.append(f"model_config.{k}")
    return config


def _trainer_config(path: str | Path) -> Any:
    from reshard.semantics.trainer_config import read_trainer_config

    return read_trainer_config(path)


def _trainer_recipe(tc: Any) -> dict[str, int]:
    """The recipe fields a trainer config states (its accumulation may need the dp degree: see the plan)."""
    if tc is None:
        return {}
    out = {"micro_batch": tc.micro_batch, "grad_accum": tc.grad_accum, "seq_len": tc.seq_len,
           "global_batch": tc.global_batch}
    return {k: v for k, v in out.items() if v is not None}


def _no_duplicate_names(records: list[dict[str, str]]) -> None:
    names = [r["name"] for r in records]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise BadInput(f"two conventions (from --convention or the profile) are both named '{dup}'",
                       hint="Give each convention a name of its own: a manifest records conventions by name.")


def convention_records(paths: Iterable[str | Path]) -> list[dict[str, str]] | None:
    """``--convention FILE`` arguments as the plan options record them: file, name and sha256 of each."""
    records = [load_user_convention(p).record() for p in paths]
    names = [r["name"] for r in records]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise BadInput(f"two --convention files are both named '{dup}'",
                       hint="Give each convention file a name of its own: a manifest records conventions by name.")
    return records or None


def user_conventions(options: Options) -> tuple[Convention, ...]:
    """The conventions ``options.conventions`` records, read again and checked against their recorded hashes."""
    out = []
    for rec in options.conventions or []:
        if not isinstance(rec, dict) or not all(isinstance(rec.get(f), str) for f in ("file", "name", "sha256")):
            raise BadInput(f"the plan options record a malformed convention {rec!r}",
                           hint="Expected {\"file\", \"name\", \"sha256\"} per --convention file.")
        uc = load_user_convention(rec["file"], rec.get("table"))
        if uc.sha256 != rec["sha256"] or uc.convention.name != rec["name"]:
            raise BadInput(f"the convention file no longer holds the convention '{rec['name']}' the plan read the keys "
                           f"with (sha256 {rec['sha256'][:16]}, now {uc.sha256[:16]} named '{uc.convention.name}')",
                           where=rec["file"],
                           hint="Restore the file the plan was made with, or make the plan again with the new file.")
        out.append(uc.convention)
    return tuple(out)


def check_plan_matches(given: dict[str, Any], plan: Plan) -> None:
    """`convert --plan`: refuse to execute anything but the plan that was printed."""
    if given.get("plan_version") != PLAN_VERSION:
        raise BadInput(f"plan version {given.get('plan_version')} is not {PLAN_VERSION}", where="--plan")
    if given.get("fingerprint") != plan.fingerprint():
        raise BadInput("the given plan does not match what this source and these options produce now "
                       "(the source changed, or options differ)", where="--plan",
                       hint="Re-run `reshard plan --json` and review it again.")


def options_from_plan(given: dict[str, Any]) -> Options:
    try:
        return Options(**given["options"])
    except (KeyError, TypeError) as exc:
        raise BadInput(f"not a reshard plan ({exc})", where="--plan") from None


@contextmanager
def opened_source(text: str) -> Iterator[Source]:
    """The checkpoint a source argument names, opened once for the command
    (`reshard.storage.source.opened`: a path, or a store URL staged for as long as the block runs).
    The CLI and the API build the options beside it (a profile next to the checkpoint is found
    either way) and hand it to the command, whose steps all read it through its own reader."""
    from reshard.storage.source import opened

    with opened(text) as source:
        yield source
