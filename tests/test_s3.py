"""Checkpoints read from S3-compatible object storage (issue 34, first part), against a real S3 server.

The server is moto's, speaking the S3 protocol on localhost (`tests/s3_server.py`: one per
session, credentials and endpoint in the environment, the bucket made with the server's own
API); reshard reaches it through fsspec and s3fs, no client mocked. The checkpoint is the
session's `plain_fsdp2_ckpt` (real FSDP2 ranks, `dcp.save`), uploaded once.

- `test_inspect_and_plan_match_a_local_copy`: `inspect` and `plan --to dp=2`, text and
  `--json`, print what they print for the local copy, but for the path (the URL) and the
  plan's fingerprint (which records the path); exit codes equal.
- `test_only_metadata_sidecars_and_small_items_are_requested`: one listing, `.metadata` and
  the sidecars fetched, and of the data objects only the byte ranges of the small items
  inspect reads (step counters), a small fraction of the data.
- `test_credentials_are_never_printed_or_recorded`: neither key appears in any output; a
  URL carrying ``user:secret@`` is refused (exit 2) without echoing the secret.
- `test_hostile_keys_and_names_are_refused`: a data-file name with ``/`` or ``..`` requests
  nothing; a listed key with a ``..`` part is refused (exit 2), as a symlink out is on disk.
- `test_missing_uncommitted_and_truncated_say_what_local_says`: an empty prefix, a prefix
  without `.metadata` (a writer died before its commit) and a truncated data object are
  refused or reported as on disk, naming the URL.
- `test_convert_from_the_store_is_byte_identical_and_verifies`: `convert s3://... DST` writes
  `.metadata` and data files byte-identical to converting the local copy, verified against the
  store's items, its report and manifest naming the URL and no credential; `verify` takes a URL
  on either side; `--data link` from a store is refused (exit 2), nothing written; `--workers 2`
  from the store writes the same bytes (each worker fetching what its own files need).
- `test_inspect_and_plan_of_a_store_import_no_torch`: both commands on a URL, in a fresh
  interpreter, exit 0 without importing torch.
- `test_items_are_fetched_ahead_within_the_bounds`: the conversion's reads are prefetched by
  at most ``--threads`` requests at once (and more than one), with at most ``--buffer-memory``
  bytes fetched and not yet used, the output unchanged.
- `test_export_from_the_store_matches_the_local_export`: `export s3://... DST` writes the
  safetensors files of the local copy's export: the same tensor bytes and header, but for the
  source it names (the URL).
- `test_convert_to_the_store_commits_metadata_last_and_torch_loads_it`: `convert s3://src
  s3://dst` uploads the local conversion's objects byte for byte, leaves no upload marker,
  torch's own `FsspecReader` loads every tensor strictly and bitwise equal to the local output,
  `verify` agrees, and a second run into the committed prefix is refused; with `--overwrite` it
  replaces it (`.metadata` put last), but not a prefix holding an object of someone else's.
- `test_a_kill_before_the_commit_leaves_no_metadata_and_the_rerun_resumes_the_upload`:
  SIGKILLed after its local commit, as it sends the files after the data objects (a forked
  process), the upload leaves no `.metadata`:
  stock `dcp.load` through `FsspecReader` refuses it, `inspect` says not committed; the same
  command again takes the committed local output from the staging folder (checked against its
  CRC-32s, not converted again), keeps every data object already sent (size and ETag as
  recorded), sends the rest and commits the same objects; the staging folder goes.
- `test_a_kill_while_data_objects_go_during_the_verification_commits_nothing`: the data objects
  are uploaded while the output is verified; killed after the first, nothing is committed in the
  store, and the rerun resumes, keeps what was sent and commits the same bytes.
- `test_a_source_the_cache_holds_is_fetched_whole_once_and_spliced`: each data object fetched by
  one GET into the read cache's file, spliced from there, the local conversion's bytes.
- `test_a_kill_during_the_local_conversion_resumes_it_and_a_changed_object_is_sent_again`:
  killed after its first item, the rerun resumes the conversion from its journal (the remote
  source's identity, sizes and ETags, is the same across runs); an object overwritten in the
  store after a killed upload is sent again, the others kept.
- `test_export_into_the_store_uploads_the_shards_index_last_and_resumes`: `export` to a URL
  puts the local export's shards byte for byte, the index last, each loadable by safetensors;
  killed after its first shard, the rerun exports again and keeps that shard (same CRC-32, ETag).
- `test_the_upload_check_reads_the_servers_own_etags`: each object sent is checked by the ETag
  the server computed (single PUT and a three-part multipart upload); other bytes fail it.
- `test_ctrl_c_bound_for_the_store_says_where_the_work_waits`: SIGINT mid-conversion, exit 130,
  one line naming the store (nothing committed) and the staging folder.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import cli
from s3_server import ACCESS_KEY, SECRET_KEY, s3_server


@pytest.fixture(scope="session")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture(autouse=True)
def staging(tmp_path_factory, monkeypatch) -> Path:
    """Outputs bound for the store are made under a folder of the test's own (not ~/.cache)."""
    folder = tmp_path_factory.mktemp("staging")
    monkeypatch.setenv("RESHARD_STAGING_DIR", str(folder))
    return folder


@pytest.fixture(scope="session")
def plain_url(s3, plain_fsdp2_ckpt) -> str:
    """`plain_fsdp2_ckpt` uploaded once: its URL on the server."""
    return s3.upload(plain_fsdp2_ckpt, "plain")


@pytest.fixture(scope="module")
def local_dp2(plain_fsdp2_ckpt, tmp_path_factory) -> Path:
    """`plain_fsdp2_ckpt` converted to dp=2 from the local copy: what every conversion from the store must equal."""
    out = tmp_path_factory.mktemp("s3") / "local_dp2"
    code, _out, err = cli(["convert", plain_fsdp2_ckpt, out, "--to", "dp=2", "--quiet"])
    assert code == 0, err
    return out


def _data_files(ckpt: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in ckpt.iterdir() if p.suffix == ".distcp" or p.name == ".metadata"}


def _same_but_path(local: str, remote: str, ckpt: Path, url: str) -> None:
    assert remote == local.replace(str(ckpt.resolve()), url).replace(str(ckpt), url)


@pytest.mark.parametrize("argv", [["inspect", "--json"], ["inspect"], ["plan", "--to", "dp=2", "--json"],
                                  ["plan", "--to", "dp=2"]], ids=["inspect-json", "inspect", "plan-json", "plan"])
def test_inspect_and_plan_match_a_local_copy(argv, plain_fsdp2_ckpt, plain_url):
    code_l, out_l, _ = cli([argv[0], plain_fsdp2_ckpt, *argv[1:]])
    code_r, out_r, err_r = cli([argv[0], plain_url, *argv[1:]])
    assert code_r == code_l == 0, err_r
    if argv[0] == "plan":  # the fingerprint covers the source path, so it differs with it and only with it
        fp_l = (json.loads(out_l) if "--json" in argv else {"fingerprint": out_l.split("fingerprint ")[1].split()[0]})["fingerprint"]
        fp_r = (json.loads(out_r) if "--json" in argv else {"fingerprint": out_r.split("fingerprint ")[1].split()[0]})["fingerprint"]
        assert fp_l != fp_r
        out_r = out_r.replace(fp_r, fp_l)
    if argv[:2] == ["inspect", "--json"]:  # one key more: what describing it fetched, against what the prefix holds
        d = json.loads(out_r)
        store = d.pop("store")
        assert store["listings"] == 1 and 0 < store["bytes_requested"] < store["bytes_stored"], store
        out_l, out_r = json.dumps(json.loads(out_l)), json.dumps(d)
    _same_but_path(out_l, out_r, plain_fsdp2_ckpt, plain_url)
    if "--json" in argv:
        d = json.loads(out_r)
        assert (d["path"] if argv[0] == "inspect" else d["source"]["path"]) == plain_url


def test_only_metadata_sidecars_and_small_items_are_requested(s3, plain_fsdp2_ckpt, plain_url):
    from reshard.planning.describe import inspect_checkpoint
    from reshard.storage.source import opened

    with opened(plain_url) as source:
        root, rc = source.root, source.remote
        staged_names = sorted(p.name for p in root.iterdir())
        ins = inspect_checkpoint(source)
        counters = rc.counters.to_dict()
    assert ins.report["complete"] and ins.report["path"] == plain_url
    assert not root.exists()  # the private directory is gone with the block
    assert counters["listings"] == 1
    assert ".metadata" in staged_names and not any(n.endswith(".distcp") for n in staged_names)
    sizes = s3.keys("plain")
    data = {k: n for k, n in sizes.items() if k.endswith(".distcp")}
    assert counters["by_file"][".metadata"] == sizes[".metadata"]
    asked = sum(n for k, n in counters["by_file"].items() if k in data)
    small = sum(e.location.length if not e.is_tensor else e.chunks[0].location.length
                for e in ins.index.entries.values() if not e.is_tensor or e.numel == 1)
    assert 0 < asked <= small < sum(data.values()) // 4, counters  # step counters, objects: no tensor's bytes


def test_credentials_are_never_printed_or_recorded(plain_url):
    outs = [cli(["inspect", plain_url, "--json"]), cli(["plan", plain_url, "--to", "dp=2", "--json"]),
            cli(["inspect", plain_url])]
    for code, out, err in outs:
        assert code == 0
        assert ACCESS_KEY not in out + err and SECRET_KEY not in out + err
    code, out, err = cli(["inspect", plain_url.replace("s3://", f"s3://{ACCESS_KEY}:{SECRET_KEY}@")])
    assert code == 2 and "credentials in the URL are refused" in err
    assert SECRET_KEY not in out + err and ACCESS_KEY not in out + err


def test_hostile_keys_and_names_are_refused(s3, plain_fsdp2_ckpt, plain_url):
    from reshard.errors import BadInput
    from reshard.storage.objectstore.remote import open_remote

    rc = open_remote(plain_url)
    for name in ("../evil/__0_0.distcp", "sub/__0_0.distcp", "/__0_0.distcp", ".."):
        with pytest.raises(BadInput, match="outside the checkpoint|not a plain name inside"):
            rc.read_range(name, 0, 1)
    assert rc.counters.requests == 0  # refused before any request
    url = s3.upload(plain_fsdp2_ckpt, "dotdot")
    s3.client().put_object(Bucket=s3.bucket, Key="dotdot/sub/../x", Body=b"x")
    code, _out, err = cli(["inspect", url])
    assert code == 2 and "'sub/../x' points outside the checkpoint" in err and url in err


def test_missing_uncommitted_and_truncated_say_what_local_says(s3, plain_fsdp2_ckpt, tmp_path):
    code, _o, err = cli(["inspect", s3.url("nothing-here")])
    assert code == 2 and "nothing is stored under this prefix" in err and s3.url("nothing-here") in err

    url = s3.upload(plain_fsdp2_ckpt, "uncommitted")
    s3.client().delete_object(Bucket=s3.bucket, Key="uncommitted/.metadata")
    code, _o, err = cli(["inspect", url])
    assert code == 2 and "not committed" in err and url in err and "reshard-remote-" not in err

    local = tmp_path / "trunc"
    shutil.copytree(plain_fsdp2_ckpt, local)
    victim = sorted(local.glob("*.distcp"))[-1]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    url = s3.upload(local, "trunc")
    code_l, out_l, _ = cli(["inspect", local, "--json"])
    code_r, out_r, _ = cli(["inspect", url, "--json"])
    assert code_r == code_l == 2
    d = json.loads(out_r)
    assert any(f["code"] == "truncated_file" for f in d["problems"]) and d.pop("store")["listings"] == 1
    _same_but_path(json.dumps(json.loads(out_l)), json.dumps(d), local, url)


def test_convert_from_the_store_is_byte_identical_and_verifies(s3, plain_fsdp2_ckpt, plain_url, local_dp2, tmp_path):
    """`convert s3://... DST` writes the same `.metadata` and data files as converting the local
    copy; its report and manifest name the URL (never the private staged directory); `verify`
    takes a URL on either side; what cannot work from a store yet is refused with the way out."""
    remote = tmp_path / "remote"
    code, out, err = cli(["convert", plain_url, remote, "--to", "dp=2", "--quiet", "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["source"] == report["verification"]["a"] == plain_url and report["verification"]["equal"]
    assert report["verification"]["compared"]["tensors"] > 0  # compared with the store's items value by value
    assert _data_files(remote) == _data_files(local_dp2)
    # each byte fetched once: the verification reads the copy's fetches again from this machine
    got, data = report["source_store"], sum(n for k, n in s3.keys("plain").items() if k.endswith(".distcp"))
    assert got["bytes_read_again_from_the_local_copy"] > 0 and report["estimate"]["read_cache_bytes"] > 0, got
    assert got["bytes_requested"] <= data + (4 << 20) + (1 << 16), (got, data)  # + the throughput probe, .metadata
    manifest = json.loads((remote / "manifest.json").read_text())
    assert manifest["lineage"][-1]["policies"]["source_path"] == plain_url
    for p in remote.iterdir():
        text = p.read_bytes()
        assert b"reshard-remote-" not in text and ACCESS_KEY.encode() not in text and SECRET_KEY.encode() not in text
    for a, b in ((plain_url, remote), (remote, plain_url), (plain_url, plain_fsdp2_ckpt)):
        code, out, err = cli(["verify", a, b, "--json"])
        assert code == 0 and json.loads(out)["equal"], err

    code, _o, err = cli(["convert", plain_url, tmp_path / "x", "--to", "dp=2", "--data", "link"])
    assert code == 2 and "--data link" in err and not (tmp_path / "x").exists()
    # several workers from the store (issue 46): each fetches what its own files need; the same bytes
    code, _o, err = cli(["convert", plain_url, tmp_path / "w", "--to", "dp=2", "--workers", "2", "--quiet"])
    assert code == 0, err
    assert _data_files(tmp_path / "w") == _data_files(local_dp2)


def test_export_from_the_store_matches_the_local_export(s3, plain_fsdp2_ckpt, plain_url, tmp_path):
    """`export s3://... DST` writes the safetensors files exporting the local copy writes (the same tensor bytes
    and header), but for the source they and the report name: the URL."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    assert cli(["export", plain_fsdp2_ckpt, local, "--quiet"])[0] == 0
    code, out, err = cli(["export", plain_url, remote, "--quiet", "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["source"] == plain_url
    got, data = report["source_store"], sum(n for k, n in s3.keys("plain").items() if k.endswith(".distcp"))
    assert got["bytes_requested"] <= data + (4 << 20) + (1 << 16), (got, data)  # its verification reads the local copy
    shards = sorted(p.name for p in local.iterdir() if p.suffix == ".safetensors")
    assert shards and shards == sorted(p.name for p in remote.iterdir() if p.suffix == ".safetensors")
    for name in shards:  # the same header but for the source it names, and the same tensor bytes
        (hl, dl), (hr, dr) = _safetensors(local / name), _safetensors(remote / name)
        assert hl["__metadata__"].pop("source") == str(plain_fsdp2_ckpt.resolve())
        assert hr["__metadata__"].pop("source") == plain_url
        assert hl == hr and dl == dr, name


def test_export_into_the_store_uploads_the_shards_index_last_and_resumes(s3, plain_url, tmp_path, monkeypatch):
    """`export s3://src s3://dst` (several shards) puts the files the same export writes locally,
    byte for byte, the index last; safetensors' own loader reads each shard from the store. Killed
    after its first shard's upload, the same command exports again and sends only what the store
    lacks (the re-exported first shard has the same bytes, proven by its CRC-32 and ETag)."""
    import os

    import forked
    from safetensors.torch import load as load_safetensors

    local = tmp_path / "local"
    opts = ["--max-shard-size", "4KB", "--quiet"]
    assert cli(["export", plain_url, local, *opts])[0] == 0
    files = sorted(p.name for p in local.iterdir() if p.is_file())
    shards = [n for n in files if n.endswith(".safetensors")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in files, files

    dst = s3.url("exported")
    r = forked.run(["export", plain_url, dst, *opts], env={**os.environ, "RESHARD_FAULT_KILL_AT": f"upload {shards[0]}"})
    assert r.returncode == -9, r.stderr
    keys = s3.keys("exported")
    assert shards[0] in keys and "model.safetensors.index.json" not in keys and ".reshard-uploading" in keys
    events = tmp_path / "events"
    monkeypatch.setenv("RESHARD_FAULT_COUNT", str(events))
    code, out, err = cli(["export", plain_url, dst, *opts[:-1], "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["destination"] == dst
    assert report["uploaded"]["kept_from_an_interrupted_upload"]["objects"] == 1
    uploads = [label for label in (ln.split(" ", 1)[1] for ln in events.read_text().splitlines())
               if label.startswith("upload ")]
    assert uploads[-1] == "upload model.safetensors.index.json", uploads  # the loader's entry file last
    for argv in (["verify", plain_url, dst], ["inspect", dst]):  # an export in the store, read back by range
        code, out, err = cli(argv)
        assert code == 0 and "reshard-remote-" not in out + err, out + err  # named by its URL, never the staged folder
    c = s3.client()
    assert set(s3.keys("exported")) == set(files)
    for name in files:
        if name.endswith(".safetensors"):  # the report file names the run (time), the shards are the same bytes
            body = c.get_object(Bucket=s3.bucket, Key=f"exported/{name}")["Body"].read()
            assert body == (local / name).read_bytes(), name
            assert load_safetensors(body).keys() == load_safetensors((local / name).read_bytes()).keys()


def test_the_upload_check_reads_the_servers_own_etags(s3, tmp_path, monkeypatch):
    """`upload.etag_matches` against ETags the server computed: a single PUT's (the MD5) and a
    multipart upload's (``md5(md5(part)...)-N``, three parts of 5 MiB, the smallest S3 allows),
    both True for the bytes sent, False for other bytes of the same size; an ETag of another
    form is None (not checked), never True. reshard's own upload (`upload.Publisher.send`, parts
    sent several at once) is checked by the digests it took while sending, both forms."""
    import os

    import fsspec

    from reshard.storage.objectstore import upload

    fs = fsspec.filesystem("s3")
    data = tmp_path / "data"
    data.write_bytes(os.urandom(11 << 20))
    other = tmp_path / "other"
    other.write_bytes(os.urandom(11 << 20))
    fs.put_file(str(data), f"{s3.bucket}/etag/single", chunksize=64 << 20)
    fs.put_file(str(data), f"{s3.bucket}/etag/multi", chunksize=5 << 20)
    single, multi = fs.info(f"{s3.bucket}/etag/single"), fs.info(f"{s3.bucket}/etag/multi")
    assert str(multi["ETag"]).strip('"').endswith("-3"), multi["ETag"]
    assert upload.etag_matches(data, single) is True and upload.etag_matches(other, single) is False
    monkeypatch.setattr(upload, "PART_BYTES", 5 << 20)  # the part size this upload used (s3fs's default is 50 MiB)
    assert upload.etag_matches(data, multi) is True and upload.etag_matches(other, multi) is False
    assert upload.etag_matches(data, {"ETag": '"not-an-md5"'}) is None

    # reshard's own upload (`Publisher.send`): parts digested as they are read, several under way at
    # once, the ETag checked from those digests (three parts of 5 MiB), then the single-PUT form
    monkeypatch.setattr(upload, "SEND_PART", 5 << 20)
    stage = upload.Stage(s3.url("etag/own"), tmp_path / "stage")
    stage.folder.mkdir()
    pub = upload.Publisher(stage)
    pub.begin()
    pub.send("multi", data)
    monkeypatch.setattr(upload, "SEND_PART", 64 << 20)
    pub.send("single", other)
    assert pub.checked == 2 and pub.unchecked == 0 and pub.sent.bytes == 22 << 20
    assert str(fs.info(f"{s3.bucket}/etag/own/multi")["ETag"]).strip('"').endswith("-3")
    assert fs.cat_file(f"{s3.bucket}/etag/own/multi") == data.read_bytes()
    assert fs.cat_file(f"{s3.bucket}/etag/own/single") == other.read_bytes()


def _safetensors(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (JSON) and its data bytes."""
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def test_items_are_fetched_ahead_within_the_bounds(plain_url, local_dp2, tmp_path, monkeypatch):
    """Without room to keep the source whole (no read cache), the conversion's reads of a remote
    source go through a prefetch: several ranged requests at once but never more than
    ``--threads``, never more than ``--buffer-memory`` bytes fetched ahead and not yet used, and the
    output the same bytes as with no prefetch at all."""
    monkeypatch.setenv("RESHARD_READ_CACHE", "0")
    from reshard.engine.conversion import convert
    from reshard.engine.copy import IOOptions
    from reshard.model.plan import Options
    from reshard.planning.plan import make_plan
    from reshard.storage.source import opened

    with opened(plain_url) as source:  # the conversion reads its source's store (`Source.remote`), counted there
        report = convert(make_plan(source, Options(to="dp=2")), source, tmp_path / "out",
                         io=IOOptions(threads=3, window=16 << 10))
        counters = source.remote.counters.to_dict()
    assert report["verification"]["equal"]
    (copy,) = [p for p in counters["prefetches"] if p["label"] == "copy"]
    assert 2 <= copy["peak_in_flight"] <= 3, counters
    assert 0 < copy["peak_buffered"] <= 16 << 10, counters
    assert counters["prefetched"] > 0
    assert _data_files(tmp_path / "out") == _data_files(local_dp2)


def test_a_source_the_cache_holds_is_fetched_whole_once_and_spliced(s3, plain_url, local_dp2, tmp_path):
    """With room to keep it (the default), each data object of the source is fetched by one GET,
    whole, into the read cache's local file (`remote.Mirror`), the copy splices from those files as
    from a local source, and the verification reads them there: one request per data object, each
    byte once, the output the local conversion's bytes."""
    from reshard.engine.conversion import convert
    from reshard.model.plan import Options
    from reshard.planning.plan import make_plan
    from reshard.storage.source import opened

    with opened(plain_url) as source:
        report = convert(make_plan(source, Options(to="dp=2")), source, tmp_path / "out")
        counters = source.remote.counters.to_dict()
    assert report["verification"]["equal"]
    stored = {k: n for k, n in s3.keys("plain").items() if k.endswith(".distcp")}
    assert not [p for p in counters["prefetches"] if p["label"] == "copy"], counters  # no range prefetch
    for name, size in stored.items():  # the whole object once; the 4 MiB probe of the estimate may add a range
        assert size <= counters["by_file"][name] <= size + (4 << 20), (name, counters["by_file"])
    assert report["verification"]["checked_while_writing"] > 0, report["verification"]  # spliced, as from disk
    assert _data_files(tmp_path / "out") == _data_files(local_dp2)


def _load_with_fsspec_reader(url: str, like: Path) -> dict:
    """Every tensor of the checkpoint at ``url`` loaded by torch's own `FsspecReader` into tensors
    shaped as the local checkpoint ``like`` declares them (strict: every key must be there)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(like)).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=FsspecReader(url), planner=dcp.DefaultLoadPlanner(allow_partial_load=False))
    return sd


def test_convert_to_the_store_commits_metadata_last_and_torch_loads_it(s3, plain_url, local_dp2, tmp_path, monkeypatch):
    """`convert s3://src s3://dst`: the objects are the local conversion's files (data and
    `.metadata` byte for byte), no upload marker is left, torch's `FsspecReader` loads every
    tensor strictly and bitwise equal to the local output, and a second run into the same
    prefix is refused (a committed checkpoint is never replaced without --overwrite); with
    `--overwrite` it is replaced (`.metadata` put last), but not a prefix holding an object of
    someone else's."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dst = s3.url("out/dp2")
    code, out, err = cli(["convert", plain_url, dst, "--to", "dp=2", "--quiet", "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["destination"] == report["verification"]["b"] == dst
    assert report["uploaded"]["checked_by_etag"] == report["uploaded"]["objects"] > 0, report["uploaded"]
    assert report["uploaded"]["not_checked"] == 0
    up = report["estimate"]["upload"]  # the store's upload rate probed for the estimate, the probe deleted
    assert up["bytes"] > 0 and up["error"] is None and "to upload" in report["estimate"]["basis"], report["estimate"]
    keys = s3.keys("out/dp2")
    assert ".reshard-uploading" not in keys and not any(k.startswith(".reshard-probe-") for k in keys), keys
    c = s3.client()
    for name, data in _data_files(local_dp2).items():
        assert c.get_object(Bucket=s3.bucket, Key=f"out/dp2/{name}")["Body"].read() == data, name
    got = _load_with_fsspec_reader(dst, local_dp2)
    md = dcp.FileSystemReader(str(local_dp2)).read_metadata()
    want = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}
    dcp.load(want, storage_reader=dcp.FileSystemReader(str(local_dp2)))
    assert got.keys() == want.keys() and got
    for k in want:
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k
    code, _o, err = cli(["verify", local_dp2, dst])
    assert code == 0, err
    code, _o, err = cli(["convert", plain_url, dst, "--to", "dp=2", "--quiet"])
    assert code == 2 and "a committed checkpoint" in err and "--overwrite" in err

    # --overwrite replaces a committed checkpoint (its .metadata deleted first), never a foreign object
    events = tmp_path / "events"
    monkeypatch.setenv("RESHARD_FAULT_COUNT", str(events))
    code, _o, err = cli(["convert", plain_url, dst, "--to", "dp=1", "--quiet", "--overwrite"])
    assert code == 0, err
    keys = s3.keys("out/dp2")
    assert ".reshard-uploading" not in keys and all("__1_" not in k for k in keys), keys  # dp=2's rank-1 file went
    uploads = [ln.split(" ", 1)[1] for ln in events.read_text().splitlines() if " upload " in f" {ln}"]
    assert uploads[-1] == "upload .metadata", uploads
    code, _o, err = cli(["verify", plain_url, dst])
    assert code == 0, err
    c.put_object(Bucket=s3.bucket, Key="out/dp2/notes.txt", Body=b"mine")
    code, _o, err = cli(["convert", plain_url, dst, "--to", "dp=2", "--quiet", "--overwrite"])
    assert code == 2 and "notes.txt" in err and "--overwrite refuses" in err, err
    assert "notes.txt" in s3.keys("out/dp2") and ".metadata" in s3.keys("out/dp2")  # nothing replaced


def test_a_kill_before_the_commit_leaves_no_metadata_and_the_rerun_resumes_the_upload(s3, plain_url, local_dp2, staging):
    """A conversion into the store SIGKILLed after its local commit, while it sends the files
    after the data objects (a real process, `tests/forked.py`; the data objects went while the
    output was verified), leaves data objects and no `.metadata`: stock `dcp.load` through
    `FsspecReader` refuses the prefix, `inspect` calls it not committed. The same command run
    again resumes: it takes the committed local output the killed run left in its staging
    folder (items checked against their CRC-32 now, not converted again), sends only what the
    store lacks (`.metadata` and the sidecars; every data object and the first sidecar are kept,
    proven by their size and ETag), and commits what a clean run commits; the staging folder
    goes with the commit."""
    import os

    import forked
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.api import CheckpointException

    from reshard.storage.objectstore.upload import stage_folder

    dst = s3.url("out/killed")
    from reshard.storage.objectstore.upload import ENTRY_FILES

    data = {n for n in _data_files(local_dp2) if n.endswith(".distcp")}
    last = max(data)
    side = min(p.name for p in local_dp2.iterdir() if p.is_file() and p.suffix != ".distcp" and p.name not in ENTRY_FILES)
    argv = ["convert", plain_url, dst, "--to", "dp=2", "--quiet", "--json"]
    # the killed child's temporary files in a folder of its own: no cleanup runs on SIGKILL, and the
    # shared temporary folder holds other test workers' staged sources, which must not be touched
    own_tmp = staging.parent / f"{staging.name}-tmp"
    own_tmp.mkdir()
    r = forked.run(argv, env={**os.environ, "TMPDIR": str(own_tmp), "RESHARD_FAULT_KILL_AT": f"upload {side}"})
    assert r.returncode == -9, r.stderr
    assert [p.name[:15] for p in own_tmp.iterdir()] == ["reshard-remote-"]  # the staged source, left by the kill
    shutil.rmtree(own_tmp)
    assert (stage_folder(dst) / "out" / ".metadata").is_file()  # the committed local output waits
    keys = s3.keys("out/killed")
    assert last in keys and side in keys and ".metadata" not in keys and ".reshard-uploading" in keys
    with pytest.raises(CheckpointException, match="global metadata read failed: .*killed/.metadata"):
        dcp.load({"x": torch.empty(1)}, storage_reader=FsspecReader(dst))
    code, _o, err = cli(["inspect", dst])
    assert code == 2 and "not committed" in err

    code, out, err = cli(argv)
    assert code == 0, err
    report = json.loads(out)
    assert report["taken_again"]["items_checked_now"] > 0
    assert report["uploaded"]["kept_from_an_interrupted_upload"]["objects"] == len(data) + 1
    assert report["uploaded"]["objects"] == len(s3.keys("out/killed")) - len(data) - 1 >= 1  # .metadata and the rest
    assert not stage_folder(dst).exists()
    from reshard.render.report import render_convert

    text = render_convert(report)  # what a person reads: whose verification, and what was kept
    assert "by the interrupted run that made it" in text and "already there from the interrupted upload, kept" in text
    assert "ranged requests" in text
    c = s3.client()
    assert ".reshard-uploading" not in s3.keys("out/killed")
    for name, want in _data_files(local_dp2).items():
        assert c.get_object(Bucket=s3.bucket, Key=f"out/killed/{name}")["Body"].read() == want, name
    got = _load_with_fsspec_reader(dst, local_dp2)
    assert got


def test_a_kill_while_data_objects_go_during_the_verification_commits_nothing(s3, plain_url, local_dp2, staging):
    """The data objects of a conversion bound for the store are uploaded while the output is
    verified and committed locally (`publishing.EarlyUpload`, a thread of its own). SIGKILLed right
    after its first data object, the run has committed nothing in the store (no `.metadata`, the
    upload marker there), whether or not the local commit had happened meanwhile (the two race);
    the rerun takes the committed local output again or converts again, keeps what was sent (size and ETag as recorded), and commits the clean conversion's bytes."""
    import os

    import forked

    from reshard.storage.objectstore.upload import stage_folder

    data = sorted(n for n in _data_files(local_dp2) if n.endswith(".distcp"))
    dst = s3.url("out/killed-early-upload")
    argv = ["convert", plain_url, dst, "--to", "dp=2", "--quiet", "--json"]
    own_tmp = staging.parent / f"{staging.name}-tmp-early"
    own_tmp.mkdir()
    r = forked.run(argv, env={**os.environ, "TMPDIR": str(own_tmp), "RESHARD_FAULT_KILL_AT": f"upload {data[0]}"})
    assert r.returncode == -9, r.stderr
    shutil.rmtree(own_tmp)
    keys = s3.keys("out/killed-early-upload")
    assert data[0] in keys and ".metadata" not in keys and ".reshard-uploading" in keys, keys
    code, out, err = cli(argv)
    assert code == 0, err
    report = json.loads(out)
    # the local commit had happened (taken again) or not: then the conversion ran again, its staging
    # gone with the killed run's TMPDIR; either way what reached the store is kept, not sent again
    assert report["uploaded"]["kept_from_an_interrupted_upload"]["objects"] >= 1, report["uploaded"]
    assert ".reshard-uploading" not in s3.keys("out/killed-early-upload") and not stage_folder(dst).exists()
    c = s3.client()
    for name, want in _data_files(local_dp2).items():
        assert c.get_object(Bucket=s3.bucket, Key=f"out/killed-early-upload/{name}")["Body"].read() == want, name


def test_a_kill_during_the_local_conversion_resumes_it_and_a_changed_object_is_sent_again(s3, plain_url, local_dp2):
    """Bound for the store, a conversion SIGKILLed after its first item written resumes from its
    journal on the rerun (as beside a local destination: the report's ``resume`` keeps items).
    Then an upload killed mid-way whose first data object someone else overwrites in the store:
    the rerun sends that object again (its ETag is not the one recorded), keeps the others, and
    the result is the clean conversion's bytes."""
    import os

    import forked

    c = s3.client()
    data = sorted(n for n in _data_files(local_dp2) if n.endswith(".distcp"))
    dst = s3.url("out/killed-early")
    argv = ["convert", plain_url, dst, "--to", "dp=2", "--quiet"]
    r = forked.run(argv, env={**os.environ, "RESHARD_FAULT_KILL_AT": "1"})
    assert r.returncode == -9, r.stderr
    assert s3.keys("out/killed-early") == {}
    code, out, err = cli([*argv, "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["resume"]["resumed"] and report["resume"]["items_kept"] >= 1, report["resume"]
    for name, want in _data_files(local_dp2).items():
        assert c.get_object(Bucket=s3.bucket, Key=f"out/killed-early/{name}")["Body"].read() == want, name

    dst = s3.url("out/overwritten")
    argv = ["convert", plain_url, dst, "--to", "dp=2", "--quiet"]
    from reshard.storage.objectstore.upload import ENTRY_FILES

    side = min(p.name for p in local_dp2.iterdir() if p.is_file() and p.suffix != ".distcp" and p.name not in ENTRY_FILES)
    # killed after the local commit, as the files after the data objects go (the data objects went earlier)
    r = forked.run(argv, env={**os.environ, "RESHARD_FAULT_KILL_AT": f"upload {side}"})
    assert r.returncode == -9, r.stderr
    c.put_object(Bucket=s3.bucket, Key=f"out/overwritten/{data[0]}", Body=b"not what reshard wrote")
    code, out, err = cli([*argv[:-1], "--json", "--progress", "json"])
    assert code == 0, err
    up = json.loads(out)["uploaded"]
    assert up["kept_from_an_interrupted_upload"]["objects"] == len(data) - 1 + 1  # and the sidecar sent before the kill
    ends = [e for e in map(json.loads, err.splitlines()) if e.get("phase") == "upload" and e["event"] == "end"]
    total = up["bytes"] + up["kept_from_an_interrupted_upload"]["bytes"]
    assert [(e["bytes_done"], e["bytes_total"]) for e in ends] == [(total, total)], err  # progress by bytes
    for name, want in _data_files(local_dp2).items():
        assert c.get_object(Bucket=s3.bucket, Key=f"out/overwritten/{name}")["Body"].read() == want, name


def test_ctrl_c_bound_for_the_store_says_where_the_work_waits(s3, plain_url, tmp_path):
    """SIGINT while the conversion bound for the store writes its first item: exit 130 and one
    line saying nothing is committed in the store and where the resumable work waits."""
    import os
    import signal
    import time

    import forked

    from reshard.storage.objectstore.upload import stage_folder

    dst = s3.url("out/ctrl-c")
    events = tmp_path / "events"
    p = forked.start(["convert", plain_url, dst, "--to", "dp=2", "--quiet"],
                     env={**os.environ, "RESHARD_FAULT_SLEEP_AT": "1:60", "RESHARD_FAULT_COUNT": str(events)})
    deadline = time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline and not (events.exists() and events.read_text()):
        time.sleep(0.05)
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    _out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert (f"interrupted: nothing committed in {dst}; the same command run again resumes from what waits in "
            f"{stage_folder(dst)} (--restart starts over)") in err, err
    assert s3.keys("out/ctrl-c") == {}


NO_TORCH_RUN = """
import sys
from reshard.cli import main

for argv in (["inspect", sys.argv[1], "--json"], ["plan", sys.argv[1], "--to", "dp=2", "--json"]):
    try:
        main(argv)
    except SystemExit as exc:
        print("exit", argv[0], exc.code, file=sys.stderr)
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
"""


def test_inspect_and_plan_of_a_store_import_no_torch(plain_url):
    """`inspect` and `plan` of a remote checkpoint stay off torch, as on disk (docs/architecture.md,
    "Where torch is imported"): fsspec, s3fs and the staged directory bring none of it. A fresh
    interpreter is the point (this one has torch), so it is a subprocess, one for both commands."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", NO_TORCH_RUN, plain_url], capture_output=True, text=True,
                       env=os.environ, timeout=300)
    assert "exit inspect 0" in r.stderr and "exit plan 0" in r.stderr, r.stderr
    assert "torch imported: False" in r.stderr, r.stderr


def test_the_python_api_reads_and_converts_from_the_store(s3, plain_fsdp2_ckpt, plain_url, local_dp2, tmp_path):
    """`reshard.inspect`, `plan`, `estimate` and `convert(plan, dst)` (docs/api.md) take the URL as the
    CLI does: the same plan JSON as `plan URL --json`, the output byte-identical to converting the
    local copy, and the URL recorded (each call stages the source again; the plan keeps no staged copy)."""
    import reshard

    ins = reshard.inspect(plain_url)
    assert ins.exit_code == 0 and ins.report["path"] == plain_url
    p = reshard.plan(plain_url, to="dp=2")
    code, out, err = cli(["plan", plain_url, "--to", "dp=2", "--json"])
    assert code == 0 and json.loads(out) == json.loads(json.dumps(p.to_dict(tensors="auto"))), err
    assert p.source["path"] == plain_url
    room = reshard.estimate(p, tmp_path / "out")
    assert room["enough"] and room["needed_bytes"] > 0
    report = reshard.convert(p, tmp_path / "out")
    assert report["source"] == plain_url and report["verification"]["equal"]
    assert _data_files(tmp_path / "out") == _data_files(local_dp2)
