"""The counting functions of stats.py, alone, on trajectories written by hand."""

from cllm.decoding.stats import (
    DecodeStats,
    correct_prefix_length,
    fast_forwarded_per_update,
    stationary_count,
)

FIXED = (10, 11, 12, 13)


def test_correct_prefix_length_stops_at_first_wrong_token():
    assert correct_prefix_length((10, 11, 1, 13), FIXED) == 2
    assert correct_prefix_length((9, 11, 12, 13), FIXED) == 0
    assert correct_prefix_length(FIXED, FIXED) == 4


def test_correct_prefix_length_ignores_tokens_after_a_short_fixed_point():
    assert correct_prefix_length((10, 99, 5, 5), (10, 99)) == 2


def test_fast_forwarded_counts_the_growth_of_the_correct_prefix():
    trajectory = [(10, 10, 10, 10), (10, 11, 1, 13), (10, 11, 12, 13), (10, 11, 12, 13)]
    assert fast_forwarded_per_update(trajectory, FIXED) == [1, 2, 0]


def test_fast_forwarded_is_empty_for_a_block_known_before_any_update():
    assert fast_forwarded_per_update([(14,)], (14,)) == []


def test_stationary_counts_a_token_correct_behind_a_wrong_one_that_stays():
    # position 3 (13) is right from state 1 on while position 2 is still wrong
    trajectory = [(10, 10, 10, 10), (10, 11, 1, 13), (10, 11, 12, 13)]
    assert stationary_count(trajectory, FIXED) == 1


def test_stationary_ignores_a_correct_token_that_changes_later():
    # position 2 is right in state 0 (behind a wrong token), wrong in state 1, right again in 2
    trajectory = [(10, 5, 12, 5), (10, 11, 7, 5), (10, 11, 12, 13)]
    assert stationary_count(trajectory, FIXED) == 0


def test_stationary_ignores_tokens_reached_by_the_contiguous_run():
    trajectory = [(10, 10, 10, 10), (10, 11, 12, 13)]
    assert stationary_count(trajectory, FIXED) == 0


def test_stationary_counts_each_position_once():
    trajectory = [(10, 0, 12, 13), (10, 11, 0, 13), (10, 11, 12, 13)]
    # position 3 stays correct from state 0 with a wrong token before it: one stationary token;
    # position 2 is correct in state 0 but changes, then is reached by the contiguous run
    assert stationary_count(trajectory, FIXED) == 1


def test_decode_stats_histogram_and_tokens_per_forward():
    stats = DecodeStats(forward_passes=4, new_tokens=5, accepted=[1, 1, 1, 2])
    assert stats.accepted_histogram() == {1: 3, 2: 1}
    assert stats.tokens_per_forward == 5 / 4


def test_decode_stats_add_block_records_iterations_fast_forward_and_stationary():
    stats = DecodeStats()
    stats.add_block([(10, 10, 10, 10), (10, 11, 1, 13), (10, 11, 12, 13), (10, 11, 12, 13)], FIXED)
    stats.add_block([(14,)], (14,))
    assert stats.iterations_per_block == [3, 0]
    assert stats.fast_forwarded == [1, 2, 0]
    assert stats.stationary == [1, 0]
    assert stats.mean_fast_forwarded == 1.0
    assert stats.summary()["stationary_tokens"] == 1
