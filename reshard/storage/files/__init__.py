"""Byte I/O and durable files on this machine.

Positional and direct I/O (`fileio`), outputs that appear all at once (`atomic`) and what
`--overwrite` may replace (`replaceable`), bytes shared under a second name (`linkfs`: reflink,
else hard link), the journal that lets a killed conversion resume (`journal`), and item
checksums, destination space and out-of-space errors (`integrity`).

Why a room: these know files and file systems, not what a checkpoint means; every format
reads and writes through them.
"""
