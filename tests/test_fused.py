"""Fused QKV with grouped-query heads and padded vocab across TP degrees, on real TP x FSDP2 layouts."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.testing.synthetic_llama import LlamaShape, canonical_weights, load_global, make_llama_checkpoint
from reshard.semantics.transforms import to_canonical

SHAPE = LlamaShape()  # 8 query heads, 2 KV heads, head_dim 8, ffn 96, vocab 100 padded to multiples of 8 x tp
QKV = "model.decoder.layers.0.self_attention.linear_qkv.weight"
FC1 = "model.decoder.layers.1.mlp.linear_fc1.weight"
EMB = "model.embedding.word_embeddings.weight"


@pytest.fixture(scope="module")
def fused_tp2(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("fused") / "tp2", shape=SHAPE, tp=2, dp=1, fused=True, seed=5)


@pytest.fixture(scope="module")
def round_trip(fused_tp2, tmp_path_factory, request):
    root = tmp_path_factory.mktemp("fused_rt")
    tp1, back = root / "tp1", root / "tp2"
    from reshard.cli import main

    for src, dst, spec in ((fused_tp2, tp1, "dp=1,tp=1"), (tp1, back, "dp=1,tp=2")):
        try:
            main(["convert", str(src), str(dst), "--to", spec, "--json"])
        except SystemExit as exc:
            assert exc.code == 0, f"convert {spec} exited {exc.code}"
    return tp1, back


def test_tp2_to_1_to_2_is_exact(fused_tp2, round_trip):
    _, back = round_trip
    a, b = load_global(fused_tp2), load_global(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_tp1_fused_equals_the_one_built_from_unfused_weights(round_trip):
    tp1, _ = round_trip
    ix = CheckpointIndex.open(tp1)
    unfused = canonical_weights(SHAPE, fused=False, seed=5)
    expect_qkv = torch.cat([unfused[f"layers.0.attention.{n}.weight"] for n in ("wq", "wk", "wv")], dim=0)
    assert torch.equal(ix.read_tensor(QKV), expect_qkv)
    expect_fc1 = torch.cat([unfused[f"layers.1.feed_forward.{n}.weight"] for n in ("w1", "w3")], dim=0)
    assert torch.equal(ix.read_tensor(FC1), expect_fc1)
    # moments follow their parameter's rule
    src_m = CheckpointIndex.open(tp1).read_tensor(f"optim.state.{QKV[len('model.'):]}.exp_avg")
    assert src_m.shape == expect_qkv.shape


def test_tp2_layout_interleaves_parts_per_rank(fused_tp2):
    ix = CheckpointIndex.open(fused_tp2)
    g = ix.read_tensor(QKV)
    hd, q, kv = SHAPE.head_dim, SHAPE.n_heads * SHAPE.head_dim, SHAPE.n_kv_heads * SHAPE.head_dim
    canon = to_canonical(g, 0, [q, kv, kv], 2)
    Q, K, V = torch.split(canon, [q, kv, kv])
    block0 = g[: (q + 2 * kv) // 2]
    assert torch.equal(block0, torch.cat([Q[: q // 2], K[: kv // 2], V[: kv // 2]]))
    assert hd * SHAPE.n_kv_heads == kv


def test_padded_vocab_follows_tp_and_keeps_learned_rows(fused_tp2, round_trip):
    tp1, back = round_trip
    a, m = CheckpointIndex.open(fused_tp2), CheckpointIndex.open(tp1)
    assert a.entries[EMB].shape[0] == SHAPE.padded_vocab(2) == 112
    assert m.entries[EMB].shape[0] == SHAPE.padded_vocab(1) == 104
    assert torch.equal(a.read_tensor(EMB)[:104], m.read_tensor(EMB))
    report = json.loads((tp1 / "reshard-report.json").read_text())
    emb = next(k for k in report["plan"]["keys"] if k["key"] == EMB)
    assert "vocab 100 padded 112 -> 104" in emb["reason"]


def test_tp_not_dividing_kv_heads_is_refused_with_nearest_degrees(fused_tp2, capsys):
    code, out, _ = run_cli(["plan", fused_tp2, "--to", "dp=1,tp=4", "--json"], capsys)
    p = json.loads(out)
    assert code == 1 and p["feasible"] is False
    reason = next(r for r in p["reasons"] if "tp=4" in r)
    assert "n_kv_heads = 2" in reason and "nearest feasible tp: [2, 1]" in reason
