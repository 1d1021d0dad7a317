"""Synthetic Llama checkpoints: real DCP saves laid out as a TP x FSDP2 job holds its tensors."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from reshard.semantics import conventions
from reshard.semantics import manifest as mf
from reshard.semantics import rules as R
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.testing.synthetic_llama import (
    LlamaShape,
    canonical_weights,
    load_global,
    make_llama_checkpoint,
    param_names,
)
from reshard.semantics.transforms import to_canonical

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SHAPE = LlamaShape()
CASES = [(2, 1, True), (1, 2, True), (2, 2, False)]
QKV = "decoder.layers.{}.self_attention.linear_qkv.weight"
FC1 = "decoder.layers.{}.mlp.linear_fc1.weight"
QKV_PARTS = [SHAPE.n_heads * SHAPE.head_dim, SHAPE.n_kv_heads * SHAPE.head_dim, SHAPE.n_kv_heads * SHAPE.head_dim]
FC1_PARTS = [SHAPE.ffn_hidden, SHAPE.ffn_hidden]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for tp, dp, fused in CASES:
        out[(tp, dp, fused)] = make_llama_checkpoint(
            tmp_path_factory.mktemp(f"llama_tp{tp}_dp{dp}_{'fused' if fused else 'titan'}") / "ckpt",
            shape=SHAPE, tp=tp, dp=dp, fused=fused, seed=3)
    return out


@pytest.fixture(scope="module")
def globals_(ckpts):
    return {case: load_global(path) for case, path in ckpts.items()}


def boxes(md, key):
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[key].chunks)


def expected_boxes(name, gshape, *, fused, tp, dp):
    """Independent statement of the TP x FSDP2 layout: TP cut per the TOML rule, then FSDP dim-0 chunks."""
    rule = R.select([name], family="llama-fused" if fused else "llama-torchtitan").rule_for(name)
    assert rule is not None, name

    def cut(n, k, i):
        step = -(-n // k)
        lo = min(i * step, n)
        return lo, min(lo + step, n) - lo

    out = set()
    for t in range(tp):
        offs, sizes = [0] * len(gshape), list(gshape)
        if rule.tp != "replicate":
            offs[rule.dim], sizes[rule.dim] = cut(gshape[rule.dim], tp, t)
        for d in range(dp):
            lo, n = cut(sizes[0], dp, d)
            out.add(((offs[0] + lo,) + tuple(offs[1:]), (n,) + tuple(sizes[1:])))
    return sorted(out)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"tp{c[0]}-dp{c[1]}-{'fused' if c[2] else 'titan'}")
def test_stock_dcp_reads_it_and_index_is_complete(ckpts, globals_, case):
    tp, dp, fused = case
    path = ckpts[case]
    md = FileSystemReader(str(path)).read_metadata()
    idx = CheckpointIndex.open(path)
    assert idx.complete, idx.findings
    assert idx.writer_ranks() == list(range(tp * dp))
    names = param_names(SHAPE, fused=fused)
    want_keys = {f"model.{n}" for n in names}
    want_keys |= {f"optim.state.{n}.{m}" for n in names for m in ("exp_avg", "exp_avg_sq", "step")}
    want_keys |= {"optim.param_groups.0.lr", "trainer.step"}
    assert set(md.state_dict_metadata) == want_keys
    assert isinstance(md.state_dict_metadata["trainer.step"], BytesStorageMetadata)

    # stock single-process dcp.load gives the same global tensors as reshard's index
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if isinstance(v, TensorStorageMetadata)}
    sd["trainer.step"] = 0
    sd["optim.param_groups.0.lr"] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    assert sd["trainer.step"] == 10 and sd["optim.param_groups.0.lr"] == 1e-3
    g = globals_[case]
    assert set(g) == {k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    for k, v in g.items():
        assert torch.equal(sd[k], v), k
    for n in names:
        assert g[f"optim.state.{n}.step"].shape == () and g[f"optim.state.{n}.step"].item() == 10.0
        assert bool((g[f"optim.state.{n}.exp_avg_sq"] >= 0).all())
        assert boxes(md, f"optim.state.{n}.exp_avg") == boxes(md, f"model.{n}")

    # every tensor's chunks are what a TP x FSDP2 job holds
    for n in names:
        for key in (f"model.{n}", f"optim.state.{n}.exp_avg", f"optim.state.{n}.exp_avg_sq"):
            assert boxes(md, key) == expected_boxes(n, tuple(md.state_dict_metadata[key].size),
                                                    fused=fused, tp=tp, dp=dp), key

    # the key layout is the reshard convention's, nothing unknown
    cls = conventions.classify([(e.key, e.kind) for e in idx.entries.values()])
    assert cls.convention.name == "reshard" and cls.unknown == []

    # manifest
    m = mf.read_manifest(path)
    assert m.topology.dims["tp"] == tp and m.topology.dims["dp_shard"] == dp and m.topology.world_size == tp * dp
    assert m.model.family == ("llama-fused" if fused else "llama-torchtitan")
    assert m.model.config == SHAPE.config() and m.model.config["head_dim"] == 8
    assert m.key_convention == "reshard" and m.rng.policy == "none" and m.step == 10
    assert m.data.cursor == 0 and m.batch.global_batch == dp and m.batch.seq_len == 16


def test_concrete_chunk_boxes(ckpts):
    md = FileSystemReader(str(ckpts[(2, 2, False)])).read_metadata()
    # row-parallel wo [64, 64]: TP cuts dim 1 in halves, FSDP cuts dim 0 in halves
    assert boxes(md, "model.layers.0.attention.wo.weight") == [
        ((0, 0), (32, 32)), ((0, 32), (32, 32)), ((32, 0), (32, 32)), ((32, 32), (32, 32))]
    # row-parallel w2 [64, 96]
    assert boxes(md, "model.layers.1.feed_forward.w2.weight") == [
        ((0, 0), (32, 48)), ((0, 48), (32, 48)), ((32, 0), (32, 48)), ((32, 48), (32, 48))]
    # column-parallel wq [64, 64]: TP block t = rows [32t, 32t+32); FSDP splits each block
    assert boxes(md, "model.layers.0.attention.wq.weight") == [
        ((0, 0), (16, 64)), ((16, 0), (16, 64)), ((32, 0), (16, 64)), ((48, 0), (16, 64))]
    # wk [16, 64] (2 KV heads x head_dim 8)
    assert boxes(md, "model.layers.0.attention.wk.weight") == [
        ((0, 0), (4, 64)), ((4, 0), (4, 64)), ((8, 0), (4, 64)), ((12, 0), (4, 64))]
    # vocab padded to a multiple of 8 x 2 = 16 -> 112 rows
    assert boxes(md, "model.tok_embeddings.weight") == [
        ((0, 0), (28, 64)), ((28, 0), (28, 64)), ((56, 0), (28, 64)), ((84, 0), (28, 64))]
    # replicated norm: only FSDP's cut (DCP keeps one copy of the TP replicas)
    assert boxes(md, "model.norm.weight") == [((0,), (32,)), ((32,), (32,))]

    md = FileSystemReader(str(ckpts[(2, 1, True)])).read_metadata()
    assert boxes(md, "model." + QKV.format(0)) == [((0, 0), (48, 64)), ((48, 0), (48, 64))]
    assert boxes(md, "model." + FC1.format(1)) == [((0, 0), (96, 64)), ((96, 0), (96, 64))]
    assert boxes(md, "model.decoder.layers.0.self_attention.linear_proj.weight") == [
        ((0, 0), (64, 32)), ((0, 32), (64, 32))]
    assert boxes(md, "model.decoder.final_layernorm.weight") == [((0,), (64,))]

    md = FileSystemReader(str(ckpts[(1, 2, True)])).read_metadata()
    assert boxes(md, "model.embedding.word_embeddings.weight") == [((0, 0), (52, 64)), ((52, 0), (52, 64))]
    assert boxes(md, "model.decoder.layers.0.self_attention.linear_proj.weight") == [
        ((0, 0), (32, 64)), ((32, 0), (32, 64))]


def test_fused_tp2_is_interleaved_canonical_of_the_unfused_model(globals_):
    fused_tp2 = globals_[(2, 1, True)]
    titan = globals_[(2, 2, False)]  # unfused tensors are TP-independent: canonical as stored
    fused_tp1 = globals_[(1, 2, True)]
    ref = canonical_weights(SHAPE, fused=False, seed=3)
    for n in range(SHAPE.n_layers):
        p = f"layers.{n}."
        qkv = fused_tp2["model." + QKV.format(n)]
        want = torch.cat([titan[f"model.{p}attention.{w}.weight"] for w in ("wq", "wk", "wv")])
        assert torch.equal(want, torch.cat([ref[f"{p}attention.{w}.weight"] for w in ("wq", "wk", "wv")]))
        assert not torch.equal(qkv, want)  # tp=2 really is interleaved
        assert torch.equal(to_canonical(qkv, 0, QKV_PARTS, 2), want)
        assert torch.equal(fused_tp1["model." + QKV.format(n)], want)  # tp=1: canonical as stored
        # rank 0's half is [Q_0; K_0; V_0]
        q, k, v = torch.split(want, QKV_PARTS)
        assert torch.equal(qkv[:48], torch.cat([q[:32], k[:8], v[:8]]))

        fc1 = fused_tp2["model." + FC1.format(n)]
        want = torch.cat([titan[f"model.{p}feed_forward.w1.weight"], titan[f"model.{p}feed_forward.w3.weight"]])
        assert torch.equal(to_canonical(fc1, 0, FC1_PARTS, 2), want)
        for a, b in (("linear_proj", "attention.wo"), ("linear_fc2", "feed_forward.w2")):
            sub = "self_attention" if a == "linear_proj" else "mlp"
            assert torch.equal(fused_tp2[f"model.decoder.layers.{n}.{sub}.{a}.weight"], titan[f"model.{p}{b}.weight"])
    # moments are fused the same way
    ea = fused_tp2[f"optim.state.{QKV.format(0)}.exp_avg"]
    want = torch.cat([titan[f"optim.state.layers.0.attention.{w}.weight.exp_avg"] for w in ("wq", "wk", "wv")])
    assert torch.equal(to_canonical(ea, 0, QKV_PARTS, 2), want)


def test_vocab_rows_are_padded_for_the_tp_degree(globals_):
    V = SHAPE.vocab_size
    for (tp, _, fused), g in globals_.items():
        names = (("embedding.word_embeddings.weight", "output_layer.weight") if fused
                 else ("tok_embeddings.weight", "output.weight"))
        for n in names:
            t = g["model." + n]
            assert t.shape == (SHAPE.padded_vocab(tp), SHAPE.dim) == (104 if tp == 1 else 112, 64)
            assert bool((t[V:] == 0).all())
            assert bool((t[:V] != 0).any(dim=1).all())
    a = globals_[(2, 1, True)]["model.embedding.word_embeddings.weight"]
    b = globals_[(1, 2, True)]["model.embedding.word_embeddings.weight"]
    c = globals_[(2, 2, False)]["model.tok_embeddings.weight"]
    assert torch.equal(a[:V], b[:V]) and torch.equal(a[:V], c[:V])


def test_canonical_weights_shapes():
    w = canonical_weights(SHAPE, fused=True)
    assert w[QKV.format(0)].shape == (64 + 16 + 16, 64)
    assert w[FC1.format(1)].shape == (192, 64)
    assert w["embedding.word_embeddings.weight"].shape == (104, 64)
    t = canonical_weights(SHAPE, fused=False)
    assert t["layers.0.attention.wo.weight"].shape == (64, 64)
    assert t["layers.0.feed_forward.w2.weight"].shape == (64, 96)
    assert len(t) == 3 + 2 * 9 and len(w) == 3 + 2 * 6
    # deterministic in (seed, name), different across seeds
    assert torch.equal(t["norm.weight"], canonical_weights(SHAPE, fused=False)["norm.weight"])
    assert not torch.equal(t["norm.weight"], canonical_weights(SHAPE, fused=False, seed=1)["norm.weight"])


def test_tp_not_allowed_by_the_rules_fails_before_spawning(tmp_path):
    with pytest.raises(ValueError, match="does not divide"):
        make_llama_checkpoint(tmp_path / "x", shape=SHAPE, tp=4, dp=1, fused=True)  # 2 KV heads
    assert not (tmp_path / "x").exists()
