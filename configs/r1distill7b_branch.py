"""GRPO + Branch on DeepSeek-R1-Distill-Qwen-7B (long reasoning; think/answer template, 8k completions).

    python -m sage_jax.train --config configs/r1distill7b_branch.py --workdir gs://BUCKET/r1distill7b_branch \
        --config.model.path=/path/to/DeepSeek-R1-Distill-Qwen-7B

Hardware: TPU v5p-128 (longer rollouts). Should produce (paper, pass@64): 0.452 / 0.774 (GRPO: 0.449 / 0.771).
"""

from configs import qwen7b_branch

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = qwen7b_branch.get_config(arg)
    c.model.path = "checkpoints/DeepSeek-R1-Distill-Qwen-7B"
    c.data.template = "r1_think"
    c.rollout.update(max_new_tokens=8192, temperature=0.6, top_p=0.95)
    c.eval.update(n=64, ks=(1, 4, 16, 64), temperature=0.6, top_p=0.95)
    return c
