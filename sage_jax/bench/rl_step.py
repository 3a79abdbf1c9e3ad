"""One RL step, `trainer.rl_step` as `run_rl` runs it, against a peer's on the same weights: TRL's GRPOTrainer
(`--peer trl`, the default) or tunix's GRPOLearner (`--peer tunix`, tunix_peer.py).

  python -m sage_jax.bench rl_step --preset small
  python -m sage_jax.bench rl_step --preset small --new-tokens 512 --workload longtail --layout both
  python -m sage_jax.bench rl_step --preset small --peer tunix --workload longtail --new-tokens 512

Both sides generate the same completion lengths (workload "fixed": every row runs to --new-tokens; "longtail":
workloads.longtail_lengths), forced so that the step's work does not depend on what the random weights sample: our
CollectFn stops each row's sampling at its forced length (as the trainer's rows stop at EOS) and ends it with EOS
unless it runs to the limit, TRL's generate is forced by a logits processor, tunix's sampler by a wrapped sampling
step. Only tokens before EOS count as generated. The steps are interleaved (ours after each peer step, then the matmul
peak under the same load); the first step of each side is left out as warm-up, and so is any later step that compiled
(compiles.py: a step that compiled is not a timing; the table counts them).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax.run import config as config_lib
from sage_jax.bench import workloads
from sage_jax.models import decoder as model, sharding
from sage_jax.sampling import sampler
from sage_jax.training import trainer
from sage_jax.bench import common, compiles, flops, trl_peer
from sage_jax.bench.common import print_table

EOS_ID = 1  # trl_peer.word_level_tokenizer's "<eos>": the token both sides end a forced-length completion with


def ids_reward(ids) -> float:
    """Trivial in-process reward: the share of even token ids (varies across a group, so advantages are non-zero)."""
    ids = np.asarray(ids)
    return float((ids % 2 == 0).mean()) if ids.size else 0.0


def forced_rollout(out, lengths_N: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """Rollouts in rollouts.rollout's layout from a sample of max_new_tokens, cut to the forced lengths: row n ends
    with EOS at lengths[n] - 1 unless it runs to the limit (truncated)."""
    N, C = out.tokens.shape
    finished = lengths_N < C
    tokens = np.where(np.arange(C)[None] < lengths_N[:, None], out.tokens, 0)
    tokens[np.flatnonzero(finished), lengths_N[finished] - 1] = eos_id
    return dict(prompt_tokens=np.asarray(out.prompt_tokens), prompt_mask=np.asarray(out.prompt_mask), tokens=tokens,
                lengths=lengths_N, finished=finished, sampler_logp=np.where(tokens > 0, out.logprobs, 0.0))


def forced_length_collect(cfg: model.ModelConfig, prompts_BxP: np.ndarray, group: int, lengths_N: np.ndarray,
                          seed: int, marks: list[float]) -> trainer.CollectFn:
    """rl_step's CollectFn for the benchmark: `group` samples per prompt from the policy (temperature 1, EOS
    ignored, each row stopped at its forced length), cut to lengths_N and scored by ids_reward. Appends the time
    after sampling and after scoring to `marks`."""
    prompts = prompts_BxP.tolist()
    new_tokens = int(lengths_N.max())
    row_limits = [int(n) for n in lengths_N]

    def collect(params, step: int):
        # each row stops at its own length, as it would at its EOS, so finished rows leave the decode batch
        out = jax.device_get(sampler.generate(cfg, params, prompts, new_tokens, temperature=1.0, eos_ids=(),
                                              seed=seed + step, num_samples=group, row_max_new_tokens=row_limits))
        ro = forced_rollout(out, lengths_N, EOS_ID)
        marks.append(time.perf_counter())
        ro["rewards"] = np.array([ids_reward(row[:n]) for row, n in zip(ro["tokens"], ro["lengths"])], np.float32)
        ro["correct"] = (ro["rewards"] >= 1.0).astype(np.float32)
        marks.append(time.perf_counter())
        return ro, {}
    return collect


def rl_config(preset: str, dtype: str, prompts: int, group: int, new_tokens: int, beta: float, seed: int,
              packed: bool):
    """configs/base.py with the benchmark's model and rollout shape and the SAGE arm (Branch guide, `beta`)."""
    config = config_lib.load(str(common.REPO / "configs" / "base.py"))
    cfg = common.preset_config(preset, dtype)
    config.seed = seed
    config.model.update(preset=preset, param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype,
                        ref_dtype=cfg.compute_dtype, remat=cfg.remat, scan_layers=cfg.scan_layers,
                        logits_chunk=cfg.logits_chunk, attention=cfg.attention)
    config.rollout.update(prompts_per_step=prompts, group_size=group, max_new_tokens=new_tokens, temperature=1.0)
    config.loss.update(beta=beta, guide="branch")
    config.train.update(packing=packed, logprob_rows=0)  # the reference pass over all rows at once
    return config


def sage_rl_runner(preset: str, dtype: str, params, prompts_BxP: np.ndarray, group: int, lengths_N: np.ndarray,
                   beta: float, seed: int = 0, packed: bool = True) -> Callable[[], dict[str, float]]:
    """run() does one trainer.rl_step (set up by trainer.setup_rl on one device, as the peer runs) and returns its
    seconds per phase. packed: the reference pass and the update on packed rows (packing.py), else padded rows."""
    config = rl_config(preset, dtype, prompts_BxP.shape[0], group, int(lengths_N.max()), beta, seed, packed)
    mesh, rules = sharding.make_mesh((1, 1, 1), jax.devices()[:1]), dict(config.mesh.rules)
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        # a copy: the state is donated to the first update, and the caller's params serve the other runners too
        ctx, state = trainer.setup_rl(config, mesh, rules, None, params_override=jax.tree.map(jnp.copy, params))
    marks: list[float] = []
    collect = forced_length_collect(ctx.cfg, prompts_BxP, group, lengths_N, seed, marks)
    box = {"state": state, "step": 0}

    def run() -> dict[str, float]:
        # rl_step's own phase timings (each waits for its outputs); the collect's marks split generation from scoring
        marks.clear()
        with jax.set_mesh(mesh), sharding.use_rules(rules), compiles.CompileCounter() as counted:
            out = trainer.rl_step(ctx, box["state"], box["step"], collect)
        box["state"], box["step"] = out.state, box["step"] + 1
        sampled, scored = marks
        h = out.host  # the update's lap waited for the new state and metrics
        return dict(seconds=h["time/step_s"], generate_s=h["time/rollout_s"] - (scored - sampled),
                    reward_s=scored - sampled,
                    ref_s=h["time/batch_s"] + h["time/ref_s"] + h.get("time/old_s", 0.0), batch_s=h["time/batch_s"],
                    update_s=h["time/update_s"], padded_frac=h["perf/padded_frac"], **counted.split())
    return run


PEERS = ("trl", "tunix")


def _interleaved_steps(preset: str, dtype: str, params, prompts_BxP: np.ndarray, group: int, lengths_N: np.ndarray,
                       beta: float, repeats: int, peer: str | None, seed: int, layouts: tuple[str, ...]):
    """(per-step phase seconds of each impl, the matmul peak's (seconds after each step, FLOPs), the peer's realised
    lengths per step). Each peer step is followed by one step of each of ours and the matmul peak."""
    ours = {"sage_jax" if layout == "packed" else "sage_jax_padded": sage_rl_runner(
        preset, dtype, params, prompts_BxP, group, lengths_N, beta, seed, packed=layout == "packed")
        for layout in layouts}
    peak_fn, peak_flops = common.matmul_peak_fn(dtype)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ours}
    peak_s: list[float] = []
    peer_lengths: list = []

    def after_peer_step() -> None:  # our steps, then the matmul peak under the same load
        for name, run in ours.items():
            runs[name].append(run())
        start = time.perf_counter()
        jax.block_until_ready(peak_fn())
        peak_s.append(time.perf_counter() - start)

    if peer == "trl":
        with tempfile.TemporaryDirectory() as model_dir:
            hf_cfg = common.preset_config(preset, "fp32")  # TRL runs in fp32
            model.save_hf(model_dir, hf_cfg, params)
            runs["trl"] = trl_peer.trl_interleaved(model_dir, hf_cfg.vocab_size, prompts_BxP, group, lengths_N, beta,
                                                   repeats + 1, after_peer_step, ids_reward, EOS_ID, seed,
                                                   peer_lengths)
    elif peer == "tunix":
        from sage_jax.bench import tunix_peer
        tunix_run = tunix_peer.grpo_runner(common.preset_config(preset, dtype), params, prompts_BxP, group,
                                           lengths_N, beta, ids_reward, EOS_ID, seed)
        runs["tunix"] = []
        for _ in range(repeats + 1):
            runs["tunix"].append(tunix_run())
            after_peer_step()
    else:
        for _ in range(repeats + 1):
            after_peer_step()
    return runs, (peak_s, peak_flops), peer_lengths


def bench_rl_step(preset: str = "tiny", dtype: str = "fp32", prompts: int = 8, group: int = 8, prompt_len: int = 32,
                  new_tokens: int = 128, beta: float = 0.05, repeats: int = 3, peer: str | None = "trl",
                  seed: int = 0, workload: str = "fixed", layouts: tuple[str, ...] = ("packed",)) -> list[dict]:
    """Generated tokens/s (before EOS) of one RL step: ours for each of `layouts` (the reference pass and update on
    packed rows, impl "sage_jax", or on padded rows, "sage_jax_padded") and the peer's: TRL's (torch, CPU, fp32) or
    tunix's (JAX, our dtype), or none. Medians over the steps after the first that compiled nothing
    (compiles.timed_steps); compiled_steps counts those left out."""
    if peer not in (*PEERS, None):
        raise ValueError(f"unknown peer {peer!r}; choose one of {list(PEERS)} or none")
    cfg = common.preset_config(preset, dtype)
    params = common.init_params(cfg, seed)
    prompts_BxP = np.random.default_rng(seed).integers(2, cfg.vocab_size, (prompts, prompt_len))
    lengths_N = workloads.workload_lengths(workload, prompts * group, new_tokens, seed)
    load_before = common.load_average()
    runs, (peak_s, peak_flops), trl_lengths = _interleaved_steps(preset, dtype, params, prompts_BxP, group, lengths_N,
                                                                 beta, repeats, peer, seed, layouts)
    peak = peak_flops / statistics.median(peak_s[1:] or peak_s)
    step_flops = flops.rl_step_flops(cfg, prompts, group, prompt_len, new_tokens) if workload == "fixed" else None
    tokens = int((lengths_N - (lengths_N < new_tokens)).sum())  # generated tokens before EOS
    out = []
    for impl, rs in runs.items():
        counted, steps = compiles.timed_steps(rs) if "compiles" in rs[0] else (rs[1:] or rs, {})
        row = compiles.median_row([{k: v for k, v in r.items() if "compile" not in k} for r in counted])
        realised = trl_lengths[-1] if impl == "trl" and trl_lengths else lengths_N  # one step's rows, EOS included
        lengths = {k: v for k, v in workloads.length_quantiles(realised, new_tokens).items() if k != "tokens"}
        out.append(dict(preset=preset, dtype=dtype if impl != "trl" else "fp32", impl=impl, workload=workload,
                        prompts=prompts, group=group, new_tokens=new_tokens, tokens_per_s=tokens / row["seconds"],
                        **lengths, **row, **steps, **_compile_sums(rs)))
        if step_flops:
            out[-1].update(model_gflops=step_flops / 1e9, gflops_per_s=step_flops / row["seconds"] / 1e9,
                           peak_gflops_per_s=peak / 1e9, frac_of_peak=step_flops / row["seconds"] / peak,
                           at_peak_s=step_flops / peak)
    _add_ratios(out, bool(step_flops))
    _print_rl_table(out, preset, prompts, group, load_before, step_flops)
    return out


def _compile_sums(steps: list[dict]) -> dict[str, float]:
    """The compilations of the steps after the first (the warm-up's are expected): all, the sampler's, the train
    step's."""
    after = steps[1:]
    return {k: sum(s.get(k, 0.0) for s in after) for k in ("compiles", "sampler_compiles", "train_compiles")
            if after and k in after[0]}


def _add_ratios(out: list[dict], with_flops: bool) -> None:
    by = {r["impl"]: r for r in out}
    for r in out:
        for peer in PEERS:
            if peer in by and r["impl"] not in PEERS:
                r[f"vs_{peer}"] = r["tokens_per_s"] / by[peer]["tokens_per_s"]
        if r["impl"] == "sage_jax" and "sage_jax_padded" in by:
            r["vs_padded"] = r["tokens_per_s"] / by["sage_jax_padded"]["tokens_per_s"]
    if with_flops and "trl" in by:
        by["trl"]["ceiling_vs_trl"] = by["trl"]["seconds"] / by["trl"]["at_peak_s"]


def _print_rl_table(out: list[dict], preset: str, prompts: int, group: int, load_before: float,
                    step_flops: float | None) -> None:
    print_table(out, [("impl", ""), ("workload", ""), ("new_tokens", "d"), ("len_p50", ".0f"), ("len_p90", ".0f"),
                      ("len_max", ".0f"), ("padded_frac", ".3f"), ("seconds", ".2f"), ("tokens_per_s", ".1f"),
                      ("vs_trl", ".2f"), ("vs_tunix", ".2f"), ("vs_padded", ".2f"), ("generate_s", ".2f"),
                      ("reward_s", ".3f"),
                      ("ref_s", ".2f"), ("reward_ref_s", ".2f"), ("update_s", ".2f"), ("frac_of_peak", ".2f"),
                      ("at_peak_s", ".2f"), ("ceiling_vs_trl", ".2f"), ("timed_steps", ".0f"),
                      ("compiled_steps", ".0f"), ("sampler_compiles", ".0f"), ("train_compiles", ".0f")])
    print(f"{preset} preset, {prompts} prompts x {group} samples; padded_frac: share of the positions the reference "
          "pass and the update compute on that hold no token; tokens: generated before EOS; 1-min load average "
          f"{load_before:.1f} before, {common.load_average():.1f} after ({os.cpu_count()} cores); timed_steps: the "
          "steps after the first that compiled nothing (the medians' steps), compiled_steps: those that compiled and "
          "are left out; sampler_compiles / train_compiles: their sampler and train-step compilations")
    if step_flops:
        print(f"at_peak_s: the step's model FLOPs ({step_flops / 1e9:.0f} GFLOP: sampling, reference forward, policy "
              "forward + backward) at the jitted matmul peak timed after each step; ceiling_vs_trl: TRL's step over "
              "that, the most any implementation at this machine's matmul peak could reach against it")


def rl_step_mode(args) -> list[dict]:
    if args.batch % args.group:
        raise ValueError(f"--batch {args.batch} rows must be a multiple of --group {args.group} (rows = prompts x "
                         "group)")
    if args.peer == "tunix":
        from sage_jax.bench import tunix_peer
        tunix_peer.require_tunix()
    layouts = ("packed", "padded") if args.layout == "both" else (args.layout,)
    return [r for p in common.presets(args.preset) for r in bench_rl_step(
        p, args.dtype, args.batch // args.group, args.group, args.prompt_len, args.new_tokens, repeats=args.repeats,
        peer=args.peer, workload=args.workload, layouts=layouts)]
