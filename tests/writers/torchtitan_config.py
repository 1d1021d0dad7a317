"""Write the job config torchtitan 0.3.0 saves for a run, with torchtitan's own code.

    python torchtitan_config.py SPEC

SPEC is a JSON list of jobs {"dump", "config", "overrides"} run one after the other in the
same process (importing torchtitan dominates): each writes DUMP/job_config.json for the
llama3 config_registry function CONFIG (e.g. "llama3_debugmodel") with the command-line
OVERRIDES (e.g. ["--training.local_batch_size", "8"]).

torchtitan 0.3 has no job TOML: a run is a config_registry function (``--module llama3
--config llama3_debugmodel``) plus command-line overrides (``--training.local_batch_size 8``).
What the run resolved to is written by the trainer itself when ``debug.save_config_file`` is
set: ``Trainer.__init__`` initialises the process group, then calls
``Trainer.Config.maybe_log()``, which on rank 0 json-dumps ``config.to_dict()`` to
``dump_folder/save_config_file``. This script goes the same way:

- the config is parsed by torchtitan's ``ConfigManager().parse_args`` (what
  ``torchtitan.train.main`` calls) from ``--module llama3 --config NAME`` and the overrides;
- a one-rank gloo process group is initialised (``maybe_log`` writes nothing without one;
  torchtitan's ``init_distributed`` asks for cuda:nccl, so gloo is the CPU stand-in, and a
  file rendezvous needs no port);
- ``config.maybe_log()`` writes DUMP/job_config.json, torchtitan's own bytes.

No trainer is built (no model, no data): the file is written before any of that in
``Trainer.__init__``, and the degrees it records (e.g. 64-way FSDP) need not be the world
size of this process, exactly as a config file states a run without running it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

CONFIG_FILE = "job_config.json"


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec", help="JSON list of {dump, config, overrides}")
    jobs = json.loads(ap.parse_args(argv).spec)

    import torch.distributed as dist
    from torchtitan.config import ConfigManager

    written = []
    with tempfile.TemporaryDirectory() as rdzv:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(rdzv, 'pg')}", rank=0, world_size=1)
        try:
            for job in jobs:
                config = ConfigManager().parse_args([
                    "--module", "llama3", "--config", job["config"],
                    "--dump_folder", str(job["dump"]), "--debug.save_config_file", CONFIG_FILE,
                    *job.get("overrides", []),
                ])
                config.maybe_log()
                out = Path(job["dump"]) / CONFIG_FILE
                if not out.is_file():
                    raise SystemExit(f"torchtitan wrote no {out}")
                written.append(out)
        finally:
            dist.destroy_process_group()
    return written


if __name__ == "__main__":
    print("\n".join(map(str, main(sys.argv[1:]))))
