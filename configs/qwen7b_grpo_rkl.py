"""GRPO with the exact reverse KL(pi || pi_ref) over completions (k1 in the reward) on Qwen2.5-Math-7B.

    python -m sage_jax.train --config configs/qwen7b_grpo_rkl.py --workdir gs://BUCKET/qwen7b_grpo_rkl

The "GRPO (reverse KL)" of the paper's theory, whose stationary policy is pi_ref * exp(r / beta) / Z; qwen7b_grpo
is the authors' code (k3 in the loss). Each completion's reward gets -beta * sum_t log(pi / pi_ref) before the
group advantages.
Hardware: TPU v5p-64. Not in the paper's tables.
"""

from configs import paper

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.update(kl_estimator="k1", kl_in_reward=True)
    return c
