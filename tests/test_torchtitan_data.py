"""torchtitan's data position carried across a change of data-parallel degree (issue 36).

torchtitan 0.3.0's ``HuggingFaceTextDataLoader`` keeps, per dp rank, its dataset's own position
(`reshard.semantics.data`'s docstring derives the arithmetic). `--data-policy translate` rewrites it
for a new dp degree where that is exact (a streamed dataset split by example: form
``datasets-stream-modulo`` in formats/data_states.toml) and refuses, with the reason, where it is
not (a map-style dataset's contiguous blocks, whole shards per rank, a shuffle buffer, one rank,
ranks that read different numbers of examples in a way no new split takes up).

What is checked, cheapest first:
- the translation's arithmetic against a brute force over every candidate state (no processes);
- torchtitan's own loaders in this process: a state translated here and loaded by torchtitan's
  ``load_state_dict`` on the new ranks reads every token not yet emitted exactly once, for
  examples of different lengths (ranks at different positions), and each refusal on a real state;
- the acceptance: torchtitan's own job (llama3, FSDP2, CheckpointManager) trains at dp=4 and
  saves; ``reshard convert --to dp=2`` and ``dp=3 --data-policy translate``; torchtitan's
  CheckpointManager loads each output WITH the dataloader on 2 and 3 ranks and trains to the
  end of the epoch; every example is read exactly once over the whole run, and each new rank
  reads first the examples ``plan`` said it would.
"""
from __future__ import annotations

import collections
import itertools
import json
import os
import pickle
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import once_per_run, require_packages, writer_key  # noqa: E402

require_packages("torchtitan", "torchdata", "datasets")

from reshard.errors import BadInput  # noqa: E402
from reshard.semantics import data as data_mod  # noqa: E402
from tests.conftest import cli  # noqa: E402

WRITERS = Path(__file__).parent / "writers"
WRITER = WRITERS / "torchtitan_data_run.py"
KEY = "dataloader.dp_rank_{}".format


# ---------------------------------------------------------------------------- the arithmetic

def _simulate(idx: list[int], new_pos: list[int], bound: int) -> tuple[set[int], collections.Counter]:
    """(examples below ``bound`` read by the old ranks at ``idx``, how often the new ranks at ``new_pos`` read each)."""
    world, new_world = len(idx), len(new_pos)
    before = {r + world * i for r in range(world) for i in range(idx[r] // world)}  # shard 0: idx_r = W * s_r
    after = collections.Counter(x for k, p in enumerate(new_pos) for x in range(p + k, bound, new_world))
    return {x for x in before if x < bound}, after


def _exact(idx: list[int], new_pos: list[int]) -> bool:
    bound = max(idx + new_pos) + 3 * len(new_pos) * len(idx) + 8
    before, after = _simulate(idx, new_pos, bound)
    return all(after[x] == (0 if x in before else 1) for x in range(bound))


def test_equal_positions_every_new_rank_keeps_the_position():
    """Lock-step ranks (all at P = W*s): the consumed set is the prefix [0, P), every new rank resumes at P."""
    for world, s in ((4, 11), (3, 7), (2, 1)):
        idx = [world * s] * world
        for new_world in (2, 3, 5, 8):
            pos = data_mod.translate_stream(idx, new_world)
            assert pos == [world * s] * new_world
            proof = data_mod.stream_proof(idx, pos)
            assert proof["exact"] and proof["consumed_before"] == proof["consumed_after"] == world * s, proof
            assert _exact(idx, pos)


def test_translation_agrees_with_a_brute_force_over_every_state():
    """Ranks that read different numbers of examples: where translate gives positions they are exact (simulated
    read by read), and where it refuses, no positions in the range a state may name (0 .. the furthest recorded)
    are exact: the refusal is not a gap in the derivation."""
    rng = random.Random(36)
    seen = collections.Counter()
    for _ in range(160):
        world = rng.choice([2, 3, 4])
        new_world = rng.choice([w for w in (2, 3) if w != world])
        base = rng.randint(0, 3)
        idx = [world * (base + rng.choice([0, 0, 1, 1, 2])) for _ in range(world)]
        try:
            pos = data_mod.translate_stream(idx, new_world)
        except data_mod.NotExact as exc:
            seen["refused"] += 1
            assert "read" in str(exc) or "past every position recorded" in str(exc), exc
            top = max(idx)
            assert not any(_exact(idx, list(c)) for c in itertools.product(range(top + 1), repeat=new_world)), (idx, new_world)
            continue
        seen["translated"] += 1
        assert _exact(idx, pos), (idx, new_world, pos)
        assert data_mod.stream_proof(idx, pos)["exact"]
        assert min(pos) >= 0 and max(pos) <= max(idx)
    assert seen["refused"] >= 10 and seen["translated"] >= 30, seen  # both branches exercised


def test_positions_of_another_split_are_refused():
    """Positions not congruent modulo W are not a modulo split by W."""
    with pytest.raises(data_mod.NotExact, match="not congruent"):
        data_mod.translate_stream([8, 9, 8, 8], 2)


def test_buffers_are_carried_whole_and_each_part_starts_a_document():
    old = {0: {"inputs_buffer": [5, 6], "labels_buffer": [6, 7], "positions_buffer": [3, 4]},
           1: {"inputs_buffer": [9], "labels_buffer": [10], "positions_buffer": [2]},
           2: {"inputs_buffer": [11, 12, 13], "labels_buffer": [12, 13, 14], "positions_buffer": [1, 0, 1]}}
    fields = ["inputs_buffer", "labels_buffer", "positions_buffer"]
    new = data_mod.combine_buffers(old, 2, fields, "positions_buffer")
    assert new[0] == {"inputs_buffer": [5, 6, 11, 12, 13], "labels_buffer": [6, 7, 12, 13, 14],
                      "positions_buffer": [0, 1, 0, 0, 1]}  # rank 2's tail renumbered from 0, as torchtitan does
    assert new[1] == {"inputs_buffer": [9], "labels_buffer": [10], "positions_buffer": [0]}


# ---------------------------------------------------------------------------- torchtitan's loaders in this process

VAR_EXAMPLES = 120


@pytest.fixture(scope="module")
def loaders(tmp_path_factory):
    """torchtitan's HuggingFaceTextDataLoader over local JSON-lines datasets, registered in its DATASETS table.

    ``var``: one file of examples of 1 to 4 content tokens (so ranks read different numbers of
    examples); ``two``: the same in two files (2 shards); ``map``: the file as a map-style Dataset;
    ``shuffled``: the stream through a shuffle buffer.
    """
    from datasets import load_dataset
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets

    work = tmp_path_factory.mktemp("titan_data")
    rng = random.Random(7)
    lengths = [rng.randint(1, 4) for _ in range(VAR_EXAMPLES)]
    rows = [json.dumps({"text": f"example {i} {lengths[i]}"}) + "\n" for i in range(VAR_EXAMPLES)]
    (work / "var.jsonl").write_text("".join(rows))
    (work / "a.jsonl").write_text("".join(rows[:60]))
    (work / "b.jsonl").write_text("".join(rows[60:]))

    class Tokens(BaseTokenizer):
        """Example i of n tokens -> [BOS, 2+4i, ..., 2+4i+n-1, EOS]: every token names its example."""

        def __init__(self) -> None:
            super().__init__()
            self.eos_id = 1

        def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
            _, i, n = text.split()
            return [0] + [2 + 4 * int(i) + j for j in range(int(n))] + [1]

        def decode(self, ids: list[int]) -> str:
            return ""

        def get_vocab_size(self) -> int:
            return 2 + 4 * VAR_EXAMPLES

    stream = lambda p: load_dataset("json", data_files=p, split="train", streaming=True)  # noqa: E731
    registered = {
        "reshard_var": DatasetConfig(str(work / "var.jsonl"), stream, lambda s: s["text"]),
        "reshard_two": DatasetConfig(str(work / "a.jsonl"), lambda p: load_dataset(
            "json", data_files=[p, str(work / "b.jsonl")], split="train", streaming=True), lambda s: s["text"]),
        "reshard_map": DatasetConfig(str(work / "var.jsonl"), lambda p: load_dataset(
            "json", data_files=p, split="train", cache_dir=str(work / "cache")), lambda s: s["text"]),
        "reshard_shuffled": DatasetConfig(str(work / "var.jsonl"), lambda p: stream(p).shuffle(seed=0, buffer_size=8),
                                          lambda s: s["text"]),
    }
    text_datasets.DATASETS.update(registered)

    def make(name: str, world: int, rank: int):
        cfg = text_datasets.HuggingFaceTextDataLoader.Config(dataset=name, infinite=False)
        return text_datasets.HuggingFaceTextDataLoader(cfg, dp_world_size=world, dp_rank=rank, tokenizer=Tokens(),
                                                       seq_len=4, local_batch_size=1)

    expected = collections.Counter(t for i in range(VAR_EXAMPLES) for t in [0] + [2 + 4 * i + j for j in range(lengths[i])])
    yield {"make": make, "expected": expected, "trained": {}}
    for name in registered:
        text_datasets.DATASETS.pop(name, None)


def _train(loaders, name: str, world: int, steps: int) -> tuple[dict[int, tuple[str, bytes]], list[int]]:
    """``steps`` batches on every rank of ``world``: (each rank's saved state, the tokens emitted); once per module."""
    memo = loaders["trained"]
    if (name, world, steps) in memo:
        per_rank, emitted = memo[name, world, steps]
        return dict(per_rank), list(emitted)
    emitted, per_rank = [], {}
    for r in range(world):
        dl = loaders["make"](name, world, r)
        it = iter(dl)
        for _ in range(steps):
            x, _ = next(it)
            emitted += x["input"].flatten().tolist()
        per_rank[r] = (KEY(r), dl.state_dict()[f"dp_rank_{r}"])
    memo[name, world, steps] = (dict(per_rank), list(emitted))
    return per_rank, emitted


def _translate(per_rank, world: int, new_world: int, policy: str = "translate"):
    return data_mod.decide(per_rank, {"dataloader.world_size": world}, source_dp=world, target_dp=new_world,
                           policy=policy, key_for_rank=KEY)


# (world, new world, steps): lock-step and uneven positions, growing and shrinking; which translate and which
# are refused is the arithmetic's answer for these example lengths, asserted below
CASES = [(4, 2, 3), (4, 3, 2), (2, 3, 5), (3, 2, 1), (2, 4, 6), (3, 5, 3), (4, 5, 6)]


@pytest.mark.parametrize("world,new_world,steps", CASES)
def test_torchtitan_loaders_read_every_token_once_after_translate(loaders, world, new_world, steps):
    """Translated: torchtitan's load_state_dict takes the new states, and the tokens emitted before, after, and left
    in the buffers at the end of the epoch are every example's tokens exactly once. Refused: for the arithmetic's
    reason (ranks that read different numbers of examples)."""
    per_rank, emitted = _train(loaders, "reshard_var", world, steps)
    try:
        d = _translate(per_rank, world, new_world)
    except BadInput as exc:
        assert "not exact" in str(exc) and "--data-policy drop" in str(exc), exc
        return
    assert d.proof["exact"] and d.proof["consumed_before"] == d.proof["consumed_after"]
    left = []
    for k in range(new_world):
        dl = loaders["make"]("reshard_var", new_world, k)
        dl.load_state_dict({f"dp_rank_{k}": d.writes[KEY(k)], "world_size": d.writes["dataloader.world_size"]})
        emitted += [t for x, _ in dl for t in x["input"].flatten().tolist()]
        left += pickle.loads(dl.state_dict()[f"dp_rank_{k}"])["dataset_state"]["inputs_buffer"]
    assert collections.Counter(emitted + left) == loaders["expected"]


def test_some_uneven_positions_translate_and_some_are_refused(loaders):
    """The cases above cover both answers (else the parametrised test proves less than it says)."""
    answers = collections.Counter()
    for world, new_world, steps in CASES:
        per_rank, _ = _train(loaders, "reshard_var", world, steps)
        idx = {data_mod.stream_position(data_mod.split_forms()[0], pickle.loads(v), k)[1] for k, v in per_rank.values()}
        try:
            _translate(per_rank, world, new_world)
            answers["translated, uneven" if len(idx) > 1 else "translated, even"] += 1
        except BadInput:
            answers["refused"] += 1
    assert answers["translated, uneven"] and answers["refused"], answers


@pytest.mark.parametrize("name,world,new_world,policy,reason", [
    ("reshard_map", 2, 3, "translate", "contiguous blocks"),
    ("reshard_two", 2, 3, "translate", "whole shards per rank"),
    ("reshard_shuffled", 2, 3, "translate", "shuffle buffer is not saved"),
    ("reshard_var", 2, 1, "translate", "one rank cannot resume"),
    ("reshard_var", 2, 3, "restart-epoch", "not offered"),
])
def test_refusals_say_why_and_what_remains(loaders, name, world, new_world, policy, reason):
    """A real state of each kind that cannot be translated exactly: exit 2's error, the reason, and drop offered."""
    per_rank, _ = _train(loaders, name, world, 2)
    with pytest.raises(BadInput) as info:
        _translate(per_rank, world, new_world, policy)
    text = str(info.value)
    assert reason in text and "--data-policy drop" in text and info.value.exit_code == 2, text


def test_a_shard_split_on_the_new_degree_fails_loudly_not_silently(loaders):
    """Two data files: dp=4 splits by example (2 is not a multiple of 4), and so does dp=3, exactly; but dp=2 gives
    each rank a whole file, which the checkpoint cannot show. The translation says what it assumes, and torchtitan's
    loader at dp=2 stops at its first batch with the guard's text instead of reading its file from the start."""
    per_rank, emitted = _train(loaders, "reshard_two", 4, 6)  # 6 steps: positions from which dp=3 and dp=2 are exact
    exact = _translate(per_rank, 4, 3)
    left = []
    for k in range(3):
        dl = loaders["make"]("reshard_two", 3, k)
        dl.load_state_dict({f"dp_rank_{k}": exact.writes[KEY(k)], "world_size": 3})
        emitted += [t for x, _ in dl for t in x["input"].flatten().tolist()]
        left += pickle.loads(dl.state_dict()[f"dp_rank_{k}"])["dataset_state"]["inputs_buffer"]
    assert collections.Counter(emitted + left) == loaders["expected"]
    again = loaders["make"]("reshard_two", 3, 0)  # a translated run, saved again, is again of the form
    again.load_state_dict({"dp_rank_0": exact.writes[KEY(0)], "world_size": 3})
    it = iter(again)
    next(it), next(it)
    form = data_mod.split_forms()[0]
    assert data_mod.stream_position(form, pickle.loads(again.state_dict()["dp_rank_0"]), "again")[1] > 0
    shards = _translate(per_rank, 4, 2)
    assert "must not be a multiple of the new dp degree" in shards.requires and shards.requires in shards.note
    dl = loaders["make"]("reshard_two", 2, 0)
    dl.load_state_dict({"dp_rank_0": shards.writes[KEY(0)], "world_size": 2})
    with pytest.raises(KeyError, match="reads whole shards"):
        next(iter(dl))
    assert "met:" in _translate(per_rank, 4, 8).requires  # 8 is a multiple of 4: the split by example is proven


# ---------------------------------------------------------------------------- acceptance: torchtitan's own job

EXAMPLES = 240


def _torchrun(nproc: int, mode: str, spec: dict[str, Any], work: Path) -> None:
    import subprocess

    path = work / f"{mode}-{nproc}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WRITER),
           mode, str(path)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(cmd)}:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"


def _reads(dump: Path, tag: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((dump / "reads" / f"{tag}-rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def titan_source(tmp_path_factory) -> dict[str, Any]:
    """dp=4: 2 steps of torchtitan's job over EXAMPLES examples, saved by CheckpointManager (one 4-rank launch,
    once per run), and the ids, tokens and buffers each rank read."""
    sys.path.insert(0, str(WRITERS))
    import torchtitan_data_run as run

    def make(work: Path) -> str:
        run.examples_file(work / "ids.jsonl", EXAMPLES)
        _torchrun(4, "write", {"dump": str(work / "dp4"), "data": str(work / "ids.jsonl"), "steps": 2}, work)
        return str(work)

    src = Path(once_per_run(tmp_path_factory, writer_key(WRITER, "torchtitan", "datasets") + "-dp4", make))
    return {"dir": src, "ckpt": src / "dp4" / "checkpoint" / "step-2", "before": _reads(src / "dp4", "write", 4)}


@pytest.fixture(scope="module")
def resumed(titan_source, tmp_path_factory):
    """``resumed(world)``: plan and convert the dp=4 checkpoint to dp=world with --data-policy translate, then one
    launch at world ranks that loads it with the dataloader and trains to the end of the epoch (each world once)."""
    work = tmp_path_factory.mktemp("titan_data_resume")
    done: dict[int, dict[str, Any]] = {}

    def get(world: int) -> dict[str, Any]:
        if world not in done:
            code, text, err = cli(["plan", titan_source["ckpt"], "--to", f"dp={world}", "--data-policy", "translate", "--json"])
            assert code == 0, text + err
            plan = json.loads(text)
            dst = work / f"dp{world}" / "checkpoint" / "step-2"
            code, text, err = cli(["convert", titan_source["ckpt"], dst, "--to", f"dp={world}", "--data-policy", "translate"])
            assert code == 0, text + err
            report = json.loads((dst / "reshard-report.json").read_text())
            _torchrun(world, "resume", {"dump": str(work / f"dp{world}"), "data": str(titan_source["dir"] / "ids.jsonl"),
                                        "step": 2, "tag": "resume"}, work)
            done[world] = {"plan": plan, "report": report, "after": _reads(work / f"dp{world}", "resume", world)}
        return done[world]

    return get


@pytest.mark.parametrize("world", [2, 3])
def test_every_example_read_exactly_once_across_the_dp_change(titan_source, resumed, world):
    """dp=4 for 2 steps, then dp=2 (dp=3) from the converted checkpoint to the end of the epoch: the ids every rank
    read, before and after, are each of the examples exactly once; so are the tokens (emitted, plus what the
    buffers hold when the epoch ends, which torchtitan leaves unemitted)."""
    before, after = titan_source["before"], resumed(world)["after"]
    assert all(r["loaded"] and r["step_loaded"] == 2 for r in after), [(r["loaded"], r["step_loaded"]) for r in after]
    assert all(r["trained"] > 0 for r in after)
    assert all(r["buffer"] for r in before), "the dp=4 buffers were empty at the save: the buffer carry is untested"
    ids = collections.Counter(i for r in before + after for i in r["read"])
    assert sorted(ids) == list(range(EXAMPLES)) and set(ids.values()) == {1}, \
        {i: n for i, n in ids.items() if n != 1} or sorted(set(range(EXAMPLES)) - set(ids))
    tokens = collections.Counter([t for r in before + after for t in r["emitted"]] + [t for r in after for t in r["buffer"]])
    assert tokens == collections.Counter(t for i in range(EXAMPLES) for t in (0, 2 + 2 * i, 3 + 2 * i))


@pytest.mark.parametrize("world", [2, 3])
def test_plan_names_where_each_new_rank_resumes_and_the_proof(titan_source, resumed, world):
    """plan --json: per new rank its stream position and first examples, which are the examples torchtitan's loader
    then read first; the proof (read before = read by no new rank, none twice); the convert report records the same."""
    run = resumed(world)
    data = run["plan"]["data"]
    assert data["policy"] == "translate" and data["form"] == "datasets-stream-modulo" and data["continuity"] is True
    consumed = sum(len(r["read"]) for r in titan_source["before"])
    assert [r["position"] for r in data["resume"]] == [consumed] * world
    for r, got in zip(data["resume"], run["after"]):
        assert got["read"][:4] == r["first_examples"], (r, got["read"][:4])
    proof = data["proof"]
    assert proof["exact"] and proof["consumed_before"] == proof["consumed_after"] == consumed and proof["read_twice"] == 0
    assert proof["buffered_tokens_before"] == proof["buffered_tokens_after"] == sum(len(r["buffer"]) for r in titan_source["before"])
    assert run["report"]["plan"]["data"]["proof"] == proof
    assert "one file" in data["requires"]
    code, text, err = cli(["plan", titan_source["ckpt"], "--to", f"dp={world}",
                           "--data-policy", "translate"])
    assert code == 0, text + err
    assert f"new rank {world - 1}: resumes at stream position {consumed}, reads examples " \
           f"{', '.join(map(str, data['resume'][-1]['first_examples']))}" in text, text
    assert f"proof: {consumed} examples read before, {consumed} read by no new rank, 0 read twice" in text, text


def test_an_alias_of_a_dp_rank_is_refused_naming_both(loaders, tmp_path):
    """Issue 42 item 2: ``dataloader.dp_rank_001`` (an older position of rank 1) beside ``dataloader.dp_rank_1``,
    in a checkpoint written by ``dcp.save``: torchtitan loads ``dp_rank_1`` only, so a translation proven against
    either would be proven against a state the trainer may not read. ``plan --data-policy translate`` refuses it
    (exit 2) naming both keys, and inspect reports it. Costs a single-process dcp.save and two CLI calls (~1 s)."""
    import torch
    import torch.distributed.checkpoint as dcp

    per_rank, _ = _train(loaders, "reshard_var", 2, 6)  # (2, 4, 6) of CASES: translates when nothing is aliased
    older, _ = _train(loaders, "reshard_var", 2, 1)
    assert _translate(per_rank, 2, 4).proof["exact"]
    sd = {"tok_embeddings.weight": torch.ones(8, 4), "output.weight": torch.ones(8, 4),
          "dataloader": {"dp_rank_0": per_rank[0][1], "dp_rank_1": per_rank[1][1], "dp_rank_001": older[1][1],
                         "world_size": 2},
          "train_state": {"step": 5, "ntokens_seen": 40}}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    code, out, err = cli(["plan", tmp_path / "ck", "--from", "dp=2", "--to", "dp=4", "--data-policy", "translate",
                          "--trust-pickle", "--json"])
    assert code == 2, out + err
    assert "'dataloader.dp_rank_001' and 'dataloader.dp_rank_1'" in err and "--convention" in err, err
    code, out, _ = cli(["inspect", tmp_path / "ck", "--json"])
    problems = json.loads(out)["problems"]
    assert any(p["code"] == "data_rank_alias" and set(p["keys"]) == {"dataloader.dp_rank_001", "dataloader.dp_rank_1"}
               for p in problems), problems
