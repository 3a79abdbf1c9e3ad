"""Packed loss batches: several (prompt + completion) sequences per row, so the model computes on real tokens.

The padded loss batch (objectives.loss_fn layout) gives every row the step's prompt bucket plus its completion
bucket; with long-tailed lengths most of that is padding. `pack` moves each row's real tokens into rows of
`row_len` tokens (first-fit decreasing), with segment ids (1, 2, ... per sequence, 0 = padding) and positions that
restart in each sequence, so attention never crosses sequences (attention.py) and each token sees exactly the
context it had in the padded row.

Everything per row of the padded batch keeps its [N, C] layout (completion_mask, advantages, sampler_logp, ref_logp,
...); the model's per-token log-probs are computed on the packed rows and gathered back into [N, C] by `gather`, so
the loss (objectives.loss_from_logprobs) is the padded batch's loss, unchanged.

Layout: every array leads with a slice axis S. The N rows are cut into S contiguous slices (whole rows each) packed
independently, so splitting the leading axis (over processes, data-parallel devices, gradient-accumulation
micro-batches or mini-batches) keeps each slice's packed rows with the rows they hold:
  tokens, segment_ids, positions  int32 [S, R, row_len]
  gather                          int32 [S, n, C]   flat index into R * row_len of the position predicting
                                                    completion token j of row i (0 where completion_mask is 0)
  per-row arrays                  [S, n, ...]       n = N / S
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax import model as model_lib
from sage_jax import objectives

PACKED_KEYS = ("tokens", "segment_ids", "positions")
MIN_SAVING = 1 / 8  # pack_if_smaller keeps the padded batch unless packing removes at least this share of positions


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


def pack(batch: Mapping[str, np.ndarray], slices: int = 1, row_len: int = 0, rows_multiple: int = 1,
         pad_id: int = 0) -> dict[str, np.ndarray]:
    """The packed layout (module docstring) of a padded loss batch (host numpy arrays, rows [N, ...]).

    row_len: tokens per packed row (0: the padded row's width, so every sequence fits and the shape is as stable as
    the padded batch's: equal-length rows then pack one per row, as padded); every slice gets the same number of
    rows R, rounded up to a multiple of rows_multiple (fewer distinct shapes to compile).
    """
    tokens, mask = np.asarray(batch["tokens"]), np.asarray(batch["mask"]) > 0
    comp = np.asarray(batch["completion_mask"]) > 0
    N, T = tokens.shape
    C = comp.shape[1]
    P = T - C
    if N % slices:
        raise ValueError(f"{N} rows do not split into {slices} slices: choose a slice count that divides the rows")
    prompt_lens, comp_lens = mask[:, :P].sum(1), comp.sum(1)
    if np.any(prompt_lens < 1):
        raise ValueError("every row needs at least one prompt token to predict its first completion token from")
    seq_lens = prompt_lens + comp_lens
    longest = int(seq_lens.max(initial=1))
    row_len = row_len or T
    if longest > row_len:
        raise ValueError(f"a sequence of {longest} tokens does not fit packed rows of {row_len}: raise row_len")
    n = N // slices
    places = [_first_fit_decreasing(seq_lens[s * n:(s + 1) * n], row_len) for s in range(slices)]
    R = max(1 + max(b for b, _ in p) for p in places)
    R = -(-R // rows_multiple) * rows_multiple
    out = {k: np.zeros((slices, R, row_len), np.int32) for k in PACKED_KEYS}
    out["tokens"][:] = pad_id
    gather = np.zeros((slices, n, C), np.int32)
    for s, place in enumerate(places):
        in_row = np.zeros(R, np.int32)  # sequences placed so far per packed row: the next segment id - 1
        for i_local in sorted(range(n), key=lambda i: place[i][1]):
            b, o = place[i_local]
            i = s * n + i_local
            seq = np.concatenate([tokens[i, :P][mask[i, :P]], tokens[i, P:][comp[i]]])
            in_row[b] += 1
            out["tokens"][s, b, o:o + len(seq)] = seq
            out["segment_ids"][s, b, o:o + len(seq)] = in_row[b]
            out["positions"][s, b, o:o + len(seq)] = np.arange(len(seq))
            j = np.arange(comp_lens[i])
            gather[s, i_local, j] = b * row_len + o + prompt_lens[i] - 1 + j
    out["gather"] = gather
    for k, v in batch.items():
        if k in ("tokens", "mask", "rl_step"):
            continue
        v = np.asarray(v)
        out[k] = v.reshape(slices, n, *v.shape[1:])
    if "rl_step" in batch:
        out["rl_step"] = batch["rl_step"]
    return out


def pack_if_smaller(batch: Mapping[str, np.ndarray], slices: int = 1, rows_multiple: int = 1,
                    pad_id: int = 0) -> Mapping[str, np.ndarray]:
    """pack(), or the padded batch itself where packing would not remove MIN_SAVING of the computed positions
    (equal lengths: the packed rows would be the padded ones, plus logits on prompt positions); loss_fn takes both."""
    packed = pack(batch, slices, rows_multiple=rows_multiple, pad_id=pad_id)
    if packed["tokens"].size > (1 - MIN_SAVING) * np.asarray(batch["tokens"]).size:
        return batch
    return packed


def is_packed(batch: Mapping[str, Any]) -> bool:
    return "segment_ids" in batch


def slice_count(rows: int, group_size: int, data_parallel: int, grad_accum: int, mini_batches: int) -> int:
    """The fewest slices that split evenly over devices x micro-batches x mini-batches (of whole prompt groups)."""
    slices = data_parallel * grad_accum * mini_batches
    if rows % slices or (mini_batches > 1 and (rows // slices) % group_size):
        raise ValueError(f"train.packing: {rows} rows do not split into {slices} slices (data-parallel devices x "
                         f"optim.grad_accum x optim.mini_batches) of whole groups of {group_size}; change those "
                         "or set --config.train.packing=False")
    return slices


def row_view(a: jax.Array) -> jax.Array:
    """A per-row array [S, n, ...] of the packed layout as [S * n, ...] (the padded batch's row order)."""
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


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
    rows = {k: row_view(v) for k, v in batch.items() if k not in (*PACKED_KEYS, "gather") and v is not None}
    return objectives.loss_from_logprobs(logp, ent, rows, loss_cfg, step, key)
