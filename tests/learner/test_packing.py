"""Packing is pure logic: per-token data lands on the positions that predict it; splits are exact."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.learner.packing import (
    IGNORE_INDEX,
    make_sequence,
    pack,
    split_micro_batches,
    split_over_ranks,
)


def test_completion_tokens_are_predicted_at_the_right_positions():
    s = make_sequence(
        0,
        np.array([10, 11, 12]),
        np.array([20, 21]),
        loss_mask=np.array([1, 0], np.float32),
        behavior_logprobs=np.array([-0.5, -0.75], np.float32),
        versions=np.array([4, 5]),
    )
    assert s.input_ids.tolist() == [10, 11, 12, 20]
    assert s.labels.tolist() == [11, 12, 20, 21]
    assert s.mask.tolist() == [0, 0, 1, 0]
    assert s.behavior_logp.tolist() == [0, 0, -0.5, -0.75]
    assert s.versions.tolist() == [0, 0, 4, 5]


def test_empty_prompt_cannot_predict_its_first_token_and_max_len_cuts():
    s = make_sequence(0, np.array([], np.int64), np.array([1, 2, 3]))
    assert s.input_ids.tolist() == [1, 2] and s.labels.tolist() == [2, 3]
    assert s.mask.tolist() == [1, 1]  # tokens 2 and 3; token 1 has nothing before it
    cut = make_sequence(0, np.array([1, 2]), np.array([3, 4, 5, 6]), max_len=3)
    assert cut.input_ids.tolist() == [1, 2, 3] and cut.labels.tolist() == [2, 3, 4]
    assert cut.mask.tolist() == [0, 1, 1]


def test_pack_restarts_positions_and_selects_trained_tokens():
    a = make_sequence(0, np.array([1, 2]), np.array([3, 4]), advantage=1.5)
    b = make_sequence(1, np.array([5]), np.array([6, 7, 8]), advantage=-2.0)
    mb = pack([a, b])
    assert mb.tokens.tolist() == [[1, 2, 3, 5, 6, 7]]
    assert mb.positions.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert mb.labels.tolist() == [[2, 3, 4, 6, 7, 8]]
    assert mb.sel.tolist() == [1, 2, 3, 4, 5]
    assert mb.seq_ids.tolist() == [0, 0, 1, 1, 1]
    assert mb.advantages.tolist() == [1.5, 1.5, -2.0, -2.0, -2.0]
    empty = pack([])
    assert empty.is_empty and empty.sel.numel() == 0 and empty.labels.item() == IGNORE_INDEX


lengths = st.lists(st.integers(1, 50), min_size=0, max_size=30)


@settings(max_examples=60, deadline=None)
@given(lengths, st.integers(1, 4), st.integers(1, 120))
def test_splits_keep_every_sequence_exactly_once(lens, world, max_tokens):
    seqs = [make_sequence(i, np.array([1]), np.arange(n) + 3) for i, n in enumerate(lens)]
    shards = split_over_ranks(seqs, world)
    assert sorted(s.index for sh in shards for s in sh) == list(range(len(lens)))
    loads = [sum(len(s) for s in sh) for sh in shards]
    if seqs:  # greedy balance: no rank exceeds the lightest by more than the longest sequence
        assert max(loads) - min(loads) <= max(len(s) for s in seqs)
    for sh in shards:
        bins = split_micro_batches(sh, max_tokens)
        assert sorted(s.index for b in bins for s in b) == sorted(s.index for s in sh)
        for b in bins:
            assert len(b) == 1 or sum(len(s) for s in b) <= max_tokens
