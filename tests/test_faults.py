"""Faults during `reshard convert`: killed runs, full disks, concurrent runs, corrupt bytes.

Every conversion here runs as a real process (except where noted: a child forked from a
server that imported reshard and torch once, `tests/forked.py`, so a kill is a real SIGKILL of
a real process without a torch import per run) with ``SOURCE_DATE_EPOCH`` set, and every test asserts the source directory is
untouched (`snapshot`: sha256, mtime and size of every file). Fault injection uses the
test hooks documented in `reshard.engine.conversion` (``RESHARD_FAULT_KILL_AT`` / ``_SLEEP_AT`` /
``_COUNT``). `scripts/soak_faults.py` runs the kill loop at every event and random byte
mutations.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import forked
from conftest import mounted_tmpfs, run_cli
from reshard.storage.files.atomic import stale_temporaries

EPOCH = "1700000000"


# ---------------------------------------------------------------------------- helpers
def snapshot(d: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under ``d`` -> (sha256, mtime_ns, size)."""
    out = {}
    for p in sorted(Path(d).rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(d))] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime_ns, st.st_size)
    return out


def contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


def assert_identical(out: Path, reference: Path) -> None:
    a, b = contents(out), contents(reference)
    assert sorted(a) == sorted(b)
    different = [n for n in a if a[n] != b[n]]
    assert not different, f"files differ from the uninterrupted run: {different}"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_FAULT_")}
    env["SOURCE_DATE_EPOCH"] = EPOCH
    env.update(extra)
    return env


def _cmd(src: Path, dst: Path, to: str = "dp=2", *extra: str) -> list[str]:
    return ["convert", str(src), str(dst), "--to", to, *extra]


def start(src: Path, dst: Path, to: str = "dp=2", *extra: str, file_size_limit: int | None = None,
          **env: str) -> forked.ForkedCLI:
    return forked.start(_cmd(src, dst, to, *extra), env=_env(**env), file_size_limit=file_size_limit)


def run(src: Path, dst: Path, to: str = "dp=2", *extra: str, file_size_limit: int | None = None,
        **env: str) -> subprocess.CompletedProcess:
    return finish(start(src, dst, to, *extra, file_size_limit=file_size_limit, **env))


def finish(p: forked.ForkedCLI) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def lock_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.reshard-lock"


def assert_lock_free(dst: Path) -> None:
    """A lock file may be left by a killed run; nobody may hold it."""
    lp = lock_path(dst)
    if lp.exists():
        fd = os.open(lp, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if held
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def assert_clean(dst: Path) -> None:
    """What a finished or failed run leaves beside dst: no temporary directory, no lock file."""
    assert stale_temporaries(dst.parent, dst.name) == []
    assert not lock_path(dst).exists()


@pytest.fixture(scope="module")
def src(reference_ckpt, tmp_path_factory) -> Path:
    """A private copy of the reference checkpoint (4 ranks, 188 keys, ~1.3 MB)."""
    d = tmp_path_factory.mktemp("faults") / "src"
    shutil.copytree(reference_ckpt, d)
    return d


# ---------------------------------------------------------------------------- 1. killed runs
def _events(count_file: Path) -> list[str]:
    return [ln.split(" ", 1)[1] for ln in count_file.read_text().splitlines()]


def _kill_points(labels: list[str], at_least: int = 20) -> list[int]:
    """>= ``at_least`` distinct event numbers: every non-item event (metadata commit, manifest,
    reports, rename), the first two and the last item, and the rest spread evenly."""
    total = len(labels)
    special = {1, 2} | {i + 1 for i, lab in enumerate(labels) if not lab.startswith("item ")}
    special.add(max(i + 1 for i, lab in enumerate(labels) if lab.startswith("item ")))
    for n in range(2, total + 1):
        points = special | {1 + round(i * (total - 1) / (n - 1)) for i in range(n)}
        if len(points) >= at_least:
            return sorted(points)
    return list(range(1, total + 1))


def _check_after_kill(dst: Path, n: int, labels: list[str], reference: Path, capsys) -> None:
    total = len(labels)
    if n < total:  # killed before the rename: nothing committed at dst
        assert not dst.exists(), f"kill after event {n} ({labels[n - 1]}): {dst} exists"
        code, _, err = run_cli(["inspect", dst], capsys)
        assert code == 2, err
        temps = stale_temporaries(dst.parent, dst.name)
        assert len(temps) == 1, temps
        for t in temps:  # never a half checkpoint that loads: uncommitted, or complete
            if (t / ".metadata").exists():
                from reshard.storage.checkpoints.index import CheckpointIndex

                assert CheckpointIndex.open(t).complete, f"kill after event {n}: {t} is committed but incomplete"
            else:
                code, _, err = run_cli(["inspect", t], capsys)
                assert code == 2 and "not committed" in err
    else:  # killed right after the rename: the complete output is in place
        assert (dst / ".metadata").exists() and (dst / "manifest.json").exists()
        assert_identical(dst, reference)
    assert_lock_free(dst)


KILL_PARTS = 4  # the kill points, dealt out to this many tests (each well under a minute on a loaded machine)


@pytest.fixture(scope="module")
def uninterrupted(src, tmp_path_factory) -> dict:
    """An uninterrupted run's output and its write events, twice (one per lane), and the kill points."""
    root = tmp_path_factory.mktemp("faults_lanes")
    lanes = [root / f"lane{i}" for i in range(2)]  # two kills at a time, each lane its own dst
    for lane in lanes:
        lane.mkdir()
    procs = [start(src, lane / "dst", RESHARD_FAULT_COUNT=str(lane / "events")) for lane in lanes]
    for p in procs:
        r = finish(p)
        assert r.returncode == 0, r.stderr
    labels = _events(lanes[0] / "events")
    assert labels == _events(lanes[1] / "events")  # the event sequence is deterministic
    for lane in lanes:
        (lane / "dst").rename(lane / "reference")
    return {"lanes": lanes, "labels": labels, "points": _kill_points(labels)}


def test_the_kill_points_cover_every_kind_of_write_event(uninterrupted):
    """>= 20 distinct points: every event that is not an item (the .metadata commit, the manifest, both
    reports, the rename), the first two and the last item, the rest spread evenly."""
    labels, points = uninterrupted["labels"], uninterrupted["points"]
    assert labels[-5:] == ["metadata", "manifest", "report.json", "report.md", "rename"]
    assert all(lab.startswith("item ") for lab in labels[:-5])
    assert len(points) >= 20 and len(set(points)) == len(points)
    assert {1, 2, len(labels) - 5} | set(range(len(labels) - 4, len(labels) + 1)) <= set(points)


@pytest.mark.parametrize("part", range(KILL_PARTS), ids=lambda i: f"part{i + 1}of{KILL_PARTS}")
def test_killed_conversion_commits_nothing_and_rerun_is_byte_identical(src, uninterrupted, part, capsys):
    """SIGKILL after each of >= 20 distinct write events (a quarter of them here); each time dst is
    absent (or, after the final rename, complete), and the same command run again succeeds with the
    same bytes as an uninterrupted run (reports included: SOURCE_DATE_EPOCH nulls their timings)."""
    before = snapshot(src)
    lanes, labels = uninterrupted["lanes"], uninterrupted["labels"]
    pending = uninterrupted["points"][part::KILL_PARTS]
    assert pending
    while pending:
        batch = [(lane, pending.pop(0)) for lane in lanes if pending]
        kills = [(lane, n, start(src, lane / "dst", RESHARD_FAULT_KILL_AT=str(n))) for lane, n in batch]
        for lane, n, p in kills:
            r = finish(p)
            assert r.returncode == -signal.SIGKILL, f"event {n}: exit {r.returncode}: {r.stderr}"
            _check_after_kill(lane / "dst", n, labels, lane / "reference", capsys)
        reruns = []
        for lane, n, _ in kills:
            extra = ("--overwrite",) if n == len(labels) else ()
            if extra:  # the committed output is protected: the same command refuses it
                r = run(src, lane / "dst")
                assert r.returncode == 2 and "already exists" in r.stderr
            reruns.append((lane, n, start(src, lane / "dst", "dp=2", *extra)))
        for lane, n, p in reruns:
            r = finish(p)
            assert r.returncode == 0, f"rerun after a kill at event {n} ({labels[n - 1]}): {r.stderr}"
            assert_identical(lane / "dst", lane / "reference")
            assert_clean(lane / "dst")  # the stale temporary directory was removed, the lock released
            shutil.rmtree(lane / "dst")
        assert snapshot(src) == before


# ---------------------------------------------------------------------------- 2. disk full


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 300 KiB tmpfs (root only); skipped where mounting is not allowed."""
    with mounted_tmpfs(tmp_path / "mnt", "size=300k") as mnt:
        yield mnt


@pytest.mark.parametrize("how", ["rlimit_fsize", "tmpfs"])
def test_disk_full_stops_with_exit_2_naming_destination_and_bytes_nothing_committed(src, tmp_path, how, request):
    from reshard.engine.space import estimate_output_bytes, space_check
    from reshard.model.plan import Options
    from reshard.planning.plan import make_plan

    before = snapshot(src)
    plan = make_plan(src, Options(to="dp=2"))
    needed = estimate_output_bytes(plan)
    if how == "tmpfs":
        dst = request.getfixturevalue("small_tmpfs") / "out"
        check = space_check(plan, dst)  # what `reshard plan --dst` warns about in advance
        assert not check["enough"] and check["needed_bytes"] == needed and str(dst) in check["warning"]
        r = run(src, dst, "dp=2", "--force")  # past the refusal before the first byte (tests/test_preflight.py)
    else:
        dst = tmp_path / "out"
        r = run(src, dst, file_size_limit=200_000)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert err.startswith(f"error: {dst}: out of space") and "\n" not in err and "Traceback" not in err
    assert f"({needed} bytes)" in err and "Nothing was committed" in err
    assert ("No space left on device" if how == "tmpfs" else "File too large") in err
    assert not dst.exists()
    assert_clean(dst)
    assert snapshot(src) == before


def test_space_check_compares_estimate_with_free_space(src, tmp_path, capsys):
    """space_check(plan, dst): metadata only; the estimate is close to what convert writes."""
    from reshard.engine.space import space_check
    from reshard.model.plan import Options
    from reshard.planning.plan import make_plan

    plan = make_plan(src, Options(to="dp=2"))
    ok = space_check(plan, tmp_path / "not" / "yet" / "there")
    assert ok["enough"] and ok["warning"] is None and ok["checked"] == str(tmp_path)
    # twice the free space: other tests (the suite runs on every core) write and delete files on the
    # same file system between the two calls, so "just over" would not stay over
    tight = space_check(plan, tmp_path / "out", needed=2 * ok["free_bytes"] + 1)
    assert not tight["enough"] and "needs about" in tight["warning"] and str(tmp_path / "out") in tight["warning"]
    code, _, err = run_cli(["convert", src, tmp_path / "out", "--to", "dp=2"], capsys)
    assert code == 0, err
    written = sum(p.stat().st_size for p in (tmp_path / "out").iterdir())
    assert written <= ok["needed_bytes"] <= 1.25 * written, (written, ok["needed_bytes"])


# ---------------------------------------------------------------------------- 3. source never touched
AUDIT = r"""
import os, sys
src = os.path.realpath(sys.argv[1])
log = sys.argv[2]
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
MUTATING = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.utime",
            "os.truncate", "os.link", "os.symlink", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
reads = [0]

def under(p):
    if isinstance(p, int) or p is None:
        return False
    try:
        p = os.path.realpath(os.fsdecode(p))
    except (TypeError, ValueError):
        return False
    return p == src or p.startswith(src + os.sep)

def hook(event, args):
    bad = None
    if event == "open" and under(args[0]):
        mode, flags = args[1], args[2] or 0
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or flags & WRITE:
            bad = f"open {args[0]} mode={mode} flags={flags}"
        else:
            reads[0] += 1
    elif event in MUTATING and any(under(a) for a in args[:2] if not isinstance(a, int)):
        bad = f"{event} {args[:2]}"
    if bad:
        with open(log, "a") as f:
            f.write(bad + "\n")
        raise PermissionError("reshard tried to modify its source: " + bad)

sys.addaudithook(hook)
import atexit
atexit.register(lambda: open(log + ".reads", "w").write(str(reads[0])))
from reshard.cli import main
main(sys.argv[3:])
"""


def test_source_never_touched_read_only_and_no_write_opens(src, tmp_path, capsys):
    """A read-only source converts; an audit hook proves no source file is opened for
    writing, renamed, removed, chmod-ed or touched (root bypasses the permission bits)."""
    ro = tmp_path / "ro_src"
    shutil.copytree(src, ro)
    subprocess.run(["chmod", "-R", "a-w", str(ro)], check=True)
    before = snapshot(ro)
    log = tmp_path / "violations"
    try:
        r = subprocess.run([sys.executable, "-c", AUDIT, str(ro), str(log), "convert", str(ro), str(tmp_path / "out"),
                            "--to", "dp=2"], env=_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert not log.exists(), log.read_text()
        assert int(Path(str(log) + ".reads").read_text()) > 0  # the hook saw the source being read
        assert snapshot(ro) == before
        assert all(not (p.stat().st_mode & 0o222) for p in [ro, *ro.iterdir()])
        code, _, err = run_cli(["verify", ro, tmp_path / "out"], capsys)
        assert code == 0, err
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(ro)], check=True)


# ---------------------------------------------------------------------------- 4. concurrent runs
def test_concurrent_runs_into_same_destination_one_wins_other_exits_2(src, tmp_path):
    """Two converts into one dst at once (each pauses 5 s holding the lock after its first
    write): exactly one exits 0; the other exits 2 'another reshard run is writing'; dst is
    the winner's output, complete and verified."""
    before = snapshot(src)
    dst = tmp_path / "out"
    procs = {to: start(src, dst, to, RESHARD_FAULT_SLEEP_AT="1:5") for to in ("dp=2", "dp=1")}
    results = {to: finish(p) for to, p in procs.items()}
    codes = sorted(r.returncode for r in results.values())
    assert codes == [0, 2], {to: (r.returncode, r.stderr) for to, r in results.items()}
    winner = next(to for to, r in results.items() if r.returncode == 0)
    loser = next(to for to, r in results.items() if r.returncode == 2)
    assert "another reshard run is writing" in results[loser].stderr
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["topology"]["dims"]["dp_shard"] == int(winner.split("=")[1])
    assert_clean(dst)
    r = forked.run(["verify", src, dst], env=_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert snapshot(src) == before


# ---------------------------------------------------------------------------- 5. integrity
def _flip_payload_byte(root: Path, key: str, chunk_index: int = -1) -> tuple[str, int]:
    """Flip one bit in the middle of a tensor chunk's payload (the torch.save zip still loads)."""
    from reshard.storage.checkpoints.index import CheckpointIndex
    from reshard.storage.checkpoints import dcp

    ix = CheckpointIndex.open(root)
    c = ix.entries[key].chunks[chunk_index]
    blob = dcp.read_item_bytes(root, c.location, key=key)
    payload = ix.read_box(key, c.box).contiguous().numpy().tobytes()
    i = blob.find(payload)
    assert i > 0 and blob.find(payload, i + 1) < 0
    pos = c.location.offset + i + len(payload) // 2
    with open(root / c.location.file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    return c.location.file, c.location.offset


def test_flipped_payload_byte_is_named_by_inspect_deep_and_verify(src, tmp_path, capsys):
    """convert records a CRC-32 per item; a flipped payload byte (which loads fine and is
    invisible to `inspect --deep` without checksums) makes `inspect --deep` exit 2 and
    `verify` exit 2 (corrupt input), both naming the first corrupt item's key and file."""
    import zlib

    from reshard.storage.checkpoints.index import CheckpointIndex
    from reshard.storage.checkpoints import dcp

    before = snapshot(src)
    out = tmp_path / "out"
    code, _, err = run_cli(["convert", src, out, "--to", "dp=2"], capsys)
    assert code == 0, err
    assert snapshot(src) == before
    manifest = json.loads((out / "manifest.json").read_text())
    integ = manifest["integrity"]
    ix = CheckpointIndex.open(out)
    assert integ["algorithm"] == "crc32" and len(integ["items"]) == ix.item_count()
    for e in ix.entries.values():
        for loc in ([c.location for c in e.chunks] if e.is_tensor else [e.location]):
            raw = dcp.read_item_bytes(out, loc, key=e.key)
            assert integ["items"][f"{loc.file}:{loc.offset}"] == format(zlib.crc32(raw), "08x")

    # two corrupt items; the first in (file, offset) order is the one named
    big = sorted((e for e in ix.tensors() if e.nbytes >= 4096), key=lambda e: e.key)
    k1, k2 = big[0].key, big[-1].key
    f1 = _flip_payload_byte(out, k1)
    f2 = _flip_payload_byte(out, k2)
    first_key, first_file = (k1, f1[0]) if f1 < f2 else (k2, f2[0])

    blind = tmp_path / "no_checksums"  # without the manifest's checksums: the items' own zip CRC-32s still tell
    shutil.copytree(out, blind)
    m = json.loads((blind / "manifest.json").read_text())
    del m["integrity"]
    (blind / "manifest.json").write_text(json.dumps(m))
    code, text, err = run_cli(["inspect", "--deep", "--json", blind], capsys)
    assert code == 2, err
    crc = [p for p in json.loads(text)["problems"] if p["code"] == "crc_mismatch"]
    assert sorted(k for p in crc for k in p["keys"]) == sorted({k1, k2})

    code, text, _ = run_cli(["inspect", "--deep", "--json", out], capsys)
    assert code == 2
    rep = json.loads(text)
    p = rep["problems"][0]
    assert p["code"] == "checksum_mismatch" and p["file"] == first_file and p["keys"][0] == first_key
    assert sorted(p["keys"]) == sorted({k1, k2})
    assert f"item '{first_key}' ({first_file}" in p["message"] and "1 more item" in p["message"]
    code, text, _ = run_cli(["inspect", "--deep", out], capsys)
    assert code == 2 and first_key in text and first_file in text

    code, _, err = run_cli(["verify", src, out], capsys)
    assert code == 2
    # named by the manifest's record, or by the item's own zip CRC-32 record (read while comparing)
    named = [(k, f) for k, f in ((k1, f1[0]), (k2, f2[0])) if f"item '{k}' ({f}" in err or f"item '{k}' in {f} fails" in err]
    assert named and str(out / named[0][1]) in err, err
    assert snapshot(src) == before


def test_manifest_integrity_field_is_optional_and_validated(tmp_path):
    from reshard.semantics import manifest as mf
    from reshard.errors import BadInput
    from test_manifest import sample_manifest

    m = sample_manifest()
    assert m.integrity is None and "integrity" not in m.to_dict()  # older manifests: unchanged and valid
    m.integrity = {"algorithm": "sha256", "items": {"__0_0.distcp:0": "ab" * 32}}
    d = m.to_dict()
    assert list(d)[-1] == "integrity" and mf.Manifest.from_dict(d) == m
    for bad, field in [({"algorithm": "md5", "items": {}}, "integrity.algorithm"),
                       ({"algorithm": "sha256", "items": {"__0_0.distcp:0": "xyz"}}, "integrity.items"),
                       ({"algorithm": "sha256", "items": {"nooffset": "ab" * 32}}, "integrity.items"),
                       ({"algorithm": "sha256"}, "integrity.items")]:
        d["integrity"] = bad
        (tmp_path / "manifest.json").write_text(json.dumps(d))
        with pytest.raises(BadInput) as exc:
            mf.read_manifest(tmp_path)
        assert f"'{field}" in str(exc.value)


def test_writer_surfaces_file_system_errors_with_their_errno(tmp_path):
    """An EFBIG inside torch.save reaches the caller as that OSError (torch would wrap it in a
    RuntimeError), so convert can tell 'out of space' from a bug."""
    code = (
        "import errno, resource, signal, sys, torch\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100000, 100000))\n"
        "from reshard.storage.checkpoints.dcp_writer import DcpWriter\n"
        "w = DcpWriter(sys.argv[1]); w.declare_tensor('a', (100000,), torch.float32)\n"
        "try:\n"
        "    w.write_chunk(0, 'a', (0,), torch.zeros(100000))\n"
        "except OSError as e:\n"
        "    print(errno.errorcode[e.errno])\n"
        "w.close()\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "EFBIG", r.stderr


def test_plan_warns_in_advance_when_the_destination_lacks_space(src, small_tmpfs, capsys):
    """`reshard plan --dst` compares the estimated output with the free space before anything is written."""
    import json as _json

    from conftest import run_cli

    code, out, err = run_cli(["plan", src, "--to", "dp=2", "--dst", small_tmpfs / "out", "--json"], capsys)
    assert code == 0
    space = _json.loads(out)["space"]
    assert space["enough"] is False and space["needed_bytes"] > space["free_bytes"]
    assert err.startswith("warning:") and str(small_tmpfs / "out") in err
    code, out, err = run_cli(["plan", src, "--to", "dp=2", "--dst", small_tmpfs.parent / "roomy"], capsys)
    assert code == 0 and "warning" not in err
