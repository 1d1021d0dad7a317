"""Starting local rank processes cheaply: a fork server with torch imported once.

A job of N gloo ranks on one machine (the reference trainer's runs, the checkpoint makers)
needs N fresh processes. ``spawn`` gives each a new interpreter that imports torch again,
2-3 s per rank on a quiet 2-core machine and 10-20 s on a loaded one. ``forkserver`` forks
each rank from a server that imported torch once and never ran a torch op or started a
thread, so forking it is safe, and every rank is still a fresh process with its own process
group. Whoever starts the server first decides what it preloads; later callers just use it.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import sys
import types
from typing import Any, Callable, Iterator, Sequence

# What a rank of the reference trainer or of a checkpoint maker imports anyway.
PRELOAD = ("torch", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.fsdp", "torch.distributed.tensor")


def default_start_method(preload: Sequence[str] = PRELOAD) -> str:
    """``forkserver`` where the platform has it (preloading ``preload`` if the server is not yet
    running), else ``spawn``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(list(preload))  # no effect once the server runs
    return "forkserver"


@contextlib.contextmanager
def main_not_reimported(fn: Callable[..., object]) -> Iterator[None]:
    """Keep spawned or forkserver children from re-importing the caller's ``__main__``.

    multiprocessing re-runs the parent's main module in every such child (so that functions
    defined there can be unpickled). A rank's function lives in a library module, so that
    import is pure cost (under pytest about 0.5 s of CPU per rank) and a hazard (a script
    without an ``if __name__ == "__main__":`` guard would recurse). While the children start,
    ``__main__`` is an empty module, which the child's preparation then has nothing to record of.
    """
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" or main is None:
        yield
        return
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def start_ranks(fn: Callable[..., object], args: tuple, nprocs: int, *, join: bool = True,
                start_method: str | None = None, preload: Sequence[str] = PRELOAD) -> Any:
    """``fn(rank, *args)`` on ``nprocs`` fresh processes (`torch.multiprocessing.start_processes`),
    by default forked from the fork server (``default_start_method(preload)``), the caller's
    ``__main__`` not re-imported. Returns what ``start_processes`` returns (its context when
    ``join`` is False); with ``join`` it raises as that does when a rank fails."""
    import warnings

    import torch.multiprocessing as mp

    with warnings.catch_warnings(), main_not_reimported(fn):
        warnings.simplefilter("ignore")
        return mp.start_processes(fn, args=args, nprocs=nprocs, join=join,
                                  start_method=start_method or default_start_method(preload))
