"""Rollouts for the RL step: sample G completions per prompt, score them (with DAPO's dynamic sampling), then
shape them into the loss's batch layout (padded or packed)."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
import numpy as np

from sage_jax.data import tasks
from sage_jax.models import sharding
from sage_jax.rl import objectives, packing
from sage_jax.sampling import sampler
from sage_jax.data.tokenizer import bucket_length
from sage_jax.training import tool_rollouts

log = logging.getLogger("sage_jax")

COMPLETION_BUCKETS = tuple(32 * 2 ** i for i in range(12))

# A collect in phases (`collect_phases`, `rollout_phases`): a generator that yields HOST before a stretch of host-only
# work (reading fully replicated arrays, decoding, scoring this process's rows) and DEVICE before a stretch that may
# issue operations spanning processes (sampling, gathers across processes); its first stretch is DEVICE. Run on one
# thread (`run_phases`) it is the plain function. The off-policy pipeline runs the HOST stretches on its worker thread
# and, on several processes, every DEVICE stretch on the main thread, so every process issues its multi-process
# operations from one thread in one order (JAX's multi-controller rule; offpolicy.py, jax.thread_guard).
HOST, DEVICE = "host", "device"


def run_phases(phases) -> Any:
    """Drive a phased collect to its end on this thread; its return value."""
    try:
        while True:
            next(phases)
    except StopIteration as done:
        return done.value


def rollout(task: tasks.Task, cfg, params, examples, rollout_cfg, key, max_prompt_len: int) -> dict[str, Any]:
    """Sample G completions per example. Host numpy arrays, rows grouped by prompt."""
    return run_phases(rollout_phases(task, cfg, params, examples, rollout_cfg, key, max_prompt_len))


def rollout_phases(task: tasks.Task, cfg, params, examples, rollout_cfg, key, max_prompt_len: int):
    """rollout() in phases: sampling, and the gather of rows spread over processes, are dispatched (DEVICE); the
    rows are then read and decoded (HOST)."""
    prompts, cut = encode_prompts(task, examples, max_prompt_len)
    G = rollout_cfg.group_size
    if tuple(getattr(rollout_cfg, "tools", ())):  # rows pause at tool calls (tool_rollouts.py)
        ro = tool_rollouts.rollout_tool_rows(task, cfg, params, prompts, rollout_cfg, key)
        yield HOST
        return {**ro, "golds": [task.gold(ex) for ex in examples for _ in range(G)],
                "prompts": [task.prompt_text(ex) for ex in examples for _ in range(G)], "prompts_cut": cut}
    out = sampler.generate(cfg, params, prompts, max_new_tokens=rollout_cfg.max_new_tokens,
                           temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
                           min_p=rollout_cfg.min_p, eos_ids=cfg.eos_token_ids, seed=key,
                           num_samples=rollout_cfg.group_size, pad_id=cfg.pad_token_id,
                           slots=getattr(rollout_cfg, "slots", None),
                           decode_attention=getattr(rollout_cfg, "decode_attention", "auto"))
    out = sharding.gather(out)  # every process gets all rows (all-gathered across hosts): dispatched here
    yield HOST
    out = sharding.to_host(out)
    lengths = np.asarray(out.lengths)
    texts = [task.tokenizer.decode(row[:n]) for row, n in zip(np.asarray(out.tokens), lengths)]
    return {"prompt_tokens": np.asarray(out.prompt_tokens), "prompt_mask": np.asarray(out.prompt_mask),
            "tokens": np.asarray(out.tokens), "lengths": lengths, "finished": np.asarray(out.finished),
            "sampler_logp": np.asarray(out.logprobs), "texts": texts,
            "golds": [task.gold(ex) for ex in examples for _ in range(G)],
            "prompts": [task.prompt_text(ex) for ex in examples for _ in range(G)], "prompts_cut": cut}


def samples(ro: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The first n rows for samples.jsonl: prompt, completion, reward, and with tools each turn (the model's text
    and each tool's output)."""
    return [{"prompt": ro["prompts"][i], "completion": ro["texts"][i], "reward": float(ro["rewards"][i]),
             **({"turns": ro["messages"][i][1:]} if "messages" in ro else {})} for i in range(min(n, len(ro["texts"])))]


def encode_prompts(task: tasks.Task, examples, max_prompt_len: int) -> tuple[list[list[int]], int]:
    """(the examples' prompt token ids, each cut to max_prompt_len by cut_prompt, how many were cut)."""
    prompts = [task.encode_prompt(ex) for ex in examples]
    cut = sum(len(p) > max_prompt_len for p in prompts)
    if cut:
        _warn_cut(cut, len(prompts), max(map(len, prompts)), max_prompt_len)
        prompts = [cut_prompt(p, max_prompt_len, task.tokenizer) for p in prompts]
    return prompts, cut


def score_phases(ro: dict[str, Any], pool, ro_cfg, tr):
    """Score rollouts in place, in phases: each process its share of the rows (HOST), everyone gets all rewards back
    (DEVICE); "correct" is reward >= 1, then DAPO's overlong penalty is added to "rewards"."""
    mine = sharding.local_rows(len(ro["texts"]))
    yield HOST  # (a stopping point before the scoring: offpolicy.Pipeline cancels a batch there)
    scores = pool.score(ro["texts"][mine], ro["golds"][mine]).astype(np.float32)
    yield DEVICE
    ro["rewards"] = sharding.allgather_rows(scores)
    ro["correct"] = (ro["rewards"] >= 1.0).astype(np.float32)
    ro["rewards"] = ro["rewards"] + overlong_penalty(ro["lengths"], ro_cfg.max_new_tokens, tr.overlong_buffer,
                                                     tr.overlong_penalty)


_WARNED_CUT = []


def _warn_cut(cut: int, total: int, longest: int, limit: int) -> None:
    if not _WARNED_CUT:  # once a process: rl/prompts_cut counts them at every step
        _WARNED_CUT.append(True)
        log.warning("%d of %d prompts are longer than data.max_prompt_len=%d (the longest %d tokens): each keeps its "
                    "last tokens (and its BOS); raise data.max_prompt_len to train on them whole (rl/prompts_cut "
                    "counts them each step)", cut, total, limit, longest)


def cut_prompt(ids: list[int], limit: int, tokenizer: Any = None) -> list[int]:
    """The last `limit` tokens of a prompt (its question and the template's generation prompt), keeping the BOS
    it starts with, if any."""
    if len(ids) <= limit:
        return ids
    bos = getattr(tokenizer, "added_bos_id", None)
    if bos is not None and ids[:1] == [bos] and limit > 1:
        return [bos] + ids[len(ids) - limit + 1:]
    return ids[len(ids) - limit:]


def collect_rollouts(task: tasks.Task, cfg, config, pool, params, rl_step: int):
    """Rollouts + rewards (+ DAPO dynamic sampling) for one RL step; host arrays. Bound to its first four
    arguments (functools.partial) it is trainer.rl_step's CollectFn (`pool`: a rewards.pool.RewardPool)."""
    return run_phases(collect_phases(task, cfg, config, pool, params, rl_step))


def collect_phases(task: tasks.Task, cfg, config, pool, params, rl_step: int):
    """collect_rollouts in phases (see HOST / DEVICE): what the off-policy pipeline (offpolicy.Pipeline) runs."""
    ro_cfg, tr = config.rollout, config.train
    G, B = ro_cfg.group_size, ro_cfg.prompts_per_step
    parts, kept = [], 0
    for attempt in range(1 + (tr.max_resample if tr.dynamic_sampling else 0)):
        examples = task.train_batch(rl_step * (1 + tr.max_resample) + attempt if tr.dynamic_sampling else rl_step,
                                    B, config.seed)
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), rl_step), attempt)
        ro = yield from rollout_phases(task, cfg, params, examples, ro_cfg, key, config.data.max_prompt_len)
        yield from score_phases(ro, pool, ro_cfg, tr)
        parts.append(ro)
        if not tr.dynamic_sampling:
            break
        # DAPO filters on accuracy: a group whose rollouts differ only in the overlong penalty is still dropped
        kept += int((~np.asarray(objectives.zero_variance_groups(ro["correct"], G))).sum())
        if kept >= B:
            break
    cut = sum(part.pop("prompts_cut", 0) for part in parts)
    tool_stats = [part.pop("tool_stats") for part in parts if "tool_stats" in part]
    ro = concat_rollouts(parts, cfg.pad_token_id)
    zero_var = np.asarray(objectives.zero_variance_groups(ro["rewards"], G))
    stats = {"rl/zero_var_groups": float(zero_var[:B].mean()) if not tr.dynamic_sampling else float(zero_var.mean()),
             "rl/prompts_cut": float(cut)}
    if tr.dynamic_sampling:
        # informative groups first; degenerate ones only fill up what resampling could not
        same_accuracy = np.asarray(objectives.zero_variance_groups(ro["correct"], G))
        order = np.concatenate([np.flatnonzero(~same_accuracy), np.flatnonzero(same_accuracy)])[:B]
        ro = take_rows(ro, (order[:, None] * G + np.arange(G)).reshape(-1))
        stats["rl/resample_rounds"] = float(len(parts) - 1)
    stats.update({k: float(np.mean([t[k] for t in tool_stats])) for k in (tool_stats[0] if tool_stats else ())})
    stats.update(pool.take_counts())
    return ro, stats


def _left_pad_to(a: np.ndarray, width: int, value) -> np.ndarray:
    return np.pad(a, ((0, 0), (width - a.shape[1], 0)), constant_values=value)


def concat_rollouts(parts: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """Join rollouts whose prompt buckets may differ (left-pad prompts to the widest)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p["prompt_tokens"].shape[1] for p in parts)
    out = {}
    for k in parts[0]:
        vals = [p[k] for p in parts]
        if k in ("prompt_tokens", "prompt_mask"):
            vals = [_left_pad_to(v, width, pad_id if k == "prompt_tokens" else False) for v in vals]
        out[k] = np.concatenate(vals) if isinstance(vals[0], np.ndarray) else sum(vals, [])
    return out


def take_rows(ro: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
    return {k: (v[rows] if isinstance(v, np.ndarray) else [v[i] for i in rows]) for k, v in ro.items()}


def overlong_penalty(lengths: np.ndarray, max_len: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment: linear from 0 to -penalty over the last `buffer` tokens."""
    if buffer <= 0:
        return np.zeros_like(lengths, np.float32)
    over = np.clip(lengths - (max_len - buffer), 0, buffer)
    return (-penalty * over / buffer).astype(np.float32)


def mini_batch_rows(rows: int, mini_batches: int, group_size: int, rl_step: int) -> np.ndarray:
    """int [mini_batches, rows / mini_batches]: the rows of each mini-batch, whole prompt groups, shuffled per step
    (the same for both layouts: packing.pack keeps each mini-batch's rows in its own run of slices)."""
    groups = rows // group_size
    if groups % mini_batches:
        raise ValueError(f"optim.mini_batches={mini_batches} must divide the {groups} prompt groups per step")
    g = np.random.default_rng(rl_step).permutation(groups).reshape(mini_batches, -1)
    return (g[:, :, None] * group_size + np.arange(group_size)).reshape(mini_batches, -1)


def build_batch(ro: dict[str, Any], advantages: np.ndarray, pad_id: int, max_new_tokens: int, packed: bool = False,
                slices: int | Sequence[int] = 1, rows_multiple: int = 1, row_groups: np.ndarray | None = None,
                shapes: set | None = None) -> dict[str, np.ndarray]:
    """Loss batch (objectives.loss_fn layout); completions trimmed to a length bucket to save compute.

    packed: several rows' real tokens per row instead (packing.pack: `slices` slices, or the best of several
    counts, of balanced rows within each mini-batch of row_groups, for packing.loss_fn / packing.sequence_logprobs),
    so the model computes on real tokens only; kept padded where that would not save much
    (packing.pack_if_smaller: equal lengths). A packed batch's per-row arrays are max_new_tokens wide (no model
    compute: steps whose longest rows differ share a shape); shapes: the run's packed shapes so far (a set the
    caller keeps; packing.pack_if_smaller's `known`), so a step whose rows fit one of them within a bucket step
    reuses its compiled programs, as partial rollouts' steps, each training whichever rows finished, would not.
    """
    C = min(bucket_length(int(ro["lengths"].max(initial=1)), COMPLETION_BUCKETS), max_new_tokens)
    batch = _padded(ro, advantages, pad_id, C)
    if not packed:
        return batch
    wide = None if C == max_new_tokens else _padded(ro, advantages, pad_id, max_new_tokens)
    return packing.pack_if_smaller(batch, slices, rows_multiple, pad_id, row_groups, known=shapes, wide=wide)


def _columns(a, C: int, value=0) -> np.ndarray:
    """The first C columns of a [N, ...] completion array, padded with `value` where it has fewer."""
    a = np.asarray(a)[:, :C]
    return np.pad(a, ((0, 0), (0, C - a.shape[1])), constant_values=value)


def _padded(ro: dict[str, Any], advantages: np.ndarray, pad_id: int, C: int) -> dict[str, np.ndarray]:
    """The padded loss batch with completions C wide."""
    comp_mask = np.arange(C)[None, :] < ro["lengths"][:, None]
    comp = np.where(comp_mask, _columns(ro["tokens"], C, pad_id), pad_id)
    logp = _columns(ro["sampler_logp"], C)
    batch = {
        "tokens": np.concatenate([ro["prompt_tokens"], comp], axis=1).astype(np.int32),
        "mask": np.concatenate([ro["prompt_mask"], comp_mask], axis=1).astype(np.int32),
        "completion_mask": comp_mask.astype(np.float32),
        "advantages": advantages.astype(np.float32),
        "sampler_logp": np.where(comp_mask, logp, 0.0).astype(np.float32),
        "truncated": ~ro["finished"],
    }
    if ro.get("sampled_mask") is not None:  # multi-turn rows: observed tokens are attended to, never trained
        sampled = comp_mask & (_columns(ro["sampled_mask"], C) > 0)
        bad = np.argwhere(sampled & ~np.isfinite(batch["sampler_logp"]))
        if len(bad):
            raise ValueError(f"row {bad[0][0]}, completion token {bad[0][1]}: a sampled token has a NaN behaviour "
                             "log-prob (NaN marks observed tokens); the row's segments and log-probs disagree")
        batch["sampled_mask"] = sampled.astype(np.float32)
    return batch
