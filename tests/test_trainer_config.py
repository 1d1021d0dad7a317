"""`--trainer-config FILE`: a trainer's own config file read into profile facts (issue 16).

The torchtitan 0.3 files are written by torchtitan itself (tests/writers/torchtitan_config.py:
its ConfigManager parses the run, its Trainer.Config.maybe_log dumps it); the job TOMLs of
torchtitan <= 0.2, which 0.3 can no longer write, follow that schema as its shipped
train_configs spell it. The shipped flavour table is checked against torchtitan's own
flavours, and the seed's recipe (64 ranks x micro-batch 8 x accumulation 4 = 2,048) comes
out of both kinds of file.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import require_packages
from reshard.errors import BadInput
from reshard.paths import formats_root
from reshard.semantics.trainer_config import (
    TrainerConfig,
    grad_accum_for,
    llama_ffn_hidden,
    read_trainer_config,
    step_from_folder,
)

WRITER = Path(__file__).parent / "writers" / "torchtitan_config.py"
TABLE = tomllib.loads((formats_root() / "trainers" / "torchtitan.toml").read_text())


@pytest.fixture(scope="module")
def titan_json(tmp_path_factory) -> dict[str, Path]:
    """torchtitan 0.3's saved job configs: the seed's recipe, the defaults, the 8B preset."""
    require_packages("torchtitan")
    root = tmp_path_factory.mktemp("titan_cfg")
    jobs = {
        "seed": ("llama3_debugmodel", ["--training.local_batch_size", "8", "--training.global_batch_size", "2048",
                                       "--parallelism.data_parallel_shard_degree", "64"]),
        "default": ("llama3_debugmodel", []),
        "8B": ("llama3_8b", ["--parallelism.data_parallel_shard_degree", "8", "--parallelism.tensor_parallel_degree", "8"]),
    }
    spec = [{"dump": str(root / name), "config": cfg, "overrides": ov} for name, (cfg, ov) in jobs.items()]
    r = subprocess.run([sys.executable, str(WRITER), json.dumps(spec)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    assert r.returncode == 0, r.stderr[-3000:]
    return {name: root / name / "job_config.json" for name in jobs}


def _toml(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# torchtitan <= 0.2's job TOML (torchtitan/models/llama3/train_configs/llama3_8b.toml of
# v0.2.2), with the seed's recipe in [training] / [parallelism]
SEED_TOML_8B = """
[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "./assets/hf/Llama-3.1-8B"

[optimizer]
name = "AdamW"
lr = 3e-4

[training]
local_batch_size = 8
global_batch_size = 2048
seq_len = 8192
max_norm = 1.0
steps = 1000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = 64
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = true
folder = "checkpoint"
interval = 500
"""


# -------------------------------------------------------------- torchtitan 0.3 saved JSON


def test_seed_recipe_from_torchtitans_saved_config(titan_json):
    from torchtitan.models.llama3 import model_registry

    tc = read_trainer_config(titan_json["seed"])
    assert isinstance(tc, TrainerConfig)
    assert (tc.trainer, tc.kind, tc.file) == ("torchtitan", "torchtitan-0.3-json", str(titan_json["seed"].resolve()))
    assert (tc.micro_batch, tc.global_batch, tc.grad_accum, tc.seq_len) == (8, 2048, None, 2048)
    assert tc.degrees == {"dp_shard": 64, "dp_replicate": 1, "tp": 1, "pp": 1, "cp": 1}
    # the seed's case: 64 x 8 x 4 = 2,048; at 32 ranks the same 2,048 needs 8
    assert tc.accumulation(64) == 4 and tc.accumulation(32) == 8
    with pytest.raises(BadInput, match="2048 is not a multiple of micro-batch 8 x data-parallel degree 48"):
        tc.accumulation(48)
    # head counts and sizes are torchtitan's debugmodel's, as its own config objects say
    m = model_registry("debugmodel").model
    qkv = m.layers[0].attention.qkv_linear
    assert tc.flavor == "debugmodel" and tc.model == "llama3"
    assert tc.model_config == {"n_heads": qkv.n_heads, "n_kv_heads": qkv.n_kv_heads, "dim": m.dim,
                               "n_layers": len(m.layers), "vocab_size": m.vocab_size,
                               "ffn_hidden": m.layers[0].feed_forward.w1.out_features}
    assert tc.model_config["n_heads"] == 16 and tc.model_config["dim"] == 256
    out = tc.contributed()
    json.dumps(out)  # plain data, for the report
    assert out["sha256"] == tc.sha256 and len(tc.sha256) == 64
    assert out["micro_batch"] == 8 and out["global_batch"] == 2048 and "grad_accum" not in out
    assert out["from"]["model_config.n_heads"].endswith("qkv_linear.n_heads")


def test_torchtitan_defaults_mean_no_accumulation_and_no_stated_dp(titan_json):
    tc = read_trainer_config(titan_json["default"])
    # global_batch_size = -1: global = local x dp, so accumulation 1 at any dp
    assert (tc.micro_batch, tc.global_batch, tc.grad_accum) == (8, None, 1)
    assert tc.accumulation(64) == 1 and tc.accumulation(3) == 1
    # data_parallel_shard_degree = -1 ("the rest of the world") is no degree the file states
    assert "dp_shard" not in tc.degrees and tc.degrees["tp"] == 1
    assert tc.contributed()["grad_accum"] == 1


def test_8b_preset_and_tp_from_the_saved_config(titan_json):
    tc = read_trainer_config(titan_json["8B"])
    assert tc.flavor == "8B"
    assert tc.degrees["tp"] == 8 and tc.degrees["dp_shard"] == 8
    assert {k: tc.model_config[k] for k in ("n_heads", "n_kv_heads", "dim", "ffn_hidden")} == \
        {"n_heads": 32, "n_kv_heads": 8, "dim": 4096, "ffn_hidden": 14336}


def test_layers_that_disagree_are_refused_naming_the_path(titan_json, tmp_path):
    doc = json.loads(titan_json["seed"].read_text())
    doc["model_spec"]["model"]["layers"][3]["attention"]["qkv_linear"]["n_heads"] = 8
    p = tmp_path / "mixed.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(BadInput) as e:
        read_trainer_config(p)
    assert e.value.where == str(p.resolve())
    assert "qkv_linear.n_heads is not one value" in e.value.message and "8, 16" in e.value.message


# -------------------------------------------------------------- torchtitan <= 0.2 job TOML


def test_job_toml_8b_flavour_implies_head_counts(tmp_path):
    p = _toml(tmp_path, SEED_TOML_8B)
    tc = read_trainer_config(p)
    assert (tc.kind, tc.flavor, tc.model) == ("torchtitan-job-toml", "8B", "llama3")
    assert tc.model_config == {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336}
    assert "vocab_size" not in tc.model_config  # torchtitan 0.1 took it from the tokenizer: no flavour fixes it
    assert tc.origins["model_config.n_heads"] == "flavour llama3/8B"
    # the seed's recipe
    assert (tc.micro_batch, tc.global_batch, tc.grad_accum, tc.seq_len, tc.steps) == (8, 2048, None, 8192, 1000)
    assert tc.degrees == {"dp_shard": 64, "dp_replicate": 1, "tp": 1, "pp": 1, "cp": 1}
    assert tc.accumulation(64) == 4 and tc.accumulation(32) == 8


def test_older_job_toml_spellings(tmp_path):
    # before June 2025: training.batch_size, no global batch (no accumulation at all);
    # 2024: the degrees under [training], data_parallel_degree for FSDP
    p = _toml(tmp_path, """
[model]
name = "llama3"
flavor = "8B_flex"
[training]
batch_size = 4
seq_len = 2048
data_parallel_degree = -1
tensor_parallel_degree = 2
""")
    tc = read_trainer_config(p)
    assert (tc.micro_batch, tc.global_batch, tc.grad_accum) == (4, None, 1)
    assert tc.degrees == {"tp": 2}
    assert tc.model_config["n_kv_heads"] == 8 and tc.origins["model_config.n_kv_heads"] == "flavour llama3/8B"


def test_unknown_flavour_implies_nothing_and_says_so(tmp_path):
    p = _toml(tmp_path, '[model]\nname = "llama3"\nflavor = "my_13B"\n[training]\nlocal_batch_size = 2\n')
    tc = read_trainer_config(p)
    assert tc.model_config == {} and tc.micro_batch == 2
    assert any("my_13B" in n and "--model-config" in n for n in tc.notes)
    assert tc.contributed()["notes"] == tc.notes


def test_shipped_flavour_table_is_torchtitans():
    """Every shipped flavour against torchtitan 0.3's own model configs (the same flavours)."""
    require_packages("torchtitan")
    from torchtitan.models.common.feed_forward import compute_ffn_hidden_dim
    from torchtitan.models.llama3 import model_registry

    for flavor, v in TABLE["flavors"]["llama3"].items():
        m = model_registry(flavor).model
        qkv = m.layers[0].attention.qkv_linear
        assert (v["dim"], v["n_layers"], v["n_heads"], v["n_kv_heads"], v["vocab_size"]) == \
            (m.dim, len(m.layers), qkv.n_heads, qkv.n_kv_heads, m.vocab_size), flavor
        ffn = llama_ffn_hidden(v["dim"], v["multiple_of"], v.get("ffn_dim_multiplier"))
        assert ffn == m.layers[0].feed_forward.w1.out_features, flavor
        assert ffn == compute_ffn_hidden_dim(v["dim"], multiple_of=v["multiple_of"],
                                             ffn_dim_multiplier=v.get("ffn_dim_multiplier"))


# -------------------------------------------------------------- refused files


@pytest.mark.parametrize("body, field", [
    ("[training]\nlocal_batch_size = 0\n", "training.local_batch_size"),
    ("[training]\nlocal_batch_size = \"8\"\n", "training.local_batch_size"),
    ("[training]\nlocal_batch_size = 8.0\n", "training.local_batch_size"),
    ("[training]\nglobal_batch_size = 0\n", "training.global_batch_size"),
    ("[training]\nseq_len = -5\n", "training.seq_len"),
    ("[parallelism]\ntensor_parallel_degree = 0\n", "parallelism.tensor_parallel_degree"),
    ("[parallelism]\ndata_parallel_shard_degree = -2\n", "parallelism.data_parallel_shard_degree"),
    ("[parallelism]\ndata_parallel_replicate_degree = -1\n", "parallelism.data_parallel_replicate_degree"),
    ("[model]\nflavor = 8\n", "model.flavor"),
    # the file's own degrees cannot make 2,000 out of 8 x 64
    ("[training]\nlocal_batch_size = 8\nglobal_batch_size = 2000\n[parallelism]\ndata_parallel_shard_degree = 64\n",
     "training.global_batch_size"),
])
def test_malformed_values_are_refused_naming_file_and_field(tmp_path, body, field):
    p = _toml(tmp_path, body)
    with pytest.raises(BadInput) as e:
        read_trainer_config(p)
    assert e.value.where == str(p.resolve()) and field in e.value.message
    assert e.value.hint


@pytest.mark.parametrize("content, says", [
    (b"[optimizer]\nlr = 1e-3\n", "no known kind"),
    (b'{"optimizer": {"lr": 0.001}}', "no known kind"),
    (b'{"training": {"local_batch_size": 8}', "not valid JSON"),
    (b"[1, 2]", "neither a JSON object nor valid TOML"),
    (b"training = [\n", "neither a JSON object nor valid TOML"),
    (b"[training]\nlocal_batch_size = 8\n\xff\xfe", "not UTF-8"),
])
def test_unknown_or_unreadable_files_are_refused(tmp_path, content, says):
    p = tmp_path / "cfg"
    p.write_bytes(content)
    with pytest.raises(BadInput, match=says) as e:
        read_trainer_config(p)
    assert e.value.where in (str(p), str(p.resolve()))


def test_not_a_regular_file_or_missing(tmp_path):
    with pytest.raises(BadInput, match="not a regular file"):
        read_trainer_config(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(BadInput, match="not a regular file"):  # never blocks on a reader
        read_trainer_config(fifo)
    with pytest.raises(BadInput, match="cannot open") as e:
        read_trainer_config(tmp_path / "absent.toml")
    assert e.value.where == str(tmp_path / "absent.toml")


# -------------------------------------------------------------- step folders, accumulation


def test_step_from_folder_name():
    assert TABLE["step_folder"] == r"^step-(\d+)$"
    assert step_from_folder("/runs/llama/outputs/checkpoint/step-80000") == 80000
    assert step_from_folder("/runs/llama/outputs/checkpoint/step-80000/") == 80000
    assert step_from_folder(Path("step-0")) == 0
    for other in ("/runs/x/checkpoint", "global_step80000", "step-80000.tmp", "step-", "step-8a", "old-step-5",
                  "step-" + "9" * 40):
        assert step_from_folder(other) is None, other


def test_grad_accum_for():
    assert grad_accum_for(2048, 8, 64) == 4
    assert grad_accum_for(2048, 8, 32) == 8
    with pytest.raises(BadInput, match="global batch 2048 is not a multiple of micro-batch 8 x data-parallel degree 48 = 384"):
        grad_accum_for(2048, 8, 48)
    with pytest.raises(BadInput, match="micro-batch must be a positive integer"):
        grad_accum_for(2048, 0, 64)


# -------------------------------------------------------------- through the CLI (plan options)


def _plan_json(args: list, capsys) -> tuple[int, dict, str]:
    from conftest import run_cli

    code, out, err = run_cli(["plan", *args, "--json", "--no-profile"], capsys)
    return code, (json.loads(out) if out.strip() else {}), err


def test_seed_recipe_planned_from_a_trainer_config(seed64_ckpt, titan_json, tmp_path, capsys):
    """The seed's 64 -> 32 case, no manifest: the recipe from torchtitan's saved config and from a job TOML."""
    for cfg in (titan_json["seed"], _toml(tmp_path, SEED_TOML_8B)):
        code, p, err = _plan_json([seed64_ckpt, "--from", "dp=64", "--to", "dp=32", "--trainer-config", cfg],
                                  capsys)
        assert code == 0, err
        b = p["batch"]
        assert b["before"] == {"micro_batch": 8, "grad_accum": 4, "dp": 64, "global_batch": 2048}, cfg
        assert b["after"] == {"micro_batch": 8, "grad_accum": 8, "dp": 32, "global_batch": 2048}, cfg
        assert b["kept"] is True and f"trainer config {cfg.name}" in b["note"]
        rec = p["options"]["trainer_config"]
        assert rec["file"] == str(cfg.resolve()) and len(rec["sha256"]) == 64
        assert {"source_micro_batch", "source_global_batch"} <= set(rec["contributed"])
    # a flag wins over the trainer config
    code, p, err = _plan_json([seed64_ckpt, "--from", "dp=64", "--to", "dp=32", "--trainer-config",
                               titan_json["seed"], "--source-micro-batch", "4"], capsys)
    assert code == 0 and p["batch"]["before"] == {"micro_batch": 4, "grad_accum": 8, "dp": 64, "global_batch": 2048}
    # a stated layout the checkpoint's chunks contradict is refused before any recipe is computed (issue 31;
    # tc.accumulation(48) is refused in test_seed_recipe_from_torchtitans_saved_config)
    code, p, err = _plan_json([seed64_ckpt, "--from", "dp=48", "--to", "dp=32", "--trainer-config",
                               titan_json["seed"]], capsys)
    assert code == 2 and "--from dp=48" in err and "Traceback" not in err, err


def test_a_profile_names_the_trainer_config(seed64_ckpt, titan_json, tmp_path, capsys):
    prof = _toml(tmp_path, f'trainer_config = "{titan_json["seed"]}"\n', "reshard.toml")
    from conftest import run_cli

    code, out, err = run_cli(["plan", seed64_ckpt, "--from", "dp=64", "--to", "dp=32", "--json",
                              "--profile", prof], capsys)
    assert code == 0, err
    p = json.loads(out)
    assert p["batch"]["after"]["grad_accum"] == 8 and p["options"]["trainer_config"]["kind"] == "torchtitan-0.3-json"
