"""GRPO + Branch on Qwen2.5-Math-7B with a Python tool: tool-integrated reasoning (the model writes ```python
blocks, each runs in the sandbox, its output comes back as an untrained ```output block).

    python -m sage_jax.train --config configs/qwen7b_tools.py --workdir gs://BUCKET/qwen7b_tools \
        --config.model.path=/path/to/Qwen2.5-Math-7B

Hardware: as configs/qwen7b_branch.py (TPU v5p-64 or 32 x H100/H200). On a multi-host slice the first host runs
the tools and tells the others which calls have answered (eval/tool_loop.py). Up to 4 calls per row, each at most
5 s and 512 output tokens, all within the 6144-token budget. Not run at this scale: no result to expect from here
(the CPU study of configs/tools_arms.py is the learning result).
Plan it: `python -m sage_jax.plan --config configs/qwen7b_tools.py --compiler tpu --chip v5p --topology 2x4x4`.
"""

from configs import qwen7b_branch

ARGS = ()


def get_config(arg=None):
    c = qwen7b_branch.get_config()
    c.rollout.update(tools=("python",), tool_format="markdown", max_turns=4, tool_timeout=5.0, max_tool_tokens=512,
                     tool_workers=16)
    return c
