"""Distributed conversion: several processes (one or many machines) write one checkpoint.

Run as ``torchrun --nnodes N --nproc-per-node M -m reshard convert SRC DST --to ...`` (or
``reshard convert ... --workers M``, which starts exactly that on this machine). Every
worker derives the same plan from the same source and reserves every item of the output in
the same order (`reshard.io.dcp_writer.DcpWriter.reserve_chunk`), so all of them agree on
the layout of every data file without exchanging it. The target data files are divided
among the workers (file of target rank ``r`` -> worker ``r mod W``); each worker writes
only its files, and only it reads the source bytes they need.

Protocol (collectives over the default ``torch.distributed`` group; gloo is enough, no
tensor crosses the network, only short Python objects):

1. worker 0 takes the destination's lock and creates the hidden temporary directory
   beside ``dst`` (`reshard.io.atomic.atomic_directory`) and broadcasts its path (the
   directory must be on a file system every worker sees, as DCP itself requires);
2. each worker writes and fsyncs its files, then reports ``(ok, checksums)`` or its error;
3. if any worker failed, every worker raises that error and worker 0 deletes the temporary
   directory: nothing is committed. Otherwise worker 0 writes ``.metadata`` and
   ``manifest.json`` (inside the still-hidden directory);
4. each worker verifies its own files against the source in global terms
   (`reshard.verify.verify_checkpoints` restricted to its files) and reports the result;
5. only when every part verified does worker 0 write the reports and rename the
   directory into place. The commit is that rename: before it, nothing at
   ``dst`` looks like a checkpoint.

A worker killed outright makes the others fail in their next collective (its connection
closes) and torchrun stops the group; what is left is the hidden temporary directory,
which the next run into ``dst`` removes. The output is byte-identical to a single-process
conversion: the same reservations give the same offsets, and the same bytes are written
at them (``tests/test_distributed.py``).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import sys
import time as _time
from pathlib import Path
from typing import Any

from reshard.errors import BadInput, Infeasible, ReshardError

__all__ = ["in_torchrun", "convert_distributed", "launch_workers"]


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


def _gather(dist: Any, obj: Any, world: int) -> list[Any]:
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _error_status(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, ReshardError):
        return {"ok": False, "error": str(exc), "exit_code": exc.exit_code}
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "exit_code": 2}


def _raise_first(statuses: list[dict[str, Any]], stage: str) -> None:
    bad = [(i, s) for i, s in enumerate(statuses) if not s.get("ok")]
    if not bad:
        return
    worker, s = bad[0]
    cls = Infeasible if s.get("exit_code") == 1 else BadInput
    raise cls(f"worker {worker} of {len(statuses)} failed while {stage}: {s['error']}",
              hint="Nothing was committed; fix the cause and run the conversion again.")


def convert_distributed(plan: Any, src: Path, dst: Path, *, overwrite: bool = False, progress: Any = None,
                        io: Any = None) -> dict[str, Any] | None:
    """This worker's part of a distributed conversion; the report on worker 0, None elsewhere."""
    from reshard import execute as ex
    from reshard.io.atomic import atomic_directory, fault_point
    from reshard.io.dcp_writer import CHECKSUM_ALGORITHM, DcpWriter
    from reshard.manifest import write_manifest
    from reshard.transition import output_manifest

    dist, rank, world = _init()
    started = _time.time()
    stamp = ex._now()
    src, dst, ix = ex._prepare(plan, src, dst)
    io = io or ex.IOOptions()
    lead = rank == 0
    with contextlib.ExitStack() as stack:
        # 1. worker 0 takes the lock and makes the hidden directory; everyone learns its path (or the error)
        msg: list[Any] = [None]
        failure: BaseException | None = None
        if lead:
            try:
                msg = [{"ok": True, "tmp": str(stack.enter_context(atomic_directory(dst, overwrite=overwrite)))}]
            except Exception as exc:
                failure, msg = exc, [_error_status(exc)]
        dist.broadcast_object_list(msg, src=0)
        if failure is not None:
            raise failure
        _raise_first(msg, "preparing the destination")
        tmp = Path(msg[0]["tmp"])

        def owns(file_rank: int) -> bool:
            return file_rank % world == rank

        # 2. write this worker's files
        w = DcpWriter(tmp, owned=owns)
        try:
            if lead:
                for key, equal_to in plan.checks.items():
                    from reshard.inspection import bitwise_equal

                    if not bitwise_equal(ix, key, equal_to):
                        raise Infeasible(f"tied copies '{key}' and '{equal_to}' differ: the target would keep one of "
                                         "them silently", where=str(src),
                                         hint="Inspect the source: tied weights and their optimizer state must be equal.")
            checked = ex.WriteChecks()
            ex._write_items(plan, ix, w, progress if lead else None, io=io, commit=False, checked=checked)
            w.sync_files()
            status: dict[str, Any] = {"ok": True, "checksums": w.checksums()}
        except Exception as exc:  # reported to every worker, then raised everywhere
            w.close()
            status = _error_status(exc)
        statuses = _gather(dist, status, world)
        _raise_first(statuses, "writing its files")

        # 3. worker 0 writes .metadata inside the hidden directory
        status = {"ok": True}
        if lead:
            try:
                merged: dict[str, str] = {}
                for s in statuses:
                    merged.update(s["checksums"])
                w.adopt(merged)
                w.finish()
                manifest = output_manifest(plan, ex._source_manifest(src), time=stamp)
                manifest.integrity = ex.integrity_record(w.checksums(), algorithm=CHECKSUM_ALGORITHM)
                write_manifest(tmp, manifest)  # verification reads the step and cursor from it
                fault_point("manifest")
            except Exception as exc:
                status = _error_status(exc)
        else:
            w.close()
        _raise_first(_gather(dist, status, world), "writing .metadata and the manifest")

        # 4. each worker verifies its own files
        files = sorted({loc.file for loc in w.locations().values() if owns(_file_rank(loc.file))})
        try:
            part = ex._verify(src, tmp, plan, b_files=set(files), checked=checked)
            status = {"ok": True, "verification": part, "files": files}
        except Exception as exc:
            status = _error_status(exc)
        statuses = _gather(dist, status, world)
        _raise_first(statuses, "verifying its files")
        if not lead:
            return None

        # 5. worker 0 commits
        verification = _merge([s["verification"] for s in statuses])
        verification["b"] = str(dst)
        verification["workers"] = [{"worker": i, "files": s["files"]} for i, s in enumerate(statuses)]
        report = ex._report(plan, src, dst, tmp, verification, manifest.to_dict(), w.checksums(), _time.time() - started)
        report["workers"] = world
        ex._write_reports(tmp, report)
        ex._refuse_if_different(verification, dst, "the converted checkpoint")
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


def launch_workers(workers: int, argv: list[str]) -> int:
    """``reshard convert ... --workers M``: run the same command under torchrun with M processes here.

    Returns torchrun's exit code (worker 0's report is printed by worker 0).
    """
    import subprocess

    if workers < 1:
        raise BadInput(f"--workers must be >= 1, got {workers}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
           "-m", "reshard", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)
