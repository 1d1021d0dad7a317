"""Distributed conversion: several processes (one or many machines) write one checkpoint.

Run as ``torchrun --nnodes N --nproc-per-node M -m reshard convert SRC DST --to ...`` (or
``reshard convert ... --workers M``, which starts exactly that on this machine). Every
worker derives the same plan from the same source and reserves every item of the output in
the same order (`reshard.storage.checkpoints.dcp_writer.DcpWriter.reserve_chunk`), so all of them agree on
the layout of every data file without exchanging it. The target data files are divided
among the workers (file of target rank ``r`` -> worker ``r mod W``); each worker writes
only its files, and only it reads the source bytes they need.

Protocol (collectives over the default ``torch.distributed`` group; gloo is enough, no
tensor crosses the network, only short Python objects). Each worker runs
`reshard.engine.pipeline.run_conversion` with a `DistributedOutput`, so the steps and their order
are a single process's; every step taken together goes through one `Collective` (run on each
worker or on worker 0 alone, every outcome gathered, the first failure raised on every worker):

1. worker 0 checks the destination's space and takes the destination's lock, creating the
   hidden temporary directory beside ``dst`` (`reshard.storage.files.atomic.atomic_directory`), and
   broadcasts its path (the directory must be on a file system every worker sees, as DCP
   itself requires); worker 0 checks the tied copies;
2. each worker writes and fsyncs its files, then reports ``(checksums, split)`` or its
   error, where ``split`` lists the source storages it read only in part, each with the
   CRC-32s of its pieces (`reshard.engine.copy.PieceLedger`);
3. if any worker failed, every worker raises that error and worker 0 deletes the temporary
   directory: nothing is committed. Otherwise worker 0 checks every split source storage
   once against its writer's record (`check_split_storages`: the workers' pieces combined,
   what no piece covered read once; a contradiction is the `CorruptItem` a single process
   raises, and nothing is committed), then writes ``.metadata``, carries the sidecars and
   writes ``manifest.json`` (inside the still-hidden directory);
4. each worker verifies its own files against the source in global terms
   (`reshard.verification.checkpoints.verify_checkpoints` restricted to its files) and reports the result;
5. only when every part verified does worker 0 write the reports and rename the
   directory into place. The commit is that rename: before it, nothing at
   ``dst`` looks like a checkpoint.

A destination in object storage has no shared directory: `reshard.engine.streaming.StreamedStoreOutput`
runs the same steps with each worker streaming its own files into the store.

A worker killed outright makes the others fail in their next collective (its connection
closes) and torchrun stops the group; each worker notes in torchrun's rendezvous store the
collectives it reached, so the others name the lost one (rank, node, host, pid: `Collective`); what is left is the hidden temporary directory,
which the next run into ``dst`` removes. The output is byte-identical to a single-process
conversion: the same reservations give the same offsets, and the same bytes are written
at them (``tests/test_distributed.py``).

Errors: one contract however the command runs
---------------------------------------------
The worker where an error arises raises it unchanged, so the CLI renders it exactly as a
single process would (`reshard.errors.render_error`: same exit code, same paragraph); the
other workers raise `WorkerFailed`, which carries that worker's code and paragraph. Under
``--workers`` (`launch_workers`) torchrun runs inside the command itself: each worker writes
its error (exit code, paragraph, whether it was relayed) to a file in a private temporary
directory named by ``RESHARD_WORKER_ERRORS`` and prints nothing (a relay first waits for its
cause's file: torchrun stops the others as soon as one worker exits); the command then raises
the first worker's own error (earliest, then lowest rank), or says which worker was killed
by which signal, and exits with its code. torchrun's traceback and its log lines are
shown with ``--debug`` only. Started by ``torchrun`` directly, each worker prints its own
error once (relayed copies stay silent) and also writes it to torchrun's error file
(``TORCHELASTIC_ERROR_FILE``), so torchrun's summary names the cause; torchrun itself then
exits 1 with its own summary, which reshard cannot change.

``--trust-pickle``: one warning line per command
------------------------------------------------
Every worker loads the object items (plan, copy, verification), so each would name them.
Instead each hands the items it unpickled to the one process that warns (`pass_on_trusted`):
under ``--workers`` it leaves them in ``trusted-<rank>.json`` beside the errors and the
command prints one line naming every key once; under a plain ``torchrun`` worker 0 gathers
every worker's items (one collective at exit) and prints the line, the others print none.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import json
import logging
import os
import signal
import sys
import tempfile
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from reshard.errors import BadInput, ReshardError, render_error
from reshard.engine.pipeline import Output, Run

if TYPE_CHECKING:
    from reshard.storage.source import Source

__all__ = ["ERRORS_ENV", "LAUNCHER_ENV", "Collective", "DistributedOutput", "WorkerFailed", "bind_to_launcher", "launcher_alive", "in_torchrun", "check_split_storages", "convert_distributed", "launch_workers",
           "pass_on_trusted", "report_worker_error"]

ERRORS_ENV = "RESHARD_WORKER_ERRORS"  # private directory where the workers of `launch_workers` leave their errors
LAUNCHER_ENV = "RESHARD_LAUNCHER_PID"  # the `convert --workers` process whose workers these are: they die with it
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def bind_to_launcher() -> None:
    """A worker started by `launch_workers` dies with the command that started it.

    torchrun starts each worker in a session of its own, so killing the command's process
    group (a timeout, an OOM kill, a scheduler's kill, Ctrl-\\) does not reach the workers:
    they would hold the lock and commit long after the command died. ``PR_SET_PDEATHSIG``
    SIGKILLs the worker when its parent (the command, which hosts torchrun's launcher) dies;
    a parent that died before the call is caught by `launcher_alive`. Outside `launch_workers`
    (a torchrun the user started) nothing changes.
    """
    if not os.environ.get(LAUNCHER_ENV):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the commit's `launcher_alive` check still holds
        pass
    if not launcher_alive():
        os.kill(os.getpid(), signal.SIGKILL)


def launcher_alive() -> bool:
    """Whether the command that started this worker still runs (True outside `launch_workers`)."""
    pid = os.environ.get(LAUNCHER_ENV)
    return not pid or os.getppid() == int(pid)


def in_torchrun() -> bool:
    """Whether this process is one of several started by torchrun (``WORLD_SIZE`` > 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        return False


def _init() -> tuple[Any, int, int]:
    import torch.distributed as dist

    if not dist.is_initialized():
        # Long timeout: between two collectives a worker may copy for hours. A dead peer
        # still fails the collective at once (its connection closes).
        dist.init_process_group("gloo", timeout=_dt.timedelta(hours=int(os.environ.get("RESHARD_DIST_TIMEOUT_H", "24"))))
    return dist, dist.get_rank(), dist.get_world_size()


def _same(exc: BaseException) -> BaseException:
    return exc


class WorkerFailed(ReshardError):
    """Another worker's error (or the loss of a worker), raised where the error did not arise.

    It renders as exactly the paragraph the failing worker printed and leaves with its exit
    code, so a distributed run reads like a single process. ``worker`` is the index of the
    worker whose error this is (None when a worker vanished without saying why).
    """

    def __init__(self, paragraph: str, *, exit_code: int, worker: int | None = None):
        self.paragraph, self.exit_code, self.worker = paragraph, exit_code, worker
        super().__init__(paragraph)

    def render(self) -> str:
        return self.paragraph


class Collective:
    """The protocol of every step a distributed conversion takes together, written once (modelled on
    DCP's ``_DistWrapper``): a function run on each worker (`run`) or on worker 0 alone
    (`from_lead`), every worker told every outcome, and the first failure raised on all of them.

    The worker where an error arose raises it unchanged (a single process's paragraph and exit
    code); every other worker raises `WorkerFailed` carrying that worker's paragraph and code. A
    collective that fails because a peer died (its connection closed) becomes one paragraph, not
    a gloo trace. Only short Python objects cross the network.
    """

    def __init__(self, dist: Any, rank: int, world: int):
        self.dist, self.rank, self.world = dist, rank, world
        self.calls = 0                                  # collectives entered so far (the same count on every worker)
        self.store: Any = _arrivals_store()              # where each worker says it reached a collective (None: nowhere)
        self.roster: list[dict[str, Any]] = []          # each worker's host, pid and node, by rank (`introduce`)

    @classmethod
    def joined(cls) -> Collective:
        """This worker in the default process group (started here when it is not yet)."""
        dist, rank, world = _init()
        made = cls(dist, rank, world)
        made.introduce()
        return made

    @property
    def lead(self) -> bool:
        """Worker 0: it holds the lock, writes what exists once, reports and commits."""
        return self.rank == 0

    def run(self, stage: str, fn: Callable[[], Any], *, own: Callable[[BaseException], BaseException] = _same) -> list[Any]:
        """``fn()`` on every worker; every worker's result, by rank. ``own`` words this worker's error
        as a single process would (a full disk names the destination)."""
        failure: BaseException | None = None
        try:
            status: dict[str, Any] = {"ok": True, "value": fn()}
        except Exception as exc:  # reported to every worker, then raised everywhere
            failure = own(exc)
            status = _error_status(failure)
        statuses = self.gather(status, stage)
        _raise_first(statuses, failure)
        return [s["value"] for s in statuses]

    def from_lead(self, stage: str, fn: Callable[[], Any], *,
                  own: Callable[[BaseException], BaseException] = _same) -> Any:
        """``fn()`` on worker 0 alone; its result on every worker (or its error, raised on every worker)."""
        failure: BaseException | None = None
        msg: list[Any] = [None]
        if self.lead:
            try:
                msg = [{"ok": True, "value": fn()}]
            except Exception as exc:
                failure = own(exc)
                msg = [_error_status(failure)]
        self._call(stage, self.dist.broadcast_object_list, msg, 0)
        _raise_first(msg, failure)
        return msg[0]["value"]

    def gather(self, obj: Any, stage: str) -> list[Any]:
        """Every worker's ``obj``, by rank."""
        out: list[Any] = [None] * self.world
        self._call(stage, self.dist.all_gather_object, out, obj)
        return out

    def introduce(self) -> None:
        """Every worker's host, pid and node learnt by all (one collective), so a lost one can be named."""
        import socket

        me = {"host": socket.gethostname(), "pid": os.getpid(), "node": os.environ.get("GROUP_RANK", "0")}
        self.roster = self.gather(me, "starting")

    def _call(self, stage: str, fn: Any, *args: Any) -> None:
        self.calls += 1
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"reshard/arrived/{self.calls}/{self.rank}", "1")
        try:
            fn(*args)
        except RuntimeError as exc:  # gloo's DistBackendError and friends
            detail = _gloo_detail(exc)
            raise WorkerFailed(BadInput(
                f"{self._lost()} stopped while {stage} (its connection closed: {detail})",
                hint="Nothing was committed; the same command run again resumes from what this one left beside the "
                     "destination (--restart discards it).",
            ).render(), exit_code=2) from None

    def _lost(self) -> str:
        """The workers that never reached the collective that failed, by rank, host, node and pid, as far
        as the rendezvous store tells (it may have gone with them): "worker 1 (node 1, host h, pid 42)"."""
        lost: list[int] = []
        if self.store is not None:
            for r in range(self.world):
                try:
                    if r != self.rank and not self.store.check([f"reshard/arrived/{self.calls}/{r}"]):
                        lost.append(r)
                except Exception:  # noqa: BLE001 - the store went with the lost node
                    lost = []
                    break
        if not lost:
            return f"one of the {self.world} workers"

        def who(r: int) -> str:  # "1 (node 1, host h, pid 42)"
            info = self.roster[r] if r < len(self.roster) else {}
            said = ", ".join(f"{k} {info[k]}" for k in ("node", "host", "pid") if k in info)
            return f"{r}" + (f" ({said})" if said else "")

        return ("worker " if len(lost) == 1 else "workers ") + ", ".join(who(r) for r in lost) + f" of {self.world}"


def _gloo_detail(exc: BaseException) -> str:
    """gloo's message without its source path and advice: "Connection closed by peer [127.0.0.1]:34709"."""
    import re

    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    first = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", first)
    return first.split(". ", 1)[0].rstrip(".")


def _arrivals_store() -> Any:
    """A client of torchrun's rendezvous store (``MASTER_ADDR``/``MASTER_PORT``), where each worker
    notes the collectives it reached; None outside torchrun or where it cannot be reached."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or not in_torchrun():
        return None
    try:
        from torch.distributed import TCPStore

        return TCPStore(addr, int(port), is_master=False, timeout=_dt.timedelta(seconds=30),
                        wait_for_workers=False)
    except Exception:  # noqa: BLE001 - naming a lost worker is a courtesy: without the store it says "one of"
        return None


def _peer_lost(exc: BaseException) -> bool:
    """A worker vanished (killed, its connection closed): the run is kept for the next one to resume,
    as a single process's temporary directory is after a SIGKILL."""
    return isinstance(exc, WorkerFailed) and exc.worker is None


def _error_status(exc: BaseException) -> dict[str, Any]:
    code, paragraph = render_error(exc)
    return {"ok": False, "error": paragraph, "exit_code": code}


def _raise_first(statuses: list[dict[str, Any]], own: BaseException | None = None) -> None:
    """This worker's own error unchanged; else the first failing worker's, as `WorkerFailed`."""
    if own is not None:
        raise own
    for worker, s in enumerate(statuses):
        if not s.get("ok"):
            raise WorkerFailed(s["error"], exit_code=int(s.get("exit_code", 2)), worker=worker)


def convert_distributed(plan: Any, source: Source, dst: Path, *, overwrite: bool = False, progress: Any = None,
                        io: Any = None, restart: bool = False, force: bool = False) -> dict[str, Any] | None:
    """This worker's part of a distributed conversion; the report on worker 0, None elsewhere.

    Resumable as a single process is (`reshard.storage.files.journal`): worker 0 decides, holding the
    lock, whether to continue an interrupted run's temporary directory (``restart``: never) and
    tells every worker with the directory's path; each worker keeps or writes its own files."""
    from reshard.engine.copy import IOOptions
    from reshard.engine.pipeline import run_conversion

    output = DistributedOutput(Path(dst), overwrite=overwrite, force=force, progress=progress, io=io or IOOptions(),
                               restart=restart)
    return run_conversion(plan, source, output)


LEAD_STEPS = {"preflight": "checking the destination's space", "tied copies": "checking the tied copies",
              "sidecars": "carrying the sidecars", "manifest": "writing the manifest"}
"""The steps of `reshard.engine.pipeline.run_conversion` worker 0 takes alone, every worker told the
outcome; by what a worker was doing when a peer was lost. Writing and verifying are every worker's
(`DistributedOutput.write`, `DistributedOutput.verify`); after the verification only worker 0 goes on."""


@dataclass
class DistributedOutput(Output):
    """One torchrun worker's part of a DCP copy (steps 1-5 of the module docstring): worker 0 makes
    the hidden directory, every worker writes and verifies the files it owns, worker 0 writes
    ``.metadata``, the manifest and the reports and commits. ``collective``: the process group
    (joined on first use)."""

    io: Any = None
    restart: bool = False
    collective: Optional[Collective] = None
    _journal: Any = field(default=None, init=False, repr=False)
    _writer: Any = field(default=None, init=False, repr=False)
    _checked: Any = field(default=None, init=False, repr=False)
    _resume: Any = field(default=None, init=False, repr=False)
    _split_checked: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        from reshard.engine.copy import IOOptions, WriteChecks

        if self.collective is None:
            self.collective = Collective.joined()
        self.io = self.io or IOOptions()
        self._checked = WriteChecks()

    @property
    def commits(self) -> bool:
        return self.collective.lead

    @property
    def shown(self) -> Any:
        return self.progress if self.collective.lead else None

    def step(self, run: Run, name: str, fn: Callable[[], Any]) -> Any:
        """Worker 0 alone for `LEAD_STEPS`; the commit only while the command that started us lives."""
        if name in LEAD_STEPS:
            return self.collective.from_lead(LEAD_STEPS[name], fn, own=run.own)
        if name == "commit" and not launcher_alive():  # nobody is there to report a commit
            raise ReshardError("the command that started these workers has died; nothing was committed",
                               where=str(self.dst), hint="Run the conversion again.")
        return fn()

    def _owns(self, file_rank: int) -> bool:
        """The data files of target rank ``r`` are worker ``r mod W``'s."""
        return file_rank % self.collective.world == self.collective.rank

    @contextlib.contextmanager
    def staging(self, run: Run) -> Iterator[Path]:
        """1. worker 0 takes the lock and makes the hidden directory; everyone learns its path (or the error)."""
        from reshard.engine.resume import resume_key
        from reshard.storage.files.atomic import atomic_directory
        from reshard.storage.files.journal import Journal
        from reshard.storage.files.replaceable import why_not_replaceable

        c = self.collective
        self._journal = journal = Journal(resume_key(run.plan, run.source), restart=self.restart)
        with contextlib.ExitStack() as stack:
            def make() -> dict[str, Any]:
                made = stack.enter_context(atomic_directory(self.dst, overwrite=self.overwrite,
                                                            replaceable=why_not_replaceable, reuse=journal.choose,
                                                            keep=_peer_lost))
                journal.begin(made)  # a reused directory is cleaned, a new one gets its key, before anyone writes
                return {"tmp": str(made), "resumed": journal.resumed, "message": journal.message}

            made = c.from_lead("preparing the destination", make, own=run.own)
            if not c.lead:  # worker 0's decision, the same on every worker
                journal.resumed, journal.message = made["resumed"], made["message"]
                journal.begin(Path(made["tmp"]), lead=False)
            yield Path(made["tmp"])

    def write(self, run: Run) -> None:
        """2. each worker writes its files; 3. worker 0 checks the source storages split between
        workers and writes ``.metadata``."""
        from reshard.engine.copy import write_items
        from reshard.engine.pipeline import writing_bytes
        from reshard.render.progress import phase_of
        from reshard.storage.checkpoints.dcp_writer import DcpWriter
        from reshard.storage.files.journal import merge_summaries

        c = self.collective
        self._writer = w = DcpWriter(run.tmp, owned=self._owns, journal=self._journal)

        def own_files() -> dict[str, Any]:
            try:
                with phase_of(run.progress, self.phase, writing_bytes(run.plan, run.ix)) as bar:
                    write_items(run.plan, run.ix, w, bar, io=self.io, commit=False,
                                checked=self._checked)
                w.sync_files()
            except BaseException:
                w.close()
                raise
            return {"checksums": w.checksums(), "split": self._checked.ledger.partial(),
                    "resume": self._journal.summary()}

        written = c.run("writing its files", own_files, own=run.own)
        self._resume = merge_summaries([p["resume"] for p in written])

        def metadata() -> int:
            checked = check_split_storages([p["split"] for p in written])
            merged: dict[str, str] = {}
            for p in written:
                merged.update(p["checksums"])
            w.adopt(merged)
            w.finish()
            return checked

        if not c.lead:
            w.close()
        self._split_checked = c.from_lead("writing .metadata", metadata, own=run.own)

    def manifest(self, run: Run, manifest: Any) -> None:
        from reshard.storage.checkpoints.dcp_writer import CHECKSUM_ALGORITHM
        from reshard.storage.files.integrity import record

        manifest.integrity = record(self._writer.checksums(), algorithm=CHECKSUM_ALGORITHM)

    def verify(self, run: Run) -> dict[str, Any] | None:
        """4. each worker verifies its own files; worker 0 merges the parts (None elsewhere)."""
        from reshard.engine.outcome import verify_output

        c = self.collective
        files = sorted({loc.file for loc in self._writer.locations().values() if self._owns(_file_rank(loc.file))})

        def own_part() -> dict[str, Any]:
            part = verify_output(run.source, run.tmp, run.plan, b_files=set(files), checked=self._checked,
                                 progress=run.progress, write_checks=self._checked.summary())
            return {"verification": part, "files": files}

        parts = c.run("verifying its files", own_part, own=run.own)
        if not c.lead:
            return None
        verification = _merge([p["verification"] for p in parts])
        verification["workers"] = [{"worker": i, "files": p["files"]} for i, p in enumerate(parts)]
        if self._split_checked:  # absent when every source storage was read whole by one worker
            verification["storages_checked_across_workers"] = self._split_checked
        return verification

    def checksums(self, run: Run) -> dict[str, str]:
        return self._writer.checksums()

    def describe(self, run: Run, report: dict[str, Any]) -> None:
        report["workers"] = self.collective.world

    def resume(self, run: Run) -> dict[str, Any]:
        return self._resume


def check_split_storages(parts: list[list[tuple[Any, list[tuple[int, int, int]]]]],
                         read: Callable[[Any, int, int], int] | None = None) -> int:
    """Every source storage that no single worker read whole, checked once against its writer's
    CRC-32 record; returns how many there were.

    A source shard cut between targets of different workers (dp 4 -> 8: each source feeds
    one file of each worker) leaves each worker with pieces of it, so no worker's own ledger
    could check it. ``parts`` holds each worker's `reshard.engine.copy.PieceLedger.partial`:
    the pieces are combined here (``crc32_combine``, no bytes read); a storage they do not
    tile (a part was copied by a path that reports no pieces) is completed by reading what
    no piece covered, once. The first contradiction in (file, offset) order is raised: the
    `CorruptItem` paragraph (file and key) and exit code 2 a single process gives. ``read(rec,
    offset, nbytes)``: the CRC-32 of those bytes of the storage read where the source is (a store's
    object, the records naming it), instead of from the local file ``rec.path``.
    """
    from reshard.storage.checkpoints.crcledger import CrcLedger

    ledger = CrcLedger(collect=True)
    seen = set()
    for part in parts:
        for rec, pieces in part:
            seen.add(rec.ident)
            for offset, nbytes, crc in pieces:
                ledger.add(rec, offset, nbytes, crc)
    ledger.raise_first()
    for rec in ledger.pending():
        _read_rest(ledger, rec, read)
    return len(seen)


def _read_rest(ledger: Any, rec: Any, read: Callable[[Any, int, int], int] | None = None) -> None:
    """The bytes of ``rec`` no piece covered, read once into ``ledger`` (which checks the storage);
    the whole storage when the pieces overlap without chaining up."""
    from reshard.safefs import open_read

    if read is not None:
        crc_of = read
        fd = None
    else:
        fd = open_read(rec.path)

        def crc_of(rec: Any, offset: int, nbytes: int) -> int:
            return _crc_range(fd, rec.at + offset, nbytes)
    try:
        for offset, nbytes in ledger.missing(rec):
            ledger.add(rec, offset, nbytes, crc_of(rec, offset, nbytes))
        if not ledger.verified(rec) and not ledger.failures:
            ledger.add(rec, 0, rec.nbytes, crc_of(rec, 0, rec.nbytes))
    finally:
        if fd is not None:
            os.close(fd)
    ledger.raise_first()


def _crc_range(fd: int, pos: int, n: int, slab: int = 8 << 20) -> int:
    """CRC-32 of ``n`` bytes of ``fd`` at ``pos``, read in slabs (memory: one slab)."""
    from reshard.storage.files.fileio import crc32, read_exact

    buf = memoryview(bytearray(min(n, slab)))
    crc = 0
    while n > 0:
        view = buf[:min(n, len(buf))]
        read_exact(fd, view, pos)
        crc = crc32(view, crc)
        pos += len(view)
        n -= len(view)
    return crc


def _file_rank(name: str) -> int:
    """The target rank of a data file name ``__{rank}_0.distcp``."""
    return int(name[2:].split("_", 1)[0])


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One verification result from the workers' parts (keys and semantics are the same in each)."""
    out = dict(parts[0])
    seen = set()
    diffs = []
    for p in parts:
        for d in p["differences"]:
            k = (d.get("key"), d.get("kind"), d.get("detail"))
            if k not in seen:
                seen.add(k)
                diffs.append(d)
    out["differences"] = diffs
    for name in ("rewritten", "notes"):  # each worker lists what it saw in its part
        merged, seen_items = [], set()
        for p in parts:
            for item in p.get(name, []):
                k = repr(item)
                if k not in seen_items:
                    seen_items.add(k)
                    merged.append(item)
        out[name] = merged
    out["equal"] = not diffs
    out["exit_code"] = 0 if not diffs else 1
    if all("write_checks" in p for p in parts):  # items are counted by the worker that wrote them
        out["write_checks"] = {k: sum(p["write_checks"][k] for p in parts)
                               for k in ("items_against_source_crc", "items_read_back", "items_compared_after_writing")}
    comp = dict(parts[0].get("compared", {}))
    for field_ in ("elements", "bytes"):
        if field_ in comp:
            comp[field_] = sum(p.get("compared", {}).get(field_, 0) for p in parts)
    out["compared"] = comp
    return out


def pass_on_trusted() -> bool:
    """A worker's ``--trust-pickle`` items (`reshard.storage.checkpoints.dcp.TRUSTED_UNPICKLES`) handed to the
    process that prints the run's one warning line; returns whether this worker stays silent.

    Under `launch_workers` they go to ``trusted-<rank>.json`` in the ``RESHARD_WORKER_ERRORS``
    directory (the command reads them back, `_adopt_trusted`). Under a plain ``torchrun``,
    once the process group exists, every worker takes part in one gather and worker 0 keeps
    everyone's items (so it prints) while the others print nothing. A worker that cannot
    hand its items over (the file cannot be written, a peer is gone) keeps them and prints
    its own line: a warning is never dropped.
    """
    from reshard.storage.checkpoints.dcp import TRUSTED_UNPICKLES

    items = TRUSTED_UNPICKLES.take()
    rank = int(os.environ.get("RANK", "0"))
    folder = os.environ.get(ERRORS_ENV)
    if folder:
        if not items or _write_json(Path(folder) / f"trusted-{rank}.json", {"rank": rank, "items": items}):
            return True
        everyone = [items]
    else:
        everyone = _gather_trusted(items)
        if everyone is None:
            everyone = [items]
        elif rank != 0:
            return True
    for part in everyone:
        for key, where in part:
            TRUSTED_UNPICKLES.record(key, where)
    return False


def _gather_trusted(items: list[tuple[str, str]]) -> list[list[tuple[str, str]]] | None:
    """Every worker's trusted items, by rank (one gather), or None without a process group or a peer."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return Collective(dist, dist.get_rank(), dist.get_world_size()).gather(
            items, "naming the items --trust-pickle unpickled")
    except WorkerFailed:
        return None


def _adopt_trusted(folder: Path) -> None:
    """The workers' ``trusted-<rank>.json`` (`pass_on_trusted`), recorded in this process, in rank
    order, so the command's one warning line names every key once."""
    from reshard.safefs import read_json
    from reshard.storage.checkpoints.dcp import TRUSTED_UNPICKLES

    found = []
    for p in folder.glob("trusted-*.json"):
        try:
            r = read_json(p, root=folder, what="worker's trusted items", limit=64 << 20)
            found.append((int(r["rank"]), [(str(k), str(w)) for k, w in r["items"]]))
        except (ReshardError, OSError, KeyError, TypeError, ValueError):
            continue  # unreadable (never half-written: it is renamed into place): nothing to add
    for _rank, items in sorted(found, key=lambda f: f[0]):
        for key, where in items:
            TRUSTED_UNPICKLES.record(key, where)


def report_worker_error(exc: BaseException, code: int, paragraph: str) -> bool:
    """A worker's error, left where its launcher reads it; returns whether the worker should print it too.

    Under `launch_workers` (``RESHARD_WORKER_ERRORS`` set) the error goes to
    ``worker-<rank>.json`` in that private directory and the worker prints nothing: the
    command prints the first worker's error once. Under a plain ``torchrun`` the worker
    where the error arose prints it (a relayed `WorkerFailed` stays silent: its origin
    printed it; a lost peer cannot, so its survivors do) and writes it to torchrun's error
    file so torchrun's summary names it.
    """
    rank = int(os.environ.get("RANK", "0"))
    relayed = isinstance(exc, WorkerFailed)
    folder = os.environ.get(ERRORS_ENV)
    if folder:
        record = {"rank": rank, "world": int(os.environ.get("WORLD_SIZE", "1")), "exit_code": code,
                  "paragraph": paragraph, "relayed": relayed, "time": _time.time()}
        if _write_json(Path(folder) / f"worker-{rank}.json", record):
            if relayed and exc.worker is not None and exc.worker != rank:
                _await_report(Path(folder) / f"worker-{exc.worker}.json")
            return False
    # a lost peer printed nothing (it is gone): the survivors say what they saw
    speaks = not (isinstance(exc, WorkerFailed) and exc.worker is not None)
    torch_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if torch_file and speaks:  # the format of torch.distributed.elastic's ErrorHandler.record_exception
        _write_json(Path(torch_file), {"message": {"message": paragraph, "extraInfo": {
            "py_callstack": f"error: {paragraph}", "timestamp": str(int(_time.time()))}}})
    return speaks


def _await_report(path: Path, timeout: float = 30.0) -> None:
    """Wait until the worker whose error this one relays has left its own report (or ``timeout``).

    torchrun stops every worker as soon as one exits with an error, so a relay that left
    first would have the cause killed before it said what it was (the cause may still be
    removing the temporary directory); the command would then name a SIGTERM instead.
    """
    end = _time.monotonic() + timeout
    while not path.exists() and _time.monotonic() < end:
        _time.sleep(0.01)


def _write_json(path: Path, obj: Any) -> bool:
    """Best effort (an error report must not raise a second error): write, then rename into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def launch_workers(workers: int, argv: list[str], *, debug: bool = False) -> int:
    """``reshard convert ... --workers M``: run the same command under torchrun with M processes here.

    torchrun's launcher runs inside this process, so its result is ours to map: 0 when every
    worker succeeded; otherwise the first worker's own error is raised here (`WorkerFailed`,
    the same exit code and paragraph as a single process), or a paragraph naming the worker
    a signal killed. A worker that left with a code and no error (none does today) gives
    that code. torchrun's traceback and log lines appear with ``debug`` only.
    """
    if workers < 1:
        raise BadInput(f"--workers must be >= 1, got {workers}")
    args = ["--standalone", f"--nproc-per-node={workers}", "-m", "reshard", *argv]
    with tempfile.TemporaryDirectory(prefix="reshard-workers-") as folder:
        failures = _run_torchrun(args, {ERRORS_ENV: folder, LAUNCHER_ENV: str(os.getpid())}, debug=debug)
        _adopt_trusted(Path(folder))  # the CLI prints them as one line, as for a single process
        if not failures:
            return 0
        reports = _worker_reports(Path(folder))
    raise_run_error(reports, failures, workers)
    return min(failures.items())[1]


def raise_run_error(reports: list[dict[str, Any]], failures: dict[int, int], workers: int) -> None:
    """The run's error from what the workers reported and how they ended (``failures``: rank -> exit code).

    A worker's own error wins (earliest, then lowest rank): it is the cause, the others only
    relay it. Next a worker killed by a signal (its peers' relayed "connection closed" is a
    consequence; SIGTERM, which torchrun sends to the survivors, comes last). Then a relayed error. Returns when nothing was reported (the caller exits
    with the worker's code).
    """
    ranked = sorted(reports, key=lambda r: (r["time"], r["rank"]))
    for r in ranked:
        if not r["relayed"]:
            raise WorkerFailed(r["paragraph"], exit_code=r["exit_code"], worker=r["rank"])
    killed = [(rank, code) for rank, code in failures.items() if code < 0]
    # torchrun stops the survivors with SIGTERM: the worker killed by anything else is the cause
    for rank, code in sorted(killed, key=lambda rc: (rc[1] == -signal.SIGTERM, rc[0])):
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            raise WorkerFailed(BadInput(
                f"worker {rank} of {workers} was killed by {name} before it finished",
                hint="Nothing was committed; run the same command again (it resumes from what the stopped run left "
                     "beside the destination; --restart discards it). If the system killed it for memory, give --buffer-memory a smaller size.",
            ).render(), exit_code=2, worker=rank)
    if ranked:
        r = ranked[0]
        raise WorkerFailed(r["paragraph"], exit_code=r["exit_code"], worker=r["rank"])


def _worker_reports(folder: Path) -> list[dict[str, Any]]:
    from reshard.safefs import read_json

    out = []
    for p in sorted(folder.glob("worker-*.json")):
        try:
            r = read_json(p, root=folder, what="worker error report", limit=1 << 20)
            out.append({"rank": int(r["rank"]), "exit_code": int(r["exit_code"]), "paragraph": str(r["paragraph"]),
                        "relayed": bool(r["relayed"]), "time": float(r["time"])})
        except (ReshardError, OSError, KeyError, TypeError, ValueError):
            continue  # a report cut short by a dying worker: its exit code still counts
    return out


@contextlib.contextmanager
def _quiet_torchrun(debug: bool) -> Iterator[None]:
    """Without --debug, torchrun's log lines (its own account of a worker's exit) go nowhere."""
    if debug:
        yield
        return
    saved = []
    for name in ("torch.distributed.run", "torch.distributed.launcher", "torch.distributed.elastic"):
        lg = logging.getLogger(name)
        handler = logging.NullHandler()
        saved.append((lg, lg.propagate, handler))
        lg.addHandler(handler)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, propagate, handler in saved:
            lg.removeHandler(handler)
            lg.propagate = propagate


def stopped_by_signal(exc: BaseException, signal_type: type) -> bool:
    """Whether ``exc`` was raised while torchrun handled a signal (``signal_type`` in its context chain).

    torchrun's signal handler raises its ``SignalException`` at whatever bytecode the agent is
    running. Landing between ``try:`` and ``start = time.time()`` in its metrics wrapper
    (``elastic.metrics.api.prof``), the wrapper's ``finally`` raises ``UnboundLocalError``
    instead, with the signal only as its context. The workers are still stopped by the agent's
    own ``finally``; a Ctrl-C must still read as one.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, signal_type):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _run_torchrun(args: list[str], env: dict[str, str], *, debug: bool) -> dict[int, int]:
    """torchrun's launcher in this process; {global rank: exit code} of the workers that failed ({} if none)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    saved = dict(os.environ)
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with _quiet_torchrun(debug):
            torchrun.run(torchrun.parse_args(args))
    except ChildFailedError as exc:
        if debug:
            print(exc.format_msg(), file=sys.stderr)
        return {int(rank): int(f.exitcode) for rank, f in exc.failures.items()}
    except SignalException:  # Ctrl-C or SIGTERM: torchrun has stopped the workers
        raise KeyboardInterrupt from None
    except Exception as exc:
        if stopped_by_signal(exc, SignalException):
            raise KeyboardInterrupt from None
        raise
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {}
