"""The decode pool's rows: which prefilled sequence each row continues, how many tokens it already has, and the key
and id it draws with -- the bookkeeping behind "a row leaves the pool and comes back with its tokens so far"
(sampler.generate's stop_after_groups and resume).

Row n of the program (decode_pool.generate_program) continues the prefilled sequence source_N[n] -- a prompt
left-padded in the prompt bucket P, then the tokens its row carries in, if any -- from generation position
start_N[n]: its token j (j >= start) is drawn with fold_in(fold_in(key_N[n], j), id_N[n]) (row_keys), fed back at
RoPE position len(prompt) + j, and written at cache position P + j, as uninterrupted. A fresh row (sample g of prompt
b, in a call with key k) continues prompt b from 0 with key k and id b * G + g. A row that comes back (Resumed) brings
its prompt, the tokens and behaviour log-probs it has so far, and its original call's key and row id: its prompt is
prefilled into the prompt bucket and its tokens into generation positions [0, start) of its cache (start =
len(tokens)), and it goes on at start, each later token drawn with the key and at the position it would have had
uninterrupted. The prompt bucket is the prompts' (not prompt + tokens): the cache, and what each decode step's
attention reads, are those of the uninterrupted call.
Its carried log-probs are returned as given (those of the policy that drew them); the new ones are the running
call's (the cache of its carried tokens is recomputed with the call's params). A multi-turn row -- leave the pool at
a tool call, append the tool's answer, come back -- will take this same path.

Groups: row n belongs to group group_N[n] (fresh rows: their prompt's; resumed rows: Resumed.group, rows with equal
labels forming one group, None a group of its own); with stop_after_groups = k the loop ends once k groups have every
row of theirs in the call done (complete_groups), and the rows still running come back as they are (done False).

Layout (host side, `layout`): the program's rows are the resumed rows in the order given, then the fresh rows
(prompt-major), then filler rows (limit 0: done from the start) up to a multiple of data x fsdp (or min_rows), so
with fewer slots than rows the resumed rows take the slots first; generate returns the fresh rows first (`output`).
With no resumed rows the sequences are the prompts, padded as before (prompt-major rows: each shard's rows continue
its own block of prompts when the prompts split evenly). With resumed rows each data-parallel shard's rows continue
only sequences of that shard's block (a prompt whose G rows straddle two shards is prefilled in both), so each shard
keeps its own queue (decode_pool.queue_groups); a block is its resumed rows' sequences, then its prompts, each part
padded to one size over the shards (Layout.carrying: the first part), and only the first part is prefilled with the
carried positions (a prompt's prefill stays the prompt bucket's).
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class Resumed(NamedTuple):
    """A row that comes back into the pool with the tokens it has so far (see the module docstring)."""
    prompt: Sequence[int]
    tokens: Sequence[int]  # its completion so far; decoding goes on at position len(tokens)
    logprobs: Sequence[float]  # the behaviour log-probs of those tokens, returned exactly as given
    key: jax.Array | int  # the seed (an int or a jax PRNG key) of the call that started the row
    row_id: int  # its row index in that call (prompt-major: b * G + g)
    max_new_tokens: int | None = None  # its budget for the whole completion (None: the running call's)
    group: Hashable | None = None  # rows with equal labels complete one group; None: a group of its own


class Rows(NamedTuple):
    """Per-row inputs of the program (N rows)."""
    source_N: jax.Array  # int32: the prefilled sequence row n continues
    start_N: jax.Array  # int32: the generated tokens it already has (its next token is token start_N[n])
    id_N: jax.Array  # int32: its id in its keys
    group_N: jax.Array  # int32: its group (N for filler rows: in none)
    key_N: jax.Array  # [N] PRNG keys: its call's key


class Layout(NamedTuple):
    """sampler.generate's rows on the host (numpy): the sequences to prefill and the per-row inputs."""
    sequences: list  # prompts (token lists), prefilled each once (left-padded to the prompt bucket by the caller)
    carried: list  # per sequence, the tokens a resumed row carries in (prefilled after its prompt); [] for a prompt
    tokens_NxC: np.ndarray  # int32: each row's tokens so far, pad after
    logp_NxC: np.ndarray  # float32: their behaviour log-probs, 0 after
    limit_N: np.ndarray  # int32: each row's budget (0: a filler row)
    rows: Rows  # numpy arrays; key_N as key data [N, ...] (uint32)
    real_rows: int  # the rows returned: fresh rows, then resumed rows
    groups: int
    output: np.ndarray  # int32 [real_rows]: the program row of each returned row (resumed rows run first)
    carrying: int = 0  # per data-parallel shard: the first sequences of its block carry tokens in (the rest: prompts)


def row_keys(key: jax.Array, steps_B: jax.Array, rows_B: jax.Array) -> jax.Array:
    """Row b's key at its decode position steps_B[b]: fold_in(fold_in(key, step), row), key one key or one per row."""
    fold = lambda k, j, r: jax.random.fold_in(jax.random.fold_in(k, j), r)
    return jax.vmap(fold, (0 if key.ndim else None, 0, 0))(key, steps_B, rows_B)


def complete_groups(group_N: jax.Array, done_N: jax.Array, valid_N: jax.Array) -> jax.Array:
    """How many groups have rows in the call and every one of them done (filler rows are in group N: none)."""
    N = group_N.shape[0]
    count = lambda x: jnp.zeros((N,), jnp.int32).at[group_N].add(x.astype(jnp.int32), mode="drop")
    return jnp.sum((count(valid_N) > 0) & (count(valid_N & ~done_N) == 0), dtype=jnp.int32)


def as_key(seed) -> jax.Array:
    """A typed PRNG key from an int seed, a typed key or a raw uint32 key."""
    if isinstance(seed, jax.Array):
        return seed if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(seed)
    return jax.random.key(int(seed))


def check_resumed(resumed: Sequence[Resumed], vocab: int, max_new_tokens: int, max_positions: int,
                  eos_ids: Sequence[int]) -> None:
    for i, r in enumerate(resumed):
        j0, limit = len(r.tokens), max_new_tokens if r.max_new_tokens is None else int(r.max_new_tokens)
        ids = [int(t) for t in (*r.prompt, *r.tokens)]
        problem = ("needs a prompt" if not len(r.prompt) else
                   f"has {j0} tokens and {len(r.logprobs)} log-probs" if len(r.logprobs) != j0 else
                   f"has token ids outside [0, {vocab})" if min(ids) < 0 or max(ids) >= vocab else
                   f"needs {j0} tokens so far < its max_new_tokens={limit} <= generate's {max_new_tokens}"
                   if not j0 < limit <= max_new_tokens else
                   f"ends in a stop token ({int(r.tokens[-1])}): it had stopped" if j0 and int(r.tokens[-1]) in eos_ids
                   else f"has row_id={r.row_id}: needs an int >= 0" if int(r.row_id) < 0 else
                   f"exceeds max_position_embeddings={max_positions}" if len(r.prompt) + limit > max_positions else "")
        if problem:
            raise ValueError(f"resume[{i}] {problem}")


def _shard_sequences(wanted: list, N: int, dp: int) -> tuple[list, np.ndarray, int]:
    """Each data-parallel shard's rows (N / dp each) continue the distinct sequences they want, placed in the shard's
    block of sequences: its resumed rows' sequences ("r" names) first, padded to `carrying` (a power of two, the same
    for every shard, at least N / dp / 16; 0 when no shard has one), then its prompts, padded to a power of two
    (padding repeats a name of the block; no row continues it): -> (sequence names, source per row, carrying). The
    prefill runs the two parts apart (decode_pool: only the first `carrying` of a block take the carried positions)."""
    n = N // dp
    blocks = [list(dict.fromkeys(wanted[q * n:(q + 1) * n])) or [wanted[0]] for q in range(dp)]
    parts = [([x for x in b if x[0] == "r"], [x for x in b if x[0] != "r"]) for b in blocks]
    pow2 = lambda k: 1 << (k - 1).bit_length() if k else 0  # fewer distinct programs across calls
    carried = max(len(r) for r, _ in parts)  # at least n / 16 when any: a pool's carried rows vary call to call
    carrying, fresh = pow2(max(carried, -(-n // 16)) if carried else 0), max(1, pow2(max(len(p) for _, p in parts)))
    names, source_N = [], np.zeros(N, np.int32)
    for q, (r, p) in enumerate(parts):
        block = r + (r or p)[:1] * (carrying - len(r)) + p + (p or r)[:1] * (fresh - len(p))
        local = {**{name: i for i, name in enumerate(r)}, **{name: carrying + i for i, name in enumerate(p)}}
        width = carrying + fresh
        source_N[q * n:(q + 1) * n] = [q * width + local[name] for name in wanted[q * n:(q + 1) * n]] + \
            [q * width] * max(0, (q + 1) * n - max(q * n, len(wanted)))  # filler rows: the block's first
        names += block
    return names, source_N, carrying


def _keys(seeds: list, key: jax.Array) -> np.ndarray:
    """Key data [N, ...] of one key per row (the call's key where seeds[n] is None)."""
    impl, cache, out = jax.random.key_impl(key), {}, []
    for s in seeds:
        k = key if s is None else s
        token = id(k) if isinstance(k, jax.Array) else int(k)
        if token not in cache:
            typed = as_key(k)
            if jax.random.key_impl(typed) != impl:
                raise ValueError(f"a resumed row's key is a {jax.random.key_impl(typed)} key, the call's a {impl} key")
            cache[token] = np.asarray(jax.random.key_data(typed))
        out.append(cache[token])
    return np.stack(out)


def layout(prompts: list, G: int, limits: list, resumed: Sequence[Resumed], max_new_tokens: int, C: int, dp: int,
           pad_id: int, key: jax.Array, min_rows: int = 0) -> Layout:
    """The rows of one generate call (see the module docstring): resumed rows, fresh rows, filler rows (with resumed
    rows, at least min_rows rows in all, and the sequences of each shard a power of two: calls whose mix of fresh and
    carried rows differs then share their programs)."""
    B, R = len(prompts), len(resumed)
    if not R:
        padded = B
        while (padded * G) % dp:  # smallest padding that lets the N = padded * G rows split over data x fsdp
            padded += 1
        N = padded * G
        sequences, source_N = prompts + [prompts[0]] * (padded - B), np.arange(N, dtype=np.int32) // G
        carried, carrying = [[] for _ in sequences], 0
    else:  # resumed rows first: they take the slots before the fresh rows (a row that waits, waits as a fresh one)
        N = -(-max(B * G + R, min_rows) // dp) * dp
        wanted = [("r", i) for i in range(R)] + [("p", n // G) for n in range(B * G)]
        names, source_N, carrying = _shard_sequences(wanted, N, dp)
        sequences = [prompts[i] if kind == "p" else [*map(int, resumed[i].prompt)] for kind, i in names]
        carried = [[] if kind == "p" else [*map(int, resumed[i].tokens)] for kind, i in names]
    tokens_NxC, logp_NxC = np.full((N, C), pad_id, np.int32), np.zeros((N, C), np.float32)
    limit_N, start_N, group_N = np.zeros(N, np.int32), np.zeros(N, np.int32), np.full(N, N, np.int32)
    id_N = np.arange(N, dtype=np.int32)
    fresh = slice(R, R + B * G)  # the fresh rows' program rows (their ids: b * G + g)
    limit_N[fresh], group_N[fresh], id_N[fresh] = limits, np.arange(B * G) // G, np.arange(B * G)
    labels: dict = {}
    for n, r in enumerate(resumed):
        j0 = len(r.tokens)
        tokens_NxC[n, :j0], logp_NxC[n, :j0], start_N[n], id_N[n] = r.tokens, r.logprobs, j0, int(r.row_id)
        limit_N[n] = max_new_tokens if r.max_new_tokens is None else int(r.max_new_tokens)
        group_N[n] = B + labels.setdefault(("row", n) if r.group is None else ("label", r.group), len(labels))
    seeds = [r.key for r in resumed] + [None] * (N - R)
    rows = Rows(source_N, start_N, id_N, group_N, _keys(seeds, key))
    output = np.concatenate([np.arange(R, R + B * G), np.arange(R)]).astype(np.int32)  # fresh rows out first
    return Layout(sequences, carried, tokens_NxC, logp_NxC, limit_N, rows, B * G + R, B + len(labels), output,
                  carrying)


def interrupted(out, prompts: Sequence[Sequence[int]], seed, num_samples: int = 1,
                row_max_new_tokens: Sequence[int] | None = None, resume: Sequence[Resumed] = (),
                tag: Hashable | None = None) -> list[Resumed]:
    """The rows of `out` -- sampler.generate's output for these prompts, seed, num_samples, row_max_new_tokens and
    resume -- that stop_after_groups interrupted (done False), as Resumed rows a later call continues as if never
    interrupted (each keeps its call's key, its row id, its budget and its group). A fresh row's group is (tag, its
    prompt's index); tag None: a new label, so rows of different calls never share a group."""
    tag = object() if tag is None else tag
    done, lengths = np.asarray(out.done), np.asarray(out.lengths)
    tokens, logp = np.asarray(out.tokens), np.asarray(out.logprobs)
    G, fresh = num_samples, len(prompts) * num_samples
    back = []
    for n in np.flatnonzero(~done):
        so_far = dict(tokens=tokens[n, :lengths[n]], logprobs=logp[n, :lengths[n]])
        if n >= fresh:  # a row that had come back already: its key, id and group stay, its budget is made explicit
            r = resume[n - fresh]
            back.append(r._replace(max_new_tokens=tokens.shape[1] if r.max_new_tokens is None else r.max_new_tokens,
                                   **so_far))
        else:
            limit = tokens.shape[1] if row_max_new_tokens is None else int(row_max_new_tokens[n])
            back.append(Resumed(list(prompts[n // G]), key=seed, row_id=int(n), max_new_tokens=limit,
                                group=(tag, int(n // G)), **so_far))
    return back
