"""Errors that carry their exit code, so the CLI can stay a thin renderer.

Exit codes are part of the interface: 0 ok, 1 a check found a difference or a plan is
infeasible, 2 bad input (usage, incomplete, corrupt or unsafe checkpoint).
"""
from __future__ import annotations


class ReshardError(Exception):
    """Base class: one clear paragraph saying what is wrong, where, and the way out."""

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        self.message = message
        self.where = where
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        parts = []
        if self.where:
            parts.append(f"{self.where}: {self.message}")
        else:
            parts.append(self.message)
        if self.hint:
            parts.append(self.hint)
        return " ".join(parts)


class BadInput(ReshardError):
    """Usage errors, incomplete/corrupt/unreadable checkpoints (exit 2)."""

    exit_code = 2


class UnsafeInput(BadInput):
    """The input asks us to run code (a pickle referencing a non-allow-listed global)."""


class Incomplete(BadInput):
    """The checkpoint was never committed or some of its bytes are gone."""


class Infeasible(ReshardError):
    """The check ran and found a difference, or a plan cannot be carried out (exit 1)."""

    exit_code = 1
