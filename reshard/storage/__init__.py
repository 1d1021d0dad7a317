"""Storage formats and file access: bytes and layouts, nothing of training.

Rooms: `checkpoints` (checkpoint formats on disk), `pickles` (pickles and `.metadata` decoded and
encoded without executing them or importing torch), `files` (byte I/O and durable files),
`objectstore` (checkpoints in object storage); `source` (`Source`, the checkpoint a command
opened) at the top, since every room's caller uses it.
"""
