"""`reshard export`: a DCP checkpoint as one consolidated set of weights (safetensors, torch, or a
Hugging Face model directory).

What an export writes under which names is `reshard.planning.export`, the run that writes,
reads back and commits it `reshard.engine.export.export`, and its comparison with the source
(`reshard verify SRC HF_EXPORT`) `reshard.verification.exports`. This command adds what only
the command line brings: the ``--model-config`` values as written (``name=value``), completed
for ``--format hf`` by the profile's ``[model]`` values (recorded in the report), and the
``--max-shard-size`` text (``5GB``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from reshard.engine.export import export as run_export
from reshard.engine.publishing import export_into_store
from reshard.semantics.hf import parse_values
from reshard.semantics.profile import find_profile, load_profile
from reshard.storage.source import Source
from reshard.units import parse_size


def export(src: Source | Path, dst: Path | str, *, fmt: str, dtype: str | None, only: str, max_shard_size: str,
           rename: Path | None, model_config: list[str] | None, profile: Path | None, no_profile: bool,
           overwrite: bool, force: bool, progress: Any = None) -> dict[str, Any]:
    """Export ``src`` into ``dst`` with the options as the command line gives them; returns the export report.

    ``profile``: the profile file (``--profile``), else ``reshard.toml`` found in the working
    directory or beside the checkpoint unless ``no_profile``: with ``--format hf`` its model
    values fill what ``model_config`` does not give, its ``tie`` pairs are written once (any
    format; checked bitwise equal, refused when they differ), and the report names it.
    ``src``: as `reshard.storage.source.opened` made it (a store read through its own handle).
    """
    src = Source.of(src)
    values = parse_values(model_config)
    record = None
    ties: list[list[str]] = []
    found = find_profile(src.root, profile, enabled=not no_profile)
    if found is not None:
        prof = load_profile(found)
        used = sorted(k for k in prof.model_config if k not in values) if fmt == "hf" else []
        values.update({k: prof.model_config[k] for k in used})
        ties = [list(t) for t in prof.ties]
        record = {"file": prof.file, "sha256": prof.sha256,
                  "contributed": [f"model_config.{k}" for k in used] + (["tie"] if ties else [])}

    def run(local: Path, url: str | None = None) -> dict[str, Any]:
        return run_export(src, local, publish_to=url, fmt=fmt, dtype=dtype, only=only, max_shard_size=parse_size(max_shard_size),
                          rename=rename, overwrite=overwrite and local == dst, model_config=values or None,
                          profile=record, progress=progress, force=force, ties=ties or None)

    if isinstance(dst, str):  # s3://bucket/prefix: made locally, then uploaded (`reshard.engine.publishing`)
        return export_into_store(dst, run, overwrite=overwrite, progress=progress)
    return run(dst)
