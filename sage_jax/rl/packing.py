"""Packed loss batches: several (prompt + completion) sequences per row, so the model computes on real tokens.

The padded loss batch (objectives.loss_fn layout) gives every row the step's prompt bucket plus its completion
bucket; with long-tailed lengths most of that is padding. `pack` moves each row's real tokens into packed rows, with
segment ids (1, 2, ... per sequence, 0 = padding) and positions that restart in each sequence, so attention never
crosses sequences (attention.py) and each token sees exactly the context it had in the padded row.

Everything per row of the padded batch keeps its [n, C] layout (completion_mask, advantages, sampler_logp, ref_logp,
...); the model's per-token log-probs are computed on the packed rows and gathered back into [n, C] by `gather`, so
the loss (objectives.loss_from_logprobs) is the padded batch's loss, unchanged.

Layout: every array leads with a slice axis S: one slice per (mini-batch, micro-batch, data-parallel device), each
with the same number n = N / S of the padded batch's rows, so splitting the leading axis keeps each slice's packed
rows with the rows they hold and every micro-batch has as many rows as in the padded layout (seq-mean losses
average the same way; token-mean divides by the whole batch's count, objectives.with_batch_normaliser):
  tokens, segment_ids, positions  int32 [S, R, L]
  gather                          int32 [S, n, C]   flat index into R * L of the position predicting completion
                                                    token j of the slot's row (0 where completion_mask is 0)
  row_index                       int32 [S, n]      the padded-batch row each slot holds
  per-row arrays                  [S, n, ...]       the padded batch's rows, in row_index order

Which rows share a slice is chosen for balance, not kept contiguous: few rows per slice (a 7B step has 4-8 per
device and micro-batch) packed on their own would leave most of a fixed-width row empty. Rows go to slices longest
first, each to the least-filled slice with a free slot (`row_groups`: within each mini-batch), then one row length
L and row count R for all slices is chosen from a grid (the padded width, and a power-of-two granule times a
`bucket`ed count; R itself is bucketed: eight values per octave, so a run's steps share a few shapes instead of
compiling a new one whenever a step packs into one more row) to minimise S * R * L, subject to R * L <= n * T
and R * L^2 <= n * T^2 for padded width T: a slice never computes more positions or attention scores than the n
padded rows it replaces, so the padded layout's memory plan bounds it, and the shapes (hence compiled programs)
come from a small finite set per padded width. Where even so most positions
would be padding (every slice must fit the longest sequence), pack may use fewer slices, i.e. fewer and fuller
micro-batches (slice_options, micro_batches), under the same per-slice bound.
"""

from __future__ import annotations

import functools
import heapq
from typing import Any, Collection, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax.models import decoder as model_lib
from sage_jax.rl import objectives

PACKED_KEYS = ("tokens", "segment_ids", "positions")
LAYOUT_KEYS = (*PACKED_KEYS, "gather", "row_index")  # the packing itself, not per-row loss inputs
MIN_SAVING = 1 / 8  # pack_if_smaller keeps the padded batch unless packing removes at least this share of positions
MIN_GRANULE = 128


class Layout(NamedTuple):
    row_index: np.ndarray  # int32 [S, n]: padded-batch row of each slot
    row: np.ndarray        # int32 [N]: packed row (within its slice) that padded row i goes to
    offset: np.ndarray     # int32 [N]: where in that packed row its sequence starts
    rows: int              # R packed rows per slice
    row_len: int           # L tokens per packed row


def _first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[tuple[int, int]]:
    """(bin, offset) per item: items longest first into the first bin with room."""
    free: list[int] = []
    place = [(0, 0)] * len(lengths)
    for i in np.argsort(-lengths, kind="stable"):
        for b, room in enumerate(free):
            if room >= lengths[i]:
                break
        else:
            b = len(free)
            free.append(capacity)
        place[i] = (b, capacity - free[b])
        free[b] -= int(lengths[i])
    return place


def _balanced_slices(lengths: np.ndarray, slices: int) -> np.ndarray:
    """int [slices, n]: indices of `lengths` per slice, n each, longest first into the least-filled slice."""
    n = len(lengths) // slices
    heap = [(0, s) for s in range(slices)]
    members: list[list[int]] = [[] for _ in range(slices)]
    for i in np.argsort(-lengths, kind="stable"):
        load, s = heapq.heappop(heap)
        members[s].append(int(i))
        if len(members[s]) < n:
            heapq.heappush(heap, (load + int(lengths[i]), s))
    return np.asarray(members, np.int64).reshape(slices, n)


def granule(width: int) -> int:
    """The row-length step: the largest power of two <= width / 16, at least MIN_GRANULE."""
    return max(MIN_GRANULE, 1 << max(0, (width // 16).bit_length() - 1))


def bucket(x: int) -> int:
    """The smallest m * 2^e >= x with 8 <= m < 16 (every integer up to 16): eight steps per octave, so rounding up
    adds at most 1/8, and a run's steps, whose packed row counts differ by a few rows, share a few shapes (one
    compiled program each) instead of one shape per new count."""
    e = max(0, int(x).bit_length() - 4)
    return -(-int(x) >> e) << e if e else int(x)


def row_len_candidates(longest: int, width: int, n: int) -> list[int]:
    """Packed row lengths to try: the padded width and granule * bucket(k) from `longest` up to sqrt(n) * width
    (past that one row alone would hold more attention scores than n padded rows)."""
    g = granule(width)
    top = int(np.sqrt(n) * width)
    multiples = {bucket(k) for k in range(-(-longest // g), top // g + 1)}
    return sorted({width} | {g * k for k in multiples if g * k <= top})


def layout(seq_lens: np.ndarray, slices: int, width: int, row_groups: np.ndarray | None = None,
           row_len: int = 0, rows_multiple: int = 1, budget_rows: int = 0) -> Layout:
    """Where each sequence of seq_lens [N] goes (module docstring); width: the padded row's T.

    row_groups [parts, N / parts]: padded rows that must share mini-batch part p (its slices are the p-th
    slices / parts ones); default all rows one part. row_len > 0 fixes L instead of choosing it. budget_rows: the
    padded rows whose positions and scores bound a slice (default its own n)."""
    seq_lens = np.asarray(seq_lens, np.int64)
    N = len(seq_lens)
    groups = np.arange(N)[None] if row_groups is None else np.asarray(row_groups)
    parts = groups.shape[0]
    if N % slices or slices % parts or groups.size != N:
        raise ValueError(f"{N} rows do not split into {slices} slices over {parts} mini-batches: choose a slice "
                         "count that divides the rows and is a multiple of the mini-batches")
    n = budget_rows or N // slices
    row_index = np.concatenate([g[_balanced_slices(seq_lens[g], slices // parts)] for g in groups])
    longest = int(seq_lens.max(initial=1))
    if row_len and longest > row_len:
        raise ValueError(f"a sequence of {longest} tokens does not fit packed rows of {row_len}: raise row_len")
    best, fullest = None, int(seq_lens[row_index].sum(1).max())
    for L in [row_len] if row_len else row_len_candidates(longest, width, n):
        if best is not None and -(-fullest // L) * L >= best[0]:
            continue  # even a perfect fill of the fullest slice costs no less than the best so far
        places = [_first_fit_decreasing(seq_lens[ix], L) for ix in row_index]
        R = _row_count(max(1 + max(b for b, _ in p) for p in places), N // slices, rows_multiple)
        fits = R * L <= n * width and R * L * L <= n * width * width
        if (fits or row_len or L == width) and (best is None or R * L < best[0]):
            best = (R * L, R, L, places)
    _, R, L, places = best
    row, offset = np.zeros(N, np.int32), np.zeros(N, np.int32)
    for ix, place in zip(row_index, places):
        row[ix], offset[ix] = np.asarray(place, np.int32).T.reshape(2, -1)
    return Layout(row_index.astype(np.int32), row, offset, R, L)


def _row_count(rows: int, slot_rows: int, rows_multiple: int) -> int:
    """Packed rows per slice: `rows` rounded up to a bucket, but never past the slice's own row count (the padded
    layout's, itself a fixed shape), then to a multiple of rows_multiple."""
    R = max(rows, min(bucket(rows), slot_rows))
    return -(-R // rows_multiple) * rows_multiple


def _within(lay: Layout, budget_rows: int, width: int) -> bool:
    return lay.rows * lay.row_len <= budget_rows * width and lay.rows * lay.row_len ** 2 <= budget_rows * width ** 2


def choose_layout(seq_lens: np.ndarray, slices: int | Sequence[int], width: int, row_groups: np.ndarray | None = None,
                  row_len: int = 0, rows_multiple: int = 1, known: Collection[tuple[int, int, int]] = ()
                  ) -> tuple[int, Layout]:
    """(slice count, its layout) for `slices`: a count, or the counts to choose from (slice_options). A count
    below the largest is taken only where its slices stay within the largest one's budget (its n padded rows each)
    and it saves MIN_SAVING of the largest one's positions (fewer shapes to compile); then the fewest positions.
    known: (S, R, L) shapes already compiled; the cheapest one these sequences fit is taken instead of a new shape
    where it costs at most MIN_SAVING more positions (as a bucket step does): a compile saved."""
    options = sorted({slices} if isinstance(slices, int) else set(slices))
    N = len(seq_lens)
    if N % options[-1]:
        raise ValueError(f"{N} rows do not split into {options[-1]} slices: choose a slice count that divides them")
    budget = N // options[-1]
    lays = {s: layout(seq_lens, s, width, row_groups, row_len, rows_multiple, budget) for s in options}
    cost = {s: s * lays[s].rows * lays[s].row_len for s in options}
    fitting = [s for s in options if s == options[-1] or (_within(lays[s], budget, width) and
                                                          cost[s] <= (1 - MIN_SAVING) * cost[options[-1]])]
    S = min(fitting, key=lambda s: (cost[s], -s))
    return _known_shape(seq_lens, options, width, row_groups, row_len, rows_multiple, budget, known,
                        (1 + MIN_SAVING) * cost[S]) or (S, lays[S])


def _known_shape(seq_lens, options, width, row_groups, row_len, rows_multiple, budget, known, most: float
                 ) -> tuple[int, Layout] | None:
    """The cheapest known (S, R, L) of at most `most` positions whose R rows of L hold each slice's sequences."""
    longest = int(np.max(seq_lens, initial=1))
    for S, R, L in sorted(known, key=lambda k: (k[0] * k[1] * k[2], k)):
        if S * R * L > most:
            break
        if S in options and L >= longest and (not row_len or L == row_len):
            lay = layout(seq_lens, S, width, row_groups, L, rows_multiple, budget)
            if lay.rows <= R:
                return S, lay._replace(rows=R)
    return None


def pack(batch: Mapping[str, np.ndarray], slices: int | Sequence[int] = 1, row_len: int = 0, rows_multiple: int = 1,
         pad_id: int = 0, row_groups: np.ndarray | None = None, known: Collection[tuple[int, ...]] = ()
         ) -> dict[str, np.ndarray]:
    """The packed layout (module docstring) of a padded loss batch (host numpy arrays, rows [N, ...]).

    slices: a count or the counts to choose from (choose_layout); row_len: tokens per packed row (0: chosen, see
    `layout`); R is rounded up to a multiple of rows_multiple; row_groups: the padded rows of each mini-batch;
    known: `shape_key`s of packed batches already compiled (choose_layout takes one where it costs little more)."""
    tokens, mask = np.asarray(batch["tokens"]), np.asarray(batch["mask"]) > 0
    comp = np.asarray(batch["completion_mask"]) > 0
    N, T = tokens.shape
    C = comp.shape[1]
    P = T - C
    prompt_lens, comp_lens = mask[:, :P].sum(1), comp.sum(1)
    if np.any(prompt_lens < 1):
        raise ValueError("every row needs at least one prompt token to predict its first completion token from")
    same = [(S, R, L) for S, R, L, n, c in known if S * n == N and c == C]
    S, lay = choose_layout(prompt_lens + comp_lens, slices, T, row_groups, row_len, rows_multiple, same)
    n, R, L = N // S, lay.rows, lay.row_len
    out = {k: np.zeros((S, R, L), np.int32) for k in PACKED_KEYS}
    out["tokens"][:] = pad_id
    gather = np.zeros((S, n, C), np.int32)
    for s, ix in enumerate(lay.row_index):
        for j, i in enumerate(ix):  # slot j: segment ids count the row's sequences left to right
            b, o = lay.row[i], lay.offset[i]
            seq = np.concatenate([tokens[i, :P][mask[i, :P]], tokens[i, P:][comp[i]]])
            out["tokens"][s, b, o:o + len(seq)] = seq
            out["positions"][s, b, o:o + len(seq)] = np.arange(len(seq))
            out["segment_ids"][s, b, o:o + len(seq)] = 1 + int(np.sum((lay.row[ix] == b) & (lay.offset[ix] < o)))
            gather[s, j, :comp_lens[i]] = b * L + o + prompt_lens[i] - 1 + np.arange(comp_lens[i])
    out["gather"], out["row_index"] = gather, lay.row_index
    order = lay.row_index.reshape(-1)
    for k, v in batch.items():
        if k in ("tokens", "mask", "rl_step"):
            continue
        v = np.asarray(v)
        out[k] = v[order].reshape(S, n, *v.shape[1:])
    if "rl_step" in batch:
        out["rl_step"] = batch["rl_step"]
    return out


def pack_if_smaller(batch: Mapping[str, np.ndarray], slices: int | Sequence[int] = 1, rows_multiple: int = 1,
                    pad_id: int = 0, row_groups: np.ndarray | None = None, known: set | None = None,
                    wide: Mapping[str, np.ndarray] | None = None) -> Mapping[str, np.ndarray]:
    """pack(), or the padded batch itself where packing would not remove MIN_SAVING of the computed positions
    (equal lengths: the packed rows would be the padded ones, plus logits on prompt positions); loss_fn takes both.

    wide: the same rows padded to a wider completion (the run's budget), to pack instead of `batch`: the packed
    per-row arrays then have one width whatever a step's longest row, which costs no model compute. known: the
    run's packed `shape_key`s so far, a set this adds the packed batch's to (see pack)."""
    packed = pack(batch if wide is None else wide, slices, rows_multiple=rows_multiple, pad_id=pad_id,
                  row_groups=row_groups, known=known or ())
    if packed["tokens"].size > (1 - MIN_SAVING) * np.asarray(batch["tokens"]).size:
        return batch
    if known is not None:
        known.add(shape_key(packed))
    return packed


def shape_key(packed: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
    """(S, R, L, n, C): what a packed batch's compiled programs depend on."""
    return (*np.shape(packed["tokens"]), *np.shape(packed["gather"])[1:])


def is_packed(batch: Mapping[str, Any]) -> bool:
    return "segment_ids" in batch


def slice_options(rows: int, group_size: int, data_parallel: int, grad_accum: int, mini_batches: int) -> list[int]:
    """Slice counts for pack: one slice per data-parallel device x micro-batch x mini-batch (mini-batches of whole
    prompt groups), with optim.grad_accum micro-batches or fewer (a divisor: fewer, fuller micro-batches where the
    configured ones would hold mostly padding; each is one jitted train step, see micro_batches)."""
    slices = data_parallel * grad_accum * mini_batches
    if rows % slices or (rows // group_size) % mini_batches:
        raise ValueError(f"train.packing: {rows} rows ({rows // group_size} groups of {group_size}) do not split "
                         f"into {slices} slices (data-parallel devices x optim.grad_accum x optim.mini_batches) "
                         "with whole groups per mini-batch; change those or set --config.train.packing=False")
    return [data_parallel * a * mini_batches for a in range(1, grad_accum + 1) if grad_accum % a == 0]


def micro_batches(batch: Mapping[str, Any], data_parallel: int, grad_accum: int) -> int:
    """The micro-batch count a train step over `batch` (one mini-batch) splits it into: packed, its slices per
    data-parallel device; padded, optim.grad_accum."""
    return batch["tokens"].shape[0] // data_parallel if is_packed(batch) else grad_accum


def row_view(a: jax.Array) -> jax.Array:
    """A per-row array [S, n, ...] of the packed layout as [S * n, ...] (slot order, see to_rows)."""
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def to_rows(a: jax.Array, row_index: np.ndarray) -> jax.Array:
    """A per-row array [S, n, ...] in the padded batch's row order [N, ...] (row_index: the batch's, on the host)."""
    return jnp.take(row_view(a), np.argsort(np.asarray(row_index).reshape(-1)), axis=0)


def from_rows(a: jax.Array, row_index: np.ndarray) -> jax.Array:
    """A per-row array [N, ...] in the padded batch's row order as the packed slots [S, n, ...]."""
    row_index = np.asarray(row_index)
    return jnp.take(a, row_index.reshape(-1), axis=0).reshape(*row_index.shape, *a.shape[1:])


def num_tokens(batch: Mapping[str, Any]) -> int:
    """Real (prompt + completion) tokens of a loss batch, either layout."""
    return int((np.asarray(batch["segment_ids" if "segment_ids" in batch else "mask"]) > 0).sum())


def padded_fraction(batch: Mapping[str, Any]) -> float:
    """Share of the positions the model computes on that hold no real token (either layout)."""
    if "segment_ids" in batch:
        seg = np.asarray(batch["segment_ids"])
        return float(1.0 - (seg > 0).sum() / seg.size)
    mask = np.asarray(batch["mask"])
    return float(1.0 - (mask > 0).sum() / mask.size)


# --------------------------------------------------------------------------------------------------- model side

def completion_logprobs(cfg: model_lib.ModelConfig, params, batch: Mapping[str, jax.Array], temperature: float):
    """(logp, entropy) [S * n, C] of every row's completion tokens, computed on the packed rows."""
    S, R, L = batch["tokens"].shape
    tokens, seg, pos = (row_view(batch[k]) for k in PACKED_KEYS)
    targets = jnp.concatenate([tokens[:, 1:], jnp.full_like(tokens[:, :1], cfg.pad_token_id)], axis=1)
    logp, ent = model_lib.logprobs_and_entropy(cfg, params, tokens, targets, positions_BxT=pos,
                                               temperature=temperature, segment_ids_BxT=seg)
    C = batch["gather"].shape[2]
    index = batch["gather"].reshape(S, -1)
    take = lambda a_RxL: jnp.take_along_axis(a_RxL.reshape(S, R * L), index, axis=1).reshape(-1, C)
    return take(logp), take(ent)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("temperature",))
def sequence_logprobs(cfg: model_lib.ModelConfig, params, batch: Mapping[str, jax.Array], *, temperature: float):
    """(logp, entropy) [S, n, C] for a no-grad pass (reference / old policy) over a packed batch."""
    S, n, C = batch["gather"].shape
    logp, ent = completion_logprobs(cfg, params, batch, temperature)
    return logp.reshape(S, n, C), ent.reshape(S, n, C)


def sequence_logprobs_in_passes(cfg: model_lib.ModelConfig, params, batch: Mapping[str, jax.Array], *,
                                temperature: float, rows_per_pass: int = 0):
    """sequence_logprobs over whole slices at a time, about rows_per_pass padded rows' worth per pass (0: all at
    once): bounds the activations of a no-grad pass as train_state.sequence_logprobs does for padded rows."""
    S, n, _ = batch["gather"].shape
    arrays = {k: batch[k] for k in (*PACKED_KEYS, "gather")}
    per = max(1, rows_per_pass // n) if rows_per_pass else S
    if per >= S:
        return sequence_logprobs(cfg, params, arrays, temperature=temperature)
    outs = [sequence_logprobs(cfg, params, {k: v[i:i + per] for k, v in arrays.items()}, temperature=temperature)
            for i in range(0, S, per)]
    return tuple(jnp.concatenate(parts) for parts in zip(*outs))


def loss_fn(params, batch: Mapping[str, jax.Array], model_cfg: model_lib.ModelConfig,
            loss_cfg: objectives.LossConfig, step: jax.Array | int = 0, key: jax.Array | None = None):
    """objectives.loss_fn for a packed batch (the same loss and metrics as on the padded batch it was packed from);
    a padded batch goes to objectives.loss_fn itself."""
    if not is_packed(batch):
        return objectives.loss_fn(params, batch, model_cfg, loss_cfg, step, key)
    logp, ent = completion_logprobs(model_cfg, params, batch, loss_cfg.temperature)
    rows = {k: row_view(v) for k, v in batch.items() if k not in LAYOUT_KEYS and v is not None}
    return objectives.loss_from_logprobs(logp, ent, rows, loss_cfg, step, key)
