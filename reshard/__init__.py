"""reshard: move distributed-training checkpoints between parallel layouts, keeping what the run means."""

__version__ = "0.1.0"
