"""Tool rows in one pool kept on the device (eval/tool_loop._in_pool over sampling/session.py) against the same rows
through sampler calls that return and come back (the call path): the same ids, masks and log-probs."""

import jax
import numpy as np

from sage_jax.bench import tools as bench_tools
from sage_jax.eval import tool_loop
from sage_jax.models import decoder as model_lib
from sage_jax.sampling import sampler
from sage_jax.tools.base import ToolPool

CFG = model_lib.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                            intermediate_size=64, rope_theta=10000.0, max_position_embeddings=256, eos_token_ids=(2,))
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12], [13, 14, 15, 16]]


def test_tool_rows_in_the_pool_equal_rows_through_sampler_calls():
    params = model_lib.init_params(CFG, jax.random.key(0))
    key, G, C = jax.random.key(4), 3, 48
    plain = jax.device_get(sampler.generate(CFG, params, PROMPTS, C, eos_ids=(2,), seed=key, num_samples=G))
    markers, share = bench_tools._markers(np.asarray(plain.tokens), np.asarray(plain.lengths), 2)
    assert 0.2 < share < 0.8
    fn = tool_loop.bind_sampler(CFG, params, dict(max_new_tokens=C, temperature=1.0), key,
                                min_rows=len(PROMPTS) * G + 1)
    fmt = bench_tools._MarkerFormat(markers)  # every draw of a marker is a call; its output 4 observed tokens
    with ToolPool({"sleep": bench_tools._SleepTool(0.02)}, num_workers=4) as pool:
        run = lambda **kw: tool_loop.generate_with_tools(fn, PROMPTS, G, fmt, pool, tool_loop.ToolSettings(
            max_turns=2, **kw), C, key)
        in_pool, calls = run(steps_per_call=3), run(in_pool=False)
    assert in_pool["tool_stats"]["tools/calls_per_row"] > 0.2
    for k in ("tokens", "sampled_mask", "lengths", "finished"):
        np.testing.assert_array_equal(in_pool[k], calls[k], err_msg=k)
    observed = (in_pool["sampled_mask"] == 0) & (np.arange(C)[None, :] < in_pool["lengths"][:, None])
    assert observed.sum() >= 4 and np.isnan(in_pool["sampler_logp"][observed]).all()
    sampled = in_pool["sampled_mask"] > 0
    np.testing.assert_allclose(in_pool["sampler_logp"][sampled], calls["sampler_logp"][sampled], atol=1e-5)
    assert [r["calls"] for r in in_pool["row_tools"]] == [r["calls"] for r in calls["row_tools"]]
    assert in_pool["messages"] == calls["messages"]
