"""Issue 44: the options of ``plan``, ``convert`` and ``inspect`` are declared once (`reshard.model.option_table`).

A plan flag used to be spelled in seven places, and one forgotten was a flag that silently did
nothing there (``convert --plan P --seed 0`` went unrefused: 0 read as not given). Adding one now touches
the table and, where the planner reads it, `Options`. Checked here, without a checkpoint:

* every option of the table is a parameter of each verb that takes it, with the table's flag,
  default and help, in table order (the order ``--help`` lists them);
* every plan option is refused beside ``convert --plan`` (``--seed 0`` too), and nothing else is;
* every plan option is a field of `Given` with the table's default, and reaches `Options`
  (copied as given, or read by `build_options` where a profile may complete it);
* the API's `PlanOptions` are the plan options of the table;
* no module that parses or checks these flags spells one of them outside the table.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
from typer.main import get_command

from reshard import arguments, cli
from reshard.errors import BadInput
from reshard.model import option_table
from reshard.model.option_table import OPTIONS, PLAN_OPTIONS, REQUIRED
from reshard.model.plan import Options
from reshard.planning import options as planning_options
from reshard.semantics.profile import RECIPE_FIELDS

ROOT = Path(__file__).resolve().parents[1]
VERBS = ("inspect", "plan", "convert")


def _cli_params(verb: str) -> dict[str, object]:
    """The click options the CLI built for ``verb``, by their long flag, in signature order."""
    command = get_command(cli.app).commands[verb]
    return {next(o for o in p.opts if o.startswith("--")): p for p in command.params if p.param_type_name == "option"}


@pytest.mark.parametrize("verb", VERBS)
def test_every_option_of_a_verb_is_its_parameter_with_the_tables_default_and_help(verb):
    params = _cli_params(verb)
    specs = option_table.for_verb(verb)
    assert specs, verb
    for spec in specs:
        assert spec.flag in params, f"{verb} lacks {spec.flag}"
        param = params[spec.flag]
        assert param.name == spec.name
        default = spec.default_for(verb)
        assert param.required == (default is REQUIRED), spec.flag
        if default is not REQUIRED:
            assert param.default == default, spec.flag
        assert param.help == spec.help_for(verb), spec.flag
        assert param.multiple == spec.repeatable, spec.flag
    order = [flag for flag in params if flag in {s.flag for s in specs}]
    assert order == [s.flag for s in specs], "the table's options are listed in table order"


def test_plan_and_convert_take_every_plan_option_but_the_reduced_copy():
    """A plan option reaches both planning verbs, unless the table says it is convert's alone (dtype, only)."""
    for spec in PLAN_OPTIONS:
        assert "convert" in spec.verbs, spec.flag
        if spec.name not in ("dtype", "only"):
            assert "plan" in spec.verbs, spec.flag


@pytest.mark.parametrize("spec", PLAN_OPTIONS, ids=lambda s: s.flag)
def test_every_plan_option_is_refused_beside_a_plan(spec):
    value = {bool: True, int: 0 if spec.min == 0 else 1, str: "x", Path: Path("x")}[spec.type]
    with pytest.raises(BadInput) as caught:
        arguments.check_beside_plan("P.json", {spec.name: [value] if spec.repeatable else value})
    assert f"{spec.flag} has no effect beside --plan" in str(caught.value)


def test_options_not_given_and_others_are_not_refused_beside_a_plan():
    given = {spec.name: spec.default for spec in PLAN_OPTIONS} | {"to": "dp=2", "output_format": "local"}
    given |= {spec.name: [] for spec in PLAN_OPTIONS if spec.repeatable}
    arguments.check_beside_plan("P.json", given)


def test_refused_flags_are_named_in_help_order():
    given = {"only": "model", "seed": 0, "from_spec": "dp=2"}
    with pytest.raises(BadInput) as caught:
        arguments.check_beside_plan("P.json", given)
    assert "--from, --seed, --only have no effect beside --plan" in str(caught.value)


def test_every_plan_option_is_a_field_of_given_with_the_tables_default():
    fields = {f.name: f for f in dataclasses.fields(planning_options.Given)}
    g = planning_options.Given()
    for spec in OPTIONS:
        if spec.field is None:
            continue
        assert spec.field in fields, spec.flag
        expected = [] if spec.repeatable else (None if spec.default is REQUIRED else spec.default)
        assert getattr(g, spec.field) == expected, spec.flag


def test_every_plan_option_reaches_options():
    """Copied to the `Options` field of its name, or read by `build_options` itself (a profile or a
    trainer config may complete it, or it says which files to read)."""
    option_fields = {f.name for f in dataclasses.fields(Options)}
    source = inspect.getsource(planning_options.build_options)
    for spec in PLAN_OPTIONS:
        if spec.copied:
            assert spec.field in option_fields, spec.flag
        else:
            assert f"g.{spec.field}" in source or spec.field in RECIPE_FIELDS.values(), spec.flag


def test_given_from_takes_the_command_lines_values():
    g = planning_options.given_from({"convention": [Path("c.toml")], "tie": ["a=b"], "rules": Path("r.toml"),
                                     "seed": 0, "output_format": "local"}, to="dp=2")
    assert (g.to, g.conventions, g.ties, g.rules, g.seed) == ("dp=2", ["c.toml"], ["a=b"], "r.toml", 0)


def test_a_plain_option_is_copied_to_options(tmp_path):
    g = planning_options.given_from({"seed": 0, "layers": "0-1", "micro_batch": 2, "no_profile": True}, to="dp=2")
    opts = planning_options.build_options(g, tmp_path)
    assert (opts.seed, opts.layers, opts.micro_batch, opts.experts) == (0, "0-1", 2, None)


def test_the_apis_plan_options_are_the_tables():
    from reshard.api import PlanOptions

    assert list(PlanOptions.__annotations__) == [spec.name for spec in PLAN_OPTIONS]


def _literals(tree: ast.AST) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_plan_flag_is_spelled_outside_the_table():
    """Where these flags are parsed and checked, each is named through the table (``rehearse``'s
    own ``--from`` or ``export --dtype`` are other options that happen to share a spelling)."""
    flags = {spec.flag for spec in OPTIONS}
    found = []
    for rel in ("reshard/arguments.py", "reshard/cli_parse.py", "reshard/planning/options.py", "reshard/api.py"):
        tree = ast.parse((ROOT / rel).read_text())
        found += [f"{rel}:{line} {value}" for line, value in _literals(tree) if value in flags]
    tree = ast.parse((ROOT / "reshard/cli.py").read_text())
    verbs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in VERBS]
    assert len(verbs) == len(VERBS)
    for fn in verbs:
        found += [f"reshard/cli.py:{line} {value}" for line, value in _literals(fn) if value in flags]
    assert not found, "plan flags spelled outside reshard/model/option_table.py:\n" + "\n".join(found)
