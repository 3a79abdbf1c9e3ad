"""bench tools: the marker token that makes about half the rows call."""

import numpy as np

from sage_jax.bench import tools


def test_marker_is_the_token_about_half_the_rows_draw():
    tokens = np.array([[11, 12, 2, 0], [11, 13, 2, 0], [14, 12, 12, 2], [15, 16, 17, 2]])
    lengths = np.array([3, 3, 4, 4])
    marker, share = tools._marker(tokens, lengths, eos=2)
    assert share == 0.5 and marker in (11, 12)
