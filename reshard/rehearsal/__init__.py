"""Deterministic restore rehearsal of a topology transition, on the user's trainer (the trainer
contract, formats/trainer_contract.md) or the reference trainer run through the same contract."""
from reshard.rehearsal.ckpt import make_control, naive_cursor, rewrite_checkpoint
from reshard.rehearsal.contract import PLACEHOLDERS, TrainerCommand, reference_command
from reshard.rehearsal.recipe import pick_recipe
from reshard.rehearsal.judge import DEFAULT_TOLERANCES
from reshard.rehearsal.rehearse import rehearse
from reshard.render.rehearsal import render_rehearsal

__all__ = ["rehearse", "render_rehearsal", "rewrite_checkpoint", "make_control", "naive_cursor", "DEFAULT_TOLERANCES",
           "TrainerCommand", "reference_command", "PLACEHOLDERS", "pick_recipe"]
