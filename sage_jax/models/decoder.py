"""Qwen2 / Qwen3 / Llama decoder as pure functions over a params pytree.

Layers are stacked along a leading axis. Training forwards scan over them (one compiled layer, checkpointed: see
`hidden`); the KV-cache forward (a prefill, a decode step) runs them one at a time over a stacked cache
(forward_with_cache, sage_jax.models.kv_cache). Dtype policy: params in `param_dtype`, matmuls in `compute_dtype`, norms /
softmax / logits in fp32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from sage_jax.models import rope as rope_lib
from sage_jax.models import attention as attention_lib
from sage_jax.models import kv_cache as cache_lib
from sage_jax.models.sharding import constrain

# re-exported: model.init_cache, model.BITS, ... name the KV cache (sage_jax.models.kv_cache)
from sage_jax.models.kv_cache import BITS, DECODE_BLOCK, cache_axes, cache_rows, init_cache  # noqa: F401
# re-exported: model.ModelConfig, model.preset, model.init_params, ... are the public names
from sage_jax.models.config import PRESETS, ModelConfig, Params, compute_params, init_params, param_axes, param_shapes, param_shardings, preset, shard_params

# --------------------------------------------------------------------------------------------------- building blocks

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32.astype(x.dtype) * weight.astype(x.dtype))


def rope_frequencies(cfg: ModelConfig):
    """(inverse frequencies [head_dim / 2], cos/sin scale) of cfg's RoPE variant (rope.frequencies)."""
    return rope_lib.frequencies(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling), cfg.max_position_embeddings)


def _einsum_parts(equation: str) -> tuple[str, str, str, str, str, str]:
    """(x, w, y, lead, inner, outer) letters of an "x,w->y" product of an input x and a weight w: lead are x's
    letters not in w, inner w's letters contracted with x, outer w's letters kept in y (each in its operand's order)."""
    x_letters, rest = equation.split(",")
    w_letters, y_letters = rest.split("->")
    lead = "".join(c for c in x_letters if c not in w_letters)
    inner = "".join(c for c in w_letters if c in x_letters)
    outer = "".join(c for c in w_letters if c in y_letters)
    return x_letters, w_letters, y_letters, lead, inner, outer


def matmul(equation: str, x: jax.Array, w: jax.Array, **kw) -> jax.Array:
    """jnp.einsum(equation, x, w) for "lead inner, inner outer -> lead outer" (letters in that order), done as one
    2-D matmul on reshaped operands: XLA:CPU runs the 3-D einsums of the projections 1.5x slower, forward and
    backward, than the same product of [tokens, in] x [in, out] matrices. Any other equation goes to einsum."""
    x_letters, w_letters, y_letters, lead, inner, outer = _einsum_parts(equation)
    if x_letters != lead + inner or w_letters != inner + outer or y_letters != lead + outer:
        return jnp.einsum(equation, x, w, **kw)
    lead_shape, outer_shape = x.shape[:len(lead)], w.shape[len(inner):]
    y = jnp.dot(x.reshape(math.prod(lead_shape), -1), w.reshape(-1, math.prod(outer_shape)), **kw)
    return y.reshape(*lead_shape, *outer_shape)


def _project(lp: Params, name: str, equation: str, x: jax.Array, cdt, head_dim: int = 0) -> jax.Array:
    """x times weight `name` (an einsum "in,weight->out"), plus the low-rank x A B when lp carries a LoRA adapter.

    Adapters come from lora.apply: lp["lora"][name] = {"a": [in..., r], "b": [r, out...]} with the alpha / rank
    scale already in b, and optionally a dropout key and keep probability. The merged weight is never formed.
    An attention weight of decode_params' copy is 2-D (heads and head dim merged; head_dim splits its output).
    """
    w = lp[name]
    if w.ndim == 2 and name in FLAT_WEIGHTS:
        y = matmul("btf,fd->btd", x.reshape(*x.shape[:2], -1), w.astype(cdt)) if name == "wo" else \
            matmul("btd,df->btf", x, w.astype(cdt)).reshape(*x.shape[:2], -1, head_dim)
    else:
        y = matmul(equation, x, w.astype(cdt))
    adapter = lp.get("lora", {}).get(name)
    if adapter is None:
        return y
    x_letters, _, y_letters, lead, inner, outer = _einsum_parts(equation)
    if "keep" in adapter:
        keep = adapter["keep"]
        x = jnp.where(jax.random.bernoulli(adapter["key"], keep, x.shape), x / keep.astype(x.dtype), 0)
    down = matmul(f"{x_letters},{inner}r->{lead}r", x, adapter["a"].astype(cdt))
    return y + matmul(f"{lead}r,r{outer}->{y_letters}", down, adapter["b"].astype(cdt))


def _block(cfg: ModelConfig, lp: Params, x_BxTxD, positions_BxT, allowed_BxTxS, kv_cache=None, cache_index=None,
           segment_ids_BxT=None, cache_groups: int = 1, cache_layer=None, forms=None):
    """One decoder layer. With kv_cache=(k, v) [B,K,S,H] (or stacked [L,B,K,S,H], of which it reads and writes layer
    cache_layer), writes this step's keys at cache_index. Without a cache,
    attention is within segment_ids (attention.attend, cfg.attention) when given, else under allowed_BxTxS."""
    cdt = jnp.dtype(cfg.compute_dtype)
    w = lambda name: lp[name].astype(cdt)
    h = rms_norm(x_BxTxD, lp["attn_norm"], cfg.rms_norm_eps)
    q = _project(lp, "wq", "btd,dnh->btnh", h, cdt, cfg.head_dim)
    k = _project(lp, "wk", "btd,dkh->btkh", h, cdt, cfg.head_dim)
    v = _project(lp, "wv", "btd,dkh->btkh", h, cdt, cfg.head_dim)
    if cfg.qkv_bias:
        q, k, v = q + w("bq"), k + w("bk"), v + w("bv")
    if cfg.qk_norm:
        q, k = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = constrain(q, ("batch", "seq", "heads", "head_dim"))
    inv_freq, scale = rope_frequencies(cfg)
    q, k = rope_lib.apply(q, positions_BxT, inv_freq, scale), rope_lib.apply(k, positions_BxT, inv_freq, scale)
    if kv_cache is not None:  # the cache's rows split as "decode_rows" (sharding.decode_rules), the token's as "batch"
        q = constrain(q, ("decode_rows", "seq", "heads", "head_dim"))
        k, v = (constrain(x, ("decode_rows", "seq", "kv_heads", "head_dim")) for x in (k, v))
        kv_cache = tuple(cache_lib.write(c, x, cache_index, cache_groups, cache_layer, forms)
                         for c, x in zip(kv_cache, (k, v)))
        attn = cache_lib.cached_attention(q, *kv_cache, allowed_BxTxS, cache_groups, cache_layer, cdt, forms)
        attn = constrain(attn, ("batch", "seq", "heads", "head_dim"))
    elif segment_ids_BxT is not None:
        attn = attention_lib.attend(cfg.attention, q, k, v, segment_ids_BxT, cfg.attention_block)
    else:
        attn = attention_lib.masked(q, k, v, allowed_BxTxS)
    x_BxTxD = x_BxTxD + _project(lp, "wo", "btnh,nhd->btd", attn, cdt)
    x_BxTxD = constrain(x_BxTxD, ("batch", "seq", "act_embed"))
    h = rms_norm(x_BxTxD, lp["mlp_norm"], cfg.rms_norm_eps)
    gate = _project(lp, "w_gate", "btd,df->btf", h, cdt)
    up = _project(lp, "w_up", "btd,df->btf", h, cdt)
    mlp = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
    x_BxTxD = x_BxTxD + _project(lp, "w_down", "btf,fd->btd", mlp, cdt)
    return constrain(x_BxTxD, ("batch", "seq", "act_embed")), kv_cache


def default_positions(mask_BxT: jax.Array) -> jax.Array:
    """Positions for left-padded rows: 0 at the first real token."""
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def _embed(cfg: ModelConfig, params: Params, tokens_BxT: jax.Array) -> jax.Array:
    x = jnp.take(params["embed"], tokens_BxT, axis=0).astype(jnp.dtype(cfg.compute_dtype))
    return constrain(x, ("batch", "seq", "act_embed"))


@functools.partial(jax.jit, static_argnums=0)
def hidden(cfg: ModelConfig, params: Params, tokens_BxT: jax.Array, positions_BxT: jax.Array | None = None,
           mask_BxT: jax.Array | None = None, segment_ids_BxT: jax.Array | None = None) -> jax.Array:
    """Final-normed hidden states [B, T, D] (compute dtype).

    Rows are one sequence each (mask_BxT marks its tokens; positions count them) or, with segment_ids_BxT, several
    packed sequences (ids 1, 2, ...; 0 is padding) that attend only within themselves, positions restarting at 0 in
    each unless given.
    """
    B, T = tokens_BxT.shape
    if segment_ids_BxT is None:
        mask_BxT = jnp.ones((B, T), jnp.bool_) if mask_BxT is None else mask_BxT.astype(jnp.bool_)
        positions_BxT = default_positions(mask_BxT) if positions_BxT is None else positions_BxT
        segment_ids_BxT = mask_BxT.astype(jnp.int32)
    elif positions_BxT is None:
        positions_BxT = attention_lib.segment_positions(segment_ids_BxT)
    x = _embed(cfg, params, tokens_BxT)

    def layer(x, lp):
        return _block(cfg, lp, x, positions_BxT, None, segment_ids_BxT=segment_ids_BxT)[0], None

    # The backward recomputes what a layer does not keep: with remat, everything but the layer's input (least
    # memory); without, only the element-wise work, as the matmul outputs are kept. Keeping every intermediate
    # instead (plain autodiff) stores and re-reads several [B, T, F] residuals per layer: 1.2x slower on CPU
    # (docs/PERFORMANCE.md), and it keeps more.
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable if cfg.remat
                           else jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    if cfg.scan_layers:
        x, _ = jax.lax.scan(layer, x, params["layers"])
    else:
        for i in range(cfg.num_layers):
            x, _ = layer(x, jax.tree.map(lambda a: a[i], params["layers"]))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def unembed_matrix(cfg: ModelConfig, params: Params) -> jax.Array:
    """[D, V] in the compute dtype (decode_params' copy where it made one)."""
    w = params.get("decode_head")
    if w is None:
        w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return w.astype(jnp.dtype(cfg.compute_dtype))


def logits_from_hidden(cfg: ModelConfig, params: Params, h_BxTxD: jax.Array) -> jax.Array:
    logits = matmul("btd,dv->btv", h_BxTxD, unembed_matrix(cfg, params), preferred_element_type=jnp.float32)
    if "decode_head" in params:  # every row's logits of the local vocabulary split first (decode_params)
        logits = constrain(logits, ("batch", "seq", "decode_vocab"))
    return constrain(logits, ("decode_rows", "seq", "vocab"))


MLP_WEIGHTS = ("w_gate", "w_up", "w_down")
FLAT_WEIGHTS = ("wq", "wk", "wv", "wo")  # [L, D, N, H] ([L, N, H, D]): decode_params' copies are [L, D, N * H]


def _merge_heads(w: jax.Array, name: str) -> jax.Array:
    return w.reshape(*w.shape[:-3], -1, w.shape[-1]) if name == "wo" else w.reshape(*w.shape[:-2], -1)


def decode_step_rules(cfg: ModelConfig, stationary_weights: bool) -> dict:
    """The sharding rules a decode step runs under (sharding.decode_rules with cfg's dims; DecodeForms says
    whether the weights stay where they lie), and decode_params lays its weights out by."""
    from sage_jax.models import sharding
    return sharding.decode_rules(stationary_weights, dims={"mlp": cfg.intermediate_size, "vocab": cfg.vocab_size})


def decode_params(cfg: ModelConfig, params: Params, rules) -> Params:
    """params for decode steps under `rules` (sharding.decode_rules with cfg's dims): where the rules name
    "decode_mlp" ("decode_vocab") axes, a copy of the MLP weights (of the unembedding, as "decode_head") with the
    embed dim whole and the hidden (vocabulary) dim split over those axes. Each chip still holds 1 / n of them, but a
    step then gathers its rows' [rows, D] input to the MLP once and reduces one [rows, D] output, where with the
    embed dim split it reduced the partial sums of the whole [rows, F / tensor] hidden (twice) and, at the head,
    float32 partial logits of the whole [rows, V / tensor]. With the MLP copy, the attention weights are copied as
    they lie with their heads and head dim merged (FLAT_WEIGHTS): XLA:TPU relaid a [D, 7, 128] query weight (7 heads
    per chip) for its matmul in every layer of every step. The copies are made once per sampler call; prefill keeps
    the weights as they are. params itself where the rules name neither (qwen7b_branch, 32 v5p chips, 256 rows:
    1.48x -> 1.26x the ideal bytes per step; docs/PERFORMANCE.md)."""
    from sage_jax.models import sharding
    out = dict(params)
    if "decode_mlp" in rules and isinstance(params["layers"], dict):
        layers, axes = params["layers"], param_axes(cfg)["layers"]
        with sharding.use_rules(dict(rules, embed=None, mlp=rules["decode_mlp"])):
            mlp = {n: constrain(layers[n], axes[n]) for n in MLP_WEIGHTS}
        with sharding.use_rules(rules):  # the attention weights stay where they lie, their heads and head dim merged
            flat = {n: constrain(jax.lax.optimization_barrier(_merge_heads(layers[n], n)),
                                 tuple(a for a in axes[n] if a != "head_dim")) for n in FLAT_WEIGHTS}
        out["layers"] = {**layers, **mlp, **flat}
    if "decode_vocab" in rules:
        with sharding.use_rules(dict(rules, embed=None, vocab=rules["decode_vocab"])):
            out["decode_head"] = constrain(unembed_matrix(cfg, params), ("embed", "vocab"))
    return out if len(out) > len(params) or out["layers"] is not params["layers"] else params


@functools.partial(jax.jit, static_argnums=0)
def forward(cfg: ModelConfig, params: Params, tokens_BxT: jax.Array, positions_BxT: jax.Array | None = None,
            mask_BxT: jax.Array | None = None, segment_ids_BxT: jax.Array | None = None) -> jax.Array:
    """tokens int32 [B, T] -> logits float32 [B, T, V]. Materialises all logits: use logprobs_and_entropy for RL.
    Masks, positions and packed segments as in hidden()."""
    return logits_from_hidden(cfg, params, hidden(cfg, params, tokens_BxT, positions_BxT, mask_BxT, segment_ids_BxT))


# --------------------------------------------------------------------------------------------------- log-probs

def logprobs_entropy_from_hidden(cfg: ModelConfig, params: Params, h_BxSxD: jax.Array, targets_BxS: jax.Array,
                                 temperature: float = 1.0, chunk: int | None = None):
    """log p(target) and entropy of softmax(logits / temperature), `chunk` positions at a time.

    Each chunk's [B, chunk, V] logits are recomputed in the backward pass (jax.checkpoint), so neither pass holds
    the whole [B, S, V] in fp32 at once.
    """
    B, S, D = h_BxSxD.shape
    chunk = min(chunk or cfg.logits_chunk, S)
    n_chunks = -(-S // chunk)
    pad = n_chunks * chunk - S
    h = jnp.pad(h_BxSxD, ((0, 0), (0, pad), (0, 0)))
    t = jnp.pad(targets_BxS, ((0, 0), (0, pad)))
    h_CxBxLxD = h.reshape(B, n_chunks, chunk, D).swapaxes(0, 1)
    t_CxBxL = t.reshape(B, n_chunks, chunk).swapaxes(0, 1)
    w_DxV = unembed_matrix(cfg, params)
    inv_temp = 1.0 / temperature

    @jax.checkpoint
    def one_chunk(h_BxLxD, t_BxL):
        logits = matmul("bld,dv->blv", h_BxLxD, w_DxV, preferred_element_type=jnp.float32) * inv_temp
        logits = constrain(logits, ("batch", "seq", "vocab"))
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        logp = jnp.take_along_axis(logp_all, t_BxL[..., None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return logp, entropy

    def body(carry, xs):
        return carry, one_chunk(*xs)

    _, (logp, ent) = jax.lax.scan(body, None, (h_CxBxLxD, t_CxBxL))
    unchunk = lambda a: a.swapaxes(0, 1).reshape(B, n_chunks * chunk)[:, :S]
    return unchunk(logp), unchunk(ent)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("temperature", "start", "length", "chunk"))
def logprobs_and_entropy(cfg: ModelConfig, params: Params, tokens_BxT: jax.Array, targets_BxT: jax.Array,
                         positions_BxT: jax.Array | None = None, mask_BxT: jax.Array | None = None,
                         temperature: float = 1.0, start: int = 0, length: int | None = None,
                         chunk: int | None = None, segment_ids_BxT: jax.Array | None = None):
    """Per-position log p(targets[t] | tokens[:t+1]) and next-token entropy, for t in [start, start + length).
    Masks, positions and packed segments as in hidden()."""
    h = hidden(cfg, params, tokens_BxT, positions_BxT, mask_BxT, segment_ids_BxT)
    end = h.shape[1] if length is None else start + length
    return logprobs_entropy_from_hidden(cfg, params, h[:, start:end], targets_BxT[:, start:end], temperature, chunk)


# --------------------------------------------------------------------------------------------------- KV cache

def _layer_list(cfg: ModelConfig, layers) -> list[Params]:
    if isinstance(layers, (list, tuple)):
        return list(layers)
    return [jax.tree.map(lambda a: a[i], layers) for i in range(cfg.num_layers)]


def unstack_layers(cfg: ModelConfig, params: Params) -> Params:
    """params with "layers" as a list of per-layer dicts, which forward_with_cache also accepts.

    For decode loops on CPU: XLA:CPU copies a layer out of the stacked arrays on every use, so slicing once before
    the loop saves a copy of all weights per generated token (at the cost of one extra copy held during the loop).
    """
    return {**params, "layers": _layer_list(cfg, params["layers"])}


def prefill(cfg: ModelConfig, params: Params, tokens_BxT: jax.Array, mask_BxT: jax.Array, dtype: str | None = None,
            stacked: bool = True, forms=None):
    """The prompts' forward into a new cache of exactly their T slots (kv_cache.init_cache(cfg, B, T, dtype,
    stacked)): (final-normed hidden [B, T, D], the cache); a stacked cache one layer at a time, as
    forward_with_cache runs one."""
    B, T = tokens_BxT.shape
    cache = init_cache(cfg, B, T, dtype, stacked=stacked)
    cache = tuple(constrain(c, cache_axes(stacked=True)) for c in cache) if stacked else \
        [tuple(constrain(c, cache_axes()) for c in kv) for kv in cache]
    return forward_with_cache(cfg, params, tokens_BxT, default_positions(mask_BxT), cache, 0, mask_BxT,
                              return_hidden=True, forms=forms)


def forward_with_cache(cfg: ModelConfig, params: Params, tokens_BxT: jax.Array, positions_BxT: jax.Array,
                       cache, cache_index: jax.Array, kv_mask_BxS: jax.Array, return_hidden: bool = False,
                       cache_groups: int = 1, forms=None):
    """Run T new tokens written at cache slots [cache_index, cache_index + T).

    params["layers"] may be stacked or a list of per-layer dicts (unstack_layers). cache is one (k, v) pair per layer
    (a list) or one stacked pair (a tuple; stacked weights then run in a loop over the layers, so the compiler
    holds one layer's gathered weights at a time). cache_index is one int for all rows or one per row ([B]).
    kv_mask_BxS marks which cache slots hold real tokens (after this step's tokens are added); query t of row b may
    attend to slot s when kv_mask[b, s] and s <= cache_index[b] + t, and always to its own slot. A cache of more
    rows than B (decoding, T = 1) is used in the rows cache_rows(c, B, cache_groups) names; the others are kept as
    they are. forms: the decode program's forms (decode_forms; default the running backend's). Returns (logits
    [B,T,V] fp32 or hidden, new cache).
    """
    slots_S = jnp.arange(kv_mask_BxS.shape[1])
    query_slots_bxT = jnp.reshape(cache_index, (-1, 1)) + jnp.arange(tokens_BxT.shape[1])  # b = 1 or B
    allowed = (slots_S[None, None, :] <= query_slots_bxT[:, :, None]) & kv_mask_BxS[:, None, :].astype(jnp.bool_)
    allowed = allowed | (slots_S[None, None, :] == query_slots_bxT[:, :, None])
    x = _embed(cfg, params, tokens_BxT)
    block = functools.partial(_block, cfg, positions_BxT=positions_BxT, allowed_BxTxS=allowed, cache_index=cache_index,
                              cache_groups=cache_groups, forms=forms)
    if isinstance(cache, list):
        new_cache = []
        for i, lp in enumerate(_layer_list(cfg, params["layers"])):
            x, kv = block(lp, x, kv_cache=cache[i])
            new_cache.append(kv)
        cache = new_cache
    elif isinstance(params["layers"], (list, tuple)):
        for i, lp in enumerate(params["layers"]):
            x, cache = block(lp, x, kv_cache=cache, cache_layer=i)
    else:
        def layer(i, carry):
            lp = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), params["layers"])
            return block(lp, carry[0], kv_cache=carry[1], cache_layer=i)
        x, cache = jax.lax.fori_loop(0, cfg.num_layers, layer, (x, tuple(cache)))
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    if return_hidden:
        return h, cache
    return logits_from_hidden(cfg, params, h), cache


# Re-exported so `model.load_hf` / `model.save_hf` are the public entry points for checkpoints.
def load_hf(path, dtype=jnp.float32, mesh=None, rules=None):
    from sage_jax.models import hf_io
    return hf_io.load_hf(path, dtype=dtype, mesh=mesh, rules=rules)


def save_hf(out_dir, cfg: ModelConfig, params: Params, **kw) -> None:
    from sage_jax.models import hf_io
    return hf_io.save_hf(out_dir, cfg, params, **kw)
