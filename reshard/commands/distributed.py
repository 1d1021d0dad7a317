"""Distributed conversion: several processes (one or many machines) write one checkpoint.

Run as ``torchrun --nnodes N --nproc-per-node M -m reshard convert SRC DST --to ...`` (or
``reshard convert ... --workers M``, which starts exactly that on this machine). Every
worker derives the same plan from the same source and reserves every item of the output in
the same order (`reshard.storage.dcp_writer.DcpWriter.reserve_chunk`), so all of them agree on
the layout of every data file without exchanging it. The target data files are divided
among the workers (file of target rank ``r`` -> worker ``r mod W``); each worker writes
only its files, and only it reads the source bytes they need.

Protocol (collectives over the default ``torch.distributed`` group; gloo is enough, no
tensor crosses the network, only short Python objects):

1. worker 0 takes the destination's lock and creates the hidden temporary directory
   beside ``dst`` (`reshard.storage.atomic.atomic_directory`) and broadcasts its path (the
   directory must be on a file system every worker sees, as DCP itself requires);
2. each worker writes and fsyncs its files, then reports ``(ok, checksums)`` or its error;
3. if any worker failed, every worker raises that error and worker 0 deletes the temporary
   directory: nothing is committed. Otherwise worker 0 writes ``.metadata`` and
   ``manifest.json`` (inside the still-hidden directory);
4. each worker verifies its own files against the source in global terms
   (`reshard.commands.verify.verify_checkpoints` restricted to its files) and reports the result;
5. only when every part verified does worker 0 write the reports and rename the
   directory into place. The commit is that rename: before it, nothing at
   ``dst`` looks like a checkpoint.

A worker killed outright makes the others fail in their next collective (its connection
closes) and torchrun stops the group; what is left is the hidden temporary directory,
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
directory named by ``RESHARD_WORKER_ERRORS`` and prints nothing; the command then raises
the first worker's own error (earliest, then lowest rank), or says which worker was killed
by which signal, and exits with its code. torchrun's traceback and its log lines are
shown with ``--debug`` only. Started by ``torchrun`` directly, each worker prints its own
error once (relayed copies stay silent) and also writes it to torchrun's error file
(``TORCHELASTIC_ERROR_FILE``), so torchrun's summary names the cause; torchrun itself then
exits 1 with its own summary, which reshard cannot change.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import signal
import sys
import tempfile
import time as _time
from pathlib import Path
from typing import Any, Iterator

from reshard.errors import BadInput, Infeasible, ReshardError, render_error

__all__ = ["ERRORS_ENV", "WorkerFailed", "in_torchrun", "convert_distributed", "launch_workers", "report_worker_error"]

ERRORS_ENV = "RESHARD_WORKER_ERRORS"  # private directory where the workers of `launch_workers` leave their errors


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


def _collective(stage: str, world: int, fn: Any, *args: Any) -> None:
    """One collective; a peer that died (its connection closed) becomes one paragraph, not a gloo trace."""
    try:
        fn(*args)
    except RuntimeError as exc:  # gloo's DistBackendError and friends
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise WorkerFailed(BadInput(
            f"one of the {world} workers stopped while {stage} (its connection closed: {detail})",
            hint="Nothing was committed; the next run into the destination removes what this one left beside it.",
        ).render(), exit_code=2) from None


def _gather(dist: Any, obj: Any, world: int, stage: str) -> list[Any]:
    out: list[Any] = [None] * world
    _collective(stage, world, dist.all_gather_object, out, obj)
    return out


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


def convert_distributed(plan: Any, src: Path, dst: Path, *, overwrite: bool = False, progress: Any = None,
                        io: Any = None) -> dict[str, Any] | None:
    """This worker's part of a distributed conversion; the report on worker 0, None elsewhere."""
    from reshard.commands import convert as ex
    from reshard.commands.space import estimate_output_bytes
    from reshard.storage.integrity import is_space_error, out_of_space

    dist, rank, world = _init()
    src, dst, ix = ex.prepare_conversion(plan, src, dst)
    needed = estimate_output_bytes(plan, ix)

    def own(exc: BaseException) -> BaseException:
        """This worker's error as a single process reports it (a full disk names the destination and bytes)."""
        return out_of_space(dst, needed, exc) if is_space_error(exc) else exc

    try:
        return _convert_steps(plan, src, dst, ix, dist, rank, world, own, overwrite=overwrite, progress=progress,
                              io=io or ex.IOOptions())
    except OSError as exc:  # e.g. the commit itself (fsync, rename) on a full disk
        if is_space_error(exc):
            raise out_of_space(dst, needed, exc) from None
        raise


def _convert_steps(plan: Any, src: Path, dst: Path, ix: Any, dist: Any, rank: int, world: int, own: Any, *,
                   overwrite: bool, progress: Any, io: Any) -> dict[str, Any] | None:
    """Steps 1-5 of the protocol (module docstring); every failure reaches every worker before anyone raises."""
    from reshard.commands import convert as ex
    from reshard.storage.atomic import atomic_directory, fault_point
    from reshard.storage.dcp_writer import CHECKSUM_ALGORITHM, DcpWriter
    from reshard.semantics.manifest import write_manifest
    from reshard.commands.transition import output_manifest

    started = _time.time()
    stamp = ex.now_text()
    lead = rank == 0
    with contextlib.ExitStack() as stack:
        # 1. worker 0 takes the lock and makes the hidden directory; everyone learns its path (or the error)
        msg: list[Any] = [None]
        failure: BaseException | None = None
        if lead:
            try:
                msg = [{"ok": True, "tmp": str(stack.enter_context(atomic_directory(dst, overwrite=overwrite)))}]
            except Exception as exc:
                failure = own(exc)
                msg = [_error_status(failure)]
        _collective("preparing the destination", world, dist.broadcast_object_list, msg, 0)
        _raise_first(msg, failure)
        tmp = Path(msg[0]["tmp"])

        def owns(file_rank: int) -> bool:
            return file_rank % world == rank

        # 2. write this worker's files
        w = DcpWriter(tmp, owned=owns)
        try:
            if lead:
                for key, equal_to in plan.checks.items():
                    from reshard.commands.inspect import bitwise_equal

                    if not bitwise_equal(ix, key, equal_to):
                        raise Infeasible(f"tied copies '{key}' and '{equal_to}' differ: the target would keep one of "
                                         "them silently", where=str(src),
                                         hint="Inspect the source: tied weights and their optimizer state must be equal.")
            checked = ex.WriteChecks()
            ex.write_items(plan, ix, w, progress if lead else None, io=io, commit=False, checked=checked)
            w.sync_files()
            status: dict[str, Any] = {"ok": True, "checksums": w.checksums()}
        except Exception as exc:  # reported to every worker, then raised everywhere
            w.close()
            failure = own(exc)
            status = _error_status(failure)
        statuses = _gather(dist, status, world, "writing its files")
        _raise_first(statuses, failure)

        # 3. worker 0 writes .metadata inside the hidden directory
        status = {"ok": True}
        if lead:
            try:
                merged: dict[str, str] = {}
                for s in statuses:
                    merged.update(s["checksums"])
                w.adopt(merged)
                w.finish()
                manifest = output_manifest(plan, ex.source_manifest(src), time=stamp)
                manifest.integrity = ex.integrity_record(w.checksums(), algorithm=CHECKSUM_ALGORITHM)
                write_manifest(tmp, manifest)  # verification reads the step and cursor from it
                fault_point("manifest")
            except Exception as exc:
                failure = own(exc)
                status = _error_status(failure)
        else:
            w.close()
        _raise_first(_gather(dist, status, world, "writing .metadata and the manifest"), failure)

        # 4. each worker verifies its own files
        files = sorted({loc.file for loc in w.locations().values() if owns(_file_rank(loc.file))})
        try:
            part = ex.verify_output(src, tmp, plan, b_files=set(files), checked=checked)
            status = {"ok": True, "verification": part, "files": files}
        except Exception as exc:
            failure = own(exc)
            status = _error_status(failure)
        statuses = _gather(dist, status, world, "verifying its files")
        _raise_first(statuses, failure)
        if not lead:
            return None

        # 5. worker 0 commits
        verification = _merge([s["verification"] for s in statuses])
        verification["b"] = str(dst)
        verification["workers"] = [{"worker": i, "files": s["files"]} for i, s in enumerate(statuses)]
        report = ex.build_report(plan, src, dst, tmp, verification, manifest.to_dict(), w.checksums(), _time.time() - started)
        report["workers"] = world
        ex.write_reports(tmp, report)
        ex.refuse_if_different(verification, dst, "the converted checkpoint")
    return report


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
            return False
    # a lost peer printed nothing (it is gone): the survivors say what they saw
    speaks = not (isinstance(exc, WorkerFailed) and exc.worker is not None)
    torch_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if torch_file and speaks:  # the format of torch.distributed.elastic's ErrorHandler.record_exception
        _write_json(Path(torch_file), {"message": {"message": paragraph, "extraInfo": {
            "py_callstack": f"error: {paragraph}", "timestamp": str(int(_time.time()))}}})
    return speaks


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
        failures = _run_torchrun(args, {ERRORS_ENV: folder}, debug=debug)
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
                hint="Nothing was committed; run the same command again (it removes what the stopped run left "
                     "beside the destination). If the system killed it for memory, give --window a smaller size.",
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
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {}
