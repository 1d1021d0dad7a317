"""The metadata-only checkpoints of `reshard.testing.synthetic_metadata` are what `dcp.save` writes.

The gold standard is a real job: a tiny Llama (torchtitan's pre-0.3 names, GQA, a vocabulary
that does not divide, k/v projections with fewer rows than ranks) under FSDP2 ``fully_shard``
on 2 and 4 spawned gloo ranks, one AdamW step, ``get_state_dict`` + ``dcp.save``; and a
2 x 2 FSDP2 x TP job (DTensors with the placements FSDP2 x TP give, written by
``reshard.testing.synthetic_llama``). The builder, given only the state dict's description (keys,
shapes, dtypes, TP dims, objects), must reproduce the `.metadata` and the data file sizes.

Run as a script (``python tests/test_synthetic_metadata.py OUT``) this file is the writer:
the FSDP2 jobs are started from a fresh interpreter so that the ranks re-import nothing of
pytest.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the tiny model: vocab 37 over 4 ranks -> 10, 10, 10, 7 rows; wk/wv have 2 rows -> two
# ranks of four hold an empty piece (offset 2), one write item after deduplication
VOCAB, DIM, LAYERS, HEADS, KV_HEADS, HIDDEN = 37, 16, 2, 8, 1, 24
LR = 1e-3


def tiny_params():
    hd = DIM // HEADS
    out = [("tok_embeddings.weight", (VOCAB, DIM), 0)]
    for i in range(LAYERS):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (HEADS * hd, DIM), 0), (p + "attention.wk.weight", (KV_HEADS * hd, DIM), 0),
                (p + "attention.wv.weight", (KV_HEADS * hd, DIM), 0), (p + "attention.wo.weight", (DIM, HEADS * hd), 1),
                (p + "feed_forward.w1.weight", (HIDDEN, DIM), 0), (p + "feed_forward.w2.weight", (DIM, HIDDEN), 1),
                (p + "feed_forward.w3.weight", (HIDDEN, DIM), 0), (p + "attention_norm.weight", (DIM,), None),
                (p + "ffn_norm.weight", (DIM,), None)]
    return out + [("norm.weight", (DIM,), None), ("output.weight", (VOCAB, DIM), 0)]


# ---------------------------------------------------------------------------------------
# the writer (run in a fresh interpreter)
# ---------------------------------------------------------------------------------------


def _build_model():
    import torch

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            hd = DIM // HEADS
            self.wq = torch.nn.Linear(DIM, HEADS * hd, bias=False)
            self.wk = torch.nn.Linear(DIM, KV_HEADS * hd, bias=False)
            self.wv = torch.nn.Linear(DIM, KV_HEADS * hd, bias=False)
            self.wo = torch.nn.Linear(HEADS * hd, DIM, bias=False)

    class FeedForward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Linear(DIM, HIDDEN, bias=False)
            self.w2 = torch.nn.Linear(HIDDEN, DIM, bias=False)
            self.w3 = torch.nn.Linear(DIM, HIDDEN, bias=False)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = Attention()
            self.feed_forward = FeedForward()
            self.attention_norm = torch.nn.RMSNorm(DIM)
            self.ffn_norm = torch.nn.RMSNorm(DIM)

        def forward(self, h):
            a, x = self.attention, self.attention_norm(h)
            h = h + a.wo(a.wq(x)) + 0.0 * (a.wk(x).sum() + a.wv(x).sum())
            f, x = self.feed_forward, self.ffn_norm(h)
            return h + f.w2(torch.nn.functional.silu(f.w1(x)) * f.w3(x))

    class Llama(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding(VOCAB, DIM)
            self.layers = torch.nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
            self.norm = torch.nn.RMSNorm(DIM)
            self.output = torch.nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            for block in self.layers.values():
                h = block(h)
            return self.output(self.norm(h))

    return Llama()


def _fsdp2_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch

    from reshard.testing.synthetic import finish_worker, init_worker

    init_worker(rank, world_size, port)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world_size,))
        model = _build_model()
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=LR)
        model(torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(rank))).sum().backward()
        optim.step()
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out_dir)
    finally:
        finish_worker()


def _write(out: Path) -> None:
    from reshard.testing.synthetic import spawn_ranks

    for n in (2, 4):
        spawn_ranks(_fsdp2_worker, n, (str(out / f"fsdp2-{n}"),), timeout=180)


# ---------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_fsdp2(tmp_path_factory) -> dict[int, Path]:
    out = tmp_path_factory.mktemp("real-fsdp2")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, __file__, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {n: out / f"fsdp2-{n}" for n in (2, 4)}


@pytest.fixture(scope="module")
def real_tp(tmp_path_factory) -> Path:
    from reshard.testing.synthetic_llama import make_llama_checkpoint

    return make_llama_checkpoint(tmp_path_factory.mktemp("real-tp") / "ckpt", tp=2, dp=2, fused=False, manifest=False)


def _read(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    md.storage_meta.load_id = None  # set by the reader, not in the file
    return md


def _unframed(data: bytes) -> bytes:
    """A protocol-4 pickle without its FRAME headers (frames cut the stream, they do not change it)."""
    assert data[:2] == b"\x80\x04"
    out, i = bytearray(), 2
    while i < len(data) and data[i] == 0x95:
        n = int.from_bytes(data[i + 1:i + 9], "little")
        out += data[i + 9:i + 9 + n]
        i += 9 + n
    out += data[i:]
    return bytes(out)


def _storage(md):
    """storage_data with everything torch records: key, index hint, path, offset, length, in order."""
    return [(k.fqn, None if k.offset is None else tuple(k.offset), k.index, v.relative_path, v.offset, v.length,
             v.transform_descriptors) for k, v in md.storage_data.items()]


def _chunks(md):
    return {k: (None if not hasattr(v, "chunks") else
                (v.properties, tuple(v.size), [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks]))
            for k, v in md.state_dict_metadata.items()}


def _file_sizes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.glob("*.distcp"))}


# ---------------------------------------------------------------------------------------
# FSDP2 (fully_shard) against the real job
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp2_metadata_equals_dcp_save(real_fsdp2, tmp_path, n):
    from reshard.testing import synthetic_metadata as sm

    real_path = real_fsdp2[n]
    real = _read(real_path)
    entries = sm.model_entries(tiny_params(), hyper={"lr": LR})
    res = sm.make_checkpoint(tmp_path / "synthetic", entries, dp=n, checkpoint_id=real.storage_meta.checkpoint_id,
                             save_id=real.storage_meta.save_id)
    mine = _read(res.path)

    # keys in the same order, same chunks (offsets, sizes, order), dtypes and properties
    assert list(mine.state_dict_metadata) == list(real.state_dict_metadata)
    assert _chunks(mine) == _chunks(real)
    assert mine.state_dict_metadata == real.state_dict_metadata
    if n == 4:  # the k/v projections' two empty pieces are one chunk, written once
        wk = real.state_dict_metadata["model.layers.0.attention.wk.weight"]
        assert [(tuple(c.offsets), tuple(c.sizes)) for c in wk.chunks][-1] == ((2, 0), (0, DIM))
    # every storage entry: path, offset, length, index hint, in torch's order
    assert _storage(mine) == _storage(real)
    assert mine.planner_data == real.planner_data and list(mine.planner_data) == list(real.planner_data)
    assert mine.storage_meta == real.storage_meta and mine.version == real.version
    # the data files: same names, same sizes (sparse here: no block allocated)
    assert _file_sizes(res.path) == _file_sizes(real_path)
    assert res.data_bytes == sum(_file_sizes(real_path).values())
    assert res.storage_entries == len(real.storage_data)
    # and the .metadata bytes are torch's, frames aside (same save_id and checkpoint_id given)
    real_bytes = (real_path / ".metadata").read_bytes()
    mine_bytes = (res.path / ".metadata").read_bytes()
    assert _unframed(mine_bytes) == _unframed(real_bytes)
    assert abs(len(mine_bytes) - len(real_bytes)) <= 9 * (len(real_bytes) // 65536 + 1)


def test_materialized_objects_pickle_like_the_stream(real_fsdp2, tmp_path):
    """The streamed file is pickle.dumps of torch's own objects (materialize=True), frames aside."""
    from reshard.testing import synthetic_metadata as sm

    real = _read(real_fsdp2[4])
    entries = sm.model_entries(tiny_params(), hyper={"lr": LR})
    kw = dict(dp=4, checkpoint_id=real.storage_meta.checkpoint_id, save_id=real.storage_meta.save_id)
    objs, _ = sm.build_metadata(entries, materialize=True, **kw)
    lazy, _ = sm.build_metadata(entries, **kw)
    sm.write_metadata(lazy, tmp_path / ".metadata")
    assert _unframed((tmp_path / ".metadata").read_bytes()) == _unframed(pickle.dumps(objs, protocol=4))
    assert objs.storage_data == real.storage_data and objs.state_dict_metadata == real.state_dict_metadata


def test_reshard_inspect_sees_a_complete_checkpoint(tmp_path):
    """A Llama-3-shaped metadata-only checkpoint: inspect finds it complete (data files stat'ed)."""
    import json

    from reshard.testing import synthetic_metadata as sm

    cfg = sm.LlamaConfig("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab=1000)
    res = sm.make_llama_metadata_checkpoint(tmp_path / "ckpt", cfg, ranks=8)
    assert res.storage_entries == 8 * (2 * 9 + 3) * 3 + (2 * 9 + 3) + len(sm.adamw_param_group([]))
    proc = subprocess.run([sys.executable, "-m", "reshard", "inspect", str(res.path), "--json", "--no-profile"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["complete"] and report["consistent"], report["problems"]
    assert report["topology"]["dp_shard"] == 8 and report["topology"]["world_size"] == 8
    assert report["step"] == 1000  # the step counters are real torch.save bytes
    assert report["items"] == res.storage_entries
    # sparse: the tensor chunks occupy no blocks, only the small items were written
    allocated = sum(p.stat().st_blocks * 512 for p in res.path.glob("*.distcp"))
    assert allocated < res.data_bytes / 10


# ---------------------------------------------------------------------------------------
# FSDP2 x TP (DTensors on a 2 x 2 mesh) against the real job
# ---------------------------------------------------------------------------------------


def test_fsdp2_tp_metadata_equals_dcp_save(real_tp, tmp_path):
    import torch

    from reshard.testing import synthetic_metadata as sm
    from reshard.testing.synthetic_llama import LR as TP_LR
    from reshard.testing.synthetic_llama import STEP, LlamaShape, canonical_tensor, param_names, tp_global, tp_layout

    shape = LlamaShape()
    entries = []
    for name in param_names(shape, fused=False):  # the order synthetic_llama's worker saves in
        lay = tp_layout(name, shape, fused=False, tp=2)
        gshape = tuple(tp_global(canonical_tensor(name, shape, fused=False), lay, 2).shape)
        tp_dim = None if lay.kind == "replicate" else lay.dim
        for key in (f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"):
            entries.append(sm.Entry(key, "shard", (key,), gshape, torch.float32, tp_dim))
        entries.append(sm.Entry(f"optim.state.{name}.step", "tensor", (f"optim.state.{name}.step",), ()))
    entries.append(sm.Entry("optim.param_groups.0.lr", "bytes", ("optim.param_groups.0.lr",), value=TP_LR))
    entries.append(sm.Entry("trainer.step", "bytes", ("trainer.step",), value=STEP))

    real = _read(real_tp)
    res = sm.make_checkpoint(tmp_path / "synthetic", entries, dp=2, tp=2, checkpoint_id=real.storage_meta.checkpoint_id,
                             save_id=real.storage_meta.save_id)
    mine = _read(res.path)
    assert list(mine.state_dict_metadata) == list(real.state_dict_metadata)
    assert _chunks(mine) == _chunks(real)
    # replicated norms: each dp piece written once, by one of its two TP holders
    norm = real.state_dict_metadata["model.norm.weight"]
    assert len(norm.chunks) == 2
    assert _storage(mine) == _storage(real)
    assert mine.planner_data == real.planner_data
    assert _file_sizes(res.path) == _file_sizes(real_tp)


def test_scale_is_vectorised(tmp_path):
    """8B at 64 ranks: 56 k storage entries, the .metadata size the issue measured (9 MiB), sparse files."""
    from reshard.testing import synthetic_metadata as sm

    res = sm.make_llama_metadata_checkpoint(tmp_path / "ckpt", "8B", ranks=64)
    assert res.storage_entries == 64 * 291 * 3 + 291 + 12
    assert 9 * 2**20 < res.metadata_bytes < 10 * 2**20
    assert len(list(res.path.glob("*.distcp"))) == 64
    md = _read(res.path)
    emb = md.state_dict_metadata["model.tok_embeddings.weight"]
    assert [tuple(c.sizes) for c in emb.chunks] == [(2004, 4096)] * 64  # 128256 rows / 64
    wk = md.state_dict_metadata["model.layers.0.attention.wk.weight"]
    assert [tuple(c.offsets) for c in wk.chunks] == [(16 * d, 0) for d in range(64)]
    assert len(md.storage_data) == res.storage_entries


if __name__ == "__main__":
    _write(Path(sys.argv[1]))
