"""One process of the multi-process tool-loop test (tests/eval/test_tool_loop_processes.py): the tool loop over a
scripted sampler with a tool whose calls take a random time, then a digest of the rows, of the rows each sampler call
carried, and of the calls this process ran.

Run as: python tests/eval/tool_loop_worker.py [COORDINATOR NUM_PROCESSES PROCESS_ID]
"""

import json
import os
import sys

if len(sys.argv) > 1:
    os.environ.update(SAGE_COORDINATOR=sys.argv[1], SAGE_NUM_PROCESSES=sys.argv[2], SAGE_PROCESS_ID=sys.argv[3])

import jax  # noqa: E402

from sage_jax.eval import tool_loop  # noqa: E402
from sage_jax.models import sharding  # noqa: E402
from sage_jax.tools.base import ToolPool  # noqa: E402
from tests.eval.jitter_tool import JitterTool  # noqa: E402
from tests.training.test_tool_rollouts import EOS, ScriptedGenerate, StubFormat  # noqa: E402


sharding.initialize_distributed()
gen = ScriptedGenerate([5, 3, 6, 6, 17, 8, 9, EOS])  # two calls (at 3 and at 17), then the answer
gen.eos = EOS
carried = []


def generate_fn(prompts, G, resume, stop, limits, extra_eos):
    carried.append(sorted(r.row_id for r in resume))
    return gen(prompts, G, resume, stop, limits, extra_eos)


tool = JitterTool("slow", 0.2)
with ToolPool({"slow": tool}, num_workers=3) as pool:
    ro = tool_loop.generate_with_tools(generate_fn, [[1, 2], [1, 4]], 4, StubFormat(), pool,
                                       tool_loop.ToolSettings(), 64, 0)
print("DIGEST " + json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                              "tokens": ro["tokens"].tolist(), "mask": ro["sampled_mask"].tolist(),
                              "carried": carried, "tool_calls_run": tool.calls,
                              "calls_per_row": float(ro["tool_stats"]["tools/calls_per_row"])}), flush=True)
