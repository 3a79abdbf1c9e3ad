"""bench tools: the marker tokens that make about half the rows call."""

import numpy as np

from sage_jax.bench import tools


def test_marker_is_the_token_about_half_the_rows_draw():
    tokens = np.array([[11, 12, 2, 0], [11, 13, 2, 0], [14, 12, 12, 2], [15, 16, 17, 2]])
    lengths = np.array([3, 3, 4, 4])
    markers, share = tools._markers(tokens, lengths, eos=2)
    assert share == 0.5 and markers in ((11,), (12,))


def test_markers_are_several_tokens_where_no_one_token_reaches_half():
    tokens = np.array([[11, 2], [12, 2], [13, 2], [14, 2], [15, 2], [16, 2]])
    lengths = np.full(6, 2)
    markers, share = tools._markers(tokens, lengths, eos=2)
    assert share == 0.5 and markers == (11, 12, 13)
