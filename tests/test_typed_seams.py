"""The seams between the layers are typed, and the vocabularies are declared once (`reshard.model.kinds`).

Three checks, all by reading code or types (no checkpoint is made, so the file runs in a second):

* no module compares an action (``a.action``, ``rec["action"]``, a variable named ``action``) with a
  string spelled again: it compares with a member of `Action` or `ExportAction`, so a renamed or
  mistyped kind is an AttributeError at import, not a branch silently never taken;
* `Plan` and `Inspection` have no field typed ``Any`` (nor containing it): what passes between
  describing, planning and executing says what it is;
* the four checkpoint readers declare `CheckpointReader` and define each of its methods with the
  Protocol's parameters.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from reshard.model.kinds import Action, ExportAction

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "reshard"

VOCABULARY = {str(m) for m in Action} | {str(m) for m in ExportAction}

def _names_an_action(node: ast.expr) -> bool:
    """``x.action``, ``action``, ``x["action"]``, ``x.get("action")``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "action"
    if isinstance(node, ast.Name):
        return node.id == "action"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "action"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "action"
    return False


def _spelled_kinds(node: ast.expr) -> list[str]:
    """The kinds of the vocabulary spelled as string literals in ``node`` (a literal, or a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in VOCABULARY else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [k for e in node.elts for k in _spelled_kinds(e)]
    return []


def _spelled_comparisons(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            if any(_names_an_action(s) for s in sides):
                found += [(n.lineno, k) for s in sides for k in _spelled_kinds(s)]
        elif isinstance(n, ast.Assign) and any(_names_an_action(t) for t in n.targets):
            found += [(n.lineno, k) for k in _spelled_kinds(n.value)]
    return found


def test_no_action_is_compared_with_a_spelled_string():
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "reshard/model/kinds.py":
            continue
        wrong += [f"{rel}:{line}: compares an action with '{k}'" for line, k in _spelled_comparisons(ast.parse(path.read_text()))]
    assert not wrong, "use the member of reshard.model.kinds instead:\n" + "\n".join(wrong)


def test_the_scan_finds_what_it_looks_for():
    """The scan above is only as good as its reading: it flags each spelling it forbids."""
    code = ('if a.action == "dropped": pass\nif rec["action"] in ("added", "x"): pass\n'
            'if rec.get("action") != "tied_copy": pass\na.action = "carried"\nif a.action == Action.DROPPED: pass\n')
    assert sorted(_spelled_comparisons(ast.parse(code))) == [(1, "dropped"), (2, "added"), (3, "tied_copy"), (4, "carried")]


def _contains_any(tp: object) -> bool:
    if tp is typing.Any:
        return True
    if isinstance(tp, typing.ForwardRef):  # the recursive JSON alias refers to itself
        return False
    return any(_contains_any(a) for a in typing.get_args(tp))


@pytest.mark.parametrize("cls", ["Plan", "Inspection", "Options", "KeyAction", "TensorPlan"])
def test_the_plan_and_the_inspection_have_no_field_typed_any(cls):
    from reshard.model import inspection, plan

    klass = getattr(plan, cls, None) or getattr(inspection, cls)
    hints = typing.get_type_hints(klass)
    untyped = [f.name for f in dataclasses.fields(klass) if _contains_any(hints[f.name])]
    assert not untyped, f"{cls} fields typed Any (or containing Any): {untyped}"


READERS = [("reshard.storage.checkpoints.index", "CheckpointIndex"), ("reshard.storage.checkpoints.hf_dcp", "HfDcpIndex"),
           ("reshard.storage.checkpoints.safetensors_format", "ExportIndex"), ("reshard.storage.checkpoints.local_format", "LocalIndex")]


@pytest.mark.parametrize("module,name", READERS)
def test_every_reader_declares_and_implements_the_protocol(module, name):
    import importlib

    from reshard.model.reader import READER_METHODS, CheckpointReader

    klass = getattr(importlib.import_module(module), name)
    assert CheckpointReader in klass.__mro__, f"{name} does not declare CheckpointReader"
    proto_methods = {n for n, v in vars(CheckpointReader).items() if callable(v) and not n.startswith("_")}
    assert proto_methods == set(READER_METHODS)
    for method in READER_METHODS:
        owner = next(c for c in klass.__mro__ if method in vars(c))
        assert owner is not CheckpointReader, f"{name}.{method} is only the Protocol's stub"
        want = list(inspect.signature(getattr(CheckpointReader, method)).parameters.values())
        have = list(inspect.signature(getattr(klass, method)).parameters.values())
        assert [p.name for p in have[:len(want)]] == [p.name for p in want], f"{name}.{method}{inspect.signature(getattr(klass, method))}"
        extra = [p.name for p in have[len(want):] if p.default is inspect.Parameter.empty
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        assert not extra, f"{name}.{method} needs parameters the Protocol does not pass: {extra}"
    assert isinstance(vars(CheckpointReader)["complete"], property)


def _protocol_members(proto: type) -> set[str]:
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n, v in vars(proto).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


PROTOCOLS = [  # (the model's Protocol, the class of a layer above that a Plan or an Inspection holds)
    ("reshard.model.plan_sections", "RecipeView", "reshard.semantics.batch", "Recipe"),
    ("reshard.model.plan_sections", "BatchSection", "reshard.semantics.batch", "BatchDecision"),
    ("reshard.model.plan_sections", "ScheduleSection", "reshard.semantics.schedule", "ScheduleDecision"),
    ("reshard.model.plan_sections", "DataSection", "reshard.semantics.data", "DataDecision"),
    ("reshard.model.plan_sections", "RngSection", "reshard.semantics.rng", "RngDecision"),
    ("reshard.model.inspection", "KeyClassification", "reshard.semantics.conventions", "Classification"),
    ("reshard.model.inspection", "KeyRoleView", "reshard.semantics.conventions", "KeyRole"),
    ("reshard.model.inspection", "ConventionView", "reshard.semantics.conventions", "Convention"),
    ("reshard.model.inspection", "ManifestView", "reshard.semantics.manifest", "Manifest"),
]


@pytest.mark.parametrize("pmod,pname,cmod,cname", PROTOCOLS)
def test_the_classes_above_have_what_the_models_protocols_name(pmod, pname, cmod, cname):
    """The model types what it holds by Protocols; the classes semantics makes must offer every member."""
    import importlib

    proto = getattr(importlib.import_module(pmod), pname)
    klass = getattr(importlib.import_module(cmod), cname)
    fields = {f.name for f in dataclasses.fields(klass)} if dataclasses.is_dataclass(klass) else set()
    missing = sorted(n for n in _protocol_members(proto) if n not in fields and not hasattr(klass, n))
    assert not missing, f"{cname} lacks {missing}, which {pname} names"
