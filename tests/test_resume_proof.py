"""A resumed conversion keeps only what it proves against the source as it is now (issue 32, "Trust III").

Each test kills a real ``reshard convert`` process with SIGKILL at a write event (the fault hook
of `reshard.engine.conversion`, through `tests/forked.py` as `tests/test_resume.py` does), then
attacks what the rerun would build on, and reruns the same command:

1. the source is replaced by another real checkpoint with the same file sizes and mtimes (the
   data files of a second run of the reference trainer, another seed, copied over, then
   ``os.utime`` back to the old times, as ``cp -p``/``touch -r``/``rsync -t`` do): the resume
   key matches, so the rerun resumes, but keeps only the items it proves equal to what it would
   write from this source, rewrites the rest, and ends byte-identical to an uninterrupted run of
   the swapped source; ``verify SRC OUT`` then exits 0;
2. a byte of a kept item is changed in the temporary directory and its journal line given the
   new CRC-32: the journal is no evidence, the item is rewritten;
3. a symlink (or a hard link) planted in the journal directory (the data file's ``.jsonl``, or
   ``key.json``) to a file outside: never followed, the rerun starts over saying why, the file
   is unchanged;
4. a journal line (and a key file) nested 10^5 deep: an unreadable line (the item is rewritten),
   an unreadable key (start over), exit 0, never a RecursionError.

Every rerun: its exit code, its JSON ``resume`` counts, byte identity with an uninterrupted run
(``SOURCE_DATE_EPOCH``: reports included), nothing left beside the output, the source unchanged,
and its wall time bounded.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
import zlib
from pathlib import Path

import pytest

from conftest import cli
from reshard.storage.files.atomic import journal_dir
from test_resume import assert_clean, assert_identical, run, snapshot, the_temporary

RERUN_SECONDS = 60  # a rerun of this ~1.3 MB conversion takes a few seconds; a hang or a retry loop would not
KILL_AT = 40        # write events (items) before the SIGKILL: about half of the reference's items at dp=2


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("proof")


@pytest.fixture(scope="module")
def src(reference_ckpt, work) -> Path:
    """A private copy of the reference checkpoint (4 FSDP2 ranks, seed 0)."""
    d = work / "src"
    shutil.copytree(reference_ckpt, d)
    return d


@pytest.fixture(scope="module")
def other(work) -> Path:
    """A second real checkpoint of the same shape: the reference trainer with the reference's
    configuration but seed 1 (same file sizes, other values)."""
    from reshard.reference import TrainConfig, run_reference

    out = work / "other"
    cfg = TrainConfig(dp=4, tp=1, steps=3, save_at=[3], out=str(out), log=str(out / "steps.jsonl"),
                      experiment_id="test-ref", seed=1)
    return Path(run_reference(cfg)[-1])


@pytest.fixture(scope="module")
def reference(src, work) -> Path:
    """An uninterrupted run's output from ``src``, made at the destination every test converts into
    (`dst`: the reports name it), then moved aside."""
    r = run(src, work / "dst")
    assert r.returncode == 0, r.stderr
    (work / "dst").rename(work / "reference")
    return work / "reference"


@pytest.fixture
def dst(work):
    """The destination of every conversion of this module (one at a time), emptied after each test."""
    yield work / "dst"
    shutil.rmtree(work / "dst", ignore_errors=True)


def killed(src: Path, dst: Path, at: int = KILL_AT) -> Path:
    """A conversion into ``dst`` SIGKILLed after write event ``at``; returns its temporary directory."""
    r = run(src, dst, RESHARD_FAULT_KILL_AT=str(at))
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not dst.exists()
    return the_temporary(dst)


def journaled(tmp: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in journal_dir(tmp).glob("*.jsonl"))


def rerun(src: Path, dst: Path) -> tuple[int, dict, str]:
    """The same command again: (exit code, its JSON report, stderr), within `RERUN_SECONDS`."""
    t0 = time.monotonic()
    r = run(src, dst)
    took = time.monotonic() - t0
    assert took < RERUN_SECONDS, f"the rerun took {took:.1f} s"
    assert "Traceback" not in r.stderr and "unexpected" not in r.stderr, r.stderr
    return r.returncode, (json.loads(r.stdout) if r.returncode == 0 else {}), r.stderr


def verify(a: Path, b: Path) -> int:
    code, out, err = cli(["verify", a, b])
    return code


# ---------------------------------------------------------------------------- 1. another source, same sizes and mtimes
def test_a_source_swapped_under_the_same_sizes_and_mtimes_is_not_certified(src, other, work, dst):
    """The data files of another real run copied over the source with their old mtimes put back:
    the rerun resumes (the key cannot tell), keeps only the journaled items it proves equal to this
    source's bytes, rewrites the others, and ends byte-identical to an uninterrupted run of the
    swapped source; `verify SRC OUT` exits 0 against the source as it is now."""
    s = work / "swapped"
    shutil.copytree(src, s)
    tmp = killed(s, dst)
    n = journaled(tmp)
    assert n == KILL_AT
    for f in sorted(s.glob("__*_0.distcp")):
        st = f.stat()
        assert (other / f.name).stat().st_size == st.st_size  # same sizes: the resume key cannot see the change
        shutil.copyfile(other / f.name, f)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (other / "__0_0.distcp").read_bytes() == (s / "__0_0.distcp").read_bytes()
    before = snapshot(s)

    code, report, err = rerun(s, dst)
    assert code == 0, err
    assert verify(s, dst) == 0  # what was committed is this source's conversion
    res = report["resume"]
    assert res["resumed"] and "starting over" not in err
    assert res["items_not_matching_source"] > 0 and res["items_damaged"] == 0
    assert res["items_kept"] + res["items_not_matching_source"] == n  # every journaled item proven or rewritten
    assert f"{res['items_not_matching_source']:,} journaled items no longer matched the source and were rewritten" in err
    assert "each compared with the source in this run" in err
    assert_clean(dst)
    assert snapshot(s) == before

    dst.rename(work / "swap-resumed")
    fresh = run(s, dst)  # what an uninterrupted run makes of the swapped source (the reports name dst)
    assert fresh.returncode == 0, fresh.stderr
    assert_identical(work / "swap-resumed", dst)


# ---------------------------------------------------------------------------- 2. a journal line vouching for changed bytes
def test_a_changed_item_with_a_forged_journal_crc_is_rewritten(src, reference, dst):
    """A byte of a journaled item flipped in the temporary directory, and the journal line given the
    item's new CRC-32: the rerun reads the item, finds it is not what it writes from the source,
    rewrites it (counted as not matching the source), keeps the rest, and matches the uninterrupted run."""
    tmp = killed(src, dst)
    jpath = journal_dir(tmp) / "__0_0.distcp.jsonl"
    lines = jpath.read_text().splitlines()
    first = json.loads(lines[0])
    data = bytearray((tmp / "__0_0.distcp").read_bytes())
    at = first["o"] + first["n"] // 2
    data[at] ^= 0xFF
    (tmp / "__0_0.distcp").write_bytes(data)
    first["c"] = format(zlib.crc32(data[first["o"]:first["o"] + first["n"]]) & 0xFFFFFFFF, "08x")
    jpath.write_text("\n".join([json.dumps(first, separators=(",", ":"))] + lines[1:]) + "\n")
    before = snapshot(src)

    code, report, err = rerun(src, dst)
    assert code == 0, err
    res = report["resume"]
    assert res["resumed"] and res["items_not_matching_source"] == 1 and res["items_damaged"] == 0
    assert res["items_kept"] == KILL_AT - 1
    assert_identical(dst, reference)
    assert_clean(dst)
    assert snapshot(src) == before
    assert verify(src, dst) == 0


# ---------------------------------------------------------------------------- 3. a symlink in the journal directory
@pytest.mark.parametrize("planted, how", [("__0_0.distcp.jsonl", "symlink"), ("key.json", "symlink"),
                                         ("__0_0.distcp.jsonl", "hard link")])
def test_a_link_planted_in_the_journal_is_never_followed(src, reference, work, dst, planted, how):
    """The data file's journal (or the key) replaced by a symlink, or a hard link, to a file outside:
    the rerun does not read or write through it (the outside file keeps its bytes and mtime), starts
    over saying why, and matches the uninterrupted run."""
    tmp = killed(src, dst)
    victim = work / f"victim-{planted}-{how.replace(' ', '')}"
    victim.write_bytes((journal_dir(tmp) / planted).read_bytes())  # a plausible journal: following it would resume
    os.utime(victim, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    (journal_dir(tmp) / planted).unlink()
    if how == "symlink":
        (journal_dir(tmp) / planted).symlink_to(victim)
        why = f"the interrupted run's journal holds a symlink ({planted}), which is never followed"
    else:
        os.link(victim, journal_dir(tmp) / planted)
        why = f"the interrupted run's journal holds {planted}, which is not a regular file of its own (a hard link?)"
    victim_before = (victim.read_bytes(), victim.stat().st_mtime_ns)

    code, report, err = rerun(src, dst)
    assert code == 0, err
    assert f"starting over: {why}; its partial output is discarded" in err
    assert not report["resume"]["resumed"] and report["resume"]["items_kept"] == 0
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == victim_before
    assert_identical(dst, reference)
    assert_clean(dst)


def test_a_symlink_planted_after_the_decision_is_replaced_not_written_through(tmp_path):
    """The same journal opened by the writer (`Journal.open_file`) after the decision to resume, with a
    symlink planted in between: it is read as no journal (nothing outside is read) and replaced by
    a regular file; the file outside keeps its bytes."""
    from reshard.storage.files.journal import Journal, ResumeKey

    tmp = tmp_path / ".out.reshard-tmp-0123456789ab"
    tmp.mkdir()
    journal_dir(tmp).mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"x" * 64)
    victim = tmp_path / "victim"
    victim.write_text('{"o":0,"n":64,"c":"00000000"}\n')
    (journal_dir(tmp) / "__0_0.distcp.jsonl").symlink_to(victim)
    j = Journal(ResumeKey("p", {}, {}))
    j.resumed, j.directory = True, tmp
    assert j.open_file("__0_0.distcp")  # the data file is reused, but no item is a candidate
    assert j.claim("__0_0.distcp", 0, 64) is None
    j.record("__0_0.distcp", 0, 64, "0000abcd")
    j.close()
    assert victim.read_text() == '{"o":0,"n":64,"c":"00000000"}\n'
    assert not (journal_dir(tmp) / "__0_0.distcp.jsonl").is_symlink()


# ---------------------------------------------------------------------------- 4. deep nesting
def test_deeply_nested_journal_lines_and_key_are_unreadable_not_a_crash(src, reference, dst):
    """A journal line nested 10^5 deep (longer than any line the writer makes) and one nested 20,000
    deep (short enough to reach the parser, which gives up on it): both items are rewritten, the
    rest kept. Then a key file nested 10^5 deep: the journal is unreadable, the rerun starts over.
    Exit 0 both times, no RecursionError, byte-identical to the uninterrupted run."""
    tmp = killed(src, dst)
    jpath = journal_dir(tmp) / "__0_0.distcp.jsonl"
    lines = jpath.read_text().splitlines()
    deep = []
    for ln, depth in zip(lines[:2], (100_000, 20_000)):
        d = json.loads(ln)
        deep.append(f'{{"o":{d["o"]},"n":{d["n"]},"c":"{d["c"]}","v":' + "[" * depth + "]" * depth + "}")
    jpath.write_text("\n".join(deep + lines[2:]) + "\n")

    code, report, err = rerun(src, dst)
    assert code == 0, err
    res = report["resume"]
    assert res["resumed"] and res["items_kept"] == KILL_AT - 2 and res["items_damaged"] == 0
    assert_identical(dst, reference)
    shutil.rmtree(dst)

    tmp = killed(src, dst)
    (journal_dir(tmp) / "key.json").write_text("[" * 100_000 + "]" * 100_000)
    code, report, err = rerun(src, dst)
    assert code == 0, err
    assert "starting over: the interrupted run's journal is unreadable; its partial output is discarded" in err
    assert not report["resume"]["resumed"]
    assert_identical(dst, reference)
    assert_clean(dst)
