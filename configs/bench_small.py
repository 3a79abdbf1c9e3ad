"""The sampler benchmark's shape as a run config, for the plan's decode check (not a training recipe).

    python -m sage_jax.plan --config configs/bench_small.py --compiler tpu --chip v5e --devices 1 --decode-rows 64,256

`python -m sage_jax.bench sampler --preset small` decodes with the small preset (28M parameters) in bf16, prompts of
32 tokens and up to 512 new ones, 8 prompts x 8 samples; the plan judges the same decode program compiled by XLA:TPU
(`decode: rows R, copies C, bytes X ideal, predicted T tokens/s/chip`, sage_jax.plan.decode).
"""

from configs import base

ARGS = ()


def get_config(arg=None):
    c = base.get_config()
    c.model.update(preset="small", param_dtype="bfloat16", compute_dtype="bfloat16", ref_dtype="bfloat16")
    c.mesh.shape = (1, -1, 1)
    c.data.update(task="countdown", max_prompt_len=32, eval="")
    c.rollout.update(prompts_per_step=8, group_size=8, max_new_tokens=512, min_p=0.0)
    c.train.update(steps=1, reward="countdown")
    return c
