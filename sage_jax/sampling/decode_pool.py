"""The sampler's program: prefill every prompt once, then one decode loop over a fixed pool of S slots.

One KV cache of S x (P + C) positions is allocated once. Rows (prompt x sample, prompt-major) wait in a queue (one
per data-parallel shard where rows, prompts and slots split evenly: a shard's slots take its own rows); a row
that starts in a slot copies its prompt's prefilled keys and values into that slot's row of the cache (one
dynamic_update_slice per layer, never a copy of the whole cache), and when it stops (EOS or its own limit) the slot
takes the next queued row at the next step. The loop ends when the queue is empty and every slot is idle. Once the
queue is empty and the live slots fit a narrower width (stage_widths: four per halving of S), they move to the first
slots of their shard, in the same cache, and the steps after compute only those rows (on CPU a step costs its rows).

A row's cache layout, positions and keys do not depend on its slot or on when it runs: its prompt fills cache
positions [0, P) (left-padded), its token j - 1 is written at P + j - 1 (each slot has its own write position:
model.forward_with_cache with a [S] cache index), and its token j is drawn with fold_in(fold_in(key, j), row). So the
tokens equal one static batch's (S = all rows) for the same key, bit for bit.

Rows need not start at their prompt's beginning (rows.py): row n continues prefilled sequence source_N[n] from
generation position start_N[n], with its own key and id, so a row that left the pool (interrupted by
stop_after_groups; later, a tool call) comes back with its tokens so far prefilled after its prompt, into the
generation positions [P, P + start) they had (its sequence is prefilled P + plan.carried wide; a fresh prompt's
only P: _prefill), and goes on drawing the tokens it would have drawn uninterrupted: its token j is written at P + j
and fed at its uninterrupted RoPE position. With
plan.stop_early the loop also ends once `stop_groups` groups have all their rows done (rows.complete_groups); the
rows still running are returned with what they have.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from sage_jax.models import kv_cache
from sage_jax.models.decode_forms import DecodeForms, for_platform
from sage_jax.models import decoder as model_lib
from sage_jax.models import sharding as sharding_lib
from sage_jax.models.decoder import ModelConfig, Params
from sage_jax.sampling.filters import sample_tokens
from sage_jax.sampling.rows import Rows, complete_groups, row_keys


@dataclasses.dataclass(frozen=True)
class SamplerPlan:
    """Everything static about one compiled program besides the array shapes."""
    num_samples: int
    new_bucket: int
    greedy: bool
    top_k: int
    use_top_p: bool
    use_min_p: bool
    mesh: Mesh | None
    unstack_layers: bool
    slots: int  # decode slots S (a multiple of data x fsdp): rows beyond S wait for a slot to free up
    stages: tuple[int, ...] | None = None  # the pool's widths (None: stage_widths(slots, data x fsdp, C))
    stop_early: bool = False  # the loop also ends once `stop_groups` groups are complete (generate's stop_after_groups)
    carried: int = 0  # generation positions prefilled after the prompt bucket (resumed rows' tokens; rows.py)
    # the first `carrying` sequences of each data-parallel shard's block carry tokens in (rows.Layout.carrying): only
    # they are prefilled over the carried positions, the others over the prompt bucket (0: every sequence over both)
    carrying: int = 0
    forms: DecodeForms | None = None  # the decode program's forms (decode_forms; None: the running backend's)


def constrain_cache(cache):
    """A KV cache (stacked: a (k, v) pair; or a list of per-layer pairs) annotated with its logical axes."""
    one = lambda c: sharding_lib.constrain(c, kv_cache.cache_axes(stacked=c.ndim == 5))  # [R, (L,) K, S, H]
    return [tuple(map(one, kv)) for kv in cache] if isinstance(cache, list) else tuple(map(one, cache))


class _Out(NamedTuple):
    """Per output row, in row order whatever slot a row sits in."""
    tokens_NxC: jax.Array
    logp_NxC: jax.Array
    lengths_N: jax.Array
    finished_N: jax.Array


class _Pool(NamedTuple):
    """Slot s holds row row_S[s] (N: none), which has pos_S[s] tokens so far; last_S is the token fed next. Past the
    full width (stage_widths) the slot arrays have the stage's W entries, slot s in the cache rows model.cache_rows
    names."""
    row_S: jax.Array
    pos_S: jax.Array
    last_S: jax.Array
    cache: list
    next_row: jax.Array  # [Q]: each queue group's rows below it have had a slot (or stopped at their first token)
    steps: jax.Array  # decode steps run, the prefill's token counted as the first
    # data-dependent loop iterations and branches (each a host round trip on XLA:GPU): decode-loop iterations,
    # refill predicates, prompt-copy iterations, shrink moves
    loops: jax.Array


# Completions shorter than this take only halving widths: on CPU a width's decode loop body compiles in about the
# time of 100-400 of its steps (about 4 s for the small preset, 2 s for the demo's model), so finer widths pay back
# only over long completions (the CPU demo's 24 tokens: 4 min 26 s wall with 21 widths per sampler program).
FINE_WIDTHS_MIN_TOKENS = 128


def stage_widths(slots: int, dp: int, new_tokens: int | None = None) -> tuple[int, ...]:
    """The pool's widths, largest first, counted in slots per data-parallel shard (dp = data x fsdp), down to 2 per
    shard or S/32, whichever is more (with one slot per shard XLA:CPU held 2.3x the cache shard in temporaries,
    against 1.15x, in test_one_kv_cache_in_memory). Four per halving of the slots (S = 64: 64, 56, 48, 40, 32, 28,
    24, 20, 16, then 14, 12, 10, 8, 6, 4, 2, where steps of 2 are the finest); for completions of fewer than
    FINE_WIDTHS_MIN_TOKENS new tokens, halves only (64, 32, 16, 8, 4, 2). Once the queue is empty and every shard's
    live slots fit the next width, they move into its slots, and each step computes only those rows: on CPU a step
    costs about the rows it computes, and the finer widths compute at most about 4/3 of the live rows (halves: up to
    2x). Each width is one more decode loop body to compile; on the long-tail benchmark (64 rows, 512 tokens) the 16
    widths ran 2.5-8.9% faster than session 10's 7 in three A/B runs (docs/PERFORMANCE.md, session 11)."""
    if slots % dp:
        return (slots,)
    per_shard = slots // dp
    floor = max(2, per_shard // 32)
    fine = new_tokens is None or new_tokens >= FINE_WIDTHS_MIN_TOKENS
    widths = [per_shard]
    while True:
        below = 1 << max(0, (widths[-1] - 1).bit_length() - 1)  # the largest power of two under the width
        width = widths[-1] - max(2, below // 4) if fine else widths[-1] // 2
        if width < floor:
            return tuple(w * dp for w in widths)
        widths.append(width)


def _copy_prompts(cache: tuple, prompt_cache: tuple, slots_QxK: jax.Array, prompts_QxK: jax.Array,
                  count_Q: jax.Array) -> tuple:
    """In each of Q queue groups q (the cache's and the prompt caches' rows split in Q equal blocks), prompt
    prompts_QxK[q, k]'s prefilled entries (every layer's: its prompt bucket's P positions, then plan.carried
    generation positions) into the first positions of slot slots_QxK[q, k], for k < count_Q[q]; indices within the
    group. With Q = the data-parallel shards every copy stays on its device: XLA
    sees a copy batched over the sharded group axis, where a traced index into the whole prompt cache made XLA:CPU
    hold every prompt's cache on every device across the loop."""
    Q = slots_QxK.shape[0]

    def one(k, cache):
        def put(c_RxLxKxTxH, pc_BxLxKxPxH):  # a stacked cache; a cache per layer drops the L axis
            at = lambda s: (s,) + (0,) * (c_RxLxKxTxH.ndim - 1)

            def group(c1, pc1, s, p, live):
                row = jax.lax.dynamic_slice_in_dim(pc1, p, 1, 0)
                if Q > 1:  # groups that copied all theirs rewrite a slot's own entries
                    row = jnp.where(live, row, jax.lax.dynamic_slice(c1, at(s), row.shape))
                return jax.lax.dynamic_update_slice(c1, row, at(s))
            if Q == 1:
                return group(c_RxLxKxTxH, pc_BxLxKxPxH, slots_QxK[0, k], prompts_QxK[0, k], True)
            split = lambda a: a.reshape(Q, -1, *a.shape[1:])
            out = jax.vmap(group)(split(c_RxLxKxTxH), split(pc_BxLxKxPxH), slots_QxK[:, k], prompts_QxK[:, k],
                                  k < count_Q)
            return out.reshape(c_RxLxKxTxH.shape)
        return jax.tree.map(put, cache, prompt_cache)
    # a 16-bit cache is held as bits (model.BITS), so these copies move uint16, never a float32 copy on XLA:CPU
    return jax.lax.fori_loop(0, jnp.max(count_Q), one, cache)


def queue_groups(rows: int, prompts: int, slots: int, dp: int) -> int:
    """How many queues the pool keeps: one per data-parallel shard where rows, prompts and slots split evenly over
    the shards (a shard's slots then take only its own rows, whose prompts it holds: rows.layout places them so),
    else one."""
    return dp if dp > 1 and not (rows % dp or prompts % dp or slots % dp) else 1


def _queued(pool: _Pool, done_N: jax.Array) -> jax.Array:
    """[Q, N / Q]: which rows of each queue group still wait for a slot."""
    Q = pool.next_row.shape[0]
    rows_QxN = jnp.arange(done_N.shape[0], dtype=jnp.int32).reshape(Q, -1)
    return (rows_QxN >= pool.next_row[:, None]) & ~done_N.reshape(Q, -1)


def _refill(pool: _Pool, done_N: jax.Array, out: _Out, prompt_cache: list, rows: Rows) -> _Pool:
    """Every idle slot takes the next queued row of its queue group that has not already stopped (at its first
    token), in row order; Q = pool.next_row's length groups, each S / Q slots taking from N / Q rows (which continue
    sequences of the group's block of the prompt caches)."""
    N, S, Q = done_N.shape[0], pool.row_S.shape[0], pool.next_row.shape[0]
    per_group = jax.tree.leaves(prompt_cache)[0].shape[0] // Q
    n, s = N // Q, S // Q
    busy_QxS = ((pool.row_S < N) & ~done_N[jnp.minimum(pool.row_S, N - 1)]).reshape(Q, s)
    rank_QxN = jnp.cumsum(_queued(pool, done_N), axis=1, dtype=jnp.int32)  # 1-based rank among queued rows
    want_QxS = jnp.where(busy_QxS, 0, jnp.cumsum(~busy_QxS, axis=1, dtype=jnp.int32))  # 1-based rank, idle slots
    local_QxS = jax.vmap(functools.partial(jnp.searchsorted, side="left"))(rank_QxN, want_QxS).astype(jnp.int32)
    pick_QxS = local_QxS + n * jnp.arange(Q, dtype=jnp.int32)[:, None]  # the queued row of that rank
    got_QxS = ~busy_QxS & (want_QxS <= rank_QxN[:, -1:])
    row_QxS = jnp.where(got_QxS, pick_QxS, jnp.where(busy_QxS, pool.row_S.reshape(Q, s), N))
    next_row = jnp.maximum(pool.next_row, jnp.max(jnp.where(got_QxS, pick_QxS + 1, 0), axis=1))
    order_QxS = jax.vmap(lambda g: jnp.nonzero(g, size=s, fill_value=0)[0])(got_QxS).astype(jnp.int32)  # refilled first
    source_QxS = rows.source_N[jnp.minimum(jnp.take_along_axis(row_QxS, order_QxS, axis=1), N - 1)]
    prompt_QxS = source_QxS - per_group * jnp.arange(Q, dtype=jnp.int32)[:, None]
    count_Q = jnp.sum(got_QxS, axis=1, dtype=jnp.int32)
    cache = _copy_prompts(pool.cache, prompt_cache, order_QxS, prompt_QxS, count_Q)
    row_S, got_S = row_QxS.reshape(S), got_QxS.reshape(S)
    start_S = rows.start_N[jnp.minimum(row_S, N - 1)]
    first_S = jnp.take_along_axis(out.tokens_NxC[jnp.minimum(row_S, N - 1)], start_S[:, None], axis=1)[:, 0]
    return pool._replace(row_S=row_S, pos_S=jnp.where(got_S, start_S + 1, pool.pos_S),
                         last_S=jnp.where(got_S, first_S, pool.last_S), cache=constrain_cache(cache),
                         next_row=next_row, loops=pool.loops + jnp.max(count_Q))


def _shrink(pool: _Pool, live_W: jax.Array, width: int, groups: int) -> _Pool:
    """The live slots of a pool of W into the first `width` (live first, in slot order), inside each of `groups`
    equal slot groups (the data-parallel shards: no row leaves its shard), moved within the one cache: slot j of a
    group takes its j-th live slot, whose index is >= j, so no slot is overwritten before it has moved."""
    W, R = live_W.shape[0], jax.tree.leaves(pool.cache)[0].shape[0]
    m, n = W // groups, width // groups
    order_gxn = jnp.argsort(~live_W.reshape(groups, m), axis=1, stable=True)[:, :n].astype(jnp.int32)
    pick = lambda a: jnp.take_along_axis(a.reshape(groups, m), order_gxn, axis=1).reshape(width)
    take = jax.vmap(lambda c, s: jax.lax.dynamic_index_in_dim(c, s, 0))  # one row of each group (all its layers)

    def move(j, cache):
        def one(c):
            c_GxRxLxKxTxH = c.reshape(groups, R // groups, *c.shape[1:])
            row = take(c_GxRxLxKxTxH, order_gxn[:, j])
            return jax.lax.dynamic_update_slice(c_GxRxLxKxTxH, row, (0, j) + (0,) * (c.ndim - 1)).reshape(c.shape)
        return jax.tree.map(one, cache)
    # slots before the first that moves in any group keep their rows (passing through several widths at once,
    # the later shrinks move nothing)
    stays_n = jnp.all(order_gxn == jnp.arange(n, dtype=jnp.int32), axis=0)
    first = jnp.min(jnp.where(stays_n, n, jnp.arange(n, dtype=jnp.int32)))
    cache = jax.lax.fori_loop(first, n, move, pool.cache)  # bits, like every copy of the cache (model.BITS)
    return pool._replace(row_S=pick(pool.row_S), pos_S=pick(pool.pos_S), last_S=pick(pool.last_S),
                         cache=constrain_cache(cache), loops=pool.loops + n - first)


class _Ctx(NamedTuple):
    """What every decode step reads besides the pool (static numbers and arrays of the program)."""
    cfg: ModelConfig
    params: Params
    sample: object
    rows: Rows
    mask_BxP: jax.Array
    prompt_len_B: jax.Array
    limit_N: jax.Array
    valid_N: jax.Array
    pad_id: jax.Array
    eos_E: jax.Array
    new_bucket: int
    groups: int  # data-parallel shards: the pool shrinks inside each
    stop_groups: jax.Array | None  # the loop ends once this many groups are complete (None: only when all are)
    forms: DecodeForms


def _done(ctx: _Ctx, out: _Out) -> jax.Array:
    return out.finished_N | (out.lengths_N >= ctx.limit_N) | ~ctx.valid_N


def _active(ctx: _Ctx, pool: _Pool, out: _Out) -> jax.Array:
    N = ctx.limit_N.shape[0]
    return (pool.row_S < N) & ~_done(ctx, out)[jnp.minimum(pool.row_S, N - 1)]


def _record(ctx: _Ctx, out: _Out, row_b, pos_b, active_b, tok_b, logp_b) -> _Out:
    N = ctx.limit_N.shape[0]
    tok_b = jnp.where(active_b, tok_b, ctx.pad_id)
    hit_eos_b = active_b & jnp.any(tok_b[:, None] == ctx.eos_E[None, :], axis=-1)
    at_b = jnp.where(active_b, row_b, N)  # idle slots write nowhere (N is out of range: dropped)
    return _Out(out.tokens_NxC.at[at_b, pos_b].set(tok_b, mode="drop"),
                out.logp_NxC.at[at_b, pos_b].set(logp_b, mode="drop"),
                out.lengths_N.at[at_b].add(1, mode="drop"),
                out.finished_N.at[at_b].set(hit_eos_b, mode="drop"))


def _step(ctx: _Ctx, pool: _Pool, out: _Out) -> tuple[_Pool, _Out]:
    """One token for each live slot of the pool (its W slots: the cache rows model.cache_rows names for W)."""
    N, P, C = ctx.limit_N.shape[0], ctx.mask_BxP.shape[1], ctx.new_bucket
    W = pool.row_S.shape[0]
    active_W = _active(ctx, pool, out)
    row_W = jnp.minimum(pool.row_S, N - 1)
    prompt_W, new_W = ctx.rows.source_N[row_W], pool.pos_S - ctx.rows.start_N[row_W]  # tokens since its prefill
    # An idle slot writes at position 0 and reads nothing else, so the attention bound (the furthest filled
    # position over slots) only follows the live rows. A row's token j - 1 goes to P + j - 1 (carried ones too).
    index_W = jnp.where(active_W, P + pool.pos_S - 1, 0)
    kv_mask_WxT = jnp.concatenate([ctx.mask_BxP[prompt_W], jnp.ones((W, C), jnp.bool_)], axis=1) & active_W[:, None]
    positions_Wx1 = (ctx.prompt_len_B[prompt_W] + new_W - 1)[:, None]
    # The weights pass a barrier with the step count, so XLA cannot hoist their all-gathers (and XLA:CPU its
    # float32 copies of 16-bit weights) out of the loop: that held the whole model gathered beside the cache.
    params, _ = jax.lax.optimization_barrier((ctx.params, pool.steps))
    with sharding_lib.use_rules(sharding_lib.decode_rules(ctx.forms.stationary_weights)):  # TPU/GPU: weights stay
        h_Wx1xD, cache = model_lib.forward_with_cache(ctx.cfg, params, pool.last_S[:, None], positions_Wx1,
                                                      pool.cache, index_W, kv_mask_WxT, return_hidden=True,
                                                      cache_groups=ctx.groups, forms=ctx.forms)
        logits_WxV = model_lib.logits_from_hidden(ctx.cfg, params, h_Wx1xD)[:, 0]
    tok_W, logp_W = ctx.sample(logits_WxV, row_keys(ctx.rows.key_N[row_W], pool.pos_S, ctx.rows.id_N[row_W]))
    out = _record(ctx, out, pool.row_S, pool.pos_S, active_W, tok_W, logp_W)
    return pool._replace(pos_S=pool.pos_S + active_W, last_S=tok_W, cache=constrain_cache(cache),
                         steps=pool.steps + jnp.any(active_W)), out


def _decode(ctx: _Ctx, pool: _Pool, out: _Out, prompt_cache: list, widths: tuple[int, ...]) -> tuple[_Pool, _Out]:
    """The decode loop, one while_loop per width: at the full width idle slots refill from the queue; once the
    queue is empty and every shard's live slots fit the next width, they move there (_shrink) and the loop goes on
    computing only those. With ctx.stop_groups every loop also ends once that many groups are complete. Each
    iteration runs ctx.forms.steps_per_loop steps (a slot freed inside one idles until its end: a row's tokens do
    not depend on when it runs)."""
    for level, width in enumerate(widths):
        if level:
            pool = _shrink(pool, _active(ctx, pool, out), width, ctx.groups)
        smaller = widths[level + 1] if level + 1 < len(widths) else 0

        def cond(carry, smaller=smaller):
            pool, out = carry
            live_W = _active(ctx, pool, out)
            go = jnp.any(live_W)
            if smaller:
                queued = jnp.any(_queued(pool, _done(ctx, out)))
                fits = jnp.max(jnp.sum(live_W.reshape(ctx.groups, -1), axis=1)) <= smaller // ctx.groups
                go &= queued | ~fits
            if ctx.stop_groups is not None:
                go &= complete_groups(ctx.rows.group_N, _done(ctx, out), ctx.valid_N) < ctx.stop_groups
            return go

        def body(carry, refill=level == 0):
            pool, out = carry
            for _ in range(ctx.forms.steps_per_loop):  # XLA:GPU waits on the host once per iteration, not per step
                pool, out = _step(ctx, pool, out)
            pool = pool._replace(loops=pool.loops + 1 + refill)  # the loop's condition, and the refill's predicate
            if not refill:
                return pool, out
            # most steps free no slot: they skip the refill's bookkeeping (ranks, searches, the copy loop)
            done_N = _done(ctx, out)
            idle = jnp.any(~_active(ctx, pool, out)) & jnp.any(_queued(pool, done_N))
            return jax.lax.cond(idle, lambda p: _refill(p, done_N, out, prompt_cache, ctx.rows), lambda p: p, pool), out
        pool, out = jax.lax.while_loop(cond, body, (pool, out))
    return pool, out


def _gather_rows(x_B: jax.Array, source_N: jax.Array, Q: int) -> jax.Array:
    """x_B[source_N], within each of Q groups (rows of group q take from block q of x_B): with Q = the data-parallel
    shards the gather stays on each device."""
    if Q == 1:
        return x_B[source_N]
    B, N = x_B.shape[0], source_N.shape[0]
    local_Qxn = source_N.reshape(Q, N // Q) - (B // Q) * jnp.arange(Q, dtype=jnp.int32)[:, None]
    return jax.vmap(lambda x, i: x[i])(x_B.reshape(Q, B // Q, *x_B.shape[1:]), local_Qxn).reshape(N, *x_B.shape[1:])


def _prefill(cfg: ModelConfig, params: Params, tokens_BxW: jax.Array, mask_BxW: jax.Array, P: int, dp: int,
             carrying: int, forms: DecodeForms) -> tuple[jax.Array, tuple]:
    """(each sequence's hidden state at its last real position [B, 1, D], the caches [B, L, K, W, H], or one
    [B, K, W, H] pair per layer as forms.stacked_cache says) of sequences in
    the prompt bucket P, then W - P carried positions. With `carrying`, the first `carrying` sequences of each of the
    dp blocks are prefilled over all W positions and the others over P (their carried positions are padding: a
    fresh prompt's prefill costs its bucket, not the longest carried row's), their caches padded to W."""
    B, W = tokens_BxW.shape
    # the caches as bits where the platform's forms say so: never converted whole (kv_cache.BITS)
    bits = kv_cache.BITS if jnp.dtype(cfg.compute_dtype).itemsize == 2 and forms.cache_bits else None

    def run(tokens, mask):  # the last real position: the prompt's (P - 1), or a sequence's last carried token's
        h_BxTxD, cache = model_lib.prefill(cfg, params, tokens, mask, bits, forms.stacked_cache, forms)
        last_B = P - 1 + jnp.sum(mask[:, P:], axis=-1, dtype=jnp.int32)
        return jnp.take_along_axis(h_BxTxD, last_B[:, None, None], axis=1), cache
    if W == P or not carrying or carrying * dp == B:
        return run(tokens_BxW, mask_BxW)
    w = B // dp
    part = lambda a, lo, hi, cols: a.reshape(dp, w, W)[:, lo:hi, :cols].reshape(dp * (hi - lo), cols)
    h_c, cache_c = run(part(tokens_BxW, 0, carrying, W), part(mask_BxW, 0, carrying, W))
    h_f, cache_f = run(part(tokens_BxW, carrying, w, P), part(mask_BxW, carrying, w, P))
    pad = lambda c: jnp.pad(c, [(0, 0)] * (c.ndim - 2) + [(0, W - P), (0, 0)])
    merge = lambda a, b: jnp.concatenate([a.reshape(dp, carrying, *a.shape[1:]), b.reshape(dp, w - carrying,
                                                                                        *b.shape[1:])],
                                         axis=1).reshape(B, *a.shape[1:])
    return merge(h_c, h_f), jax.tree.map(lambda c, f: merge(c, pad(f)), cache_c, cache_f)


@functools.partial(jax.jit, static_argnames=("cfg", "plan"), donate_argnames=("tokens_NxC", "logp_NxC"))
def generate_program(cfg: ModelConfig, plan: SamplerPlan, params: Params, prompt_BxP: jax.Array,
                     prompt_mask_BxP: jax.Array, tokens_NxC: jax.Array, logp_NxC: jax.Array, limit_N: jax.Array,
                     rows: Rows, stop_groups: jax.Array, temperature: jax.Array, top_p: jax.Array, min_p: jax.Array,
                     pad_id: jax.Array, eos_E: jax.Array):
    """The whole sampling program sampler.generate runs (prefill, then the slot pool's decode loop); public so that
    the memory plan lowers exactly this program for abstract inputs. B sequences to prefill, N rows (rows.py: row n
    continues sequence rows.source_N[n] from its rows.start_N[n] tokens in tokens_NxC / logp_NxC; limit_N[n] = 0: a
    filler row). -> per row: tokens, log-probs, lengths, finished (EOS), done (EOS or limit), prompt tokens and mask;
    and the decode steps run, and the data-dependent loop iterations (_Pool.loops)."""
    B, P = prompt_BxP.shape[0], prompt_BxP.shape[1] - plan.carried  # the prompt bucket; then carried tokens
    N, C, S = limit_N.shape[0], plan.new_bucket, plan.slots
    forms = plan.forms or for_platform(jax.default_backend())
    if plan.unstack_layers:
        params = model_lib.unstack_layers(cfg, params)
    sample = functools.partial(sample_tokens, greedy=plan.greedy, temperature=temperature, top_k=plan.top_k,
                               top_p=top_p if plan.use_top_p else None, min_p=min_p if plan.use_min_p else None)

    mask_BxW = prompt_mask_BxP.astype(jnp.bool_)  # W = P + plan.carried
    dp = plan.mesh.shape["data"] * plan.mesh.shape["fsdp"] if plan.mesh is not None else 1
    h_Bx1xD, prompt_cache = _prefill(cfg, params, prompt_BxP, mask_BxW, P, dp, plan.carrying, forms)
    prompt_cache = constrain_cache(prompt_cache)
    Q = queue_groups(N, B, S, dp)
    logits_NxV = _gather_rows(model_lib.logits_from_hidden(cfg, params, h_Bx1xD)[:, 0], rows.source_N, Q)
    ctx = _Ctx(cfg, params, sample, rows, mask_BxW[:, :P], jnp.sum(mask_BxW, axis=-1, dtype=jnp.int32), limit_N,
               limit_N > 0, pad_id, eos_E, C, dp, stop_groups if plan.stop_early else None, forms)

    # Every row's next token (its first, or the one after those it carried in) comes from its sequence's prefill
    # logits (the last position).
    rows_N = jnp.arange(N, dtype=jnp.int32)
    tok_N, logp_N = sample(logits_NxV, row_keys(rows.key_N, rows.start_N, rows.id_N))
    out = _record(ctx, _Out(tokens_NxC, logp_NxC, rows.start_N, jnp.zeros((N,), jnp.bool_)), rows_N, rows.start_N,
                  ctx.valid_N, tok_N, logp_N)
    cache = constrain_cache(kv_cache.init_cache(cfg, S, P + C, jax.tree.leaves(prompt_cache)[0].dtype,
                                                stacked=forms.stacked_cache))
    empty_S = jnp.full((S,), N, jnp.int32)
    pool = _Pool(empty_S, jnp.ones((S,), jnp.int32), jnp.zeros((S,), jnp.int32), cache, jnp.zeros((Q,), jnp.int32),
                 jnp.int32(1), jnp.int32(0))
    pool = _refill(pool, _done(ctx, out), out, prompt_cache, rows)
    widths = plan.stages if plan.stages is not None else stage_widths(S, dp, C) if forms.shrink else (S,)
    pool, out = _decode(ctx, pool, out, prompt_cache, widths)
    return (out.tokens_NxC, out.logp_NxC, out.lengths_N, out.finished_N, _done(ctx, out) & ctx.valid_N,
            _gather_rows(prompt_BxP[:, :P], rows.source_N, Q), _gather_rows(mask_BxW[:, :P], rows.source_N, Q),
            pool.steps, pool.loops)


def auto_slots(cfg: ModelConfig, rows: int, prompts: int, cache_len: int, prompt_len: int, mesh: Mesh | None,
               headroom: float = 0.8) -> int:
    """The most slots (a multiple of data x fsdp, at most `rows`) whose KV cache fits `headroom` of the first local
    device's free memory once the prompt caches are counted; all rows where the backend reports no limit (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return rows
    dp = mesh.shape["data"] * mesh.shape["fsdp"] if mesh is not None else 1
    tp = mesh.shape["tensor"] if mesh is not None and cfg.num_kv_heads % mesh.shape["tensor"] == 0 else 1
    per_position = 2 * cfg.num_layers * (cfg.num_kv_heads // tp) * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
    free = headroom * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)) - per_position * prompt_len * prompts / dp
    per_device = int(free // (per_position * cache_len))
    return max(dp, min(rows, per_device * dp) // dp * dp)
