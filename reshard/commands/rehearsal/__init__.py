"""Deterministic restore rehearsal of a topology transition on the reference model."""
from reshard.commands.rehearsal.ckpt import make_control, naive_cursor, rewrite_checkpoint
from reshard.commands.rehearsal.rehearse import DEFAULT_TOLERANCES, rehearse
from reshard.render.rehearsal import render_rehearsal

__all__ = ["rehearse", "render_rehearsal", "rewrite_checkpoint", "make_control", "naive_cursor", "DEFAULT_TOLERANCES"]
