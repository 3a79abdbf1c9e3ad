"""The embedded default: the whole SAGE loop on a laptop CPU in minutes.

    python -m sage_jax.train --config configs/cpu_demo.py --workdir /tmp/sage_demo

Hardware: any CPU (sized for 2 cores, ~8 minutes). Task: countdown (reach a target with 3 numbers and + - * /), a
1M-parameter Qwen2-style model with a character tokenizer. It runs an SFT warm-start whose demonstrations favour
one strategy (multiplication, 70%) over the other valid ones, then GRPO + Branch (k3 anchor to q * pi_ref), then
pass@k on held-out and 4-number (out-of-distribution) problems. Expect pass@1 to rise after RL; the console ends with
a before/after table and DIR/summary.json holds the same numbers. Presets: `:quick` (a one-minute smoke run).
"""

from configs import base

ARGS = ("quick",)  # accepted config arguments (configs/cpu_demo.py:quick); any other is an error


def get_config(arg=None):
    c = base.get_config()
    c.seed = 0
    c.model.update(preset="tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                   intermediate_size=512, compute_dtype="float32", ref_dtype="float32", logits_chunk=64)
    c.mesh.shape = (1, -1, 1)
    c.data.update(task="countdown", num_train=1000, num_eval=200, max_number=15, max_prompt_len=32, eval="")
    c.rollout.update(prompts_per_step=32, group_size=8, max_new_tokens=24, temperature=1.0, min_p=0.0)
    c.loss.guide = "branch"
    c.optim.update(lr=2e-4, warmup_steps=5, weight_decay=0.0)
    # packing off: with 24-token completions 42% of the padded positions are padding (about 18% packed, in 2 packed
    # shapes over 40 steps, each compiled once: packing_report --steps 40); not measured faster on this demo
    c.train.update(steps=40, ckpt_every=20, eval_every=0, sample_every=20, reward="countdown", reward_workers=0,
                   keep_ckpts=2, packing=False)
    c.eval.update(n=32, ks=(1, 4, 16, 32), problems=100, max_new_tokens=24)
    c.sft.update(steps=400, lr=3e-3, warmup_steps=30, batch_size=64, data="countdown", num_demos=4000)
    if arg == "quick":
        c.sft.steps = 60
        c.train.steps = 4
        c.train.ckpt_every = 2
        c.eval.update(n=8, ks=(1, 8), problems=16)
    return c
