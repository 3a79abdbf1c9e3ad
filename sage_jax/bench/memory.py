"""Peak temporary memory of the log-prob loss's value_and_grad: the full [B,T,V] fp32 logits vs chunks of positions
(XLA's memory analysis of the compiled program; nothing is run)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from sage_jax.models import decoder as model
from sage_jax.bench.common import DTYPES, print_table


def _logprob_losses(cfg: model.ModelConfig, chunk: int) -> dict[str, Callable]:
    """Scalar losses of (hidden [B,T,D], unembed [D,V], targets [B,T]) using both log-probs and entropies."""
    def chunked(h_BxTxD, w_DxV, t_BxT):
        logp, ent = model.logprobs_entropy_from_hidden(cfg, {"lm_head": w_DxV}, h_BxTxD, t_BxT, chunk=chunk)
        return -(logp.mean() + 0.01 * ent.mean())

    def naive(h_BxTxD, w_DxV, t_BxT):
        logits_BxTxV = jnp.einsum("btd,dv->btv", h_BxTxD, w_DxV, preferred_element_type=jnp.float32)
        logp_all = jax.nn.log_softmax(logits_BxTxV, axis=-1)
        logp = jnp.take_along_axis(logp_all, t_BxT[..., None], axis=-1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return -(logp.mean() + 0.01 * ent.mean())
    return {"naive": naive, f"chunked_{chunk}": chunked}


def bench_memory(vocab: int = 152064, seq: int = 4096, hidden_sizes=(896, 3584), batches=(1, 4), chunks=(128, 512),
                 dtype: str = "fp32") -> list[dict]:
    """Peak temporary memory (XLA memory_analysis of the compiled program; nothing is run) of value_and_grad, w.r.t.
    hidden and unembedding, of a loss on log-probs + entropies: the full [B,T,V] fp32 logits vs chunks of positions."""
    GiB = 2.0 ** 30
    out = []
    for D in hidden_sizes:
        cfg = model.ModelConfig(vocab_size=vocab, hidden_size=D, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2,
                                intermediate_size=1, tie_embeddings=False, compute_dtype=DTYPES[dtype])
        for B in batches:
            args = (jax.ShapeDtypeStruct((B, seq, D), DTYPES[dtype]), jax.ShapeDtypeStruct((D, vocab), DTYPES[dtype]),
                    jax.ShapeDtypeStruct((B, seq), jnp.int32))
            losses: dict[str, Callable] = {}
            for c in chunks:
                losses |= _logprob_losses(cfg, c)
            naive = None
            for impl, loss in losses.items():
                mem = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile().memory_analysis()
                row = dict(hidden=D, batch=B, seq=seq, vocab=vocab, dtype=dtype, impl=impl,
                           temp_gib=mem.temp_size_in_bytes / GiB, args_gib=mem.argument_size_in_bytes / GiB,
                           output_gib=mem.output_size_in_bytes / GiB, logits_gib=B * seq * vocab * 4 / GiB)
                naive = row if impl == "naive" else naive
                row["naive_over_this"] = naive["temp_gib"] / row["temp_gib"]
                out.append(row)
    print_table(out, [("hidden", "d"), ("batch", "d"), ("seq", "d"), ("vocab", "d"), ("impl", ""),
                      ("temp_gib", ".2f"), ("args_gib", ".2f"), ("output_gib", ".2f"), ("logits_gib", ".2f"),
                      ("naive_over_this", ".1f")])
    return out


def memory_mode(args) -> list[dict]:
    return bench_memory(dtype=args.dtype)
