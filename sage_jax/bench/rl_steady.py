"""Several consecutive RL steps, on-policy and with partial rollouts (training/partial.py) interleaved step by step,
TRL's GRPOTrainer beside them (`python -m sage_jax.bench rl_step --steady N`):

  python -m sage_jax.bench rl_step --preset small --batch 64 --group 8 --new-tokens 512 --workload longtail --steady 4

On a stream of prompts with forced long-tailed lengths (rl_step.py's forced-length rollouts): generation tokens/s,
trained tokens/s, carried rows, token lag, the carried rows' prefill, and the generation ceiling (a static batch at the
full width).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax.bench import common, compiles, trl_peer, workloads
from sage_jax.bench.common import print_table
from sage_jax.bench.rl_step import EOS_ID, forced_rollout, ids_reward, rl_config
from sage_jax.models import decoder as model, sharding
from sage_jax.sampling import sampler
from sage_jax.training import rollouts as rollouts_lib, trainer


def _stream(workload: str, rows: int, new_tokens: int, seed: int, chunks: int) -> np.ndarray:
    """Forced lengths for `chunks` steps' worth of rows, each chunk the workload's multiset (a new shuffle each)."""
    return np.concatenate([workloads.workload_lengths(workload, rows, new_tokens, seed + c) for c in range(chunks)])


def _forced_batch(ro: dict, new_tokens: int) -> dict:
    """Rows that stopped at their forced length before the limit end with EOS (as forced_rollout), scored."""
    ro["finished"] = ro["lengths"] < new_tokens
    ends = np.flatnonzero(ro["finished"])
    ro["tokens"][ends, ro["lengths"][ends] - 1] = EOS_ID
    ro["rewards"] = np.array([ids_reward(row[:n]) for row, n in zip(ro["tokens"], ro["lengths"])], np.float32)
    ro["correct"] = (ro["rewards"] >= 1.0).astype(np.float32)
    return ro


def steady_collect(cfg: model.ModelConfig, prompts: np.ndarray, group: int, lengths: np.ndarray, batch_prompts: int,
                   new_tokens: int, seed: int, partial_cfg: tuple[float, int] | None):
    """rl_step's CollectFn over a stream of prompts and forced lengths: on-policy (partial_cfg None: step t samples
    prompts t*B .. (t+1)*B - 1 with their lengths) or with partial rollouts (partial_cfg = (oversample, max_lag): the
    stream consumed as the carry asks). Stats: bench/drawn (tokens the call drew), bench/gen_s, bench/carried_tokens
    (tokens of carried rows prefilled again). The carry is the returned collect's `.carry`."""
    from sage_jax.training import partial
    stream = prompts.tolist()
    carry = partial.Carry()

    min_rows = 0 if partial_cfg is None else partial.pool_rows(batch_prompts, group, partial_cfg[0])
    slots = None if partial_cfg is None else partial.pool_slots(None, batch_prompts, group)

    def generate(params, key, prompts_b, resume, stop, limits):
        return sampler.generate(cfg, params, prompts_b, new_tokens, temperature=1.0, eos_ids=(), seed=key,
                                num_samples=group, row_max_new_tokens=limits, stop_after_groups=stop, resume=resume,
                                min_rows=min_rows, slots=slots)

    def collect(params, step: int):
        key = jax.random.key(seed + step)
        if partial_cfg is None:
            rows = slice(step * batch_prompts * group, (step + 1) * batch_prompts * group)
            t0 = time.perf_counter()
            out = jax.device_get(generate(params, key, stream[step * batch_prompts:(step + 1) * batch_prompts], (),
                                          None, lengths[rows].tolist()))
            gen_s = time.perf_counter() - t0
            ro = forced_rollout(out, lengths[rows], EOS_ID)
            return _forced_batch(ro, new_tokens), {"bench/drawn": float(ro["lengths"].sum()), "bench/gen_s": gen_s,
                                                   "bench/carried_tokens": 0.0}
        carried = float(sum(len(r.tokens) for r in carry.resumed()[1]))
        groups, dropped, drawn, gen_s = rollouts_lib.run_phases(partial.sample_partial(
            carry, step, step, batch_prompts, group, *partial_cfg,
            lambda c, n: (stream[c:c + n], list(range(c, c + n))),
            lambda p, resume, stop, limits: generate(params, key, p, resume, stop, limits), key, new_tokens,
            fresh_limits=lambda c, n: lengths[c * group:(c + n) * group].tolist()))
        ro = partial.batch_arrays(groups, group, new_tokens, 0)
        return _forced_batch(ro, new_tokens), {"bench/drawn": float(drawn), "bench/gen_s": gen_s,
                                               "bench/carried_tokens": carried,
                                               **partial.step_stats(ro, step, carry, dropped, drawn, gen_s)}
    collect.carry = carry
    return collect


def bench_rl_steady(preset: str = "small", dtype: str = "fp32", prompts: int = 8, group: int = 8,
                    prompt_len: int = 32, new_tokens: int = 512, steps: int = 4, trl_steps: int = 2,
                    seed: int = 0, workload: str = "longtail", oversample: Sequence[float] = (1.5,),
                    max_lag: int = 4, warmup: int = 3) -> list[dict]:
    """`steps` consecutive RL steps after `warmup` ones, on-policy ("sage_jax") and with partial rollouts
    ("sage_jax_partial", one per `oversample`: "sage_jax_partial_2" for 2) interleaved step by step in one run, on a
    stream of prompts and forced long-tailed lengths; TRL's step (trl_steps after a warm-up, 0: none) interleaved
    with them. Per impl (medians over the measured steps): generation-phase tokens/s (tokens drawn / sampling
    seconds), trained tokens/s (completion tokens trained / step seconds), and for partial rollouts the carried rows,
    token lag and the re-prefill's share. The warm-up steps compile the programs: partial rollouts' calls prefill
    carried rows in prompt buckets that grow with them (a handful of programs, each compiled once per run); a measured
    step that still compiled (sampler, train step or anything else: compiles.CompileCounter) is left out of the times
    and counted in compiled_steps, its sampler and train-step compilations in sampler_compiles / train_compiles."""
    cfg = common.preset_config(preset, dtype)
    params = common.init_params(cfg, seed)
    B, N = prompts, prompts * group
    chunks = steps + warmup + 1 + int(np.ceil(max(oversample))) * 2
    rng = np.random.default_rng(seed)
    prompt_stream = rng.integers(2, cfg.vocab_size, (chunks * B * 2, prompt_len))
    lengths = _stream(workload, N, new_tokens, seed, chunks * 2)
    load_before = common.load_average()
    ours, collects = _arms(preset, dtype, params, prompt_stream, group, lengths, B, new_tokens, seed, oversample,
                           max_lag)
    runs: dict[str, list[dict]] = {name: [] for name in ours}

    def one_step_each() -> None:
        for name, (ctx, box, mesh, rules) in ours.items():
            with jax.set_mesh(mesh), sharding.use_rules(rules), compiles.CompileCounter() as counted:
                out = trainer.rl_step(ctx, box["state"], box["step"], collects[name])
            box["state"], box["step"] = out.state, box["step"] + 1
            h = out.host
            trained = float(out.rollouts["lengths"].sum())
            runs[name].append(dict(seconds=h["time/step_s"], gen_s=h["bench/gen_s"], drawn=h["bench/drawn"],
                                   trained=trained, carried_tokens=h["bench/carried_tokens"],
                                   carried_rows=h.get("rl/carried_rows", 0.0), update_s=h["time/update_s"],
                                   lag=h.get("rl/token_lag_mean", 0.0), dropped=h.get("rl/dropped_groups", 0.0),
                                   **counted.split()))
            if counted.count:  # which programs: a measured step that compiled is left out of the times
                print(f"step {box['step'] - 1} {name}: compiled {counted.count} ({counted.seconds:.1f} s): "
                      + ", ".join(sorted(set(counted.names))), flush=True)
    total = steps + warmup
    per_trl = -(-total // (trl_steps + 1)) if trl_steps else total
    done = [0]

    def between() -> None:
        for _ in range(per_trl):
            if done[0] < total:
                one_step_each()
                done[0] += 1
    trl_runs: list[dict] = []
    if trl_steps:
        with tempfile.TemporaryDirectory() as model_dir:
            hf_cfg = common.preset_config(preset, "fp32")
            model.save_hf(model_dir, hf_cfg, params)
            trl_runs = trl_peer.trl_interleaved(model_dir, hf_cfg.vocab_size, prompt_stream[:B], group, lengths[:N],
                                                0.05, trl_steps + 1, between, ids_reward, EOS_ID, seed, [])
    while done[0] < total:
        between()
    ceiling = _full_width_s_per_token(ours["sage_jax"], prompt_stream[:B].tolist(), group,
                                      ceiling_length(lengths[:N * (steps + warmup)]), seed)
    out = _summarize(runs, warmup, preset, workload, B, group, new_tokens, ceiling, ours, collects, seed, trl_runs,
                     lengths[:N])
    _print(out, preset, B, group, workload, new_tokens, oversample, max_lag, steps, warmup, load_before)
    return out


def _print(out, preset, B, group, workload, new_tokens, oversample, max_lag, steps, warmup, load_before) -> None:
    print_table(out, [("impl", ""), ("steps", "d"), ("seconds", ".2f"), ("gen_s", ".2f"),
                      ("gen_tokens_per_s", ".1f"), ("trained_tokens_per_s", ".1f"), ("gen_vs_on_policy", ".2f"),
                      ("trained_vs_on_policy", ".2f"), ("trained_vs_trl", ".2f"), ("carried_rows", ".1f"),
                      ("token_lag", ".2f"), ("dropped_groups", ".0f"), ("reprefill_frac", ".3f"),
                      ("prefill_share", ".3f"), ("train_ms_per_token", ".3f"), ("train_cost_vs_on_policy", ".2f"),
                      ("timed_steps", ".0f"), ("compiled_steps", ".0f"), ("sampler_compiles", ".0f"),
                      ("train_compiles", ".0f"), ("full_width_tokens_per_s", ".1f"),
                      ("gen_ceiling_vs_on_policy", ".2f"), ("trained_ceiling_vs_on_policy", ".2f")])
    print(f"{preset} preset, {B} prompts x {group} samples per step, {workload} lengths up to {new_tokens}; partial: "
          f"oversample {', '.join(f'{o:g}' for o in oversample)}, max_lag {max_lag}; medians / sums over {steps} "
          f"steps after {warmup} warm-up steps; full_width: a static batch of the step's rows, all as long as twice "
          "the workload's mean token position (every step at the full width, every row live, each token's attention "
          "as long on average as the workload's), the generation ceiling; trained ceiling: the on-policy steps with "
          "their generation at that rate; "
          f"prefill_share: the carried rows' prefill alone (timed after the run) over a partial step's sampling; "
          f"1-min load average {load_before:.1f} before, {common.load_average():.1f} after ({os.cpu_count()} cores)")


def _arms(preset, dtype, params, prompt_stream, group, lengths, B, new_tokens, seed, oversample, max_lag):
    """({arm: (RLContext, {"state", "step"}, mesh, rules)}, {arm: its collect}): on-policy and one partial-rollout
    arm per oversample, each set up by trainer.setup_rl on one device from its own copy of params."""
    ours, collects = {}, {}
    arms = [("sage_jax", None)] + [(f"sage_jax_partial_{o:g}", (o, max_lag)) for o in oversample]
    for name, pcfg in arms:
        config = rl_config(preset, dtype, B, group, new_tokens, 0.05, seed, True)
        config.rollout.partial = pcfg is not None  # the ratio's denominator: the recorded log-probs
        mesh, rules = sharding.make_mesh((1, 1, 1), jax.devices()[:1]), dict(config.mesh.rules)
        with jax.set_mesh(mesh), sharding.use_rules(rules):
            ctx, state = trainer.setup_rl(config, mesh, rules, None, params_override=jax.tree.map(jnp.copy, params))
        collects[name] = steady_collect(ctx.cfg, prompt_stream, group, lengths, B, new_tokens, seed, pcfg)
        ours[name] = (ctx, {"state": state, "step": 0}, mesh, rules)
    return ours, collects


def _summarize(runs, warmup, preset, workload, B, group, new_tokens, ceiling, ours, collects, seed, trl_runs,
               trl_lengths) -> list[dict]:
    """One row per arm (medians and sums over the measured steps: times over those that compiled nothing, counts over
    all), the ratios, TRL's row. train_ms_per_token: the step's time outside generation (rewards, reference pass,
    update, the carry's bookkeeping) per trained token."""
    out = []
    for name, all_rs in runs.items():
        rs, counted = compiles.timed_steps(all_rs, warmup)  # the warm-up steps and any step that compiled left out
        med = lambda k, rs=rs: statistics.median(r[k] for r in rs)
        measured = all_rs[warmup:]
        out.append(dict(preset=preset, impl=name, workload=workload, prompts=B, group=group, new_tokens=new_tokens,
                        steps=len(measured), seconds=med("seconds"), gen_s=med("gen_s"), update_s=med("update_s"),
                        gen_tokens_per_s=sum(r["drawn"] for r in rs) / sum(r["gen_s"] for r in rs),
                        trained_tokens_per_s=sum(r["trained"] for r in rs) / sum(r["seconds"] for r in rs),
                        train_ms_per_token=1e3 * sum(r["seconds"] - r["gen_s"] for r in rs) / sum(
                            r["trained"] for r in rs),
                        carried_rows=statistics.mean(r["carried_rows"] for r in measured),
                        token_lag=statistics.mean(r["lag"] for r in measured),
                        dropped_groups=sum(r["dropped"] for r in measured), **counted,
                        **{k: sum(r[k] for r in measured) for k in ("sampler_compiles", "train_compiles")},
                        reprefill_frac=sum(r["carried_tokens"] for r in measured) / sum(r["drawn"] for r in measured)))
    for part in out[1:]:  # what recomputing the carried rows' caches costs a step: their prefill alone
        part["prefill_carry_s"] = _prefill_seconds(ours[part["impl"]], collects[part["impl"]].carry, group,
                                                   new_tokens, seed)
        part["prefill_share"] = part["prefill_carry_s"] / part["gen_s"] if part["gen_s"] else float("nan")
    # the generation ceiling: every decode step at the full width with every row live (a static batch of the step's
    # rows, all of one length), per token, its attention as long as the workload's average token's; and the trained
    # tokens/s of the on-policy steps had their generation run at that rate
    on = compiles.timed_steps(runs["sage_jax"], warmup)[0]
    out[0]["full_width_tokens_per_s"] = 1.0 / ceiling
    out[0]["gen_ceiling_vs_on_policy"] = (1.0 / ceiling) / out[0]["gen_tokens_per_s"]
    out[0]["trained_ceiling_vs_on_policy"] = sum(r["seconds"] for r in on) / sum(
        r["seconds"] - r["gen_s"] + r["drawn"] * ceiling for r in on)
    for r in out:
        r["gen_vs_on_policy"] = r["gen_tokens_per_s"] / out[0]["gen_tokens_per_s"]
        r["trained_vs_on_policy"] = r["trained_tokens_per_s"] / out[0]["trained_tokens_per_s"]
        r["train_cost_vs_on_policy"] = r["train_ms_per_token"] / out[0]["train_ms_per_token"]
    if trl_runs:
        trl_rs = trl_runs[1:] or trl_runs
        trl_tok = float(trl_lengths.sum()) / statistics.median(r["seconds"] for r in trl_rs)
        out.append(dict(preset=preset, impl="trl", workload=workload, prompts=B, group=group, new_tokens=new_tokens,
                        steps=len(trl_rs), seconds=statistics.median(r["seconds"] for r in trl_rs),
                        trained_tokens_per_s=trl_tok))
        for r in out[:-1]:
            r["trained_vs_trl"] = r["trained_tokens_per_s"] / trl_tok
    return out


def ceiling_length(lengths: np.ndarray) -> int:
    """The length of a static batch whose tokens' attention is, on average, as long as the workload's tokens': twice
    the mean position of a generated token (sum of L (L - 1) / 2 over the rows, over sum of L). A decode step's
    attention reads up to its furthest row, so a pool of rows at mixed positions reads at least that much."""
    lengths = np.asarray(lengths, np.float64)
    return max(1, int(round(2 * float((lengths * (lengths - 1) / 2).sum() / lengths.sum()))))


def _full_width_s_per_token(runner, prompts: list, group: int, length: int, seed: int) -> float:
    """Seconds per generated token of a static batch of the step's rows, every row `length` tokens (no tail: every
    decode step computes only live rows), the median of 3 after a warm-up, with the on-policy runner's weights."""
    ctx, box, mesh, _ = runner
    params = ctx.policy(box["state"]["params"])
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            jax.block_until_ready(sampler.generate(ctx.cfg, params, prompts, length, temperature=1.0, eos_ids=(),
                                                   seed=seed, num_samples=group))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / (len(prompts) * group * length)


def _prefill_seconds(runner, carry, group: int, new_tokens: int, seed: int) -> float:
    """Seconds to prefill the carry's rows again (a call that returns before its first decode step: stop 0), the
    median of 3 after a warm-up: what keeping their caches could save at most per step."""
    ctx, box, mesh, _ = runner
    resume, _rows = carry.resumed()
    if not resume:
        return 0.0
    params = ctx.policy(box["state"]["params"])
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            jax.block_until_ready(sampler.generate(ctx.cfg, params, [[2]], new_tokens, temperature=1.0, eos_ids=(),
                                                   seed=seed, num_samples=group, stop_after_groups=0, resume=resume))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def rl_steady_mode(args) -> list[dict]:
    if args.batch % args.group:
        raise ValueError(f"--batch {args.batch} rows must be a multiple of --group {args.group}")
    return [r for p in common.presets(args.preset) for r in bench_rl_steady(
        p, args.dtype, args.batch // args.group, args.group, args.prompt_len, args.new_tokens, steps=args.steady,
        trl_steps=0 if args.peer is None else args.repeats, workload=args.workload,
        oversample=tuple(float(o) for o in str(args.oversample).split(",")),
        max_lag=args.max_lag, warmup=args.warmup)]
