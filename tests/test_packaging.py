"""The package installs as a wheel with its `formats/` data, and CI runs the README's command."""
from __future__ import annotations

import os
import re
import tomllib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    commands = [b.strip() for b in blocks if "python3 -m venv" in b]
    assert len(commands) == 2, "README must hold exactly two set-up commands"
    test_cmd = next(c for c in commands if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines()


def test_non_editable_install_finds_formats(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True)
    assert (target / "reshard" / "formats" / "conventions" / "reshard.toml").exists()
    code = ("import reshard.semantics.conventions as c, reshard.storage.pickles.safe_pickle as s; "
            "print(sorted(x.name for x in c.builtin_conventions())); print(len(s._allow_list()))")
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout.split("\n")
    shipped = sorted(tomllib.loads(f.read_text())["name"] for f in (ROOT / "formats" / "conventions").glob("*.toml"))
    assert len(shipped) >= 5 and out[0] == str(shipped)  # every convention file in the tree is installed
    assert int(out[1]) > 10
    # every module of the source tree is in the wheel and imports from it
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "reshard").rglob("*.py") if p.name != "__main__.py")
    code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]; print('ok')"
    r = subprocess.run([sys.executable, "-c", code, *modules], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    for m in modules:
        assert (target / (m.replace(".", "/") + ".py")).exists() or (target / m.replace(".", "/") / "__init__.py").exists(), m
    # the native modules setup.py builds are in the wheel wherever one of them is (a C compiler was found)
    natives = ("storage/pickles/costscan", "storage/pickles/metadecode", "storage/files/fastcrc")
    if any((target / "reshard").glob("storage/pickles/costscan*.so")):
        for native in natives:
            assert any((target / "reshard").glob(native + "*.so")), native
    for data in ("formats/models/llama-fused.toml", "formats/renames/torchtitan-to-hf-llama.toml",
                 "formats/data_states.toml", "formats/step_log.md", "formats/manifest.schema.json"):
        assert (target / "reshard" / data).exists(), data


def test_python_dash_m_reshard_help():
    out = subprocess.run([sys.executable, "-m", "reshard", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "inspect" in out.stdout
