"""Issue 13, finding 4: every read is checked against its writer's record.

The attack: one payload byte of a tensor item flipped on disk (a low mantissa bit, so the
value stays plausible and ``torch.load`` reads it without complaint; the item's zip
records are untouched). Every path that reads the item (``inspect --deep``, ``export`` in
both formats, ``convert`` direct and ``--buffered``, ``verify`` either way round) must see
that the bytes contradict the CRC-32 the item's writer recorded, name the file and the
key, exit 2 and commit nothing. A clean checkpoint passes every command.
"""
from __future__ import annotations

import io
import json
import zlib
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.storage.checkpoints import crcledger, fastread
from reshard.storage.checkpoints.crcledger import CorruptItem, CrcLedger, StorageRecord


def _target(ckpt: Path) -> tuple[str, object]:
    """The largest model tensor (export's `--only model` includes it) and its first chunk."""
    ix = CheckpointIndex.open(ckpt)
    tensors = [e for e in ix.entries.values() if e.is_tensor and e.numel > 0]
    model = [e for e in tensors if e.key.startswith("model.")] or tensors
    e = max(model, key=lambda e: (e.nbytes, e.key))
    c = next(c for c in e.chunks if not c.box.is_empty())
    return e.key, c


def flip_payload_byte(ckpt: Path) -> tuple[str, str]:
    """Flip the lowest bit of one storage byte of a tensor item in place; returns (key, file)."""
    key, c = _target(ckpt)
    loc = c.location
    lay = fastread.item_layout(ckpt / loc.file, loc.offset, loc.length)
    assert lay is not None and lay.storage_crc, "the writer recorded a CRC-32"
    pos = lay.storage_file_offset + lay.storage_nbytes // 2
    with open(ckpt / loc.file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))
    return key, loc.file


@pytest.fixture(params=["reference", "plain"])
def clean(request, reference_ckpt, plain_fsdp2_ckpt) -> Path:
    return reference_ckpt if request.param == "reference" else plain_fsdp2_ckpt


@pytest.fixture
def flipped(clean, copy_of) -> tuple[Path, str, str]:
    bad = copy_of(clean)
    key, file = flip_payload_byte(bad)
    return bad, key, file


def _refused(code: int, out: str, err: str, key: str, file: str) -> str:
    text = out + err
    assert code == 2, text
    assert "Traceback" not in text
    assert f"'{key}'" in text and file in text, text
    assert "fails its CRC-32" in text, text
    return text


# ----------------------------------------------------------------------------- each path
def test_inspect_deep_names_the_corrupt_item(flipped, clean, capsys):
    bad, key, file = flipped
    code, out, err = run_cli(["inspect", bad, "--deep"], capsys)
    _refused(code, out, err, key, file)
    code, out, err = run_cli(["inspect", bad, "--deep", "--json"], capsys)
    assert code == 2
    r = json.loads(out)
    found = [f for f in r["problems"] if f["code"] == "crc_mismatch"]
    assert found and found[0]["file"] == file and key in found[0]["keys"]
    code, out, err = run_cli(["inspect", clean, "--deep"], capsys)
    assert code == 0, out + err


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_refuses_a_corrupt_item(flipped, clean, tmp_path, capsys, fmt):
    bad, key, file = flipped
    dst = tmp_path / f"out-{fmt}"
    code, out, err = run_cli(["export", bad, dst, "--format", fmt], capsys)
    _refused(code, out, err, key, file)
    assert not dst.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".out-{fmt}")]  # no temporary left either
    ok = tmp_path / f"ok-{fmt}"
    code, out, err = run_cli(["export", clean, ok, "--format", fmt], capsys)
    assert code == 0, out + err


@pytest.mark.parametrize("buffered", [False, True], ids=["direct", "buffered"])
def test_convert_refuses_a_corrupt_source(flipped, clean, tmp_path, capsys, monkeypatch, buffered):
    """Direct: storages aligned even when small (as the writer does from 1 MiB), so the merged
    shards are copied with direct I/O and each source checked at once; buffered: the
    read-back reads the source rows, whose CRC-32s go to the ledger."""
    from reshard.storage.checkpoints import dcp_writer

    if not buffered:
        monkeypatch.setattr(dcp_writer, "ALIGN_FROM", 1)
    bad, key, file = flipped
    dst = tmp_path / "out"
    extra = ["--buffered"] if buffered else []
    code, out, err = run_cli(["convert", bad, dst, "--to", "dp=2", *extra], capsys)
    _refused(code, out, err, key, file)
    assert not dst.exists()
    ok = tmp_path / "ok"
    code, out, err = run_cli(["convert", clean, ok, "--to", "dp=2", *extra], capsys)
    assert code == 0, out + err
    code, out, err = run_cli(["verify", clean, ok], capsys)
    assert code == 0, out + err


def test_convert_buffered_cut_in_two_checks_the_source_parts(reference_ckpt, copy_of, tmp_path, capsys):
    """dp 4 -> 8 cuts every source shard in two: the read-back of each half goes to the ledger,
    which checks the source once both halves are in."""
    bad = copy_of(reference_ckpt)
    key, file = flip_payload_byte(bad)
    code, out, err = run_cli(["convert", bad, tmp_path / "out", "--to", "dp=8", "--buffered"], capsys)
    _refused(code, out, err, key, file)
    assert not (tmp_path / "out").exists()


def test_verify_calls_a_corrupt_item_bad_input_either_way(flipped, clean, copy_of, tmp_path, capsys):
    bad, key, file = flipped
    for a, b in ((clean, bad), (bad, clean)):
        code, out, err = run_cli(["verify", a, b], capsys)
        _refused(code, out, err, key, file)
    # the same corruption on both sides compares equal byte for byte: only the record can tell
    twin = tmp_path / "twin"
    import shutil

    shutil.copytree(bad, twin)
    code, out, err = run_cli(["verify", bad, twin], capsys)
    _refused(code, out, err, key, file)
    code, out, err = run_cli(["verify", clean, clean], capsys)
    assert code == 0, out + err


# ----------------------------------------------------------------------------- the pieces
def _item(t: torch.Tensor) -> bytes:
    b = io.BytesIO()
    torch.save(t, b)
    return b.getvalue()


def test_check_item_crcs_checks_every_member_and_names_the_item():
    data = bytearray(_item(torch.arange(1000, dtype=torch.float32)))
    st = fastread.check_item_crcs(data, key="k", where="/x/__0_0.distcp")
    assert st.status == "checked" and st.checked >= 5
    members = fastread.item_members(data)
    storage = next(m for m in members if m.name.startswith("data/"))
    data[storage.start + 17] ^= 0x01
    with pytest.raises(CorruptItem, match=r"item 'k' in __0_0.distcp fails its CRC-32 \(recorded 0x[0-9a-f]{8}, "
                                          r"read 0x[0-9a-f]{8}\)") as info:
        fastread.check_item_crcs(memoryview(data), key="k", where="/x/__0_0.distcp")
    assert info.value.exit_code == 2 and info.value.where == "/x/__0_0.distcp"
    pkl = next(m for m in members if m.name == "data.pkl")
    data[storage.start + 17] ^= 0x01
    data[pkl.start + pkl.size - 3] ^= 0x01
    with pytest.raises(CorruptItem, match="member data.pkl"):
        fastread.check_item_crcs(bytes(data), key="k", where="f")
    assert fastread.check_item_crcs(b"not a zip", key="k", where="f").status == "unchecked"


def test_items_written_without_crcs_are_unrecorded_not_failed():
    torch.serialization.set_crc32_options(False)
    try:
        data = _item(torch.arange(100, dtype=torch.float32))
    finally:
        torch.serialization.set_crc32_options(True)
    assert all(m.crc == 0 for m in fastread.item_members(data))
    st = fastread.check_item_crcs(data, key="k", where="f")
    assert st.status == "unrecorded" and st.checked == 0 and st.unrecorded >= 5
    ledger = CrcLedger()
    ledger.add(StorageRecord("f", "k", 0, 400, 0), 0, 400, 123)
    assert ledger.summary() == {"checked": 0, "unrecorded": 1, "partial": 0}


def test_read_tensor_item_checks_by_default(tmp_path):
    data = bytearray(_item(torch.arange(4096, dtype=torch.float32)))
    p = tmp_path / "item.bin"
    p.write_bytes(bytes(data))
    assert torch.equal(fastread.read_tensor_item(p, 0, len(data)), torch.arange(4096, dtype=torch.float32))
    lay = fastread.item_layout(p, 0, len(data))
    data[lay.storage_file_offset + 100] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptItem, match="item 'w'"):
        fastread.read_tensor_item(p, 0, len(data), key="w")
    assert fastread.read_tensor_item(p, 0, len(data), check_crc=False) is not None  # asked not to: the bytes as stored


def test_member_crcs_stream_in_pieces_of_any_size():
    data = bytearray(_item(torch.arange(3000, dtype=torch.int64)))
    members = fastread.item_members(data)
    for step in (1, 7, 64, 4096, len(data)):
        s = fastread.MemberCrcs(members, key="k", where="f")
        for pos in range(0, len(data), step):
            s.update(pos, memoryview(data)[pos:pos + step])
        assert s.finish().status == "checked"
    storage = next(m for m in members if m.name.startswith("data/"))
    data[storage.start + storage.size - 1] ^= 0x80
    s = fastread.MemberCrcs(members, key="k", where="f")
    s.update(0, data)
    with pytest.raises(CorruptItem):
        s.finish()


def test_ledger_chains_overlapping_reads_and_catches_a_changed_file():
    data = bytes(range(256)) * 4
    rec = StorageRecord("f", "k", 0, len(data), zlib.crc32(data))
    led = CrcLedger()
    # rows read more than once, at different cuts (column blocks of a TP split)
    for off, n in ((0, 300), (0, 300), (200, 500), (300, 400), (700, 324)):
        done = led.add(rec, off, n, zlib.crc32(data[off:off + n]))
    assert done and led.verified(rec)
    gap = CrcLedger()
    gap.add(rec, 0, 500, zlib.crc32(data[:500]))
    assert not gap.verified(rec) and gap.missing(rec) == [(500, len(data) - 500)]
    assert [r.ident for r in gap.pending()] == [rec.ident]
    wrong = CrcLedger()
    wrong.add(rec, 0, 500, zlib.crc32(data[:500]))
    with pytest.raises(CorruptItem, match="item 'k' in f fails its CRC-32"):
        wrong.add(rec, 500, len(data) - 500, zlib.crc32(data[500:][::-1]))
    changed = CrcLedger()
    changed.add(rec, 0, 500, zlib.crc32(data[:500]))
    with pytest.raises(CorruptItem, match="changed while it was read"):
        changed.add(rec, 0, 500, zlib.crc32(data[1:501]))
    assert crcledger.combine_tiling([(0, 10, 0)], 20) is None


def test_compare_counts_how_each_storage_was_checked(reference_ckpt, copy_of):
    """verify's byte comparison checks every storage it read whole; a distributed worker's part
    reports the storages it read only in part as not checked (never silently)."""
    from reshard.verification.compare import compare_tensors

    ia = CheckpointIndex.open(reference_ckpt)
    ib = CheckpointIndex.open(copy_of(reference_ckpt))
    keys = sorted(k for k, e in ia.entries.items() if e.is_tensor)
    res = compare_tensors(ia, ib, keys, direct=False)
    assert all(v.status == "equal" for v in res.verdicts.values())
    items = sum(2 * sum(1 for c in ia.entries[k].chunks if not c.box.is_empty()) for k in keys)
    assert res.crc["checked"] + res.crc["checked_by_extra_read"] + res.crc["unrecorded"] == items
    assert res.crc["not_checked"] == 0 and res.crc["left_to_decoding"] == 0
    # a distributed worker's part: B's chunks in one file meet halves of A's (dp 2) shards
    import tempfile

    from conftest import cli

    with tempfile.TemporaryDirectory() as d:
        code, out, err = cli(["convert", reference_ckpt, Path(d) / "dp2", "--to", "dp=2"])
        assert code == 0, out + err
        ia2 = CheckpointIndex.open(Path(d) / "dp2")
        model = [k for k in keys if k.startswith("model.") and k in ia2.entries]
        part = compare_tensors(ia2, ib, model, direct=False, b_files={"__0_0.distcp"})
        assert all(v.status == "equal" for v in part.verdicts.values())
        assert part.crc["not_checked"] > 0 and part.crc["checked"] > 0


def test_convert_refuses_a_corrupt_object_item(reference_ckpt, copy_of, tmp_path, capsys):
    """Object items are copied verbatim: their bytes are checked before they are written."""
    from reshard.storage.checkpoints import dcp as rdcp

    bad = copy_of(reference_ckpt)
    ix = CheckpointIndex.open(bad)
    e = next(e for k, e in sorted(ix.entries.items()) if not e.is_tensor and k.startswith("rng."))
    raw = rdcp.read_item_bytes(bad, e.location, key=e.key)
    pkl = next(m for m in fastread.item_members(raw) if m.name == "data.pkl")
    pos = e.location.offset + pkl.start + pkl.size // 2
    with open(bad / e.location.file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))
    code, out, err = run_cli(["convert", bad, tmp_path / "out", "--to", "dp=2"], capsys)
    _refused(code, out, err, e.key, e.location.file)
    assert "member data.pkl" in out + err
    assert not (tmp_path / "out").exists()


def test_import_refuses_a_corrupt_torch_save_file(reference_ckpt, tmp_path, capsys):
    """`import` of a torch.save file checks every member against the zip's CRC-32 records,
    in one pass before torch maps the file."""
    exp = tmp_path / "exp"
    code, out, err = run_cli(["export", reference_ckpt, exp, "--format", "torch"], capsys)
    assert code == 0, out + err
    code, out, err = run_cli(["import", exp, tmp_path / "clean", "--to", "dp=2"], capsys)
    assert code == 0, out + err
    pt = max(exp.glob("*.pt"), key=lambda p: p.stat().st_size)
    data = bytearray(pt.read_bytes())
    storage = max((m for m in fastread.item_members(data) if m.name.startswith("data/")), key=lambda m: m.size)
    data[storage.start + storage.size // 2] ^= 0x01
    pt.write_bytes(bytes(data))
    dst = tmp_path / "imported"
    code, out, err = run_cli(["import", exp, dst, "--to", "dp=2"], capsys)
    text = out + err
    assert code == 2 and "Traceback" not in text, text
    assert pt.name in text and f"member {storage.name}" in text and "fails its CRC-32" in text, text
    assert not dst.exists()


@pytest.mark.parametrize("slab", [16 << 20, 4096], ids=["batched", "streamed"])
def test_manifest_checksums_do_not_excuse_a_contradicted_zip_record(reference_ckpt, tmp_path, capsys, slab):
    """An item corrupt before its manifest checksum was taken (the manifest agrees with the bad
    bytes) still contradicts its own zip CRC-32s: the integrity check's reads catch it too,
    whether the item fits one read or streams past in slabs."""
    from reshard.storage.files import integrity
    from reshard.storage.checkpoints import dcp as rdcp

    out = tmp_path / "out"
    code, o, e = run_cli(["convert", reference_ckpt, out, "--to", "dp=2"], capsys)
    assert code == 0, o + e
    manifest = json.loads((out / "manifest.json").read_text())
    ix = CheckpointIndex.open(out)
    assert integrity.check_items(ix, manifest["integrity"], slab_bytes=slab) == []
    key, file = flip_payload_byte(out)
    _, c = _target(out)
    loc = c.location
    alg = manifest["integrity"]["algorithm"]
    manifest["integrity"]["items"][integrity.item_name(loc.file, loc.offset)] = integrity.digest(
        rdcp.read_item_bytes(out, loc, key=key), alg)
    with pytest.raises(CorruptItem, match=f"item '{key}' in {file} fails its CRC-32"):
        integrity.check_items(CheckpointIndex.open(out), manifest["integrity"], slab_bytes=slab)
