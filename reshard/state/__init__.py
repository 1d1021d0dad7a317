"""Trainer-state translators: what a new world size does to the batch recipe, the LR
schedule, the data position and the RNG streams. They know training, nothing of bytes:
each returns a plain decision (dataclass) that the plan records and the executor applies.
"""
