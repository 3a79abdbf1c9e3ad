"""A PREDICTION of each phase of one RL step from a machine's peak FLOP/s and memory bandwidth (an analytic roofline
beside roofline.py's compiled one), and of the step's placements: on-policy colocated, k = 1 colocated, k = 1 split.

Each phase takes max(FLOPs / peak, bytes / bandwidth), summed over its calls:
- prefill: every prompt once at its bucket; reads the weights once;
- decode: one step per generated position j, at the batch the sampler runs then (the live rows, rounded up to its
  decode bucket), each reading every weight once and, per row, the KV cache written so far (prompt + j slots); the
  tail of a long-tailed batch is a run of steps with a few rows that still read every weight;
- reference: one forward over the batch's tokens (packed: the real ones; padded: rows x (prompt + completion bucket));
- update: forward + backward (3x forward) plus the optimizer's pass over the params and its two moments.
Host work (rewards, tokenising) is the measured or given seconds. Collectives are not counted (assumed hidden).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from sage_jax import sampler
from sage_jax.bench import flops as bench_flops


@dataclasses.dataclass(frozen=True)
class Machine:
    flops_per_s: float      # matmul peak of one device
    bytes_per_s: float      # memory bandwidth of one device
    name: str = ""
    link_bytes_per_s: float = 0.0  # per device across the cut between two sub-meshes (0: bytes_per_s)
    decode_step_s: float = 0.0  # fixed cost of one decode step beyond its roofline (op launches; measured on a CPU)


def _bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "bf16", "float16") else 4


def _kv_bytes_per_slot(cfg) -> float:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * _bytes(cfg.compute_dtype)


def _roof(flops: float, bytes_: float, m: Machine, devices: float) -> float:
    return max(flops / (m.flops_per_s * devices), bytes_ / (m.bytes_per_s * devices))


def decode_batches(lengths_N: np.ndarray, slots: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows computed, rows live), int [steps] each, for decode steps j = 1.. (the first token comes from the
    prefill) of the slot pool (sampler.generate, decode_pool.py): S = `slots` (default every row) slots compute at
    every step while any row is live, and a row that ends hands its slot to the next queued row."""
    lengths_N = np.asarray(lengths_N)
    S = len(lengths_N) if not slots else min(int(slots), len(lengths_N))
    free_S = np.zeros(S, np.int64)  # the step each slot frees up at; rows start in queue order on the first free
    live = []
    for n in lengths_N:
        s = int(np.argmin(free_S))
        live.append((free_S[s], free_S[s] + int(n)))
        free_S[s] += int(n)
    steps = int(free_S.max())
    start_N, end_N = (np.array(x) for x in zip(*live))
    j = np.arange(1, steps)
    live_J = ((start_N[None, :] <= j[:, None]) & (end_N[None, :] > j[:, None])).sum(1)
    return np.full(len(j), S), live_J


def generation(cfg, prompts: int, prompt_len: int, lengths_N: np.ndarray, m: Machine, devices: float = 1.0,
               tensor: int = 1, slots: int | None = None) -> dict[str, float]:
    """Seconds of sampler.generate on `devices` (rows over devices / tensor data shards, weights split `tensor`
    ways): {"prefill_s", "decode_s", "tail_s" (the steps at no more than an eighth of the rows)}."""
    P = sampler.prompt_bucket(prompt_len)
    D, V, w = cfg.hidden_size, cfg.vocab_size, _bytes(cfg.param_dtype)
    per_layer, per_slot, kv = bench_flops.layer_params(cfg), bench_flops.attention_per_key(cfg), _kv_bytes_per_slot(cfg)
    weights = cfg.num_params * w / tensor          # each data shard reads its tensor slice of every weight
    shards = max(1.0, devices / tensor)
    prefill_f = prompts * (P * (2 * per_layer + per_slot * P) + 2 * D * V)
    prefill = max(prefill_f / (m.flops_per_s * devices), weights / m.bytes_per_s)
    rows_J, live_J = decode_batches(lengths_N, slots)
    j = np.minimum(np.arange(1, len(rows_J) + 1), int(np.max(lengths_N)))  # a slot's position, at most its cache
    flops_J = rows_J * (2 * per_layer + 2 * D * V + per_slot * (P + j))
    # per device: its share of the rows' cache and FLOPs, its tensor slice of the weights
    step_J = np.maximum(flops_J / (m.flops_per_s * devices),
                        (weights + rows_J / shards * (P + j) * kv / tensor) / m.bytes_per_s) + m.decode_step_s
    tail = live_J <= max(1, len(lengths_N) // 8)
    return {"prefill_s": float(prefill), "decode_s": float(step_J.sum()), "tail_s": float(step_J[tail].sum())}


def step_tokens(prompt_len: int, lengths_N: np.ndarray, packed: bool) -> tuple[float, float]:
    """(tokens the reference pass and update compute on, of which completion positions)."""
    N = len(lengths_N)
    if packed:
        return float(N * prompt_len + lengths_N.sum()), float(lengths_N.sum())
    from sage_jax.rollouts import COMPLETION_BUCKETS
    from sage_jax.tokenizer import bucket_length
    C = bucket_length(int(lengths_N.max()), COMPLETION_BUCKETS)
    return float(N * (prompt_len + C)), float(N * C)


def forward_flops(cfg, tokens: float, completion: float, seq_len: float) -> float:
    """One forward: 2 x matmul params per token, attention over seq_len keys, the unembedding on completions."""
    return tokens * (2 * bench_flops.layer_params(cfg) + bench_flops.attention_per_key(cfg) * seq_len) \
        + completion * 2 * cfg.hidden_size * cfg.vocab_size


def training(cfg, prompt_len: int, lengths_N: np.ndarray, m: Machine, devices: float = 1.0, packed: bool = True,
             updates: int = 1, trained_params: int | None = None) -> dict[str, float]:
    """{"ref_s", "update_s"} on `devices` (FSDP: FLOPs and weight reads split over them)."""
    tokens, completion = step_tokens(prompt_len, lengths_N, packed)
    seq = prompt_len + float(np.mean(lengths_N)) if packed else tokens / len(lengths_N)
    f = forward_flops(cfg, tokens, completion, seq)
    w = cfg.num_params * _bytes(cfg.param_dtype)
    trained = cfg.num_params if trained_params is None else trained_params
    # Adam in fp32: read param, grad, 2 moments; write param, 2 moments
    opt_bytes = 7 * 4 * trained
    ref = _roof(f, w, m, devices)
    update = updates * _roof(3 * f, 3 * w + opt_bytes, m, devices)
    return {"ref_s": ref, "update_s": update}


def predict_phases(cfg, prompts: int, prompt_len: int, lengths_N: Sequence[int], m: Machine, packed: bool = True,
                   shaped: dict[str, float] | None = None) -> dict[str, float]:
    """The bench's phases (generate_s, ref_s, update_s) on one device. shaped: the matmul FLOP/s measured at the
    phases' own shapes ({"train": ..., "decode": ...}), in place of the machine's peak."""
    lengths_N = np.asarray(lengths_N)
    at = lambda k: m if not shaped else dataclasses.replace(m, flops_per_s=shaped[k])
    g = generation(cfg, prompts, prompt_len, lengths_N, at("decode"))
    t = training(cfg, sampler.prompt_bucket(prompt_len), lengths_N, at("train"), packed=packed)
    return {"generate_s": g["prefill_s"] + g["decode_s"], **t}


def placements(cfg, prompts: int, prompt_len: int, lengths_N: Sequence[int], m: Machine, chips: int, tensor: int,
               host_s: float, splits: Sequence[int], packed: bool = True) -> list[dict[str, float]]:
    """Step seconds of on-policy colocated, k = 1 colocated and k = 1 split (n chips sample, chips - n train) on a
    slice of `chips`; host_s: the host's work per step (rewards, tokenising), hidden only off-policy. The weight
    copy is counted at the link bandwidth across the cut (Machine.link_bytes_per_s) over the smaller side's chips."""
    lengths_N = np.asarray(lengths_N)
    P = sampler.prompt_bucket(prompt_len)
    rows = []

    def gen(n):
        g = generation(cfg, prompts, prompt_len, lengths_N, m, devices=n, tensor=tensor)
        return g["prefill_s"] + g["decode_s"], g["tail_s"]

    def train(n):
        t = training(cfg, P, lengths_N, m, devices=n, packed=packed)
        return t["ref_s"] + t["update_s"]
    g_all, tail_all = gen(chips)
    device_s = g_all + train(chips)
    tokens = float(len(lengths_N) * P + lengths_N.sum())
    rows.append({"placement": "on-policy colocated", "n": chips, "generate_s": g_all, "tail_s": tail_all,
                 "train_s": train(chips), "sync_s": 0.0, "host_s": host_s, "step_s": device_s + host_s})
    rows.append({"placement": "k=1 colocated", "n": chips, "generate_s": g_all, "tail_s": tail_all,
                 "train_s": train(chips), "sync_s": 0.0, "host_s": host_s, "step_s": max(device_s, host_s)})
    weights = cfg.num_params * _bytes(cfg.param_dtype)
    for n in splits:
        g, tail = gen(n)
        tr = train(chips - n)
        sync = weights / ((m.link_bytes_per_s or m.bytes_per_s) * min(n, chips - n))  # each byte crosses once
        step = max(g, tr + sync, host_s)
        rows.append({"placement": "k=1 split", "n": n, "generate_s": g, "tail_s": tail, "train_s": tr,
                     "sync_s": sync, "host_s": host_s, "step_s": step})
    base = rows[0]["step_s"]
    for r in rows:
        r["tokens_per_s"] = tokens / r["step_s"]
        r["vs_on_policy"] = base / r["step_s"]
    return rows


def tensor_for(n: int, tensor: int) -> int:
    return tensor if n % tensor == 0 else math.gcd(n, tensor)
