"""No command ever executes code a checkpoint names: pickles outside an allow list are refused unrun.

Three places a checkpoint can hide a pickle: `.metadata` (reshard's allow-listing unpickler,
no trust escape), an object item (``torch.load(weights_only=True)``; ``--trust-pickle``
lifts it), and a per-rank data-loader state stored as pickled bytes (builtins-only
unpickler, opened only with ``--data-policy translate``). Every case checks that a marker
file a payload would create never appears.
"""
from __future__ import annotations

import json
import pathlib
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import run_cli
from reshard.testing.synthetic import write_malicious_metadata


class Evil:
    """Unpickling this calls ``pathlib.Path.touch(marker)``: the observable "code execution"."""

    def __init__(self, marker: Path):
        self.marker = Path(marker)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _save(sd: dict, path: Path, marker: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    # DCP may deep-copy the state dict while saving, which runs __reduce__ here, in the test
    if marker.exists():
        marker.unlink()
    return path


def _tiny_reshard_ckpt(path: Path, marker: Path, *, evil_at: str | None) -> Path:
    w = torch.arange(8.0).reshape(4, 2)
    sd = {"model": {"w": w},
          "optim": {"state": {"w": {"exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.ones_like(w),
                                    "step": torch.tensor(3.0)}}},
          "trainer": {"step": 3, "tokens_seen": 96},
          "data": {"sampler": {"cursor": 24, "seed": 0, "epoch": 0}}}
    if evil_at == "data.sampler":
        sd["data"]["sampler"] = Evil(marker)
    elif evil_at == "trainer.step":
        sd["trainer"]["step"] = Evil(marker)
    return _save(sd, path, marker)


def _one_paragraph_error(err: str) -> str:
    text = err.strip()
    assert text.startswith("error:"), err
    assert "\n\n" not in text and "Traceback" not in err, err
    return text


def _commands(ck: Path, good: Path, dst: Path) -> dict[str, list]:
    return {"inspect": ["inspect", ck], "inspect --deep": ["inspect", "--deep", ck],
            "plan": ["plan", ck, "--to", "dp=2"], "convert": ["convert", ck, dst, "--to", "dp=2"],
            "verify": ["verify", good, ck]}


# ---------------------------------------------------------------- (a) .metadata: no trust escape

@pytest.mark.parametrize("embed", [True, False])
@pytest.mark.parametrize("trust", [False, True])
def test_malicious_metadata_refused_by_every_command(tmp_path, capsys, embed, trust):
    marker = tmp_path / "pwned-metadata"
    good = _tiny_reshard_ckpt(tmp_path / "good", marker, evil_at=None)
    ck = tmp_path / "evil"
    shutil.copytree(good, ck)
    write_malicious_metadata(ck, marker, embed=embed)
    for name, args in _commands(ck, good, tmp_path / "dst").items():
        args = args + (["--trust-pickle"] if trust else [])
        code, out, err = run_cli(args, capsys)
        assert not marker.exists(), f"{name}: the .metadata payload ran"
        assert code == 2, (name, code, out, err)
        text = _one_paragraph_error(err)
        assert "refusing to unpickle" in text and str(ck / ".metadata") in text, (name, text)
        assert not (tmp_path / "dst").exists()
    # the other direction of verify too
    code, _, err = run_cli(["verify", ck, good] + (["--trust-pickle"] if trust else []), capsys)
    assert code == 2 and not marker.exists() and ".metadata" in err


# ---------------------------------------------------------------- (b) an object item

def test_object_item_is_refused_unrun_by_every_command(tmp_path, capsys):
    """`data.sampler` = Evil(): commands that load it refuse it by key; none runs it.

    `inspect` (without --deep) and `plan` read no object bytes but the ones they need
    (counters, cursors): they may not look at the item at all, so they may exit 0, but
    must not run it.
    """
    marker = tmp_path / "pwned-object"
    good = _tiny_reshard_ckpt(tmp_path / "good", marker, evil_at=None)
    ck = _tiny_reshard_ckpt(tmp_path / "evil", marker, evil_at="data.sampler")
    twin = tmp_path / "evil-twin"  # verify must load the object on both sides to compare it
    shutil.copytree(ck, twin)
    dst = tmp_path / "dst"
    must_load = {"inspect --deep", "convert", "verify"}
    for name, args in _commands(ck, twin, dst).items():
        code, out, err = run_cli(args + (["--json"] if name.startswith("inspect") else []), capsys)
        assert not marker.exists(), f"{name}: the object item ran"
        if name not in must_load:
            assert code in (0, 2), (name, code, err)
            continue
        assert code == 2, (name, code, out, err)
        if name == "inspect --deep":
            probs = json.loads(out)["problems"]
            assert any(p["code"] == "unsafe_item" and p["keys"] == ["data.sampler"] for p in probs), probs
        else:
            text = _one_paragraph_error(err)
            assert "data.sampler" in text and "--trust-pickle" in text, (name, text)
        assert not dst.exists() or not any(dst.iterdir())


def test_object_item_read_by_every_command_is_refused_by_every_command(tmp_path, capsys):
    """A counter every command reads (`trainer.step`) holding Evil(): all five refuse it, by key."""
    marker = tmp_path / "pwned-counter"
    good = _tiny_reshard_ckpt(tmp_path / "good", marker, evil_at=None)
    ck = _tiny_reshard_ckpt(tmp_path / "evil", marker, evil_at="trainer.step")
    for name, args in _commands(ck, good, tmp_path / "dst").items():
        code, out, err = run_cli(args, capsys)
        assert not marker.exists(), f"{name}: the object item ran"
        assert code == 2, (name, code, out, err)
        assert "trainer.step" in out + err, (name, out, err)
        assert "Traceback" not in err
        assert not (tmp_path / "dst").exists()


def test_trust_pickle_lets_object_items_through_and_is_recorded(tmp_path, capsys):
    marker = tmp_path / "trusted"
    ck = _tiny_reshard_ckpt(tmp_path / "evil", marker, evil_at="data.sampler")
    code, out, err = run_cli(["inspect", ck, "--deep", "--json", "--trust-pickle"], capsys)
    assert not any(p["code"] == "unsafe_item" for p in json.loads(out)["problems"]), out
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", ck, dst, "--to", "dp=2", "--trust-pickle", "--json"], capsys)
    assert code == 0, err
    # trusting means the payload may run: that is what the flag says
    man = json.loads((dst / "manifest.json").read_text())
    assert man["lineage"][-1]["policies"]["trust_pickle"] is True
    report = json.loads((dst / "reshard-report.json").read_text())
    assert "data.sampler" in {k["key"] for k in report["plan"]["keys"]}
    # without trust, the converted output is refused like its source
    marker.unlink(missing_ok=True)
    code, _, err = run_cli(["verify", ck, dst], capsys)
    assert code == 2 and "data.sampler" in err and not marker.exists()


# ---------------------------------------------------------------- (c) pickled per-rank loader state

def _titan_ckpt(path: Path, marker: Path, rank0_state: bytes) -> Path:
    w = torch.arange(12.0).reshape(6, 2)
    good = {"sampler": {"epoch": 0, "samples_yielded": 5}, "dp_rank": 1, "world_size": 2}
    sd = {"layers.0.w": w,
          "optimizer": {"state": {"layers.0.w": {"exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.ones_like(w),
                                                 "step": torch.tensor(4.0)}}},
          "lr_scheduler": {"last_epoch": 4},
          "train_state": {"step": 4, "ntokens_seen": 320},
          "dataloader": {"dp_rank_0": rank0_state, "dp_rank_1": pickle.dumps(good), "world_size": 2}}
    return _save(sd, path, marker)


def test_pickled_loader_state_refused_unrun(tmp_path, capsys):
    marker = tmp_path / "pwned-loader"
    ck = _titan_ckpt(tmp_path / "titan", marker, pickle.dumps(Evil(marker)))
    base = ["--from", "dp=2", "--to", "dp=1", "--data-policy", "translate"]
    code, out, err = run_cli(["inspect", ck, "--deep"], capsys)  # bytes are bytes: loading them is safe
    assert not marker.exists()
    # without --trust-pickle nothing is unpickled; with it the user vouches for the source (like object items)
    for trust in ([],):
        code, out, err = run_cli(["plan", ck, *base, *trust], capsys)
        assert not marker.exists(), "plan unpickled the loader state"
        assert code == 2, (code, out, err)
        text = _one_paragraph_error(err)
        assert "dataloader.dp_rank_0" in text and "refusing to unpickle" in text, text
        dst = tmp_path / f"dst{len(trust)}"
        code, out, err = run_cli(["convert", ck, dst, *base, *trust], capsys)
        assert not marker.exists(), "convert unpickled the loader state"
        assert code == 2 and "dataloader.dp_rank_0" in err, (code, err)
        assert not dst.exists()
    # the refusal is about translating: dropping the state never opens it
    code, out, err = run_cli(["plan", ck, "--from", "dp=2", "--to", "dp=1", "--data-policy", "drop"], capsys)
    assert code == 0 and not marker.exists(), err


def test_trust_pickle_opens_pickled_loader_state_as_the_hint_says(tmp_path, capsys):
    import collections

    marker = tmp_path / "unused"
    state = collections.OrderedDict(sampler={"epoch": 0, "samples_yielded": 5}, dp_rank=0, world_size=2)
    ck = _titan_ckpt(tmp_path / "titan", marker, pickle.dumps(state))
    code, out, err = run_cli(["plan", ck, "--from", "dp=2", "--to", "dp=1", "--data-policy", "translate"], capsys)
    assert code == 2 and "--trust-pickle" in err  # refused, and told the way out ...
    code, out, err = run_cli(["plan", ck, "--from", "dp=2", "--to", "dp=1", "--data-policy", "translate",
                              "--trust-pickle"], capsys)
    assert code == 0, err  # ... which does not work
