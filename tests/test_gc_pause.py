"""`reshard.gc_pause`: the collector's pauses around the metadata path and the copy leave it as they found it."""
from __future__ import annotations

import gc

from reshard.gc_pause import frozen_heap, paused_gc


def test_frozen_heap_freezes_for_the_block_only():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        made = []
        made.append(made)  # a cycle made in the block is still collected there
        del made
        assert gc.collect() >= 1
    assert gc.get_freeze_count() == 0


def test_frozen_heap_leaves_a_callers_freeze_alone():
    gc.freeze()
    try:
        with frozen_heap():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0  # not unfrozen: the caller froze it (frozen objects may still be freed)
    finally:
        gc.unfreeze()


def test_paused_gc_nests_and_restores():
    assert gc.isenabled()
    with paused_gc():
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
