"""Pickles decoded and encoded without executing them or importing torch.

The allow-listing unpickler and the cost bound of any pickle (`safe_pickle`, its cost scan also
built in C from `costscan.c`), DCP's `.metadata` read as columns (`metadata_columns`, by the
native streaming decoder `metadecode.c` when setup.py built it) and written (`metadata_pickle`),
and small `torch.save` items decoded (`plain_items`).

Why a room: a crafted pickle is the most hostile input reshard reads; what may build an object
from one lives here, in one place, with its native twins checked against it by the tests.
"""
