"""GRPO + Branch on Qwen2.5-Math-7B with LoRA as the authors ran it: rank 8, alpha 16, on every linear layer of
attention and MLP (q, k, v, o, gate, up, down), PEFT's initialisation (B = 0), their learning rate 5e-6.

    python -m sage_jax.train --config configs/qwen7b_branch_lora.py --workdir gs://BUCKET/qwen7b_branch_lora \
        --config.model.path=/path/to/Qwen2.5-Math-7B

Only the 20.2M adapter parameters and their Adam moments are trained and checkpointed; the frozen base is held once,
in bf16 (what the matmuls run in anyway), and is also the reference policy: no fp32 master weights, no Adam moments
of the 7.6B weights, no second copy for the reference (`python -m sage_jax.bench lora memory`, docs/PERFORMANCE.md). Outputs: WORKDIR/hf_export (the merged model) and
WORKDIR/peft_adapter (loads with peft.PeftModel.from_pretrained; --config.model.lora.init_from=DIR continues from it).
"""

from configs import qwen7b_branch

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = qwen7b_branch.get_config(arg)
    c.model.lora.update(rank=8, alpha=16.0, dropout=0.0)  # targets: every linear layer (the default)
    c.model.param_dtype = "bfloat16"  # the frozen base; adapters and their optimizer state are fp32
    return c
