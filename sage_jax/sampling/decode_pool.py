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
only P: prefill.prefill_sequences), and goes on drawing the tokens it would have drawn uninterrupted: its token j is
written at P + j and fed at its uninterrupted RoPE position. With plan.stop_early the loop also ends once
`stop_groups` groups have all their rows done (rows.complete_groups); the rows still running are returned with what
they have.

A session (session.py, plan.pausing) keeps the pool on the device between calls of a few steps each: a row that
draws a pause id (a tool call's end) pauses in its slot with its cache; the host appends tokens to its row (a tool's
output) and releases it, and the decode steps feed those tokens one per step (forced: not drawn, not recorded) before
it draws again, at the positions and with the keys it would have had had the tokens been carried in.
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
# re-exported: the pool's widths and queues are decode_pool's to callers and tests
from sage_jax.sampling.prefill import gather_rows, prefill_sequences, queue_groups, stage_widths  # noqa: F401
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
    pausing: bool = False  # a session's program (session.py): rows pause on pause ids and are fed tokens appended


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
    paused_N: jax.Array  # drew a pause id (plan.pausing): keeps its slot, decodes again once the host releases it


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
    pause_E: jax.Array | None = None  # plan.pausing: the ids a row pauses on (-1: none)


def _done(ctx: _Ctx, out: _Out) -> jax.Array:
    return out.finished_N | (out.lengths_N >= ctx.limit_N) | ~ctx.valid_N


def occupied(ctx: _Ctx, pool: _Pool, out: _Out) -> jax.Array:
    """Slots holding a row that has not stopped (a paused row too: it keeps its slot and cache)."""
    N = ctx.limit_N.shape[0]
    return (pool.row_S < N) & ~_done(ctx, out)[jnp.minimum(pool.row_S, N - 1)]


def active(ctx: _Ctx, pool: _Pool, out: _Out) -> jax.Array:
    """Slots that decode at the next step: occupied and not paused."""
    if ctx.pause_E is None:
        return occupied(ctx, pool, out)
    return occupied(ctx, pool, out) & ~out.paused_N[jnp.minimum(pool.row_S, ctx.limit_N.shape[0] - 1)]


def _record(ctx: _Ctx, out: _Out, row_b, pos_b, active_b, tok_b, logp_b, forced_b=None) -> _Out:
    """Each active slot's token at its position (forced_b: a token the host appended, already there: kept)."""
    N = ctx.limit_N.shape[0]
    tok_b = jnp.where(active_b, tok_b, ctx.pad_id)
    drawn_b = active_b if forced_b is None else active_b & ~forced_b
    hit_eos_b = drawn_b & jnp.any(tok_b[:, None] == ctx.eos_E[None, :], axis=-1)
    at_b = jnp.where(drawn_b, row_b, N)  # idle slots write nowhere (N is out of range: dropped)
    paused_N = out.paused_N
    if ctx.pause_E is not None:
        hit_pause_b = drawn_b & ~hit_eos_b & jnp.any(tok_b[:, None] == ctx.pause_E[None, :], axis=-1)
        paused_N = paused_N.at[at_b].set(hit_pause_b, mode="drop")
    return _Out(out.tokens_NxC.at[at_b, pos_b].set(tok_b, mode="drop"),
                out.logp_NxC.at[at_b, pos_b].set(logp_b, mode="drop"),
                out.lengths_N.at[at_b].add(1, mode="drop"),
                out.finished_N.at[at_b].set(hit_eos_b, mode="drop"), paused_N)


def _step(ctx: _Ctx, pool: _Pool, out: _Out) -> tuple[_Pool, _Out]:
    """One token for each live slot of the pool (its W slots: the cache rows model.cache_rows names for W)."""
    N, P, C = ctx.limit_N.shape[0], ctx.mask_BxP.shape[1], ctx.new_bucket
    W = pool.row_S.shape[0]
    active_W = active(ctx, pool, out)
    row_W = jnp.minimum(pool.row_S, N - 1)
    prompt_W, new_W = ctx.rows.source_N[row_W], pool.pos_S - ctx.rows.start_N[row_W]  # tokens since its prefill
    # An idle slot writes at position 0 and reads nothing else, so the attention bound (the furthest filled
    # position over slots) only follows the live rows; a paused one writes where its next token goes (overwritten
    # when it goes on). A row's token j - 1 goes to P + j - 1 (carried ones too).
    index_W = jnp.where(active_W if ctx.pause_E is None else occupied(ctx, pool, out), P + pool.pos_S - 1, 0)
    kv_mask_WxT = jnp.concatenate([ctx.mask_BxP[prompt_W], jnp.ones((W, C), jnp.bool_)], axis=1) & active_W[:, None]
    positions_Wx1 = (ctx.prompt_len_B[prompt_W] + new_W - 1)[:, None]
    # The weights pass a barrier with the step count, so XLA cannot hoist their all-gathers (and XLA:CPU its
    # float32 copies of 16-bit weights) out of the loop: that held the whole model gathered beside the cache.
    params, _ = jax.lax.optimization_barrier((ctx.params, pool.steps))
    with sharding_lib.use_rules(model_lib.decode_step_rules(ctx.cfg, ctx.forms.stationary_weights)):
        h_Wx1xD, cache = model_lib.forward_with_cache(ctx.cfg, params, pool.last_S[:, None], positions_Wx1,
                                                      pool.cache, index_W, kv_mask_WxT, return_hidden=True,
                                                      cache_groups=ctx.groups, forms=ctx.forms)
        logits_WxV = model_lib.logits_from_hidden(ctx.cfg, params, h_Wx1xD)[:, 0]
    tok_W, logp_W = ctx.sample(logits_WxV, row_keys(ctx.rows.key_N[row_W], pool.pos_S, ctx.rows.id_N[row_W]))
    forced_W = None
    if ctx.pause_E is not None:  # tokens the host appended after a pause (a tool's output) are fed, not drawn
        forced_W = active_W & (pool.pos_S < out.lengths_N[row_W])
        tok_W = jnp.where(forced_W, out.tokens_NxC[row_W, pool.pos_S], tok_W)
    out = _record(ctx, out, pool.row_S, pool.pos_S, active_W, tok_W, logp_W, forced_W)
    return pool._replace(pos_S=pool.pos_S + active_W, last_S=jnp.where(active_W, tok_W, pool.last_S),
                         cache=constrain_cache(cache),
                         steps=pool.steps + jnp.any(active_W)), out


def run_width(ctx: _Ctx, pool: _Pool, out: _Out, prompt_cache: list, widths: tuple[int, ...], level: int,
              stop_at: jax.Array | None = None) -> tuple[_Pool, _Out]:
    """The decode loop at widths[level] (_decode). It ends when no slot is active (decodes at the next step),
    once ctx.stop_groups groups are complete, once the queue is empty and every shard's occupied slots fit the next
    width (shrink_due), and with stop_at (a session's call) once pool.steps reaches it. At the full width idle
    slots refill from the queue. Each iteration runs ctx.forms.steps_per_loop steps (a slot freed inside one idles
    until its end: a row's tokens do not depend on when it runs)."""
    smaller = widths[level + 1] if level + 1 < len(widths) else 0

    def cond(carry):
        pool, out = carry
        go = jnp.any(active(ctx, pool, out))
        if smaller:
            go &= ~shrink_due(ctx, pool, out, smaller)
        if ctx.stop_groups is not None:
            go &= complete_groups(ctx.rows.group_N, _done(ctx, out), ctx.valid_N) < ctx.stop_groups
        if stop_at is not None:
            go &= pool.steps < stop_at
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
        idle = jnp.any(~occupied(ctx, pool, out)) & jnp.any(_queued(pool, done_N))
        return jax.lax.cond(idle, lambda p: _refill(p, done_N, out, prompt_cache, ctx.rows), lambda p: p, pool), out
    return jax.lax.while_loop(cond, body, (pool, out))


def shrink_due(ctx: _Ctx, pool: _Pool, out: _Out, smaller: int) -> jax.Array:
    """The queue is empty and every shard's decoding slots fit `smaller` slots: the pool moves to that width (a
    session's paused rows move out of it: session.py)."""
    fits = jnp.max(jnp.sum(active(ctx, pool, out).reshape(ctx.groups, -1), axis=1)) <= smaller // ctx.groups
    return fits & queue_empty(ctx, pool, out)


def queue_empty(ctx: _Ctx, pool: _Pool, out: _Out) -> jax.Array:
    return ~jnp.any(_queued(pool, _done(ctx, out)))


def shrink(ctx: _Ctx, pool: _Pool, out: _Out, width: int) -> _Pool:
    return _shrink(pool, occupied(ctx, pool, out), width, ctx.groups)


def _decode(ctx: _Ctx, pool: _Pool, out: _Out, prompt_cache: list, widths: tuple[int, ...]) -> tuple[_Pool, _Out]:
    """The decode loop, one while_loop per width (run_width): at the full width idle slots refill from the queue;
    once the queue is empty and every shard's live slots fit the next width, they move there (_shrink) and the loop
    goes on computing only those."""
    for level, width in enumerate(widths):
        if level:
            pool = shrink(ctx, pool, out, width)
        pool, out = run_width(ctx, pool, out, prompt_cache, widths, level)
    return pool, out


def make_ctx(cfg: ModelConfig, plan: SamplerPlan, params: Params, prompt_mask_BxW: jax.Array, limit_N: jax.Array,
             rows: Rows, stop_groups: jax.Array, temperature: jax.Array, top_p: jax.Array, min_p: jax.Array,
             pad_id: jax.Array, eos_E: jax.Array, pause_E: jax.Array | None = None) -> _Ctx:
    """What the decode steps read (params as given: generate_program unstacks them first where the plan says so)."""
    mask_BxW = prompt_mask_BxW.astype(jnp.bool_)  # W = P + plan.carried
    sample = functools.partial(sample_tokens, greedy=plan.greedy, temperature=temperature, top_k=plan.top_k,
                               top_p=top_p if plan.use_top_p else None, min_p=min_p if plan.use_min_p else None)
    dp = plan.mesh.shape["data"] * plan.mesh.shape["fsdp"] if plan.mesh is not None else 1
    forms = plan.forms or for_platform(jax.default_backend())
    params = model_lib.decode_params(cfg, params, model_lib.decode_step_rules(cfg, forms.stationary_weights))
    return _Ctx(cfg, params, sample, rows, mask_BxW[:, :mask_BxW.shape[1] - plan.carried],
                jnp.sum(mask_BxW, axis=-1, dtype=jnp.int32), limit_N, limit_N > 0, pad_id, eos_E, plan.new_bucket, dp,
                stop_groups if plan.stop_early else None, forms,
                pause_E if plan.pausing else None)


def start(cfg: ModelConfig, plan: SamplerPlan, params: Params, prompt_BxP: jax.Array, prompt_mask_BxP: jax.Array,
          tokens_NxC: jax.Array, logp_NxC: jax.Array, limit_N: jax.Array, rows: Rows, *scalars: jax.Array,
          pause_E: jax.Array | None = None) -> tuple[_Ctx, _Pool, _Out, list, tuple[int, ...]]:
    """Every sequence prefilled once, each row's next token drawn from its prefill logits, and the pool's slots
    filled from the queue -> (ctx, pool, out, the prompt caches, the pool's widths). scalars: stop_groups,
    temperature, top_p, min_p, pad_id, eos_E (generate_program's)."""
    B, P = prompt_BxP.shape[0], prompt_BxP.shape[1] - plan.carried  # the prompt bucket; then carried tokens
    N, C, S = limit_N.shape[0], plan.new_bucket, plan.slots
    if plan.unstack_layers:
        params = model_lib.unstack_layers(cfg, params)
    ctx = make_ctx(cfg, plan, params, prompt_mask_BxP, limit_N, rows, *scalars, pause_E=pause_E)
    h_Bx1xD, prompt_cache = prefill_sequences(cfg, params, prompt_BxP, prompt_mask_BxP.astype(jnp.bool_), P,
                                              ctx.groups, plan.carrying, ctx.forms)
    prompt_cache = constrain_cache(prompt_cache)
    Q = queue_groups(N, B, S, ctx.groups)
    logits_NxV = gather_rows(model_lib.logits_from_hidden(cfg, params, h_Bx1xD)[:, 0], rows.source_N, Q)
    # Every row's next token (its first, or the one after those it carried in) comes from its sequence's prefill
    # logits (the last position).
    rows_N = jnp.arange(N, dtype=jnp.int32)
    tok_N, logp_N = ctx.sample(logits_NxV, row_keys(rows.key_N, rows.start_N, rows.id_N))
    empty_N = jnp.zeros((N,), jnp.bool_)
    out = _record(ctx, _Out(tokens_NxC, logp_NxC, rows.start_N, empty_N, empty_N), rows_N, rows.start_N,
                  ctx.valid_N, tok_N, logp_N)
    cache = constrain_cache(kv_cache.init_cache(cfg, S, P + C, jax.tree.leaves(prompt_cache)[0].dtype,
                                                stacked=ctx.forms.stacked_cache))
    empty_S = jnp.full((S,), N, jnp.int32)
    pool = _Pool(empty_S, jnp.ones((S,), jnp.int32), jnp.zeros((S,), jnp.int32), cache, jnp.zeros((Q,), jnp.int32),
                 jnp.int32(1), jnp.int32(0))
    pool = _refill(pool, _done(ctx, out), out, prompt_cache, rows)
    return ctx, pool, out, prompt_cache, pool_widths(plan, ctx.groups)


def pool_widths(plan: SamplerPlan, dp: int) -> tuple[int, ...]:
    """The widths the pool shrinks through: plan.stages, else stage_widths where the platform's forms shrink."""
    if plan.stages is not None:
        return plan.stages
    forms = plan.forms or for_platform(jax.default_backend())
    return stage_widths(plan.slots, dp, plan.new_bucket) if forms.shrink else (plan.slots,)


def done_rows(ctx: _Ctx, out: _Out) -> jax.Array:
    """Rows that stopped: EOS, their budget (filler rows are not counted)."""
    return _done(ctx, out) & ctx.valid_N


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
    ctx, pool, out, prompt_cache, widths = start(cfg, plan, params, prompt_BxP, prompt_mask_BxP, tokens_NxC, logp_NxC,
                                                 limit_N, rows, stop_groups, temperature, top_p, min_p, pad_id, eos_E)
    pool, out = _decode(ctx, pool, out, prompt_cache, widths)
    P, Q = ctx.mask_BxP.shape[1], pool.next_row.shape[0]
    return (out.tokens_NxC, out.logp_NxC, out.lengths_N, out.finished_N, done_rows(ctx, out),
            gather_rows(prompt_BxP[:, :P], rows.source_N, Q), gather_rows(ctx.mask_BxP, rows.source_N, Q),
            pool.steps, pool.loops)
