"""The paper's shared setting (Qwen2.5-Math-7B base, GRPO, k3 anchor); every qwen7b_* arm states only its differences.

Not a run by itself: use one of the arm configs, e.g. `python -m sage_jax.train --config configs/qwen7b_branch.py`.
Sized for a TPU v5p-64 pod slice (32 chips, 95 GB HBM each) or 4 nodes x 8 H100/H200: fully sharded params
(fsdp over the data-parallel devices, 4-way tensor parallel), fp32 master weights and Adam state, bf16 compute, and
a bf16 reference model. Qwen2.5-Math-7B has a 4096-token context, so prompt (1024) + completion (3072) fit in it;
the reference implementation's 6144-token completions need a longer-context model (see r1distill7b_branch).
`python -m sage_jax.plan --config configs/qwen7b_branch.py --devices 32` checks the memory plan before renting.
"""

from configs import base


def get_config(arg=None):
    c = base.get_config()
    c.model.update(path="checkpoints/Qwen2.5-Math-7B", param_dtype="float32", compute_dtype="bfloat16",
                   ref_dtype="bfloat16", remat=True, logits_chunk=512)
    c.mesh.shape = (1, -1, 4)
    c.data.update(task="math", train="math_train_l3to5", eval="aime24,aime25,amc23,math500",
                  template="qwen_math_boxed", max_prompt_len=1024)
    c.rollout.update(prompts_per_step=128, group_size=8, temperature=1.0, top_p=1.0, min_p=0.01,
                     max_new_tokens=3072)
    c.loss.update(guide="none", kl_estimator="k3", beta=0.05, eps_low=0.2, eps_high=0.2,
                  aggregation="seq-mean-token-mean")
    c.optim.update(lr=5e-6, schedule="constant", warmup_steps=0, weight_decay=0.01, grad_clip=1.0, grad_accum=16)
    c.train.update(steps=1000, ckpt_every=25, keep_ckpts=3, eval_every=100, reward="math", reward_workers=16,
                   reward_timeout=10.0)
    c.eval.update(n=256, ks=(1, 4, 16, 64, 256), temperature=1.0, top_p=1.0, min_p=0.0, at_start=False)
    return c
