"""A decode pool kept on the device across calls, so that a row can pause mid-completion (at a tool call's end) in its
slot, with its cache, while the other rows go on decoding, and go on itself once the host appends tokens to it (the
tool's output): nothing is prefilled again and no new pool is started. eval/tool_loop.py runs tool calls this way.

    s = PoolSession(cfg, params, prompts, max_new_tokens, pause_ids=(call_end,), num_samples=G, seed=key)
    while s.advance():                 # up to steps_per_call decode steps; False: no row is left that can decode
        for n in s.newly_stopped():    # rows that paused (drew a pause id) or stopped since the last look
            s.append(n, ids)           # paused: tokens appended to its row (observed), fed one per step, never drawn
            s.release(n)               # or: it goes on with nothing appended; s.end(n): it stops here (truncated)
    out = s.result()                   # sampler.SampleOutput of the fresh rows, as sampler.generate returns them

The rows are sampler.generate's for the same arguments (prompt-major, sample g of prompt b is row b * G + g) and a
row draws its token j with generate's key for j, at the position it would have had: a row that never pauses draws
the tokens generate draws for it, and a row with tokens appended draws what generate would draw had those tokens
been carried in (sampler's resume), up to the float rounding of a cache computed one step at a time instead of in one
prefill. Appended tokens count against the row's budget and carry NaN log-probs. A call of the program runs
steps_per_call decode steps at most (decode_pool.run_width with stop_at), and returns early when every row left is
paused or the decoding rows fit a narrower width.

Widths: a call computes the first W slots of the pool (of each data-parallel group), W the narrowest of generate's
widths (decode_pool.pool_widths) that holds every decoding row, the full width while rows wait in the queue. Before
its steps, paused rows in those W slots move to idle slots past them, cache rows and all (_arrange, _swap: a row's
cache and positions do not depend on its slot), so a row waiting on its tool costs no compute; a released row past W
moves back in, and W widens again when the decoding rows need it. (The widths are XLA:CPU's, where a step costs its
rows; TPU and GPU forms keep one width, where a paused row's cost is its cache read.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax.models import decoder as model_lib
from sage_jax.models import sharding as sharding_lib
from sage_jax.sampling import decode_pool, sampler


@functools.partial(jax.jit, static_argnames=("cfg", "plan"))
def _start(cfg, plan, params, inputs, pause_E):
    ctx, pool, out, prompt_cache, _ = decode_pool.start(cfg, plan, params, *inputs, pause_E=pause_E)
    return (pool, out, prompt_cache), _status(ctx, pool, out)


def _ctx(cfg, plan, params, inputs, limit_N, pause_E):
    """inputs: (the prompt mask, the rows, stop_groups, temperature, top_p, min_p, pad_id, eos ids)."""
    mask_BxW, rows, *scalars = inputs
    return decode_pool.make_ctx(cfg, plan, params, mask_BxW, limit_N, rows, *scalars, pause_E=pause_E)


@functools.partial(jax.jit, static_argnames=("cfg", "plan", "level", "steps"), donate_argnames=("state",))
def _advance(cfg, plan, level, steps, params, inputs, limit_N, pause_E, state):
    """Up to `steps` decode steps computing the first plan.stages[level] slots (of each data-parallel group), fewer
    once no row can decode or the decoding rows fit the next width -> (state, [lengths N, paused N, finished N, the
    slot group of each row (-1: none), whether the queue is empty, steps run]: one array). Before the steps the
    rows are arranged for that width (_arrange): the slots past it are not computed."""
    ctx = _ctx(cfg, plan, params, inputs, limit_N, pause_E)
    pool, out, prompt_cache = state
    width, G = plan.stages[level], ctx.groups
    if width < plan.slots:
        pool = _arrange(ctx, pool, out, width)
    front = pool._replace(**{f: _cut(getattr(pool, f), G, width) for f in _SLOT_FIELDS})
    front, out = decode_pool.run_width(ctx, front, out, prompt_cache, plan.stages, level, front.steps + steps)
    pool = front._replace(**{f: _put(getattr(pool, f), getattr(front, f), G) for f in _SLOT_FIELDS})
    return (pool, out, prompt_cache), _status(ctx, pool, out)


def _status(ctx, pool, out) -> jax.Array:
    """What the host reads after a call, in one array (one transfer)."""
    S, N = pool.row_S.shape[0], ctx.limit_N.shape[0]
    group_N = jnp.full((N,), -1, jnp.int32).at[pool.row_S].set(jnp.arange(S, dtype=jnp.int32) // (S // ctx.groups),
                                                                 mode="drop")
    as_int = lambda x: jnp.asarray(x, jnp.int32).reshape(-1)
    return jnp.concatenate([as_int(out.lengths_N), as_int(out.paused_N), as_int(out.finished_N), group_N,
                            as_int(decode_pool.queue_empty(ctx, pool, out)), as_int(pool.steps)])


_SLOT_FIELDS = ("row_S", "pos_S", "last_S")


def _cut(a_S, groups: int, width: int) -> jax.Array:
    """The first width / groups entries of each of `groups` equal blocks (the slots a width computes)."""
    return a_S if width == a_S.shape[0] else a_S.reshape(groups, -1)[:, :width // groups].reshape(width)


def _put(full_S, part_W, groups: int) -> jax.Array:
    if part_W.shape == full_S.shape:
        return part_W
    w = part_W.shape[0] // groups
    return full_S.reshape(groups, -1).at[:, :w].set(part_W.reshape(groups, w)).reshape(full_S.shape)


def _arrange(ctx, pool, out, width: int):
    """The pool's rows arranged for a call that computes the first m = width / groups slots of each group: paused
    rows among those move to idle slots past them (their cache rows with them: a paused row is not computed while
    it waits), then decoding rows past them move into the front's other slots, idle ones first (the caller's width
    holds every decoding row)."""
    G = ctx.groups
    m, w = pool.row_S.shape[0] // G, width // G
    front = jnp.arange(m) < w
    first = lambda mask: jnp.argsort(~mask, axis=1, stable=True).astype(jnp.int32)  # mask's slots first, in order
    count = lambda mask: jnp.sum(mask, axis=1, dtype=jnp.int32)

    def flags(pool):
        return (decode_pool.occupied(ctx, pool, out).reshape(G, m), decode_pool.active(ctx, pool, out).reshape(G, m))
    busy, active = flags(pool)
    park, free = busy & ~active & front, ~busy & ~front
    pool = _swap(pool, first(park), first(free), jnp.minimum(count(park), count(free)), G)
    busy, active = flags(pool)
    late = active & ~front
    room = jnp.argsort(jnp.where(front & ~busy, 0, jnp.where(front & ~active, 1, 2)), axis=1, stable=True)
    return _swap(pool, first(late), room.astype(jnp.int32), count(late), G)


def _swap(pool, a_GxM, b_GxM, count_G, groups: int):
    """In each group g, slot a[g, k] and slot b[g, k] exchange their rows (slot arrays and cache rows) for
    k < count[g] (the a's and b's of a group all distinct)."""
    m = pool.row_S.shape[0] // groups
    ok_GxM = jnp.arange(m)[None, :] < count_G[:, None]
    g_Gx1 = jnp.arange(groups)[:, None]
    # past a group's count, slot 0 (on itself in the cache; dropped in the slot arrays)
    a_GxM, b_GxM = (jnp.where(ok_GxM, x, 0) for x in (a_GxM, b_GxM))

    def slots(x_S):
        x_Gxm = x_S.reshape(groups, m)
        a, b = x_Gxm[g_Gx1, a_GxM], x_Gxm[g_Gx1, b_GxM]
        x_Gxm = x_Gxm.at[g_Gx1, jnp.where(ok_GxM, b_GxM, m)].set(a, mode="drop")
        return x_Gxm.at[g_Gx1, jnp.where(ok_GxM, a_GxM, m)].set(b, mode="drop").reshape(x_S.shape)

    # Swap k's two rows are read in iteration k and written in iteration k + 1 (a row read and written in one
    # iteration made XLA:CPU copy the whole cache to keep the read's source).

    def read(c, k):
        one = lambda c1, i: jax.lax.dynamic_index_in_dim(c1, i, 0)
        if groups == 1:
            return one(c, a_GxM[0, k]), one(c, b_GxM[0, k])
        c_G = c.reshape(groups, m, *c.shape[1:])
        return jax.vmap(one)(c_G, a_GxM[:, k]), jax.vmap(one)(c_G, b_GxM[:, k])

    def write(c, rows, k):  # swap k - 1's rows, each to the other's slot
        put = lambda c1, row, i: jax.lax.dynamic_update_index_in_dim(c1, row, i, 0)
        (ra, rb), k = rows, k - 1
        if groups == 1:
            return put(put(c, ra, b_GxM[0, k]), rb, a_GxM[0, k])
        c_G = c.reshape(groups, m, *c.shape[1:])
        c_G = jax.vmap(put)(jax.vmap(put)(c_G, ra, b_GxM[:, k]), rb, a_GxM[:, k])
        return c_G.reshape(c.shape)

    leaves, tree = jax.tree.flatten(pool.cache)

    def body(k, carry):
        leaves, rows = carry
        leaves = [write(c, r, k) for c, r in zip(leaves, rows)]
        return leaves, [read(c, k) for c in leaves]
    n = jnp.max(count_G)  # with no swap, the one write puts slot 0's row back on itself
    leaves, rows = jax.lax.fori_loop(1, n, body, (leaves, [read(c, 0) for c in leaves]))
    leaves = [write(c, r, n) for c, r in zip(leaves, rows)]
    cache = jax.tree.unflatten(tree, leaves)
    return pool._replace(**{f: slots(getattr(pool, f)) for f in _SLOT_FIELDS},
                         cache=decode_pool.constrain_cache(cache), loops=pool.loops + jnp.max(count_G))


@functools.partial(jax.jit, donate_argnames=("out",))
def _edit(out, ids_NxF, count_N, release_N):
    """Rows' appended tokens written after their tokens so far (NaN log-probs), and released rows unpaused (the
    rows' arrays only: one program whatever the pool's width)."""
    N, C = out.tokens_NxC.shape
    at_NxF = out.lengths_N[:, None] + jnp.arange(ids_NxF.shape[1], dtype=jnp.int32)[None, :]
    at_NxF = jnp.where(jnp.arange(ids_NxF.shape[1])[None, :] < count_N[:, None], at_NxF, C)  # past C: dropped
    rows_NxF = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[:, None], at_NxF.shape)
    out = out._replace(tokens_NxC=out.tokens_NxC.at[rows_NxF, at_NxF].set(ids_NxF, mode="drop"),
                       logp_NxC=out.logp_NxC.at[rows_NxF, at_NxF].set(jnp.nan, mode="drop"),
                       lengths_N=out.lengths_N + count_N, paused_N=out.paused_N & ~release_N)
    return out


def _on_device(tree):
    """Host arrays the calls read, put on the device once (one process); on several processes each call passes them
    (the same on every process) and the program places them."""
    if jax.process_count() > 1:
        return tree
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), tree)


class PoolSession:
    """One pool of rows decoded across calls, with pauses (module docstring). The keyword arguments are
    sampler.generate's (no resume, stop_after_groups or min_rows: a session's rows are all fresh and run to their
    end); pause_ids are the tokens a row pauses on; steps_per_call bounds each advance()."""

    def __init__(self, cfg, params, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 pause_ids: Sequence[int], steps_per_call: int = 16, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, min_p: float = 0.0, eos_ids: Sequence[int] | None = None, seed=0,
                 num_samples: int = 1, pad_id: int | None = None, mesh=None, unstack_layers: bool | None = None,
                 row_max_new_tokens: Sequence[int] | None = None, slots=None, decode_attention="auto"):
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call={steps_per_call} must be >= 1")
        call = sampler.prepare_call(cfg, params, prompts, max_new_tokens, temperature=temperature, top_p=top_p,
                                    top_k=top_k, min_p=min_p, eos_ids=eos_ids, seed=seed, num_samples=num_samples,
                                    pad_id=pad_id, mesh=mesh, unstack_layers=unstack_layers,
                                    row_max_new_tokens=row_max_new_tokens, slots=slots, stop_after_groups=None,
                                    resume=(), min_rows=0, decode_attention=decode_attention)
        plan, self.params = call.plan, call.params
        dp = plan.mesh.shape["data"] * plan.mesh.shape["fsdp"] if plan.mesh is not None else 1
        widths = decode_pool.pool_widths(plan, dp)
        if plan.unstack_layers:  # once for the session, not once per call
            self.params = jax.jit(model_lib.unstack_layers, static_argnums=0)(cfg, self.params)
        self.cfg, self.plan = cfg, dataclasses.replace(plan, stages=widths, pausing=True, unstack_layers=False)
        self.call, self.max_new_tokens, self.steps_per_call = call, max_new_tokens, steps_per_call
        self.pause_E, self.limit_N = _on_device(sampler.id_array(pause_ids)), np.array(call.rows.limit_N)
        self.level, self.calls, self.groups = 0, 0, dp
        self._note("start")
        with self._mesh():
            self.state, status = _start(cfg, self.plan, self.params, call.inputs, self.pause_E)
            # what each call reads besides the state (on the device once): the prompt mask, the rows, the scalars
            self.inputs = _on_device((call.inputs[1], call.inputs[5], *call.inputs[6:]))
        self._limit = _on_device(self.limit_N)
        self.seen = np.zeros(len(self.limit_N), bool)  # rows whose stop (or pause) newly_stopped has reported
        self._edits: dict[int, list[int]] = {}
        self._released: set[int] = set()
        self._read(status)

    def _note(self, *program) -> None:
        """Counted in sampler.compile_count, as generate's programs are (warm-ups read it)."""
        sampler._PROGRAMS.add((self.call.program_key, self.plan, *program))

    def _mesh(self):
        return jax.set_mesh(self.call.mesh) if self.call.mesh is not None else contextlib.nullcontext()

    def _read(self, status) -> None:
        N, status = len(self.limit_N), sharding_lib.to_host(status)
        self.lengths, self.paused, self.finished = status[:N], status[N:2 * N] > 0, status[2 * N:3 * N] > 0
        self.group, self.queue_empty, self.steps = status[3 * N:4 * N], bool(status[-2]), int(status[-1])
        self.done = (self.finished | (self.lengths >= self.limit_N)) & (self.limit_N > 0)  # decode_pool's _done
        self._host = None  # tokens and log-probs, fetched when asked for

    def _apply_edits(self) -> None:
        if not self._edits and not self._released:
            return
        N = len(self.limit_N)
        F = max(16, 1 << (max([len(v) for v in self._edits.values()] or [1]) - 1).bit_length())
        ids, count, release = np.zeros((N, F), np.int32), np.zeros(N, np.int32), np.zeros(N, bool)
        for n, v in self._edits.items():
            ids[n, :len(v)], count[n] = v, len(v)
        release[list(self._edits) + list(self._released)] = True
        self._note("edit", F)
        with self._mesh():
            pool, out, prompt_cache = self.state
            self.state = pool, _edit(out, ids, count, release), prompt_cache
        self.lengths = self.lengths + count
        self.paused = self.paused & ~release
        self.seen[release] = False
        self._edits, self._released, self._host = {}, set(), None

    def decoding(self) -> int:
        """Rows that may still draw tokens: not stopped and not paused (queued rows count)."""
        self._apply_edits()
        return int(np.sum(~self.done & ~self.paused & (self.limit_N > 0)))

    def _width_level(self) -> int:
        """The narrowest of the pool's widths that computes every decoding row of each group (the widest while rows
        wait in the queue: only it refills)."""
        if not self.queue_empty:
            return 0
        decoding = ~self.done & ~self.paused & (self.limit_N > 0) & (self.group >= 0)
        need = np.bincount(self.group[decoding], minlength=self.groups).max(initial=0)
        return max(level for level, width in enumerate(self.plan.stages) if width // self.groups >= need or not level)

    def advance(self) -> int:
        """Up to steps_per_call decode steps, fewer once no row can decode or the decoding rows fit a narrower width
        (the next call computes only that: paused rows move past it) -> the steps run, plus 1 if the width changed
        (0: no row can decode now: each is stopped, paused or queued behind paused rows)."""
        if not self.decoding():
            return 0
        before, level = self.steps, self.level
        self.level = self._width_level()
        self._note("advance", self.level, self.steps_per_call)
        with self._mesh():
            self.state, status = _advance(self.cfg, self.plan, self.level, self.steps_per_call, self.params,
                                          self.inputs, self._limit, self.pause_E, self.state)
            self.calls += 1
            self._read(status)
        return self.steps - before + (self.level != level)

    def newly_stopped(self) -> list[int]:
        """Rows that paused or stopped since the last call, each reported once (a released row again when it next
        pauses or stops)."""
        self._apply_edits()
        new = np.flatnonzero((self.paused | self.done) & ~self.seen)
        self.seen[new] = True
        return [int(n) for n in new]

    def row(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Row n's tokens and log-probs so far (host numpy)."""
        if self._host is None:
            out = self.state[1]
            self._host = sharding_lib.to_host((out.tokens_NxC, out.logp_NxC))
        L = int(self.lengths[n])
        return self._host[0][n, :L], self._host[1][n, :L]

    def append(self, n: int, ids: Sequence[int]) -> None:
        """Tokens after paused row n's (observed: fed, never drawn, NaN log-probs); it goes on after them."""
        if not self.paused[n] or self.done[n]:
            raise ValueError(f"row {n} is not paused: only a paused row takes appended tokens")
        if int(self.lengths[n]) + len(ids) + len(self._edits.get(n, [])) >= self.limit_N[n]:
            raise ValueError(f"row {n}: {len(ids)} appended tokens after its {int(self.lengths[n])} would leave no "
                             f"room in its budget of {int(self.limit_N[n])}")
        self._edits.setdefault(n, []).extend(int(t) for t in ids)

    def release(self, n: int) -> None:
        """Paused row n goes on with nothing appended."""
        self._released.add(int(n))

    def end(self, n: int) -> None:
        """Row n stops where it is (done, not finished: truncated)."""
        self.limit_N[n] = max(1, int(self.lengths[n]))
        self.done[n] = True
        self._limit = _on_device(self.limit_N)
        self._edits.pop(n, None)
        self._released.discard(n)

    def result(self) -> sampler.SampleOutput:
        """Every fresh row as sampler.generate returns it (host numpy arrays)."""
        self._apply_edits()
        out, R, C = self.state[1], self.call.rows.real_rows, self.max_new_tokens
        tokens, logp = sharding_lib.to_host((out.tokens_NxC, out.logp_NxC))
        source = np.asarray(self.call.rows.rows.source_N)[:R]  # no carried tokens: the prompt bucket only
        prompt_tokens, prompt_mask = (x[source] for x in self.call.sequences_host)
        return sampler.SampleOutput(tokens=tokens[:R, :C], lengths=self.lengths[:R], finished=self.finished[:R],
                                    logprobs=logp[:R, :C], prompt_tokens=prompt_tokens, prompt_mask=prompt_mask,
                                    steps=np.int32(self.steps), done=self.done[:R], loops=np.int32(self.calls))
