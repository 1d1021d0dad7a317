"""Progress for people at a terminal: a first line at once, then one bar in bytes per long phase.

Why it exists: a conversion, a verification or an export of a real checkpoint reads and
writes gigabytes, and a command silent for half a minute looks hung. Counting keys or
chunks says little (one embedding can be a third of the bytes), so every bar counts bytes,
whose totals the index knows before the work starts (`Entry.nbytes` per key).

Why it looks like this: the commands hold a `Progress` and open a `Phase` per long step
(``with progress.phase("writing", total) as bar``); the layers below (storage, engine)
receive only the phase, an object with ``update(nbytes)``, so they import neither this
module nor tqdm. A phase counts its bytes (``done``) even when nothing is shown, which lets
a test check the totals without a terminal.

Quiet unless a person is watching: nothing is printed when stderr is not a terminal (a
pipe, a file, CI), under ``--json`` (a script reads the output) or with ``--quiet``. This
module imports nothing heavy, so the first line can be printed before torch is imported.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, TextIO

from reshard.units import human_bytes

__all__ = ["Phase", "Progress", "describe_bytes", "phase_of"]


@dataclass
class Phase:
    """One long step: ``update(nbytes)`` adds bytes done (and moves the bar, if one is shown)."""

    name: str
    total: int
    done: int = 0
    bar: Any = None  # a tqdm bar, or None when nothing is shown

    def update(self, nbytes: int = 0) -> None:
        """``nbytes`` more bytes of this phase are done (zero or negative: nothing to show)."""
        if nbytes > 0:
            self.done += nbytes
            if self.bar is not None:
                self.bar.update(nbytes)

    __call__ = update


@dataclass
class Progress:
    """What a command shows while it works: `say` a line, `phase` a bar in bytes; nothing when disabled."""

    enabled: bool = False
    stream: TextIO | None = None
    phases: list[Phase] = field(default_factory=list)  # every phase opened, in order (their byte counts)

    @classmethod
    def for_terminal(cls, *, quiet: bool = False, json_out: bool = False, stream: TextIO | None = None) -> "Progress":
        """Shown only on a terminal (stderr by default), and never under ``--json`` or ``--quiet``."""
        out = stream if stream is not None else sys.stderr
        return cls(enabled=not quiet and not json_out and _is_terminal(out), stream=out)

    def say(self, line: str) -> None:
        """One line at once (the first thing a long command prints, before its heavy imports)."""
        if line and self.enabled and self.stream is not None:
            self.stream.write(line + "\n")
            self.stream.flush()

    @contextmanager
    def phase(self, name: str, total_bytes: int) -> Iterator[Phase]:
        """A bar of ``total_bytes`` named ``name`` while the block runs; the bar is removed after it."""
        ph = Phase(name, max(0, int(total_bytes)))
        self.phases.append(ph)
        if self.enabled:
            from tqdm import tqdm

            # binary multiples, as `human_bytes` writes the first line (tqdm spells them k, M, G)
            ph.bar = tqdm(total=ph.total, desc=name, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                          file=self.stream, dynamic_ncols=True, mininterval=0.2)
        try:
            yield ph
        finally:
            if ph.bar is not None:
                ph.bar.close()


def phase_of(progress: "Progress | None", name: str, total_bytes: int) -> Any:
    """``progress.phase(name, total_bytes)``, or a block yielding None when there is no progress
    (a library caller that passed none): the layers below accept None as "report nothing"."""
    from contextlib import nullcontext

    return nullcontext(None) if progress is None else progress.phase(name, total_bytes)


def describe_bytes(nbytes: int, count: int, noun: str) -> str:
    """``1.2 GiB in 37 tensors``: the size of a command's work, for its first line after the index is read."""
    return f"{human_bytes(nbytes)} in {count} {noun}{'' if count == 1 else 's'}"


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
