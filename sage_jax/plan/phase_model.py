"""A PREDICTION of each phase of one RL step from a machine's peak FLOP/s and memory bandwidth (an analytic roofline
beside roofline.py's compiled one), and of the step's placements: on-policy colocated, k = 1 colocated, k = 1 split.

Each phase takes max(FLOPs / rate, bytes / bandwidth) (on a CPU their sum: Machine.overlap), summed over its calls
(rate: the peak, or on a CPU the matmul rate measured at the phase's own shapes, by kind: dense layers, attention,
unembedding):
- prefill: every prompt once at its bucket; reads the weights once, after casting them to the compute dtype
  (sampler.generate: model.compute_params; one pass over the float32 weights);
- decode: one step per generated position j at the slot pool's width (S slots compute while any row is live; with
  issue 26's shrink stages, narrower once the queue is empty: sampling.schedule.decode_batches), each reading every weight once (in
  the compute dtype) and, per row, the KV cache written so far (prompt + j slots), plus a measured fixed and
  per-row cost per step on a CPU;
  the tail of a long-tailed batch is a run of steps with a few live rows that still read every weight;
- reference: one forward over the trainer's own loss layout (loss_layout: padded rows, or packed rows with their
  padding, logits at every packed position and, on XLA:CPU, dense attention over the whole packed row), plus the
  non-matmul work (pointwise_elements: norms, residuals, RoPE, the gated MLP's product, the loss head);
- update: forward + backward (3x forward) plus what the backward recomputes (attention, logits chunks; everything
  with remat) and the optimizer's pass over the params and its two moments.
Host work (rewards, tokenising) is the measured or given seconds. Collectives are not counted (assumed hidden).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from sage_jax.sampling import sampler
from sage_jax.sampling.schedule import decode_batches
from sage_jax.bench import flops as bench_flops


@dataclasses.dataclass(frozen=True)
class Machine:
    flops_per_s: float      # matmul peak of one device
    bytes_per_s: float      # memory bandwidth of one device
    name: str = ""
    link_bytes_per_s: float = 0.0  # per device across the cut between two sub-meshes (0: bytes_per_s)
    decode_step_s: float = 0.0  # fixed cost of one decode step beyond its roofline (op launches; measured on a CPU)
    decode_row_s: float = 0.0   # and per row it computes (sampling over the vocabulary, cache writes; measured)
    overlap: bool = True  # memory traffic hides under compute (a TPU's roofline max); False: they add (XLA:CPU runs
    #                       a bandwidth-bound op, e.g. the decode step's cache read, after the matmuls, not beside)


def _bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "bf16", "float16") else 4


def _kv_bytes_per_slot(cfg) -> float:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * _bytes(cfg.compute_dtype)


def _both(compute_s, memory_s, m: Machine):
    """One call's seconds from its compute and memory seconds: the roofline's max, or their sum (Machine.overlap)."""
    return np.maximum(compute_s, memory_s) if m.overlap else compute_s + memory_s


def generation(cfg, prompts: int, prompt_len: int, lengths_N: np.ndarray, m: Machine, devices: float = 1.0,
               tensor: int = 1, slots: int | None = None, stage_dp: int | None = None) -> dict[str, float]:
    """Seconds of sampler.generate on `devices` (rows over devices / tensor data shards, weights split `tensor`
    ways): {"prefill_s", "decode_s", "tail_s" (the steps at no more than an eighth of the rows)}; stage_dp: the
    pool's shrink stages (decode_batches; None: the sampler's, over devices / tensor row shards; 0: none)."""
    if stage_dp is None:
        stage_dp = max(1, int(round(devices / tensor)))
    P = sampler.prompt_bucket(prompt_len)
    rows_J, live_J = decode_batches(lengths_N, slots, stage_dp)
    j = np.minimum(np.arange(1, len(rows_J) + 1), int(np.max(lengths_N)))  # a slot's position, at most its cache
    prefill, step_J = _sampler_costs(cfg, prompts, P, rows_J, j, m, devices, tensor)
    tail = live_J <= max(1, len(lengths_N) // 8)
    return {"prefill_s": float(prefill), "decode_s": float(step_J.sum()), "tail_s": float(step_J[tail].sum())}


def _sampler_costs(cfg, sequences: int, P: int, rows_J: np.ndarray, j_J: np.ndarray, m: Machine, devices: float,
                   tensor: int, carried: int = 0, carrying: int | None = None) -> tuple[float, np.ndarray]:
    """(prefill seconds of `sequences` sequences in the prompt bucket P, `carrying` of them (default all) plus
    `carried` generation positions (prefill.prefill_sequences), seconds of each decode step computing rows_J rows at
    generation position j_J) of one sampler call."""
    D, V, w = cfg.hidden_size, cfg.vocab_size, _bytes(cfg.compute_dtype)
    per_layer, per_slot, kv = bench_flops.layer_params(cfg), bench_flops.attention_per_key(cfg), _kv_bytes_per_slot(cfg)
    # the weights are read in the compute dtype (sampler.generate casts them once: model.compute_params)
    weights = cfg.num_params * w / tensor          # each data shard reads its tensor slice of every weight
    shards = max(1.0, devices / tensor)
    pw = _bytes(cfg.param_dtype)
    cast = cfg.num_params * (pw + w) / devices / m.bytes_per_s if pw > w else 0.0  # each device its shard
    one = lambda W: W * (2 * per_layer + per_slot * W) + 2 * D * V
    carrying = sequences if carrying is None else carrying
    prefill_f = carrying * one(P + carried) + (sequences - carrying) * one(P)
    prefill = cast + _both(prefill_f / (m.flops_per_s * devices), weights / m.bytes_per_s, m)
    flops_J = rows_J * (2 * per_layer + 2 * D * V + per_slot * (P + j_J))
    # per device: its share of the rows' cache and FLOPs, its tensor slice of the weights
    step_J = _both(flops_J / (m.flops_per_s * devices),
                   (weights + rows_J / shards * (P + j_J) * kv / tensor) / m.bytes_per_s, m) \
        + m.decode_step_s + m.decode_row_s * rows_J / shards
    return float(prefill), step_J


def partial_schedule(lengths: np.ndarray, batch_groups: int, G: int, oversample: float, max_lag: int, steps: int,
                     prompt_len: int, stage_dp: int = 0, slots: int | None = None) -> list[dict]:
    """Partial rollouts (training/partial.py) simulated on the host, on-policy versions (k = 0): `lengths` is the
    stream of completion lengths (G per prompt, in order). Per step: the call's sequences to prefill (fresh prompts,
    P wide, and carried rows: prompt, then its tokens so far in the generation positions they had: P + the carried
    bucket wide), the rows it computes at each decode step (B x G slots, carried rows first and the rest queued,
    narrowing by the sampler's stages once the queue is empty: decode_batches on what each row has left), cut where
    the B-th group completes; the trained rows' lengths and the token lag (versions between drawing a token and
    training it), the groups dropped."""
    target = max(batch_groups, math.ceil(oversample * batch_groups))
    slots = slots or batch_groups * G
    groups: list[dict] = []  # {"start": step, "total": [G], "drawn": [G], "when": [G lists of (step, tokens)]}
    cursor, out = 0, []
    for t in range(steps):
        dropped = [g for g in groups if t - g["start"] > max_lag]
        groups = [g for g in groups if t - g["start"] <= max_lag]
        done = lambda g: all(d >= n for d, n in zip(g["drawn"], g["total"]))
        need = max(0, batch_groups - sum(done(g) for g in groups))
        seq_lens, J, rows_J = [], 0, np.zeros(0, np.int64)
        if need:
            while len(groups) < target:
                total = [int(n) for n in lengths[cursor * G:(cursor + 1) * G]]
                groups.append({"start": t, "total": total, "drawn": [0] * G, "when": [[] for _ in range(G)]})
                cursor += 1
            # the call's rows in the sampler's order: carried rows first (oldest groups first), then fresh ones
            running = [(g, i) for g in groups if not done(g) for i in range(G) if g["drawn"][i] < g["total"][i]]
            running.sort(key=lambda gi: gi[0]["start"] == t)
            left = np.array([g["total"][i] - g["drawn"][i] for g, i in running])
            seq_lens = [g["drawn"][i] for g, i in running if g["drawn"][i]]  # carried tokens per carried row
            fresh = sum(1 for g in groups if g["start"] == t)
            seq_lens += [0] * fresh
            # B x G slots (training/partial.pool_slots), the others queued: a row that starts at step s with r
            # tokens left ends at s + r - 1 (its first token comes from the prefill); a group completes when its
            # last row ends, and the call stops at the need-th completion
            free, start = np.zeros(min(slots, len(left)), np.int64), []
            for r in left:
                k = int(np.argmin(free))
                start.append(int(free[k]))
                free[k] += int(r)
            ends = {}
            for (g, i), r, s0 in zip(running, left, start):
                ends[id(g)] = max(ends.get(id(g), 0), s0 + int(r) - 1)
            J = sorted(ends.values())[need - 1]
            rows_all, _ = decode_batches(left, slots, stage_dp)
            rows_J = rows_all[:J] if J else rows_all[:0]
            for (g, i), r, s0 in zip(running, left, start):
                took = int(min(r, max(0, J - s0 + 1)))
                g["drawn"][i] += took
                if took:
                    g["when"][i].append((t, took))
        ready = sorted((g for g in groups if done(g)), key=lambda g: g["start"])[:batch_groups]
        groups = [g for g in groups if all(g is not r for r in ready)]
        trained = [n for g in ready for n in g["total"]]
        lag = [(t - s, k) for g in ready for w in g["when"] for s, k in w]
        tokens = sum(k for _, k in lag)
        longest = max(seq_lens, default=0)
        out.append({"sequences": len(seq_lens), "P": sampler.prompt_bucket(prompt_len),
                    "carried": sampler.prompt_bucket(longest) if longest else 0,
                    "carrying": sum(1 for x in seq_lens if x),
                    "rows_J": rows_J, "trained": np.array(trained), "dropped": len(dropped),
                    "carried_tokens": sum(seq_lens),
                    "lag_mean": sum(a * k for a, k in lag) / tokens if tokens else 0.0})
    return out


def partial_generation(cfg, schedule: list[dict], m: Machine, devices: float = 1.0, tensor: int = 1,
                       warmup: int = 0) -> dict[str, float]:
    """Mean seconds per step of the calls of partial_schedule (after `warmup` steps): {"generate_s", "prefill_s",
    "trained_tokens", "lag_mean", "dropped"}."""
    steps = schedule[warmup:]
    gen, pre = [], []
    for s in steps:
        j = np.arange(1, len(s["rows_J"]) + 1)
        prefill, step_J = _sampler_costs(cfg, s["sequences"], s["P"], s["rows_J"], j, m, devices, tensor,
                                         s["carried"], s["carrying"]) if s["sequences"] else (0.0, np.zeros(0))
        gen.append(prefill + float(step_J.sum()))
        pre.append(prefill)
    mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0
    return {"generate_s": mean(gen), "prefill_s": mean(pre),
            "trained_tokens": mean([float(s["trained"].sum()) for s in steps]),
            "lag_mean": mean([s["lag_mean"] for s in steps]), "dropped": float(sum(s["dropped"] for s in steps))}


def loss_layout(prompt_len: int, lengths_N: np.ndarray, packed: bool, slices: int = 1,
                dense_attention_max: int = 0, max_new_tokens: int = 0) -> dict[str, float]:
    """What the reference pass and the update compute on, from the layout the trainer builds (rollouts.build_batch):
    {"positions" (the rows x row length the matmuls run on), "tokens" (real ones), "logit_positions" (where the
    unembedding runs: padded, the completion bucket's; packed, every position, packing.completion_logprobs), "keys"
    (keys per query the attention computes), "row_len"}. packed falls back to padded where packing.pack_if_smaller
    does; dense_attention_max: rows up to this length run dense attention over the whole row (attention.naive,
    XLA:CPU's auto), longer ones only within each sequence; max_new_tokens > 0 caps the completion bucket."""
    from sage_jax.rl import packing
    from sage_jax.training.rollouts import COMPLETION_BUCKETS
    from sage_jax.data.tokenizer import bucket_length
    lengths_N = np.asarray(lengths_N, np.int64)
    N, C = len(lengths_N), bucket_length(int(lengths_N.max()), COMPLETION_BUCKETS)
    C = min(C, max_new_tokens) if max_new_tokens > 0 else C
    T, seq_N = prompt_len + C, prompt_len + lengths_N
    tokens = float(seq_N.sum())
    if packed and N % slices == 0:
        S, lay = packing.choose_layout(seq_N, slices, T)
        positions = S * lay.rows * lay.row_len
        if positions <= (1 - packing.MIN_SAVING) * N * T:
            keys = lay.row_len if lay.row_len <= dense_attention_max else float((seq_N ** 2).sum() / tokens)
            return {"positions": float(positions), "tokens": tokens, "logit_positions": float(positions),
                    "keys": float(keys), "row_len": float(lay.row_len)}
    return {"positions": float(N * T), "tokens": tokens, "logit_positions": float(N * C), "keys": float(T),
            "row_len": float(T)}


def forward_flops(cfg, positions: float, logit_positions: float, keys: float) -> dict[str, float]:
    """One forward's FLOPs by kind: "dense" (2 x the layers' matmul params per position), "attention" (over `keys`
    per position), "unembed" (on logit_positions)."""
    return {"dense": positions * 2 * bench_flops.layer_params(cfg),
            "attention": positions * bench_flops.attention_per_key(cfg) * keys,
            "unembed": logit_positions * 2 * cfg.hidden_size * cfg.vocab_size}


def pointwise_elements(cfg, positions: float, logit_positions: float) -> float:
    """Elements that one forward's non-matmul work reads and writes: per layer and position the two RMSNorms (read
    and write D each), the two residual adds (read 2D, write D each), RoPE on q and k, SiLU(gate) x up (read 2I,
    write I), the qkv bias and qk norm where the model has them; per logit position the loss head's log-softmax,
    entropy and gather over the vocabulary (about 4V). Memory-bound work a matmul roofline does not count: on a TPU
    it hides under the matmuls (the roofline's max), on a CPU it adds (Machine.overlap)."""
    D, I, H = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    N, K = cfg.num_heads, cfg.num_kv_heads
    per = 10 * D + 2 * (N + K) * H + 3 * I
    per += 2 * (N + 2 * K) * H if cfg.qkv_bias else 0
    per += 2 * (N + K) * H if cfg.qk_norm else 0
    return positions * cfg.num_layers * per + logit_positions * 4 * cfg.vocab_size


def _compute_s(flops: dict[str, float], m: Machine, devices: float, rates: dict[str, float] | None) -> float:
    """Seconds of FLOPs by kind, each at its measured rate (rates[kind]) or the machine's peak."""
    return sum(f / ((rates or {}).get(k, m.flops_per_s) * devices) for k, f in flops.items())


def training(cfg, prompt_len: int, lengths_N: np.ndarray, m: Machine, devices: float = 1.0, packed: bool = True,
             updates: int = 1, trained_params: int | None = None, slices: int = 1,
             dense_attention_max: int = 0, max_new_tokens: int = 0, rates: dict[str, float] | None = None
             ) -> dict[str, float]:
    """{"ref_s", "update_s"} on `devices` (FSDP: FLOPs and weight reads split over them), on loss_layout's rows;
    rates: FLOP/s by kind of matmul (forward_flops) measured at the layout's shapes, in place of the peak: "KIND"
    forward, "KIND_update" forward + backward."""
    lay = loss_layout(prompt_len, lengths_N, packed, slices, dense_attention_max, max_new_tokens)
    f = forward_flops(cfg, lay["positions"], lay["logit_positions"], lay["keys"])
    f_s = _compute_s(f, m, devices, rates)
    # the update's forward + backward at each kind's measured forward + backward rate where given
    update_rates = {k: (rates or {}).get(f"{k}_update") or (rates or {}).get(k, m.flops_per_s) for k in f}
    # and what the backward recomputes: model.hidden's checkpoint policy keeps only the matmuls without batch
    # dims (the attention einsums have them), the loss recomputes each logits chunk, remat recomputes everything
    again = {"dense": f["dense"] if cfg.remat else 0.0, "attention": f["attention"], "unembed": f["unembed"]}
    update_s = _compute_s({k: 3 * v for k, v in f.items()}, m, devices, update_rates) \
        + _compute_s(again, m, devices, rates)
    w = cfg.num_params * _bytes(cfg.param_dtype)
    trained = cfg.num_params if trained_params is None else trained_params
    # Adam in fp32: read param, grad, 2 moments; write param, 2 moments
    opt_bytes = 7 * 4 * trained
    # the non-matmul work, at its measured rate (elements/s: "pointwise", and "pointwise_update" for forward +
    # backward) or as bytes at the memory bandwidth; the update's backward recomputes it once more (the checkpoint
    # policy keeps only matmul outputs)
    pw = pointwise_elements(cfg, lay["positions"], lay["logit_positions"]) / devices
    if rates and "pointwise" in rates:
        pw_ref = pw / rates["pointwise"]
        pw_update = 3 * pw / (rates.get("pointwise_update") or rates["pointwise"]) + pw_ref  # as update_rates
    else:
        pw_ref = pw * _bytes(cfg.compute_dtype) / m.bytes_per_s
        pw_update = 4 * pw_ref
    ref = float(_both(f_s, w / (m.bytes_per_s * devices) + pw_ref, m))
    update = updates * float(_both(update_s, (3 * w + opt_bytes) / (m.bytes_per_s * devices) + pw_update, m))
    return {"ref_s": ref, "update_s": update}


def predict_phases(cfg, prompts: int, prompt_len: int, lengths_N: Sequence[int], m: Machine, packed: bool = True,
                   rates: dict[str, float] | None = None, dense_attention_max: int = 0) -> dict[str, float]:
    """The bench's phases (generate_s, ref_s, update_s) on one device. rates: the matmul FLOP/s measured at the
    phases' own shapes, in place of the machine's peak: "decode" (the decode step's), and "dense", "attention",
    "unembed" (the training passes', forward_flops)."""
    lengths_N = np.asarray(lengths_N)
    rates = rates or {}
    decode_m = dataclasses.replace(m, flops_per_s=rates.get("decode", m.flops_per_s))
    g = generation(cfg, prompts, prompt_len, lengths_N, decode_m)
    t = training(cfg, sampler.prompt_bucket(prompt_len), lengths_N, m, packed=packed,
                 dense_attention_max=dense_attention_max, rates={k: v for k, v in rates.items() if k != "decode"})
    return {"generate_s": g["prefill_s"] + g["decode_s"], **t}


def placements(cfg, prompts: int, prompt_len: int, lengths_N: Sequence[int], m: Machine, chips: int, tensor: int,
               host_s: float, splits: Sequence[int], packed: bool = True, stages: bool = True,
               max_new_tokens: int = 0, partial: tuple[float, int, np.ndarray] | None = None,
               group: int = 1) -> list[dict[str, float]]:
    """Step seconds of on-policy colocated, k = 1 colocated and k = 1 split (n chips sample, chips - n train) on a
    slice of `chips`; host_s: the host's work per step (rewards, tokenising), hidden only off-policy. The weight
    copy is counted at the link bandwidth across the cut (Machine.link_bytes_per_s) over the smaller side's chips.
    stages: the decode pool shrinks in stages (sampling.schedule.decode_batches), dp = the sampling chips / tensor.
    partial = (oversample, max_lag, a stream of lengths): also partial rollouts colocated at k = 0 and k = 1, in
    the steady state of partial_schedule (its first 8 steps left out; group: samples per prompt); their tokens/s
    count the tokens trained, and vs k=0 is the ratio of tokens/s."""
    lengths_N = np.asarray(lengths_N)
    P = sampler.prompt_bucket(prompt_len)
    rows = []

    def gen(n):
        g = generation(cfg, prompts, prompt_len, lengths_N, m, devices=n, tensor=tensor,
                       stage_dp=max(1, n // tensor) if stages else 0)
        return g["prefill_s"] + g["decode_s"], g["tail_s"]

    def train(n, lengths=lengths_N):  # packed into one slice per data-parallel shard, as the trainer does
        dp = max(1, n // tensor)
        t = training(cfg, P, lengths, m, devices=n, packed=packed, slices=dp if len(lengths) % dp == 0 else 1,
                     max_new_tokens=max_new_tokens)
        return t["ref_s"] + t["update_s"]
    g_all, tail_all = gen(chips)
    device_s = g_all + train(chips)
    tokens = float(len(lengths_N) * P + lengths_N.sum())
    rows.append({"placement": "on-policy colocated", "n": chips, "generate_s": g_all, "tail_s": tail_all,
                 "train_s": train(chips), "sync_s": 0.0, "host_s": host_s, "step_s": device_s + host_s})
    rows.append({"placement": "k=1 colocated", "n": chips, "generate_s": g_all, "tail_s": tail_all,
                 "train_s": train(chips), "sync_s": 0.0, "host_s": host_s, "step_s": max(device_s, host_s)})
    weights = cfg.num_params * _bytes(cfg.compute_dtype)  # the sampler's weights (offpolicy.placement casts first)
    for n in splits:
        g, tail = gen(n)
        tr = train(chips - n)
        sync = weights / ((m.link_bytes_per_s or m.bytes_per_s) * min(n, chips - n))  # each byte crosses once
        step = max(g, tr + sync, host_s)
        rows.append({"placement": "k=1 split", "n": n, "generate_s": g, "tail_s": tail, "train_s": tr,
                     "sync_s": sync, "host_s": host_s, "step_s": step})
    for r in rows:
        r["tokens_per_s"] = tokens / r["step_s"]
    if partial is not None:
        oversample, max_lag, stream = partial
        dp = max(1, chips // tensor)
        sched = partial_schedule(stream, prompts, group, oversample, max_lag, 24, prompt_len, dp if stages else 0)
        g = partial_generation(cfg, sched, m, devices=chips, tensor=tensor, warmup=8)
        tr = float(np.mean([train(chips, s["trained"]) for s in sched[8:]]))
        trained_tokens = g["trained_tokens"] + len(lengths_N) * P
        for name, step in (("partial k=0 colocated", g["generate_s"] + tr + host_s),
                           ("partial k=1 colocated", max(g["generate_s"] + tr, host_s))):
            rows.append({"placement": name, "n": chips, "generate_s": g["generate_s"], "tail_s": 0.0, "train_s": tr,
                         "sync_s": 0.0, "host_s": host_s, "step_s": step, "tokens_per_s": trained_tokens / step,
                         "token_lag": g["lag_mean"] + (name.startswith("partial k=1")), "prefill_s": g["prefill_s"]})
    for r in rows:
        r["vs_on_policy"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def tensor_for(n: int, tensor: int) -> int:
    return tensor if n % tensor == 0 else math.gcd(n, tensor)
