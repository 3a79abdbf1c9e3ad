"""The model-FLOP counts every benchmark (and roofline.py) divides by: matmuls only, as XLA runs them.

Embedding lookups and norms are not matmuls and are left out; attention counts every key XLA computes (the masked
half too).
"""

from __future__ import annotations

from sage_jax.models import decoder as model
from sage_jax.sampling import sampler


def layer_params(cfg: model.ModelConfig) -> int:
    """Parameters of the decoder layers (all but the embedding, unembedding and final norm)."""
    return cfg.num_params - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2) - cfg.hidden_size


def attention_per_key(cfg: model.ModelConfig) -> int:
    """FLOPs per query position per attended key over all layers: scores and mixing, 2 x 2 x heads x head_dim."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim


def train_flops(cfg: model.ModelConfig, rows: int, prompt_len: int, completion_len: int) -> float:
    """Model FLOPs of one forward + backward (3x forward): 2 * matmul params per token over all T tokens, attention
    scores and mixing over all T keys, and the unembedding on completion positions only (the loss needs nothing
    else)."""
    T = prompt_len + completion_len
    D, V = cfg.hidden_size, cfg.vocab_size
    return 3.0 * rows * (T * (2 * layer_params(cfg) + attention_per_key(cfg) * T) + completion_len * 2 * D * V)


def decode_flops(cfg: model.ModelConfig, prompts: int, samples: int, prompt_len: int, new_tokens: int) -> float:
    """Model FLOPs of sampler.generate: the prefill of each prompt once at its bucket length (2 x matmul params per
    token, attention over the bucket, the unembedding at the last position), then new_tokens - 1 decode steps for
    all prompts x samples rows (the first token comes from the prefill), each 2 x matmul params plus the unembedding
    per row and attention over every slot of the cache (prompt bucket + new-token bucket)."""
    P, C = sampler.prompt_bucket(prompt_len), sampler.new_tokens_bucket(new_tokens)
    D, V = cfg.hidden_size, cfg.vocab_size
    per_layer, per_slot = layer_params(cfg), attention_per_key(cfg)
    prefill = prompts * (P * (2 * per_layer + per_slot * P) + 2 * D * V)
    rows = prompts * samples
    return prefill + (new_tokens - 1) * rows * (2 * per_layer + 2 * D * V + per_slot * (P + C))


def rl_step_flops(cfg: model.ModelConfig, prompts: int, group: int, prompt_len: int, new_tokens: int) -> float:
    """Model FLOPs of one RL step as the rl_step mode runs it: generate (decode_flops), the reference forward (a
    third of train_flops) and the policy update (train_flops), on prompts x group rows of bucketed prompt + new
    tokens."""
    rows, P = prompts * group, sampler.prompt_bucket(prompt_len)
    return decode_flops(cfg, prompts, group, prompt_len, new_tokens) + (4 / 3) * train_flops(cfg, rows, P, new_tokens)


def xla_flops(compiled) -> float:
    """XLA's own FLOP count of a compiled program (nan when the backend gives none)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", float("nan")))
