"""The synthetic checkpoint makers write real DCP checkpoints that stock torch reads back."""
from __future__ import annotations

import os
import pickle
import pickletools
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from reshard.testing import synthetic as S

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def read_md(ckpt):
    return FileSystemReader(str(ckpt)).read_metadata()


def load_full(ckpt, keys=None):
    """Single-process ``dcp.load`` of every (or the given) tensor key into full tensors."""
    md = read_md(ckpt)
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and (keys is None or k in keys)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)
    return sd


def chunk_list(v):
    return [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks]


# ----------------------------------------------------------------------------- values


def test_synthetic_value_is_deterministic_and_distinct():
    a = S.synthetic_value(0, (6, 7), torch.float32, seed=0)
    assert torch.equal(a, S.synthetic_value(0, (6, 7), torch.float32, seed=0))
    assert not torch.equal(a, S.synthetic_value(1, (6, 7), torch.float32, seed=0))
    assert not torch.equal(a, S.synthetic_value(0, (6, 7), torch.float32, seed=1))
    assert a.unique().numel() == a.numel()  # a misplaced element is visible
    assert a.min() >= -1 and a.max() < 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8, torch.bool])
def test_synthetic_block_is_a_slice_of_the_value(dtype):
    shape = (5, 4, 3)
    full = S.synthetic_value(3, shape, dtype, seed=7)
    assert full.shape == shape and full.dtype == dtype
    for offsets, sizes in [((0, 0, 0), shape), ((1, 2, 0), (3, 2, 3)), ((4, 0, 2), (1, 4, 1)), ((5, 0, 0), (0, 4, 3))]:
        blk = S.synthetic_block(3, shape, dtype, 7, offsets, sizes)
        assert torch.equal(blk, full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])


def test_synthetic_block_chunked_generation(monkeypatch):
    monkeypatch.setattr(S, "_BLOCK_ELEMS", 7)  # force many row blocks
    small = S.synthetic_value(2, (9, 4), torch.float32, seed=1)
    monkeypatch.undo()
    assert torch.equal(small, S.synthetic_value(2, (9, 4), torch.float32, seed=1))


def test_synthetic_block_rejects_out_of_bounds():
    with pytest.raises(ValueError):
        S.synthetic_block(0, (4,), torch.float32, 0, (3,), (2,))


@pytest.mark.parametrize(
    "shape,dim,world,expected",
    [
        ((50, 16), 0, 4, [(0, 13), (13, 13), (26, 13), (39, 11)]),
        ((2, 3), 0, 4, [(0, 1), (1, 1), (2, 0), (2, 0)]),
        ((5, 3, 2), 2, 3, [(0, 1), (1, 1), (2, 0)]),
        ((8,), 0, 2, [(0, 4), (4, 4)]),
    ],
)
def test_shard_box_follows_torch_chunk(shape, dim, world, expected):
    got = []
    for r in range(world):
        offsets, sizes = S.shard_box(shape, dim, r, world)
        assert all(s == d for i, (s, d) in enumerate(zip(sizes, shape)) if i != dim)
        got.append((offsets[dim], sizes[dim]))
    assert got == expected


# ----------------------------------------------------------------------------- FSDP2


@pytest.fixture(scope="module")
def fsdp2_ckpt(tmp_path_factory):
    return S.make_plain_fsdp2(tmp_path_factory.mktemp("fsdp2") / "ckpt", 4, steps=2, seed=0)


def test_plain_fsdp2_metadata(fsdp2_ckpt):
    assert (fsdp2_ckpt / ".metadata").is_file()
    assert [p.name for p in S.list_rank_files(fsdp2_ckpt)] == [f"__{r}_0.distcp" for r in range(4)]
    assert not [p for p in fsdp2_ckpt.iterdir() if "manifest" in p.name]
    md = read_md(fsdp2_ckpt).state_dict_metadata
    model = S.TinyModel()
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == 2168
    for fqn, p in params.items():
        for key in (f"model.{fqn}", f"optim.state.{fqn}.exp_avg", f"optim.state.{fqn}.exp_avg_sq"):
            v = md[key]
            assert isinstance(v, TensorStorageMetadata)
            assert tuple(v.size) == tuple(p.shape)
            assert len(v.chunks) == 4
        step = md[f"optim.state.{fqn}.step"]
        assert isinstance(step, TensorStorageMetadata) and tuple(step.size) == ()
    assert sorted(chunk_list(md["model.embed.weight"])) == [
        ((0, 0), (13, 16)), ((13, 0), (13, 16)), ((26, 0), (13, 16)), ((39, 0), (11, 16))
    ]
    for hyper in ("lr", "betas", "eps", "weight_decay", "params"):
        assert isinstance(md[f"optim.param_groups.0.{hyper}"], BytesStorageMetadata)
    expected = {f"model.{f}" for f in params} | {f"optim.state.{f}.{n}" for f in params for n in ("exp_avg", "exp_avg_sq", "step")}
    assert expected <= set(md)
    assert all(k.startswith("optim.param_groups.0.") for k in set(md) - expected)


def test_plain_fsdp2_loads_back_trained(fsdp2_ckpt):
    sd = load_full(fsdp2_ckpt)
    torch.manual_seed(0)
    init = S.TinyModel()
    for fqn, p in init.named_parameters():
        got = sd[f"model.{fqn}"]
        assert torch.isfinite(got).all()
        assert not torch.equal(got, p.detach()), f"{fqn} did not train"
        assert sd[f"optim.state.{fqn}.step"].item() == 2
        assert (sd[f"optim.state.{fqn}.exp_avg_sq"] >= 0).all()


# ----------------------------------------------------------------------------- make_sharded


SHARDED_CASES = {
    "even-dim0-f32": dict(world_size=2, n_tensors=3, shape=(8, 6), dtype=torch.float32, shard_dim=0, seed=0),
    "uneven-dim1-f32": dict(world_size=3, n_tensors=2, shape=(7, 5), dtype=torch.float32, shard_dim=1, seed=3),
    "trailing-empty-bf16": dict(world_size=4, n_tensors=2, shape=(2, 3, 2), dtype=torch.bfloat16, shard_dim=0, seed=5),
}


@pytest.fixture(scope="module", params=list(SHARDED_CASES))
def sharded(request, tmp_path_factory):
    kw = SHARDED_CASES[request.param]
    return S.make_sharded(tmp_path_factory.mktemp(request.param) / "ckpt", **kw), kw


def test_sharded_metadata(sharded):
    ckpt, kw = sharded
    md = read_md(ckpt).state_dict_metadata
    assert set(md) == {f"model.layers.{i}.weight" for i in range(kw["n_tensors"])}
    w, dim = kw["world_size"], kw["shard_dim"]
    expected = {S.shard_box(kw["shape"], dim, r, w) for r in range(w)}  # empty pieces dedup
    for v in md.values():
        assert tuple(v.size) == kw["shape"]
        assert v.properties.dtype == kw["dtype"]
        assert set(chunk_list(v)) == expected
    assert len(S.list_rank_files(ckpt)) == w


def test_sharded_loads_back_synthetic_value(sharded):
    ckpt, kw = sharded
    sd = load_full(ckpt)
    for i in range(kw["n_tensors"]):
        assert torch.equal(sd[f"model.layers.{i}.weight"], S.synthetic_value(i, kw["shape"], kw["dtype"], kw["seed"]))


def test_make_sharded_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        S.make_sharded(tmp_path / "x", world_size=2, n_tensors=1, shape=(4,), shard_dim=1)
    with pytest.raises(ValueError):
        S.make_sharded(tmp_path / "y", world_size=2, n_tensors=1, shape=())


def _boom(rank, world_size, port):
    if rank == 1:
        raise ValueError("boom-from-rank-1")


def test_worker_error_is_raised_with_its_message():
    with pytest.raises(S.SyntheticCheckpointError, match="boom-from-rank-1"):
        S.spawn_ranks(_boom, 2, (), timeout=60)


# ----------------------------------------------------------------------------- many entries


@pytest.mark.parametrize("n,numel", [(10, 4), (10_000, 4), (3, 1)])
def test_many_entries(tmp_path, n, numel):
    ckpt = S.make_many_entries(tmp_path / "ckpt", n, numel=numel)
    md = read_md(ckpt).state_dict_metadata
    assert len(md) == n
    assert set(md) == {S.many_entries_key(i) for i in range(n)}
    assert all(tuple(v.size) == (numel,) for v in md.values())
    if n <= 10:
        sd = load_full(ckpt)
        for i in range(n):
            assert torch.equal(sd[S.many_entries_key(i)], torch.arange(numel, dtype=torch.float32) + i * numel)


# ----------------------------------------------------------------------------- corruption


def test_list_rank_files_orders_numerically(tmp_path):
    for name in ["__10_0.distcp", "__2_1.distcp", "__2_0.distcp", ".metadata", "__x_0.distcp", "__1_0.distcp.tmp"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in S.list_rank_files(tmp_path)] == ["__2_0.distcp", "__2_1.distcp", "__10_0.distcp"]


def test_truncate_and_remove_metadata(tmp_path):
    ckpt = S.make_many_entries(tmp_path / "ckpt", 10)
    (data,) = S.list_rank_files(ckpt)
    size = data.stat().st_size
    S.truncate_file(data, size // 2)
    assert data.stat().st_size == size // 2
    with pytest.raises(ValueError):
        S.truncate_file(data, size)  # cannot grow
    with pytest.raises(CheckpointException):  # a BaseException, not an Exception
        load_full(ckpt)
    S.remove_metadata(ckpt)
    assert not (ckpt / ".metadata").exists()
    with pytest.raises(Exception):
        read_md(ckpt)


@pytest.mark.parametrize("embed", [True, False])
def test_malicious_metadata_is_live(tmp_path, embed):
    """The payload really runs under stock ``pickle.load`` (so a test that sees no marker means something)."""
    ckpt = S.make_many_entries(tmp_path / "ckpt", 2)
    marker = tmp_path / "pwned"
    p = S.write_malicious_metadata(ckpt, marker, embed=embed)
    data = p.read_bytes()
    assert not marker.exists()  # writing it ran nothing
    globals_ = [arg for op, arg, _ in pickletools.genops(data) if op.name in ("GLOBAL", "STACK_GLOBAL")]
    strings = [arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    assert "Path.touch" in strings and "reshard.testing.synthetic" not in strings, (globals_, strings)
    obj = pickle.loads(data)  # the unsafe stock behaviour, on purpose
    assert marker.exists()
    if embed:
        from torch.distributed.checkpoint.metadata import Metadata

        assert isinstance(obj, Metadata)
    os.remove(marker)
