"""examples/fsdp2_trainer.py with a model of another depth: ``fsdp2_layers.py N ARGS...``.

The example's TinyLM has 2 blocks; the layer-slice tests need a deeper run to slice (its
real weights, moments, schedule and data cursor). This sets TinyLM's default ``n_layers``
to N and runs the example's own ``main`` with ARGS (its command line, e.g. ``--nproc 2``):
the same trainer code, only deeper.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import fsdp2_trainer as example  # noqa: E402

if __name__ == "__main__":
    vocab, dim, _, seq_len = example.TinyLM.__init__.__defaults__
    example.TinyLM.__init__.__defaults__ = (vocab, dim, int(sys.argv[1]), seq_len)
    code = example.main(sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the example does: a gloo thread can abort interpreter teardown
