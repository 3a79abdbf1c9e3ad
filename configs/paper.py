"""The paper's shared setting (Qwen2.5-Math-7B base, GRPO, k3 anchor); every qwen7b_* arm states only its differences.

Not a run by itself: use one of the arm configs, e.g. `python -m sage_jax.train --config configs/qwen7b_branch.py`.
Sized for a TPU v5p-64 pod slice (32 chips, 95 GB HBM each) or 4 nodes x 8 H100/H200: fully sharded params
(fsdp over the data-parallel devices, 4-way tensor parallel), fp32 master weights and Adam state, bf16 compute, and
a bf16 reference model. Qwen2.5-Math-7B has a 4096-token context, so prompt (1024) + completion (3072) fit in it;
the reference implementation's 6144-token completions need a longer-context model (see r1distill7b_branch).
`python -m sage_jax.plan --config configs/qwen7b_branch.py --devices 32` checks the memory plan before renting.
The loss, optimizer and sampling defaults of configs/base.py are the reference trainer's; only what differs is here.
"""

from configs import base

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = base.get_config()
    c.model.update(path="checkpoints/Qwen2.5-Math-7B", remat=True)
    c.mesh.shape = (1, -1, 4)
    # the paper's prompt (Qwen2.5-Math's system prompt in ChatML), not the model's chat template
    c.data.update(eval="aime24,aime25,amc23,math500", max_prompt_len=1024, template="qwen_math_boxed")
    c.rollout.update(prompts_per_step=128, max_new_tokens=3072)
    c.optim.update(grad_accum=16)
    c.train.update(ckpt_every=25, reward_workers=16)
    c.eval.update(n=256, ks=(1, 4, 16, 64, 256), at_start=False)
    return c
