"""Batched generation: prefill each prompt once, then one jax.lax.while_loop over a fixed pool of decode slots,
all in one jit (the program: sage_jax.sampling.decode_pool).

Shapes are bucketed -- prompt length to a power of two (>= 16), new tokens to a power of two (>= 32) up to 512 and
a multiple of 512 beyond -- and the real limits (one per row) are traced, so a training run compiles a handful of
programs (`compile_count()`), one per (slots, prompt, new-token) bucket. Prompts are left-padded; `num_samples=G`
prefills each prompt once and its G rows, which come out consecutively (prompt 0's G samples first), copy its cache.

`slots` rows decode at once over one KV cache of slots x (prompt + new-token bucket) positions; the other rows wait
in a queue and a row that stops hands its slot to the next one at the next step (default: a slot per row, one static
batch); once the queue is empty the pool shrinks to the widths of decode_pool.stage_widths. Decode attention reads
only the cache blocks written so far (kv_cache.cached_attention).

Behaviour log-probs: `logprobs[b, j]` is log softmax(logits / T) of the sampled token *before* top-k / top-p / min-p
truncation (log softmax(logits) when greedy, T = 0), the quantity the trainer recomputes for the policy at
temperature T; 0 on padding. Row b's key at its step j is fold_in(fold_in(key, j), b), whatever slot it runs in and
whenever, so no two rows or steps share one and the tokens do not depend on `slots`. Each row draws one uniform
(inverse CDF) and top-p is found by bisection, so no step sorts or noises the vocabulary.

Rows leave the pool and come back (rows.py): stop_after_groups=k returns once k groups are complete, the rows still
running with their tokens so far (done=False); resume=[rows.Resumed, ...] brings such rows back into a later call,
beside its fresh prompts: its prompt is prefilled into the prompt bucket and its tokens so far into the generation
positions they had, and it goes on with its first call's key and row id at the positions it would have had, so with
unchanged weights it draws the tokens it would have drawn (up to float rounding in its prefilled cache; rows.py).
A multi-turn row (a tool call) is to come back the same way.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sage_jax.models import decode_forms, decoder as model_lib
from sage_jax.models import sharding as sharding_lib
# re-exported: sampler.generate_program / SamplerPlan / constrain_cache are what sage_jax.plan lowers
from sage_jax.sampling.decode_pool import SamplerPlan, constrain_cache, generate_program, stage_widths
from sage_jax.sampling.prefill import auto_slots
from sage_jax.sampling import rows as rows_lib
from sage_jax.sampling.rows import Resumed, interrupted, row_keys  # noqa: F401  (public: generate's resume)
from sage_jax.models.decoder import ModelConfig, Params
from sage_jax.sampling.filters import CDF_BLOCK, _first_max, _inverse_cdf, _nucleus_bits, _ordered_bits, filter_logits, sample_tokens


class SampleOutput(NamedTuple):
    """Device arrays; with `resume` rows, the per-row fields are host numpy arrays (generate's end says why)."""
    tokens: jax.Array  # int32 [B, N], pad after a row stops; B = prompts * num_samples, N = max_new_tokens
    lengths: jax.Array  # int32 [B], generated tokens including the EOS
    finished: jax.Array  # bool [B], stopped by an EOS id (False: truncated at N)
    logprobs: jax.Array  # float32 [B, N], behaviour log-probs (see module docstring), 0 on padding
    prompt_tokens: jax.Array  # int32 [B, P], left-padded prompts (P = the prompt bucket), repeated per sample
    prompt_mask: jax.Array  # bool [B, P], True on real prompt tokens
    steps: jax.Array  # int32 [], decode steps run (fewer than N when every row stopped early)
    # bool [B], stopped (EOS or its budget); False: interrupted by stop_after_groups, returned with its tokens so far
    done: jax.Array | None = None
    # int32 []: data-dependent loop iterations and branches the program ran (XLA:GPU: a host round trip each)
    loops: jax.Array | None = None


_PROGRAMS: set[tuple] = set()


def compile_count() -> int:
    """Distinct programs this process has asked `generate` to compile (one per static key)."""
    return len(_PROGRAMS)


def prompt_bucket(length: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(length - 1, 0).bit_length())


def new_tokens_bucket(n: int, minimum: int = 32, step: int = 512) -> int:
    if n <= step:
        return max(minimum, 1 << max(n - 1, 0).bit_length())
    return -(-n // step) * step


# --------------------------------------------------------------------------------------------------- public API

def _data_parallel(mesh: Mesh | None) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"] if mesh is not None else 1


def _mesh_of(params: Params) -> Mesh | None:
    leaf = jax.tree.leaves(params)[0]
    sh = getattr(leaf, "sharding", None)
    if isinstance(sh, NamedSharding) and set(sharding_lib.MESH_AXES) <= set(sh.mesh.axis_names) \
            and sh.mesh.size > 1:
        return sh.mesh
    return None


def _slot_count(slots, cfg: ModelConfig, rows: int, prompts: int, P: int, C: int, mesh: Mesh | None) -> int:
    """generate's `slots` as a number, rounded up to a multiple of data x fsdp."""
    if slots == "auto":
        slots = auto_slots(cfg, rows, prompts, P + C, P, mesh)
    if slots is not None and slots != "all" and not (str(slots).isdigit() and int(slots) >= 1):
        raise ValueError(f"slots={slots!r} must be an integer >= 1 (decode slots: rows decoded at once), 'auto' or "
                         "'all'")
    dp = _data_parallel(mesh)
    return -(-(rows if slots in (None, "all") else int(slots)) // dp) * dp


def _forms(mesh: Mesh | None, decode_attention, cache_positions: int) -> decode_forms.DecodeForms:
    """generate's decode forms: given whole, or the platform's (the mesh's devices', else the backend's) with
    decode_attention's attention form, for a cache of cache_positions per row."""
    if isinstance(decode_attention, decode_forms.DecodeForms):
        return decode_attention
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    return decode_forms.for_platform(platform, decode_attention, cache_positions)


def _left_pad(sequences: Sequence[Sequence[int]], width: int, pad_id: int, carried: Sequence[Sequence[int]] = (),
              carried_width: int = 0):
    """[B, width + carried_width] tokens and mask: each prompt left-padded in the first `width`, then the tokens its
    row carries in (right-padded)."""
    tokens = np.full((len(sequences), width + carried_width), pad_id, np.int32)
    mask = np.zeros((len(sequences), width + carried_width), np.bool_)
    for b, p in enumerate(sequences):
        tokens[b, width - len(p):width] = p
        mask[b, width - len(p):width] = True
    for b, c in enumerate(carried):
        tokens[b, width:width + len(c)] = c
        mask[b, width:width + len(c)] = True
    return tokens, mask


def _check(cfg: ModelConfig, prompts: list, max_new_tokens: int, num_samples: int, temperature: float, top_p: float,
           top_k: int, min_p: float, row_max_new_tokens, resume: Sequence[Resumed], stop_after_groups,
           eos_ids: tuple) -> list[int]:
    """generate's arguments checked (ValueError naming the fix) -> the fresh rows' budgets."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and every prompt needs at least one token")
    if max_new_tokens < 1 or num_samples < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} and num_samples={num_samples} must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1 or not 0 <= min_p < 1 or top_k < 0:
        raise ValueError(f"bad sampling settings temperature={temperature} top_p={top_p} top_k={top_k} "
                         f"min_p={min_p}: need temperature >= 0, 0 < top_p <= 1, 0 <= min_p < 1, top_k >= 0")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                         f"max_position_embeddings={cfg.max_position_embeddings}; shorten prompts or generation")
    vocab_ids = [t for p in prompts for t in p]
    if min(vocab_ids) < 0 or max(vocab_ids) >= cfg.vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size}); got {min(vocab_ids)}..{max(vocab_ids)}")
    rows = len(prompts) * num_samples
    limits = [max_new_tokens] * rows if row_max_new_tokens is None else [int(n) for n in row_max_new_tokens]
    if len(limits) != rows or not all(1 <= n <= max_new_tokens for n in limits):
        raise ValueError(f"row_max_new_tokens needs {rows} entries (prompts x num_samples), each in "
                         f"[1, max_new_tokens={max_new_tokens}]")
    rows_lib.check_resumed(resume, cfg.vocab_size, max_new_tokens, cfg.max_position_embeddings, eos_ids)
    if stop_after_groups is not None and not 0 <= stop_after_groups <= len(prompts) + len(resume):
        raise ValueError(f"stop_after_groups={stop_after_groups} must lie in [0, the call's groups]: the prompts, "
                         f"plus the resumed rows' groups")
    return limits


def generate(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
             eos_ids: Sequence[int] | None = None, seed: int | jax.Array = 0, num_samples: int = 1,
             pad_id: int | None = None, mesh: Mesh | None = None, unstack_layers: bool | None = None,
             row_max_new_tokens: Sequence[int] | None = None, slots: int | str | None = None,
             stop_after_groups: int | None = None, resume: Sequence[Resumed] = (), min_rows: int = 0,
             decode_attention: str | decode_forms.DecodeForms = "auto") -> SampleOutput:
    """Sample `num_samples` completions of up to `max_new_tokens` for each prompt (lists of token ids).

    temperature 0 is greedy. eos_ids defaults to cfg.eos_token_ids, pad_id to cfg.pad_token_id; seed may be an int
    or a jax PRNG key. With a mesh (given, or the one params are sharded on) rows go over ("data", "fsdp") and KV
    heads over "tensor"; the batch is padded internally to a multiple of the data-parallel size.
    unstack_layers (default: decode_forms' choice for the platform, the CPU's only) slices the stacked layer weights
    once before the decode loop; see model.unstack_layers. decode_attention: "auto" (models.decode_forms), "blocked",
    "one_pass", "kernel" (Pallas), or whole DecodeForms (decode_forms.emulated("tpu"): the TPU's program on a CPU).
    row_max_new_tokens (one per output row, prompt-major, each <= max_new_tokens) stops each row at its own budget,
    marked truncated. slots (default: one per row) is how many rows decode at once,
    rounded up to a multiple of the data-parallel size; the others wait for a slot. The outputs do not depend on it.
    slots="auto": as many as fit the device's free memory (prefill.auto_slots); "all": one per row.

    resume: rows that come back with the tokens they have (rows.Resumed: prompt, tokens and behaviour log-probs so
    far, the key and row id of the call that started them, their budget and group). They decode in the same pool as
    the fresh prompts' rows and come out after them, in the order given, each as one whole completion: the carried
    tokens and log-probs as given, then the new ones, drawn as the row would have drawn them uninterrupted (see
    rows.py). stop_after_groups=k (default None: run until every row stops) ends the decode loop once k groups are
    complete -- every row of theirs in the call stopped (EOS or its budget); a fresh prompt's G rows are a group, and
    resumed rows group by Resumed.group -- and returns the rows still running as they are, done=False
    (rows.interrupted makes them Resumed rows for a later call). min_rows: with resumed rows, pad the call to at least
    this many rows (filler rows, done from the start), so calls whose mix of fresh and carried rows differs share
    one program (the partial-rollout trainer passes its pool's size).
    """
    call = prepare_call(cfg, params, prompts, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                        min_p=min_p, eos_ids=eos_ids, seed=seed, num_samples=num_samples, pad_id=pad_id, mesh=mesh,
                        unstack_layers=unstack_layers, row_max_new_tokens=row_max_new_tokens, slots=slots,
                        stop_after_groups=stop_after_groups, resume=resume, min_rows=min_rows,
                        decode_attention=decode_attention)
    _PROGRAMS.add(call.program_key)
    with jax.set_mesh(call.mesh) if call.mesh is not None else contextlib.nullcontext():
        tokens, logp, lengths, finished, done, prompt_tokens, prompt_mask, steps, loops = generate_program(
            cfg, call.plan, call.params, *call.inputs)
    pick = _returned_rows(call.rows, bool(resume))
    return SampleOutput(tokens=pick(tokens)[:, :max_new_tokens], lengths=pick(lengths), finished=pick(finished),
                        logprobs=pick(logp)[:, :max_new_tokens], prompt_tokens=pick(prompt_tokens),
                        prompt_mask=pick(prompt_mask), steps=steps, done=pick(done), loops=loops)


class Call(NamedTuple):
    """One generate call made ready for the program: generate_program(cfg, plan, params, *inputs)."""
    plan: SamplerPlan
    params: Params  # sharded on the mesh, in the compute dtype
    inputs: tuple  # prompt tokens and mask (left-padded, then carried tokens), per-row arrays, scalars, eos ids
    rows: rows_lib.Layout
    mesh: Mesh | None
    sequences_host: tuple  # [B, P + carried] the prefilled sequences and their mask, on the host
    program_key: tuple  # what compiles a new program (compile_count)


def prepare_call(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 temperature, top_p, top_k, min_p, eos_ids, seed, num_samples, pad_id, mesh, unstack_layers,
                 row_max_new_tokens, slots, stop_after_groups, resume, min_rows, decode_attention) -> Call:
    """generate's arguments checked and laid out (rows.layout), its plan, and its inputs on the mesh (session.py
    starts a pool from the same)."""
    prompts = [[int(t) for t in p] for p in prompts]
    pad_id = cfg.pad_token_id if pad_id is None else int(pad_id)
    eos_ids = tuple(cfg.eos_token_ids if eos_ids is None else (int(e) for e in eos_ids))
    limits = _check(cfg, prompts, max_new_tokens, num_samples, temperature, top_p, top_k, min_p, row_max_new_tokens,
                    resume, stop_after_groups, eos_ids)
    mesh = mesh if mesh is not None else _mesh_of(params)
    dp = _data_parallel(mesh)
    C = new_tokens_bucket(max_new_tokens)
    key = rows_lib.as_key(seed)
    rows = rows_lib.layout(prompts, num_samples, limits, resume, max_new_tokens, C, dp, pad_id, key, min_rows)
    B, N = len(rows.sequences), len(rows.limit_N)
    P = prompt_bucket(max(len(p) for p in rows.sequences))
    longest_carried = max(map(len, rows.carried))
    # generation positions prefilled for the carried tokens: C / 8, C / 2 or C (few programs across calls)
    Cc = next(w for w in (max(16, C // 8), max(16, C // 2), C) if w >= longest_carried) if longest_carried else 0
    if mesh is not None and _mesh_of(params) != mesh:
        params = model_lib.shard_params(params, mesh, cfg=cfg)
    params = model_lib.compute_params(cfg, params)  # read at every decode step: once in the compute dtype
    S = _slot_count(slots, cfg, N, B, P, C, mesh)
    forms = _forms(mesh, decode_attention, P + C)
    greedy = temperature == 0
    plan = SamplerPlan(num_samples=num_samples, new_bucket=C, greedy=greedy,
                       top_k=0 if greedy or top_k >= cfg.vocab_size else top_k, use_top_p=not greedy and top_p < 1,
                       use_min_p=not greedy and min_p > 0, mesh=mesh, slots=S, stop_early=stop_after_groups is not None,
                       carried=Cc, carrying=rows.carrying if Cc else 0,
                       forms=forms,
                       unstack_layers=forms.unstack_layers if unstack_layers is None else bool(unstack_layers))
    per_row = (rows.tokens_NxC, rows.logp_NxC, rows.limit_N, rows.rows)  # host arrays, the keys as their raw data
    sequences = host = _left_pad(rows.sequences, P, pad_id, rows.carried, Cc)
    if mesh is not None:  # every process passes the same host arrays: device_put takes them onto a mesh of several
        put = lambda x: jax.device_put(x, sharding_lib.data_sharding(mesh, x.ndim) if x.shape[0] % dp == 0
                                       else NamedSharding(mesh, PartitionSpec()))
        sequences, per_row = jax.tree.map(put, (sequences, per_row))
    row_info = per_row[3]._replace(key_N=jax.random.wrap_key_data(per_row[3].key_N, impl=jax.random.key_impl(key)))
    per_row = (*per_row[:3], row_info)
    scalars = (np.int32(stop_after_groups or 0), np.float32(temperature or 1.0), np.float32(top_p),
               np.float32(min_p), np.int32(pad_id))
    eos_E = id_array(eos_ids)
    program_key = (cfg, plan, B, N, P, len(eos_E), jax.tree.structure(params),
                   tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(params)))
    return Call(plan, params, (*sequences, *per_row, *scalars, eos_E), rows, mesh, host, program_key)


def id_array(ids: Sequence[int]) -> np.ndarray:
    """Stop (or pause) ids padded with -1 (never matches) to a power of two >= 4: few distinct programs."""
    out = np.full(max(4, 1 << max(len(ids) - 1, 0).bit_length()), -1, np.int32)
    out[:len(ids)] = ids
    return out


def _returned_rows(rows, resumed: bool):
    """The returned rows of a program output: the program ran resumed rows first, fresh rows come out first (no
    resumed rows: a slice). With resumed rows, reordered on the host (their callers read host arrays; an eager gather
    would compile once per row count; the outputs are replicated, so every process reads them whole)."""
    if resumed:
        return lambda x: np.asarray(x)[rows.output]
    return lambda x: x[:rows.real_rows]
