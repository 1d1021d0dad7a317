"""Object storage attacked as a hostile or careless environment would (issue 42, items 1 and 3-8, 10).

Every attack is mounted against a real S3-protocol server (moto's, on localhost: `tests/s3_server.py`)
or a real local file system, on the session's real FSDP2 checkpoint (`plain_fsdp2_ckpt`,
`dcp.save` on 4 gloo ranks); a second real run (seed 1, the same layout, other values) stands
for "another checkpoint's tensors".

- `test_an_object_replaced_during_a_conversion_commits_nothing`: a data object replaced by the
  other run's (intact, same size) while `convert` is paused after its first write (a real
  process): exit 2 naming the object, no output; reads pinned to the listed ETag refuse another
  version's bytes (`If-Match` answered 412) even when nothing else would notice.
- `test_file_urls_are_refused_and_a_symlink_out_never_copied`: `file://PATH` with a sidecar
  symlinked outside: refused (exit 2, "give the path itself") by inspect, convert and export,
  nothing written; the path itself refuses the symlink as before.
- `test_a_marker_nobody_here_wrote_deletes_nothing`: a prefix holding `.reshard-uploading` beside
  a user's objects: `convert` into it exits 2 naming them, every object still there; an upload of
  this machine's that was killed resumes, and an object added beside it since is refused by name.
- `test_a_destination_at_above_or_inside_the_source_is_refused`: equal, inside (also as
  ``s3a://``), above, for `convert --overwrite` and `export`: exit 2 before any request, the
  source's objects unchanged; a sibling prefix whose name extends the source's is accepted.
- `test_a_credential_in_any_position_is_refused_and_never_printed`: ``s3:///KEY:SECRET@bucket/p``
  and ``s3://bucket/KEY:SECRET@p`` as source and destination, text and `--json`: exit 2, neither
  part printed; the secret's value in a path is redacted from the error.
- `test_a_stalled_store_fails_within_the_bound_it_states`: a localhost server that accepts and
  never answers: `inspect` (a real process) exits 2 within the stated bound, saying it.
- `test_a_huge_listing_is_bounded_and_opaque_files_cost_no_request`: more objects than the bound
  refused before any fetch; 300 log objects, a ``logs/`` folder marker and a zero-byte
  ``.metadata/`` beside the checkpoint: inspect fetches none of the logs, lists every one, and a
  conversion carries each byte-identical.
- `test_keys_no_local_file_can_hold_are_named_by_their_url`: a file and a folder of one name, a
  part of 300 bytes, a tab (a control character): exit 2 naming the URL, never the private staging directory.

Cost: about 25 s on the 2-core machine (one moto server, one extra 4-rank save, two forked
processes, one of them paused for 4 s).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from conftest import cli, once_per_run
from s3_server import ACCESS_KEY, SECRET_KEY, s3_server


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture(autouse=True)
def staging(tmp_path_factory, monkeypatch) -> Path:
    folder = tmp_path_factory.mktemp("staging")
    monkeypatch.setenv("RESHARD_STAGING_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def other_run(tmp_path_factory) -> Path:
    """A second real FSDP2 run of the same model (seed 1): its data files have the source's names
    and sizes and other values, each item intact."""
    from reshard.testing.synthetic import make_plain_fsdp2

    return Path(once_per_run(tmp_path_factory, "plain-seed1",
                             lambda w: str(make_plain_fsdp2(w / "ckpt", world_size=4, seed=1))))


def _keys_and_etags(s3, prefix: str) -> dict[str, str]:
    c = s3.client()
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix.strip("/") + "/"):
        for o in page.get("Contents", []):
            out[o["Key"]] = o["ETag"]
    return out


def test_an_object_replaced_during_a_conversion_commits_nothing(s3, plain_fsdp2_ckpt, other_run, tmp_path):
    import forked

    from reshard.errors import BadInput
    from reshard.storage.objectstore.remote import open_remote

    victim = "__0_0.distcp"
    assert (other_run / victim).stat().st_size == (plain_fsdp2_ckpt / victim).stat().st_size
    assert (other_run / victim).read_bytes() != (plain_fsdp2_ckpt / victim).read_bytes()
    c = s3.client()

    # a ranged read asks for the version listed: another version's bytes are refused, naming the object
    url = s3.upload(plain_fsdp2_ckpt, "swap/pinned")
    rc = open_remote(url)
    first = rc.read_range(victim, 0, 64)
    c.upload_file(str(other_run / victim), s3.bucket, f"swap/pinned/{victim}")
    with pytest.raises(BadInput, match="changed since the checkpoint was listed") as caught:
        rc.read_range(victim, 0, 64)
    assert f"{url}/{victim}" in str(caught.value)
    assert first == (plain_fsdp2_ckpt / victim).read_bytes()[:64]

    # a conversion paused after its first write while the object is replaced: exit 2, nothing committed
    url = s3.upload(plain_fsdp2_ckpt, "swap/live")
    out = tmp_path / "out"
    events = tmp_path / "events"
    p = forked.start(["convert", url, out, "--to", "dp=2", "--quiet"],
                     env={**os.environ, "RESHARD_FAULT_COUNT": str(events), "RESHARD_FAULT_SLEEP_AT": "1:4"})
    deadline = time.time() + 120
    while not (events.is_file() and events.read_text().strip()) and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    c.upload_file(str(other_run / victim), s3.bucket, f"swap/live/{victim}")
    code = p.wait(timeout=180)
    _o, err = p.output()
    assert code == 2, err
    assert f"{url}/{victim}" in err and "changed since" in err, err
    assert not out.exists() and not list(tmp_path.glob("out.*"))  # nothing committed, nothing certified


def test_file_urls_are_refused_and_a_symlink_out_never_copied(plain_fsdp2_ckpt, tmp_path):
    private = tmp_path / "private.txt"
    private.write_text("someone else's secret notes")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(plain_fsdp2_ckpt, ckpt)
    (ckpt / "notes.txt").symlink_to(private)
    code, _o, err = cli(["inspect", ckpt])
    assert code == 2 and "notes.txt" in err  # the local path: contained, as before
    for argv in (["inspect", f"file://{ckpt}"], ["plan", f"file://{ckpt}", "--to", "dp=2"],
                 ["convert", f"file://{ckpt}", tmp_path / "out", "--to", "dp=2", "--quiet"],
                 ["export", f"file://{ckpt}", tmp_path / "exp", "--quiet"],
                 ["convert", ckpt, f"file://{tmp_path / 'out2'}", "--to", "dp=2", "--quiet"]):
        code, out, err = cli(argv)
        assert code == 2, (argv, out, err)
        assert "names this machine's own files" in err and f"Give the path itself ({ckpt}" in err or \
            "Give the path itself" in err, err
    for name in ("out", "exp", "out2"):
        assert not (tmp_path / name).exists()
    assert not any("someone else's" in p.read_text(errors="replace") for p in tmp_path.rglob("*")
                   if p.is_file() and p != private and not p.is_symlink())


def test_a_marker_nobody_here_wrote_deletes_nothing(s3, plain_fsdp2_ckpt, tmp_path, staging):
    import forked

    url = s3.upload(plain_fsdp2_ckpt, "marker/src")
    c = s3.client()
    mine = {"marker/dst/.reshard-uploading": b"not reshard's", "marker/dst/thesis.pdf": b"%PDF chapter 1",
            "marker/dst/data/results.csv": b"a,b\n1,2\n"}
    for k, v in mine.items():
        c.put_object(Bucket=s3.bucket, Key=k, Body=v)
    dst = s3.url("marker/dst")
    code, _o, err = cli(["convert", url, dst, "--to", "dp=2", "--quiet"])
    assert code == 2, err
    assert "no upload recorded on this machine" in err and "thesis.pdf" in err and "data/results.csv" in err, err
    for k, v in mine.items():
        assert c.get_object(Bucket=s3.bucket, Key=k)["Body"].read() == v, k

    # an upload of this machine's, killed after its first data object, resumes; an object added
    # beside it since is the user's and is refused by name, nothing deleted
    dst = s3.url("marker/killed")
    argv = ["convert", url, dst, "--to", "dp=2", "--quiet"]
    r = forked.run(argv, env={**os.environ, "RESHARD_FAULT_KILL_AT": "upload .reshard-uploading"})
    assert r.returncode == -9, r.stderr
    c.put_object(Bucket=s3.bucket, Key="marker/killed/README", Body=b"mine")
    code, _o, err = cli(argv)
    assert code == 2 and "README" in err, err
    assert c.get_object(Bucket=s3.bucket, Key="marker/killed/README")["Body"].read() == b"mine"
    c.delete_object(Bucket=s3.bucket, Key="marker/killed/README")
    code, _o, err = cli(argv)
    assert code == 0, err
    assert ".reshard-uploading" not in s3.keys("marker/killed") and ".metadata" in s3.keys("marker/killed")


@pytest.mark.parametrize("src_prefix, dst_url, how", [
    ("ov/a", "s3://{b}/ov/a", "is the source"),
    ("ov/b", "s3://{b}/ov/b/", "is the source"),
    ("ov/c", "s3://{b}/ov/c/sub", "lies inside the source"),
    ("ov/d", "s3a://{b}/ov/d/sub", "lies inside the source"),
    ("ov/e/ckpt", "s3://{b}/ov/e", "holds the source"),
], ids=["equal", "equal-slash", "inside", "inside-s3a", "above"])
def test_a_destination_at_above_or_inside_the_source_is_refused(s3, plain_fsdp2_ckpt, src_prefix, dst_url, how):
    url = s3.upload(plain_fsdp2_ckpt, src_prefix)
    before = _keys_and_etags(s3, src_prefix)
    dst = dst_url.format(b=s3.bucket)
    for argv in (["convert", url, dst, "--to", "dp=2", "--quiet", "--overwrite"], ["export", url, dst, "--quiet"]):
        code, _o, err = cli(argv)
        assert code == 2 and how in err, (argv, err)
    assert _keys_and_etags(s3, src_prefix) == before  # nothing deleted, nothing added


def test_a_sibling_whose_name_extends_the_source_is_not_an_overlap(s3, plain_fsdp2_ckpt):
    url = s3.upload(plain_fsdp2_ckpt, "sib/ckpt")
    code, _o, err = cli(["export", url, s3.url("sib/ckpt2"), "--quiet"])
    assert code == 0, err


def test_a_credential_in_any_position_is_refused_and_never_printed(s3, plain_fsdp2_ckpt, tmp_path):
    url = s3.upload(plain_fsdp2_ckpt, "cred")
    hostile = [f"s3:///{ACCESS_KEY}:{SECRET_KEY}@{s3.bucket}/cred", f"s3://{s3.bucket}/{ACCESS_KEY}:{SECRET_KEY}@cred",
               f"s3://{ACCESS_KEY}:{SECRET_KEY}@{s3.bucket}/cred"]
    for bad in hostile:
        for argv in (["inspect", bad], ["inspect", bad, "--json"], ["plan", bad, "--to", "dp=2", "--json"],
                     ["convert", url, bad, "--to", "dp=2", "--quiet", "--json"], ["export", url, bad, "--quiet"],
                     ["verify", url, bad]):
            code, out, err = cli(argv)
            assert code == 2, (argv, out, err)
            assert "credentials in the" in err and SECRET_KEY not in out + err and ACCESS_KEY not in out + err, argv
            if "--json" in argv:
                assert json.loads(out)["exit_code"] == 2
    # the last defence: a secret's value reaching a message by another path is redacted
    code, out, err = cli(["inspect", tmp_path / SECRET_KEY, "--json"])
    assert code == 2 and SECRET_KEY not in out + err and "<redacted>" in err, err


class _Silent:
    """A TCP server on localhost that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.held: list[socket.socket] = []
        self.stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
                self.held.append(conn)
            except OSError:
                continue

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        for c in self.held:
            c.close()
        self.sock.close()


def test_a_stalled_store_fails_within_the_bound_it_states(s3):
    import forked

    silent = _Silent()
    try:
        env = {**os.environ, "AWS_ENDPOINT_URL_S3": silent.endpoint, "RESHARD_STORE_CONNECT_TIMEOUT": "1",
               "RESHARD_STORE_READ_TIMEOUT": "1", "RESHARD_STORE_ATTEMPTS": "2"}
        t = time.monotonic()
        p = forked.start(["inspect", s3.url("anything")], env=env)
        try:
            code = p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
        took = time.monotonic() - t
        _o, err = p.output()
    finally:
        silent.close()
    assert code == 2, err  # old code: still waiting when killed at 60 s (code None)
    assert "did not answer in time (2 attempts of at most 1 s to connect and 1 s of silence each, 5 s in all)" in err, err
    assert silent.held, "the server was never asked"
    print(f"stalled store: exit 2 after {took:.1f} s (bound stated: 5 s, plus the process start)")


def test_a_huge_listing_is_bounded_and_opaque_files_cost_no_request(s3, plain_fsdp2_ckpt, tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from reshard.commands.inspect import inspect as run_inspect
    from reshard.planning.options import Given, build_options, opened_source
    from reshard.storage.objectstore import remote

    url = s3.upload(plain_fsdp2_ckpt, "many")
    c = s3.client()
    logs = {f"many/logs/events.{i:04d}": bytes([i % 251]) for i in range(300)}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: c.put_object(Bucket=s3.bucket, Key=kv[0], Body=kv[1]), logs.items()))
    c.put_object(Bucket=s3.bucket, Key="many/logs/", Body=b"")        # the S3 console's "create folder"
    c.put_object(Bucket=s3.bucket, Key="many/.metadata/", Body=b"")   # a zero-byte folder named .metadata

    monkeypatch.setattr(remote, "MAX_OBJECTS", 200, raising=False)  # the bound (10,000) met at a size a test can upload
    code, _o, err = cli(["inspect", url])
    assert code == 2 and "300 objects besides the data objects, more than the 200" in err, err
    monkeypatch.undo()

    with opened_source(url) as source:  # the command's own Source: its store handle counts what it fetched
        result = run_inspect(source, build_options(Given(), source.root))
        counters = source.remote.counters.to_dict()
    assert result.exit_code == 0, result.report
    report = json.loads(json.dumps(result.report))
    assert not any(k.startswith("logs/") for k in counters["by_file"]), counters["by_file"]  # not one request for a log
    listed = {s["name"]: s for s in report["sidecars"]}
    assert set(logs) - {f"many/{n}" for n in listed} == set()
    assert all(listed[k[len("many/"):]]["size"] == 1 for k in logs)
    assert report["complete"] and sorted(report["store"]["folder_markers"]) == [".metadata/", "logs/"]

    out = tmp_path / "out"
    code, _o, err = cli(["convert", url, out, "--to", "dp=2", "--quiet", "--json"])
    assert code == 0, err
    for k, v in logs.items():
        assert (out / k[len("many/"):]).read_bytes() == v, k
    assert not (out / ".metadata").is_dir()


def test_keys_no_local_file_can_hold_are_named_by_their_url(s3, plain_fsdp2_ckpt):
    c = s3.client()
    for prefix, extra in (("odd/both", {"odd/both/a": b"1", "odd/both/a/b": b"2"}),
                          ("odd/long", {"odd/long/" + "x" * 300: b"1"}),
                          ("odd/tab", {"odd/tab/notes\tmore.txt": b"1"})):  # moto takes no newline in a key; a tab is the same rule
        url = s3.upload(plain_fsdp2_ckpt, prefix)
        for k, v in extra.items():
            c.put_object(Bucket=s3.bucket, Key=k, Body=v)
        code, _o, err = cli(["inspect", url])
        assert code == 2 and url in err and "reshard-remote-" not in err, err
        assert {"both": "both an object and a folder", "long": "255 bytes",
                "tab": "'notes\\tmore.txt' holds a control character"}[prefix.split("/")[1]] in err, err
        assert err.count("\n") == 1  # one paragraph, the key's control character escaped
