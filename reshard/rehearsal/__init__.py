"""Deterministic restore rehearsal of a topology transition, on the user's trainer (the trainer
contract, formats/trainer_contract.md) or the reference trainer run through the same contract;
and the judges of a window after a switch: the rehearsal's (`judge`) and a real run's (`window`).

The names below are resolved when first used (PEP 562), not when the package is imported: the
rehearsal imports torch, and `reshard.rehearsal.window` (what ``reshard window`` runs) must not.
``rehearse`` here is the function; the module of that name is ``reshard.rehearsal.rehearse``.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_WHERE = {"rehearse": "reshard.rehearsal.rehearse", "render_rehearsal": "reshard.render.rehearsal",
          "rewrite_checkpoint": "reshard.rehearsal.ckpt", "make_control": "reshard.rehearsal.ckpt",
          "naive_cursor": "reshard.rehearsal.ckpt", "DEFAULT_TOLERANCES": "reshard.rehearsal.judge",
          "TrainerCommand": "reshard.rehearsal.contract", "reference_command": "reshard.rehearsal.contract",
          "PLACEHOLDERS": "reshard.rehearsal.contract", "pick_recipe": "reshard.rehearsal.recipe"}

__all__ = ["rehearse", "render_rehearsal", "rewrite_checkpoint", "make_control", "naive_cursor", "DEFAULT_TOLERANCES",
           "TrainerCommand", "reference_command", "PLACEHOLDERS", "pick_recipe"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'reshard.rehearsal' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """Keeps ``rehearse`` the function, as the eager package did: importing the submodule of that name
    first (``import reshard.rehearsal.rehearse``) would otherwise bind the module here."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return  # resolved by __getattr__ when asked for
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
