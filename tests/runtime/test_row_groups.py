"""Which decode rows attend together, and the (row, key) pairs a step attends."""

from __future__ import annotations

from runtime.row_groups import attended_pairs, split_rows


def test_rows_of_similar_length_attend_together_as_the_padded_batch():
    lengths = [300, 420, 380, 700]
    assert split_rows(lengths) is None
    assert attended_pairs(lengths) == 4 * 700  # each row as many keys as the longest


def test_rows_far_longer_than_the_rest_attend_apart():
    lengths = [300, 10_000, 300, 9_000] + [300] * 12
    assert split_rows(lengths) == [[1, 3], [0, 2] + list(range(4, 16))]
    assert attended_pairs(lengths) == 2 * 10_000 + 14 * 300  # 15% of the padded 160,000


def test_a_split_that_saves_too_little_is_not_made():
    # Apart: 3,000 + 4 x 300 = 4,200 pairs, 28% of the padded 15,000: not under a quarter.
    assert split_rows([300, 300, 300, 300, 3_000]) is None
    assert attended_pairs([]) == 0 and attended_pairs([50]) == 50
