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


def test_tools_bench_runs_its_arms_in_one_process():
    """A small run: the tool-free arm, an in-pool arm per steps-per-call, the call path; every ratio > 0."""
    rows = tools.main(["tools", "--batch", "8", "--group", "2", "--new-tokens", "24", "--tool-ms", "5", "--repeats",
                       "1", "--steps-per-call", "4,8"])
    assert [r["arm"] for r in rows] == ["plain", "tools_k4", "tools_k8", "tools_calls"]
    assert [r.get("steps_per_call") for r in rows] == [None, 4, 8, None]
    assert all(r["ratio"] > 0 and r["calls_per_row"] > 0 for r in rows[1:])
    assert rows[1]["sampled_tokens"] == rows[2]["sampled_tokens"] == rows[3]["sampled_tokens"]  # the same rows
