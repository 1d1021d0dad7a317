"""reshard: move distributed-training checkpoints between parallel layouts, keeping what the run means.

The Python API (docs/api.md) is the command line's verbs as functions of plain values::

    import reshard

    p = reshard.plan("ckpt/step-1000", to="dp=2")
    print(p.feasible, p.verdict)

``inspect``, ``plan``, ``convert``, ``verify``, ``export``, ``import_`` and ``estimate`` live in
`reshard.api`, with the types they return (`Inspection`, `Plan`, `Options`) and raise (the
`ReshardError` hierarchy). They are loaded on first use (PEP 562 ``__getattr__``), so
``import reshard`` costs what this file costs and imports no torch, and a command line that
never touches the API never loads it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reshard.version import __version__

if TYPE_CHECKING:  # what a type checker and an editor see; at run time `__getattr__` loads them
    from reshard.api import (BadInput, Incomplete, Infeasible, Inspection, Options, Plan, PlanOptions, ReshardError,
                             ReshardWarning, UnsafeInput, convert, estimate, export, import_, inspect, plan, verify)

__all__ = ["__version__", "inspect", "plan", "convert", "verify", "export", "import_", "estimate", "Inspection",
           "Plan", "Options", "PlanOptions", "ReshardError", "BadInput", "Incomplete", "UnsafeInput", "Infeasible",
           "ReshardWarning"]


def __getattr__(name: str) -> Any:
    """``reshard.plan`` and the other names of `__all__`, imported from `reshard.api` when first asked for."""
    if name in __all__:
        from reshard import api

        value = getattr(api, name)
        globals()[name] = value  # asked once: the next access is a plain attribute
        return value
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
