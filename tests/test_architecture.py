"""The layers of `reshard` import downward only, with no cycle and no private name crossing a module.

Every module's imports are read from its source (module level and inside functions, since a
lazy import is still a dependency) and checked against the layer order written once, in the
architecture page, docs/architecture.md (the table between the ``layers:begin`` / ``layers:end``
markers). A command imports no other command and stays short: the logic lives in the layers below.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "reshard"


def _block() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text.split("<!-- layers:begin -->", 1)[1].split("<!-- layers:end -->", 1)[0]


def _rows() -> list[list[str]]:
    rows = []
    for line in _block().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            rows.append(cells)
    return rows


def _declared() -> list[list[str]]:
    """Layers bottom-up, each a list of module prefixes, from docs/architecture.md."""
    return [re.findall(r"`(reshard[\w./]*)`", cells[1]) for cells in _rows()]


MAX_COMMAND_LINES = int(re.search(r"no module of `reshard/commands/` is longer than (\d+) lines", _block()).group(1))


def _allowed() -> list[dict[int, set[str] | None]]:
    """Per layer, the lower layers it may import: layer -> None (any module of it) or the only
    modules of it that may (``semantics (only `safetensors_format`, ...)``), read from the
    "may import" column: "nothing of reshard", "everything", names, and "A to B" ranges."""
    rows = _rows()
    names = [c[1].split(":")[0].strip() for c in rows]
    out: list[dict[int, set[str] | None]] = []
    for i, cells in enumerate(rows):
        text = cells[2]
        allowed: dict[int, set[str] | None] = {}
        if text.startswith("everything"):
            allowed = {j: None for j in range(i)}
        elif not text.startswith("nothing"):
            for part in re.split(r",\s*(?![^()]*\))", text):
                part = part.strip()
                rng = re.match(r"(\w+) to (\w+)$", part)
                if rng:
                    a, b = names.index(rng.group(1)), names.index(rng.group(2))
                    allowed.update({j: None for j in range(a, b + 1)})
                    continue
                m = re.match(r"(\w+)(?:\s*\((.*)\))?$", part)
                assert m and m.group(1) in names, f"unreadable 'may import' entry {part!r} in layer {names[i]}"
                only = re.findall(r"only `(\w+)`", m.group(2) or "")
                allowed[names.index(m.group(1))] = set(only) if only else None
        out.append(allowed)
    return out


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    # `formats/` ships as the package `reshard.formats` (pyproject's package-dir): `reshard.paths` imports
    # it, and without this entry the check would read that import as one of the package's facade
    mods["reshard.formats"] = ROOT / "formats" / "__init__.py"
    return mods


MODS = _modules()


def _target(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    if not str(MODS[mod]).endswith("__init__.py"):
        base = base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mod: str) -> list[tuple[str, int, list[str]]]:
    """(imported module, line, names taken from it) for every import of a reshard module in ``mod``."""
    tree = ast.parse(MODS[mod].read_text())
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno, []) for a in n.names if a.name.split(".")[0] == "reshard"]
        elif isinstance(n, ast.ImportFrom):
            tgt = _target(mod, n)
            if tgt.split(".")[0] != "reshard":
                continue
            plain = [a.name for a in n.names if f"{tgt}.{a.name}" not in MODS]
            out += [(f"{tgt}.{a.name}", n.lineno, []) for a in n.names if f"{tgt}.{a.name}" in MODS]
            if plain:
                out.append((tgt, n.lineno, plain))
    return out


def _layer_of(mod: str, layers: list[list[str]]) -> int:
    best, where = -1, None
    for i, prefixes in enumerate(layers):
        for p in prefixes:
            p = p.replace("/", ".").removesuffix(".py").rstrip(".")
            inside = mod == p or (mod.startswith(p + ".") and p != "reshard")  # `reshard` alone: the package itself
            if inside and len(p) > best:
                best, where = len(p), i
    assert where is not None, f"module {mod} belongs to no layer in docs/architecture.md's table"
    return where


def _command(mod: str) -> str | None:
    """The command a module belongs to (``reshard.commands.convert``), or None outside the commands."""
    parts = mod.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["reshard", "commands"] and len(parts) > 2 else None


def test_every_module_belongs_to_one_layer():
    layers = _declared()
    assert len(layers) >= 6
    for m in MODS:
        _layer_of(m, layers)


def test_a_command_imports_no_other_command():
    wrong = []
    for m in sorted(MODS):
        if _command(m) is None:
            continue
        for tgt, line, _ in _imports(m):
            if _command(tgt) is not None and _command(tgt) != _command(m):
                wrong.append(f"{m}:{line} imports {tgt}: a command imports no other command "
                             "(what two commands share belongs in a layer below)")
    assert not wrong, "\n".join(wrong)


def test_commands_orchestrate_in_a_few_hundred_lines():
    long = {m: n for m in MODS if _command(m) is not None
            for n in [len(MODS[m].read_text().splitlines())] if n > MAX_COMMAND_LINES}
    assert not long, f"commands longer than {MAX_COMMAND_LINES} lines (move the logic to a layer below): {long}"


CLI_MAY_USE = ("reshard.api",                   # a verb is parse, call the API, render
               "reshard.arguments", "reshard.cli_parse", "reshard.commands.", "reshard.render.", "reshard.errors",
               "reshard.planning.options",      # the flags, a profile and a trainer config as one set of options
               "reshard.engine.distributed")    # whether this process is a torchrun worker, and its error hand-off


def test_cli_only_parses_and_calls():
    """The CLI parses, calls a command and renders: it defines no class and imports nothing else of reshard."""
    tree = ast.parse(MODS["reshard.cli"].read_text())
    assert not [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    other = [f"reshard.cli:{line} imports {tgt}" for tgt, line, _ in _imports("reshard.cli")
             if tgt not in ("reshard", "reshard.__version__") and not tgt.startswith(CLI_MAY_USE)]
    assert not other, "\n".join(other)


def test_imports_point_down_the_declared_layers():
    layers = _declared()
    allowed = _allowed()
    wrong = []
    for m in sorted(MODS):
        lm = _layer_of(m, layers)
        for tgt, line, _ in _imports(m):
            if tgt not in MODS and tgt.rsplit(".", 1)[0] in MODS:
                tgt = tgt.rsplit(".", 1)[0]
            if tgt not in MODS or tgt == m or m.startswith(tgt + ".") and tgt != "reshard":
                continue
            lt = _layer_of(tgt, layers)
            if lt > lm:
                wrong.append(f"{m}:{line} imports {tgt} (layer {lt} above {lm})")
            elif lt < lm and (lt not in allowed[lm] or (allowed[lm][lt] is not None
                                                        and m.rsplit(".", 1)[-1] not in allowed[lm][lt])):
                wrong.append(f"{m}:{line} imports {tgt}: layer {lm} may not import layer {lt} (docs/architecture.md's 'may import')")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = {m: set() for m in MODS}
    for m in MODS:
        for tgt, _, _ in _imports(m):
            while tgt not in MODS and "." in tgt:
                tgt = tgt.rsplit(".", 1)[0]
            if tgt in MODS and tgt != m and not m.startswith(tgt + "."):
                graph[m].add(tgt)
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> None:
        seen[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if seen.get(w) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(w):] + [w]))
            if w not in seen:
                visit(w)
        stack.pop()
        seen[v] = 2

    for v in sorted(graph):
        if v not in seen:
            visit(v)


def test_no_private_name_crosses_a_module():
    wrong = []
    for m in sorted(MODS):
        tree = ast.parse(MODS[m].read_text())
        aliases: dict[str, str] = {}
        for tgt, line, names in _imports(m):
            wrong += [f"{m}:{line} takes {n} from {tgt}" for n in names if n.startswith("_") and not n.startswith("__")]
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and _target(m, n).startswith("reshard"):
                for a in n.names:
                    if f"{_target(m, n)}.{a.name}" in MODS:
                        aliases[a.asname or a.name] = f"{_target(m, n)}.{a.name}"
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.startswith("reshard") and a.asname:
                        aliases[a.asname] = a.name
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
                    and n.attr.startswith("_") and not n.attr.startswith("__") and aliases[n.value.id] != m):
                wrong.append(f"{m}:{n.lineno} uses {aliases[n.value.id]}.{n.attr}")
    assert not wrong, "\n".join(wrong)
