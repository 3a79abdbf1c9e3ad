"""Sampling one token per row from logits: top-k / top-p / min-p filters as per-row thresholds, a two-level inverse
CDF with one uniform per row, greedy without argmax (see _first_max). Used by the decode loop (decode_pool.py) and
re-exported by sampler.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp

def _ordered_bits(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order, so a value search can bisect integers and end exactly on a logit."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    sign = jnp.uint32(1 << 31)
    return jnp.where(bits >= sign, ~bits, bits | sign)


def _nucleus_bits(logits_BxV: jax.Array, top_p) -> jax.Array:
    """Ordered bits of the smallest logit in the top-p nucleus: the largest t with mass(logits >= t) >= top_p.

    32 halvings of the uint32 range make it exact; each is one masked sum over the vocabulary, far cheaper than
    sorting the vocabulary every step (about 10 ms vs 120 ms for 64 x 8192 on one CPU core).
    """
    bits_BxV = _ordered_bits(logits_BxV)
    probs_BxV = jnp.exp(logits_BxV - jnp.max(logits_BxV, axis=-1, keepdims=True))
    target_B = top_p * jnp.sum(probs_BxV, axis=-1)

    def halve(_, lo_hi):
        lo, hi = lo_hi  # mass(>= lo) >= target always; the answer lies in [lo, hi]
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2
        ok = jnp.sum(jnp.where(bits_BxV >= mid[:, None], probs_BxV, 0.0), axis=-1) >= target_B
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (jnp.min(bits_BxV, axis=-1), jnp.max(bits_BxV, axis=-1)))
    return lo


def filter_logits(logits_BxV: jax.Array, top_k: int = 0, top_p: float | jax.Array | None = None,
                  min_p: float | jax.Array | None = None) -> jax.Array:
    """Keep top-k, then the top-p nucleus (renormalised within top-k), then tokens with p >= min_p * p_max.

    Removed entries become -inf. Each filter reduces to a per-row logit threshold; tokens tied with the threshold
    are kept. `top_k` is static (0 = off); `top_p` / `min_p` may be traced (None = off).
    """
    V = logits_BxV.shape[-1]
    keep_BxV = jnp.ones(logits_BxV.shape, jnp.bool_)
    if 0 < top_k < V:
        sorted_BxK = jax.lax.top_k(logits_BxV, top_k)[0]
        # min, not [..., -1]: slicing the last value defeats XLA's TopK rewrite and sorts the whole vocabulary.
        keep_BxV = logits_BxV >= jnp.min(sorted_BxK, axis=-1, keepdims=True)
        if top_p is not None:  # the nucleus lies inside the top k: work on the k sorted values only
            probs_BxK = jax.nn.softmax(sorted_BxK, axis=-1)
            mass_before_BxK = jnp.cumsum(probs_BxK, axis=-1) - probs_BxK
            count_B = jnp.maximum(jnp.sum(mass_before_BxK < top_p, axis=-1), 1)
            keep_BxV &= logits_BxV >= jnp.take_along_axis(sorted_BxK, count_B[..., None] - 1, axis=-1)
    elif top_p is not None:
        keep_BxV = _ordered_bits(logits_BxV) >= _nucleus_bits(logits_BxV, top_p)[..., None]
    if min_p is not None:
        keep_BxV &= logits_BxV >= jnp.max(logits_BxV, axis=-1, keepdims=True) + jnp.log(min_p)
    return jnp.where(keep_BxV, logits_BxV, -jnp.inf)


CDF_BLOCK = 128  # vocabulary entries per block of the two-level inverse CDF


def _inverse_cdf(logits_BxV: jax.Array, uniform_B: jax.Array) -> jax.Array:
    """The first token with probability > 0 whose cdf exceeds u * total: one uniform per row instead of a Gumbel
    per vocab entry (3x cheaper on CPU).

    Two levels, as a flat cumsum over the vocabulary is a slow serial scan on XLA:CPU: the cdf of block sums
    (CDF_BLOCK entries each) picks the block, then the cdf within that block picks the token. A float32 cumsum is
    not monotone on every backend, so the pick is restricted to blocks and tokens with probability > 0 (a removed,
    -inf, token is impossible), and where rounding leaves no hit it falls back to the last such block / token.
    """
    B, V = logits_BxV.shape
    probs_BxV = jnp.exp(logits_BxV - jnp.max(logits_BxV, axis=-1, keepdims=True))
    nb = -(-V // CDF_BLOCK)
    probs_BxNxK = jnp.pad(probs_BxV, ((0, 0), (0, nb * CDF_BLOCK - V))).reshape(B, nb, CDF_BLOCK)

    def first_over(p_BxM, cdf_BxM, x_B):
        index_BxM = jax.lax.broadcasted_iota(jnp.int32, p_BxM.shape, 1)
        kept_BxM = p_BxM > 0
        first_B = jnp.min(jnp.where(kept_BxM & (cdf_BxM > x_B[:, None]), index_BxM, p_BxM.shape[1]), axis=-1)
        return jnp.minimum(first_B, jnp.max(jnp.where(kept_BxM, index_BxM, -1), axis=-1))

    sums_BxN = jnp.sum(probs_BxNxK, axis=-1)
    cdf_BxN = jnp.cumsum(sums_BxN, axis=-1)
    x_B = uniform_B * cdf_BxN[:, -1]
    block_B = first_over(sums_BxN, cdf_BxN, x_B)
    inner_BxK = jnp.take_along_axis(probs_BxNxK, block_B[:, None, None], axis=1)[:, 0]
    before_B = jnp.take_along_axis(cdf_BxN - sums_BxN, block_B[:, None], axis=1)[:, 0]
    token_B = first_over(inner_BxK, before_B[:, None] + jnp.cumsum(inner_BxK, axis=-1), x_B)
    return block_B * CDF_BLOCK + token_B


def _first_max(logits_BxV: jax.Array) -> jax.Array:
    """argmax as two plain reductions (the max, then the first index holding it; NaN-free logits): jnp.argmax's
    variadic (value, index) reduce sends LLVM's loop vectorizer on XLA:CPU into minutes of compile for small
    vocabularies (issue 27: rollout.temperature=0 on the 23-token countdown vocabulary)."""
    index_BxV = jax.lax.broadcasted_iota(jnp.int32, logits_BxV.shape, 1)
    top_B = jnp.max(logits_BxV, axis=-1, keepdims=True)
    return jnp.min(jnp.where(logits_BxV == top_B, index_BxV, logits_BxV.shape[-1]), axis=-1)


def sample_tokens(logits_BxV: jax.Array, key: jax.Array, rows_B: jax.Array | None = None, *, greedy: bool,
                  temperature: float | jax.Array = 1.0, top_k: int = 0, top_p=None, min_p=None):
    """-> (tokens int32 [B], behaviour log-probs float32 [B]). Row b draws with fold_in(key, rows_B[b]), or with
    key[b] when rows_B is None (key: [B] keys, as decode_pool.row_keys makes them)."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    if greedy:
        tokens_B = _first_max(logits_BxV)
        scaled_BxV = logits_BxV
    else:
        scaled_BxV = logits_BxV / temperature
        filtered_BxV = filter_logits(scaled_BxV, top_k, top_p, min_p)
        keys_B = key if rows_B is None else jax.vmap(jax.random.fold_in, (None, 0))(key, rows_B)
        tokens_B = _inverse_cdf(filtered_BxV, jax.vmap(jax.random.uniform)(keys_B))
    picked_B = jnp.take_along_axis(scaled_BxV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, picked_B - jax.nn.logsumexp(scaled_BxV, axis=-1)
