"""Tiny countdown config for the test suite (seconds on a CPU); not for real runs.

    python -m sage_jax.train --config configs/tiny_test.py --workdir /tmp/tiny
"""

from configs import base

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = base.get_config()
    c.seed = 0
    c.model.update(preset="tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                   compute_dtype="float32", ref_dtype="float32", logits_chunk=32)
    c.data.update(task="countdown", num_train=200, num_eval=16, max_number=9, max_prompt_len=32, eval="",
                  ood_max_number=0)
    c.rollout.update(prompts_per_step=4, group_size=4, max_new_tokens=16, min_p=0.0)
    c.loss.update(guide="branch", tau=0.5)
    c.optim.update(lr=1e-3, warmup_steps=0, weight_decay=0.0)
    c.train.update(steps=3, ckpt_every=1, eval_every=0, sample_every=1, reward="countdown", reward_workers=0,
                   keep_ckpts=5, progress=False, export_hf=False)
    c.eval.update(n=4, ks=(1, 4), problems=4, max_new_tokens=16, at_start=False, at_end=False)
    c.sft.update(steps=0, batch_size=16, num_demos=200)
    return c
