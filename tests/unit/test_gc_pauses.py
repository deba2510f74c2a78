"""dyad.gc_pauses: the time Python's collector held the process, per command."""

from __future__ import annotations

import gc

from dyad.gc_pauses import GcPauses, Pauses


def test_a_collection_is_timed_and_taken_once():
    pauses = GcPauses()
    try:
        gc.collect()
        gc.collect(0)
        taken = pauses.take()
        assert taken.collections >= 2  # and any the interpreter ran by itself
        assert taken.seconds > 0
        assert taken.oldest_generation == 2
        assert pauses.take() == Pauses()
    finally:
        pauses.close()


def test_closed_it_stops_counting():
    pauses = GcPauses()
    pauses.close()
    gc.collect()
    assert pauses.take() == Pauses()
