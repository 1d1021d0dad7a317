"""reshard.storage.checkpoints.fastread: zero-copy tensor item reads, bitwise equal to torch.load(weights_only=True)."""
from __future__ import annotations

import io
import os
import pickle
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from reshard.storage.checkpoints import dcp as dcp_io
from reshard.storage.checkpoints.fastread import copy_byte_range, dim0_byte_range, item_layout, read_tensor_item, storage_byte_range
from reshard.storage.checkpoints.crcledger import CorruptItem


def _blob(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() and a.requires_grad == b.requires_grad
            and bytes(a.untyped_storage()) == bytes(b.untyped_storage()))


def _tensor_items(ckpt: Path):
    raw = dcp_io.read_raw_metadata(ckpt)
    for (key, offsets), loc in raw.locations.items():
        e = raw.entries[key]
        if isinstance(e, dcp_io.RawTensor):
            sizes = dict(e.chunks)[offsets]
            yield key, e, sizes, loc


def _check_all(ckpt: Path) -> int:
    n = 0
    for key, e, sizes, loc in _tensor_items(ckpt):
        path = ckpt / loc.file
        ref = torch.load(io.BytesIO(_blob(path, loc.offset, loc.length)), weights_only=True)
        got = read_tensor_item(path, loc.offset, loc.length, expected_dtype=e.dtype, expected_shape=sizes)
        assert got is not None, key
        assert _same(got, ref), (key, got.stride(), ref.stride(), got.storage_offset(), ref.storage_offset())
        got2 = read_tensor_item(path, loc.offset, loc.length, check_crc=True)
        assert got2 is not None and _same(got2, ref)
        n += 1
    return n


@pytest.fixture(scope="module")
def mixed_ckpt(tmp_path_factory) -> Path:
    import torch.distributed.checkpoint as dcp

    out = tmp_path_factory.mktemp("mixed") / "ckpt"
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    sd = {
        "f32": torch.randn(5, 7, generator=g),
        "f64": torch.randn(3, 2, generator=g, dtype=torch.float64),
        "bf16": torch.randn(4, 9, generator=g).to(torch.bfloat16),
        "f16": torch.randn(17, generator=g).to(torch.float16),
        "i64": torch.arange(-20, 20, dtype=torch.int64).view(4, 10),
        "i8": torch.arange(-8, 8, dtype=torch.int8),
        "u8": torch.arange(0, 250, 7, dtype=torch.uint8),
        "bool": torch.rand(3, 5, generator=g) > 0.5,
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3.25),
        "scalar_i": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "empty_1d": torch.empty(0, dtype=torch.bfloat16),
        "transposed": base.t(),                 # non-contiguous, dense
        "strided": base[:, ::2],                # non-contiguous, holes
        "narrowed": base[2:4],                  # view into a larger storage
        "expanded": torch.randn(1, 4, generator=g).expand(3, 4),
        "nan_inf": torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]),
        "step": 12,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(out), no_dist=True)
    return out


def test_every_item_of_a_mixed_dcp_save(mixed_ckpt):
    assert _check_all(mixed_ckpt) >= 18


def test_every_item_of_make_sharded(tmp_path):
    from reshard.testing.synthetic import make_sharded

    ck = make_sharded(tmp_path / "s", world_size=2, n_tensors=3, shape=(8, 6), seed=1)
    assert _check_all(ck) == 6
    bf = make_sharded(tmp_path / "b", world_size=2, n_tensors=2, shape=(4, 5), dtype=torch.bfloat16, shard_dim=1, seed=2)
    assert _check_all(bf) == 4


def test_expected_dtype_and_shape_mismatch_return_none(mixed_ckpt):
    key, e, sizes, loc = next(it for it in _tensor_items(mixed_ckpt) if it[0] == "f32")
    p = mixed_ckpt / loc.file
    assert read_tensor_item(p, loc.offset, loc.length, expected_dtype=torch.float64) is None
    assert read_tensor_item(p, loc.offset, loc.length, expected_shape=(7, 5)) is None
    assert read_tensor_item(p, loc.offset, loc.length, expected_dtype=torch.float32, expected_shape=(5, 7)) is not None


def test_storage_byte_range_and_splice(mixed_ckpt, tmp_path):
    items = {k: (e, s, loc) for k, e, s, loc in _tensor_items(mixed_ckpt)}
    e, sizes, loc = items["f32"]
    p = mixed_ckpt / loc.file
    r = storage_byte_range(p, loc.offset, loc.length)
    assert r is not None
    off, n, dtype, shape = r
    ref = torch.load(io.BytesIO(_blob(p, loc.offset, loc.length)), weights_only=True)
    assert (dtype, shape, n) == (torch.float32, (5, 7), 5 * 7 * 4)
    assert _blob(p, off, n) == bytes(ref.contiguous().untyped_storage())
    roff, rn = dim0_byte_range(off, dtype, shape, 1, 3)
    assert _blob(p, roff, rn) == bytes(ref[1:4].clone().untyped_storage())
    out = tmp_path / "spliced.bin"
    with open(out, "wb") as f:
        f.write(b"HDR")
        with open(p, "rb") as src:
            copy_byte_range(src, roff, rn, f)
        f.write(b"END")
    assert out.read_bytes() == b"HDR" + bytes(ref[1:4].clone().untyped_storage()) + b"END"
    # a transposed item is not C-contiguous: no byte range
    _, _, tl = items["transposed"]
    lay = item_layout(mixed_ckpt / tl.file, tl.offset, tl.length)
    assert lay is not None
    if not lay.contiguous:
        assert storage_byte_range(mixed_ckpt / tl.file, tl.offset, tl.length) is None
    with pytest.raises(ValueError):
        dim0_byte_range(off, dtype, shape, 4, 2)


# ------------------------------------------------------------------------------- odd archives
def _members(blob: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _rezip(members, compression=zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as z:
        for name, data in members:
            z.writestr(name, data)
    return buf.getvalue()


def _put(tmp_path: Path, blob: bytes, pad: bytes = b"xx") -> tuple[Path, int, int]:
    p = tmp_path / f"item-{len(list(tmp_path.iterdir()))}.bin"
    p.write_bytes(pad + blob + pad)
    return p, len(pad), len(blob)


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_restored_zip_still_reads(tmp_path):
    """Sanity: a STORED re-zip (other alignment, no padding) is still handled, and equal."""
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    p, off, n = _put(tmp_path, _rezip(_members(_saved(t))))
    got = read_tensor_item(p, off, n)
    assert got is not None and torch.equal(got, t)


def test_compressed_archive_returns_none(tmp_path):
    t = torch.arange(1000, dtype=torch.float32)
    blob = _rezip(_members(_saved(t)), zipfile.ZIP_DEFLATED)
    p, off, n = _put(tmp_path, blob)
    assert read_tensor_item(p, off, n) is None
    assert storage_byte_range(p, off, n) is None


@pytest.mark.parametrize("case", ["garbage", "truncated", "tuple", "dict", "two_views", "big_endian", "wrong_size",
                                  "requires_grad"])
def test_odd_archives_return_none(tmp_path, case):
    t = torch.arange(6, dtype=torch.float32)
    if case == "garbage":
        blob = os.urandom(300)
    elif case == "truncated":
        blob = _saved(t)[:-40]
    elif case == "tuple":
        blob = _saved((t, t + 1))
    elif case == "dict":
        blob = _saved({"a": t})
    elif case == "two_views":
        blob = _saved([t[:3], t[3:]])
    elif case == "big_endian":
        blob = _rezip([(n, b"big" if n.endswith("/byteorder") else d) for n, d in _members(_saved(t))])
    elif case == "wrong_size":
        blob = _rezip([(n, d[:-4] if n.endswith("/data/0") else d) for n, d in _members(_saved(t))])
    else:
        blob = _saved(t.clone().requires_grad_(True))
    p, off, n = _put(tmp_path, blob)
    assert read_tensor_item(p, off, n) is None


class _Touch:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


class _System:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", [_Touch, _System])
def test_malicious_pickle_is_refused_without_running(tmp_path, payload):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(payload(marker), protocol=2)
    members = [(n, evil if n.endswith("/data.pkl") else d) for n, d in _members(_saved(torch.zeros(3)))]
    d = tmp_path / "items"
    d.mkdir()
    p, off, n = _put(d, _rezip(members))
    assert read_tensor_item(p, off, n) is None
    assert storage_byte_range(p, off, n) is None
    assert not marker.exists()
    # an evil pickle inside the tensor's rebuild arguments too
    t = torch.zeros(3)
    evil2 = pickle.dumps((t, payload(marker)), protocol=2)  # not a plain tensor, and refused either way
    members = [(n, evil2 if n.endswith("/data.pkl") else d) for n, d in _members(_saved(t))]
    p, off, n = _put(d, _rezip(members))
    assert read_tensor_item(p, off, n) is None
    assert not marker.exists()


def test_crc_check_catches_a_flipped_byte(tmp_path):
    t = torch.arange(64, dtype=torch.float32)
    blob = bytearray(_saved(t))
    lay_p, off, n = _put(tmp_path, bytes(blob))
    lay = item_layout(lay_p, off, n)
    assert lay is not None
    i = lay.storage_file_offset - off + 5
    blob[i] ^= 0xFF
    p, off, n = _put(tmp_path, bytes(blob))
    with pytest.raises(CorruptItem, match="item 'x' in .* fails its CRC-32"):  # checked by default
        read_tensor_item(p, off, n, key="x")
    fast = read_tensor_item(p, off, n, check_crc=False)  # asked not to check: the stored bytes as they are
    assert fast is not None and not torch.equal(fast, t)


def test_speed_vs_torch_load(tmp_path, capsys):
    """Prints (does not assert) the speed-up on a 16 MiB item, warm cache."""
    t = torch.randn(2048, 2048)
    p, off, n = _put(tmp_path, _saved(t))
    read_tensor_item(p, off, n)

    def timeit(fn, reps=10):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    def stock():
        with open(p, "rb") as f:
            f.seek(off)
            data = f.read(n)
        return torch.load(io.BytesIO(data), weights_only=True)

    def stock_range():
        return dcp_io.load_item(p.parent, dcp_io.ItemLocation(p.name, off, n), key="x")

    a, b, c = timeit(stock), timeit(stock_range), timeit(lambda: read_tensor_item(p, off, n))
    assert torch.equal(read_tensor_item(p, off, n), stock())
    with capsys.disabled():
        print(f"\n16 MiB item, best of 10 (warm cache): read+torch.load {a * 1e3:.1f} ms, dcp.load_item {b * 1e3:.1f} ms, "
              f"read_tensor_item {c * 1e3:.1f} ms -> {a / c:.1f}x / {b / c:.1f}x faster")
