"""GRPO + Branch on Qwen2.5-1.5B (a smaller model; paper: SAGE helps at this scale too).

    python -m sage_jax.train --config configs/qwen1p5b_branch.py --workdir gs://BUCKET/qwen1p5b_branch \
        --config.model.path=/path/to/Qwen2.5-1.5B

Hardware: TPU v5p-16 or 8 x H100. Expect pass@1 and pass@k at or above the GRPO arm (--config.loss.guide=none).
Layers recomputed in the backward (remat, as the 3B and 7B configs) and 8 micro-batches of 128 rows (32 per fsdp
device): without remat, at 4 micro-batches, the update kept every layer's matmul outputs and did not fit a chip;
`python -m sage_jax.plan --config configs/qwen1p5b_branch.py --compiler tpu --chip v5p --topology 2x2x2` checks it
(docs/PERFORMANCE.md).
"""

from configs import qwen7b_branch

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = qwen7b_branch.get_config(arg)
    c.model.path = "checkpoints/Qwen2.5-1.5B"
    c.mesh.shape = (1, -1, 2)
    c.optim.grad_accum = 8
    return c
