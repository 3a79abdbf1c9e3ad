"""The paper's "BNPO" arm on Qwen2.5-Math-7B: GRPO with the loss averaged over every token of the batch (token-mean).

    python -m sage_jax.train --config configs/qwen7b_bnpo.py --workdir gs://BUCKET/qwen7b_bnpo

This is TRL's loss_type="bnpo" (one token normaliser per update batch), which is what the authors ran; it is not the
BNPO paper's Beta-normalised advantages (those are not implemented here). Advantages, clipping and k3 anchor as GRPO.
Hardware: TPU v5p-64. Should produce (paper): pass@1 0.243, pass@256 0.699.
"""

from configs import paper

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.aggregation = "token-mean"
    return c
