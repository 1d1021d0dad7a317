"""Reference trainer: a small GPT on FSDP2 (+TP) over gloo that writes real DCP checkpoints.

From Python::

    from reshard.reference import TrainConfig, run_reference
    run_reference(TrainConfig(dp=4, steps=4, save_at=[2], out="ckpts", log="log.jsonl"))

From a shell: ``python -m reshard.reference --spawn --dp 4 ...`` or under torchrun.
"""
from reshard.reference.model import GPT, GPTConfig, SyntheticTokens
from reshard.reference.trainer import TrainConfig, checkpoint_dirs, run_in_process_group, run_reference

__all__ = ["GPT", "GPTConfig", "SyntheticTokens", "TrainConfig", "run_reference", "run_in_process_group",
           "checkpoint_dirs"]
