"""ElasticSampler: the samples an optimizer step consumes never depend on the world size."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.train import ElasticSampler


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def consume_step(s: ElasticSampler, global_batch: int, world: int, grad_accum: int) -> list[int]:
    """What all ranks together read for one optimizer step, then advance."""
    ids = []
    for micro in range(grad_accum):
        for rank in range(world):
            ids.extend(s.local_ids(global_batch, world, rank, micro, grad_accum))
    s.advance(global_batch)
    return ids


@st.composite
def recipes(draw):
    """A global batch and two (world size, grad_accum) recipes that keep it."""
    global_batch = draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 24]))
    def recipe():
        world = draw(st.sampled_from(divisors(global_batch)))
        accum = draw(st.sampled_from(divisors(global_batch // world)))
        return world, accum
    return global_batch, recipe(), recipe()


@settings(max_examples=150, deadline=None)
@given(recipes(), st.integers(1, 50), st.integers(0, 2**31 - 1), st.integers(1, 12), st.data())
def test_step_sets_do_not_depend_on_world_size(recipe, dataset_len, seed, steps, data):
    global_batch, (w1, a1), (w2, a2) = recipe
    s1, s2 = ElasticSampler(dataset_len, seed), ElasticSampler(dataset_len, seed)
    for _ in range(steps):
        expected = s1.step_ids(global_batch)
        got1 = consume_step(s1, global_batch, w1, a1)
        got2 = consume_step(s2, global_batch, w2, a2)
        assert got1 == expected  # each rank/micro-step gets a contiguous slice of the window
        assert Counter(got1) == Counter(got2)
        assert s1.state_dict() == s2.state_dict()


@settings(max_examples=150, deadline=None)
@given(recipes(), st.integers(1, 40), st.integers(0, 1000), st.integers(0, 10), st.integers(1, 10))
def test_switching_world_size_at_a_step_boundary_neither_repeats_nor_skips(recipe, dataset_len, seed, before, after):
    global_batch, (w1, a1), (w2, a2) = recipe
    reference = ElasticSampler(dataset_len, seed)
    uninterrupted = [consume_step(reference, global_batch, w1, a1) for _ in range(before + after)]

    first = ElasticSampler(dataset_len, seed)
    part1 = [consume_step(first, global_batch, w1, a1) for _ in range(before)]
    state = first.state_dict()  # what a checkpoint stores (same on every rank)
    resumed = ElasticSampler(dataset_len, seed=12345)  # a fresh job, other default seed
    resumed.load_state_dict(state)
    part2 = [consume_step(resumed, global_batch, w2, a2) for _ in range(after)]

    assert [Counter(x) for x in part1 + part2] == [Counter(x) for x in uninterrupted]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 30), st.sampled_from([1, 2, 3, 4, 8]), st.integers(0, 100), st.integers(1, 4))
def test_every_epoch_is_a_permutation_and_rolls_over(dataset_len, global_batch, seed, epochs):
    s = ElasticSampler(dataset_len, seed)
    total = epochs * dataset_len
    stream: list[int] = []
    while len(stream) < total:
        stream.extend(consume_step(s, global_batch, 1, 1))
    for e in range(epochs):
        assert sorted(stream[e * dataset_len:(e + 1) * dataset_len]) == list(range(dataset_len))
    consumed = len(stream)
    assert s.epoch == consumed // dataset_len and s.cursor == consumed % dataset_len


def test_epochs_use_different_orders_and_state_round_trip():
    s = ElasticSampler(100, seed=3)
    assert s.permutation(0).tolist() != s.permutation(1).tolist()
    s.advance(130)
    assert s.state_dict() == {"seed": 3, "epoch": 1, "cursor": 30, "dataset_len": 100}
    t = ElasticSampler(100)
    t.load_state_dict(s.state_dict())
    assert t.step_ids(8) == s.step_ids(8) == s.permutation(1)[30:38].tolist()


def test_window_straddling_an_epoch_boundary():
    s = ElasticSampler(10, seed=1)
    s.advance(8)
    ids = s.step_ids(4)
    assert ids == s.permutation(0)[8:].tolist() + s.permutation(1)[:2].tolist()


def test_bad_arguments():
    s = ElasticSampler(10)
    with pytest.raises(ValueError, match="not divisible"):
        s.local_ids(6, 4, 0)
    with pytest.raises(ValueError):
        s.local_ids(8, 2, 2)
    with pytest.raises(ValueError):
        s.load_state_dict({"seed": 0, "epoch": 0, "cursor": 0, "dataset_len": 11})
    with pytest.raises(KeyError):
        s.load_state_dict({"seed": 0})
