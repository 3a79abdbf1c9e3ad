"""One process of the multi-process in-pool test (tests/eval/test_tool_loop_processes.py): tool rows of a tiny random
model in one decode pool on a mesh over every process's devices (bind_sampler's session), a tool whose calls take a
random time, then a digest of the rows and of the calls this process ran.

Run as: python tests/eval/tool_pool_worker.py [COORDINATOR NUM_PROCESSES PROCESS_ID]
"""

import json
import os
import sys

if len(sys.argv) > 1:
    os.environ.update(SAGE_COORDINATOR=sys.argv[1], SAGE_NUM_PROCESSES=sys.argv[2], SAGE_PROCESS_ID=sys.argv[3])

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sage_jax.bench import tools as bench_tools  # noqa: E402
from sage_jax.eval import tool_loop  # noqa: E402
from sage_jax.models import decoder as model_lib, sharding  # noqa: E402
from sage_jax.sampling import sampler  # noqa: E402
from sage_jax.tools.base import ToolPool  # noqa: E402
from tests.eval.jitter_tool import JitterTool  # noqa: E402
from tests.eval.test_tool_pool import CFG, PROMPTS  # noqa: E402


sharding.initialize_distributed()
mesh = sharding.make_mesh((2, 1, 1))
params = model_lib.shard_params(model_lib.init_params(CFG, jax.random.key(0)), mesh, cfg=CFG)
key, G, C = jax.random.key(4), 3, 48
plain = sharding.to_host(sampler.generate(CFG, params, PROMPTS, C, eos_ids=(2,), seed=key, num_samples=G))
markers, _ = bench_tools._markers(np.asarray(plain.tokens), np.asarray(plain.lengths), 2)
fn = tool_loop.bind_sampler(CFG, params, dict(max_new_tokens=C, temperature=1.0), key, min_rows=len(PROMPTS) * G + 1)
tool = JitterTool("sleep", 0.1)
with ToolPool({"sleep": tool}, num_workers=3) as pool:
    ro = tool_loop.generate_with_tools(fn, PROMPTS, G, bench_tools._MarkerFormat(markers), pool,
                                       tool_loop.ToolSettings(max_turns=2, steps_per_call=3), C, key)
print("DIGEST " + json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                              "tokens": ro["tokens"].tolist(), "mask": ro["sampled_mask"].tolist(),
                              "tool_calls_run": tool.calls, "pool_calls": ro["tool_stats"]["tools/sampler_calls"],
                              "calls_per_row": float(ro["tool_stats"]["tools/calls_per_row"])}), flush=True)
