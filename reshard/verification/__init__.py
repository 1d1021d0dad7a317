"""Verification: two checkpoints compared value for value, and the evidence (a recomputed plan) that excuses each intended difference."""
