"""GRPO + Branch on Qwen2.5-Math-7B: the paper's main result.

    python -m sage_jax.train --config configs/qwen7b_branch.py --workdir gs://BUCKET/qwen7b_branch \
        --config.model.path=/path/to/Qwen2.5-Math-7B

Hardware: TPU v5p-64 (or 32 x H100/H200), ~1000 steps. Guide q = 1 + 0.3 * relu(H_t - 1.2), clamped to [0.6, 1.4].
Should produce (paper, avg of AIME24/25, AMC23, MATH-500): pass@1 0.284 and pass@256 0.729, vs GRPO 0.266 / 0.714.
"""

from configs import paper

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.guide = "branch"  # gamma 0.3, tau 1.2, q in [0.6, 1.4]: the defaults
    return c
