"""Where the declarative data in `formats/` lives, installed or in a source tree."""
from __future__ import annotations

from pathlib import Path


def formats_root() -> Path:
    """`formats/` ships as the `reshard.formats` package; a bare source checkout has it beside `reshard/`."""
    try:
        from reshard.formats import ROOT  # type: ignore[import-not-found]

        return Path(ROOT)
    except ImportError:
        return Path(__file__).resolve().parent.parent / "formats"
