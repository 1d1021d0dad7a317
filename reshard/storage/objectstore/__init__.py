"""Checkpoints in object storage (`s3://bucket/prefix`).

The one parser of a store URL (`urls`), a checkpoint in a store read by byte range through a
local stand-in directory (`remote`), and outputs made in a local stage and published in DCP's
commit order (`upload`).

Why a room: a store has no rename, no partial write and its own failure modes (ETags, bounded
requests); its readers and writers are kept together, apart from local files.
"""
