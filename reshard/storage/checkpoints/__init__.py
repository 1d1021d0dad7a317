"""Checkpoint formats on disk: how each kind of checkpoint lays out its bytes, read and written.

PyTorch DCP (`dcp`: `.metadata` and items by byte range; `index`: `CheckpointIndex`, the checkpoint
in global terms; `save_plans`; `fastread`: zero-copy tensor items; `archive`: the `torch.save`
archive of one tensor; `crcledger`: stored bytes checked against the CRC-32 their writer recorded;
`dcp_writer`: the streaming writer), torch's safetensors-backed DCP (`hf_dcp`), reshard's per-rank
safetensors (`local_format`), Hugging Face safetensors (`safetensors_format`) and the trainer
files kept beside a checkpoint (`sidecars`).

Why a room: these modules know one format each and share the `CheckpointIndex` interface;
what they decode with is in `reshard.storage.pickles`, how they touch bytes in
`reshard.storage.files`, a checkpoint in a store in `reshard.storage.objectstore`.
(Named `checkpoints`, not `formats`: `reshard.formats` is the shipped data of `formats/`.)
"""
