"""GRPO + Branch on Qwen3-4B-Base (Qwen3: per-head q/k RMSNorm, 128-wide heads, no q/k/v biases).

    python -m sage_jax.train --config configs/qwen3_4b_branch.py --workdir gs://BUCKET/qwen3_4b_branch \
        --config.model.path=/path/to/Qwen3-4B-Base

Hardware: TPU v5p-64 (32 chips) or 32 x H100/H200, as the 7B arms: full fine-tuning, fp32 master weights and Adam
state sharded over fsdp x 4-way tensor, the 7B arms' lengths (prompt 1024 + completion 3072). Qwen3-4B-Base has a
32k context, but 8192-token rows do not fit while attention is materialised per layer, and its 8 KV heads over 36
layers make the rollout's KV cache twice the 7B's (figures: docs/PERFORMANCE.md). Check the plan with
`python -m sage_jax.plan --config configs/qwen3_4b_branch.py --devices 32`.
Add --config.model.lora.rank=8 to train rank-8 adapters instead (see configs/qwen7b_branch_lora.py).
"""

from configs import qwen7b_branch

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = qwen7b_branch.get_config(arg)
    c.model.path = "checkpoints/Qwen3-4B-Base"
    c.mesh.shape = (1, -1, 4)
    c.optim.grad_accum = 32  # 32-row micro-batches: the 4B's wider attention (32 heads of 128) needs half the 7B's
    return c
