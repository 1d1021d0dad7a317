"""Every command and option the README and docs/cli.md name exists (issue 20): the front page cannot drift from the CLI.

Each ``reshard COMMAND ...`` inside the README's code (fenced blocks and inline code) must
name a real command, and each ``--option`` on that command line must appear in that
command's own ``--help``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALL = re.compile(r"(?:^|[\s`(])reshard ([a-z][a-z-]*)([^`\n]*)")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _code(text: str) -> list[str]:
    """The README's code: fenced blocks joined by their continuation lines, and inline spans."""
    blocks = [b.replace("\\\n", " ") for b in re.findall(r"```[a-z]*\n(.*?)```", text, re.S)]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return blocks + re.findall(r"`([^`\n]+)`", prose)


def test_every_command_and_option_the_readme_names_exists():
    readme = (ROOT / "README.md").read_text() + "\n" + (ROOT / "docs" / "cli.md").read_text()
    calls: dict[str, set[str]] = {}
    for code in _code(readme):
        for line in code.split("\n"):
            for m in CALL.finditer(line):
                calls.setdefault(m.group(1), set()).update(OPTION.findall(m.group(2).split(" && ")[0]))
    assert {"inspect", "plan", "convert", "demo"} <= set(calls), sorted(calls)
    env = dict(os.environ, COLUMNS="240", TERM="dumb")
    for cmd, options in sorted(calls.items()):
        p = subprocess.run([sys.executable, "-m", "reshard", cmd, "--help"], capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=120)
        assert p.returncode == 0, f"the README names 'reshard {cmd}', which is not a command: {p.stderr[-500:]}"
        missing = sorted(o for o in options if o not in p.stdout and o != "--help")
        assert not missing, f"the README gives 'reshard {cmd}' options its --help does not list: {missing}"


def test_readme_setup_figures_are_the_measured_ones():
    """Issue 35: the README's install and demo times are those `scripts/measure_setup.py` recorded
    in docs/setup-times.json, for the README's own commands. Issue 47: each figure stated once (the
    developer install too), and the record's `pip check` after the s3 line found no conflict."""
    import json

    readme = (ROOT / "README.md").read_text()
    record = json.loads((ROOT / "docs" / "setup-times.json").read_text())
    seconds = {p["name"]: p["seconds"] for p in record["parts"] if p["exit_code"] == 0}

    def said(pattern: str) -> float:
        found = re.findall(pattern, readme)
        assert len(found) == 1, (pattern, found)  # stated once
        return int(found[0][0]) * 60 + int(found[0][1])

    assert abs(said(r"(\d+) min (\d+) s to create the venv and install") - seconds["venv"] - seconds["install"]) <= 1
    assert abs(said(r"then (\d+) min (\d+) s for the demo") - seconds["demo"]) <= 1
    assert abs(said(r"\((\d+) min (\d+) s more in the same record") - seconds["test_install"]) <= 1
    assert "pip_check" in seconds and "s3_install" in seconds
    assert not re.search(r"about \d+(-\d+)? min", readme[:readme.index("## Quickstart")])  # no unmeasured figure
    commands = {p["name"]: p["command"] for p in record["parts"]}
    first = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "reshard demo" in b)
    assert commands["install"].split("pip install")[1].strip() in first  # the README's command was measured
