"""GRPO + Branch on Qwen2.5-3B.

    python -m sage_jax.train --config configs/qwen3b_branch.py --workdir gs://BUCKET/qwen3b_branch \
        --config.model.path=/path/to/Qwen2.5-3B

Hardware: TPU v5p-32 or 16 x H100. Expect pass@1 and pass@k at or above the GRPO arm (--config.loss.guide=none).
"""

from configs import qwen7b_branch

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = qwen7b_branch.get_config(arg)
    c.model.path = "checkpoints/Qwen2.5-3B"
    c.mesh.shape = (1, -1, 2)
    c.optim.grad_accum = 8
    return c
