"""The sampler against transformers' `generate` (or, with `--peer tunix`, tunix's Sampler: tunix_peer.py).

  python -m sage_jax.bench sampler --preset both --dtype fp32 --batch 64
  python -m sage_jax.bench sampler --workload longtail --preset small --json docs/results/sampler/longtail.json
  python -m sage_jax.bench sampler --model /tmp/smollm2 --workload longtail --batch 16 --group 4   # a real HF model
  python -m sage_jax.bench sampler --preset small --workload longtail --peer tunix

This sampler's tokens/s against transformers' `generate` (torch, CPU) on the same random weights, batch,
prompt length and forced completion lengths (greedy): `--workload fixed` runs every row to --new-tokens (EOS
ignored); `--workload longtail` (8 prompts x 8 samples, 512 new tokens by default) forces the same pre-drawn
long-tailed lengths on both sides (sage_jax.bench.workloads), transformers by a forced EOS, which stops a row as a real
one would. Only tokens before EOS count; the table gives each side's realised length quantiles. Warm-up runs are
excluded; each number is the median of `--repeats` runs, ours and theirs interleaved (common.interleaved_seconds)
so load from other processes hits both alike. With the fixed workload a third program in the same loop,
`matmuls_only` (decode_matmuls_fn), does only the model's matmuls for as many decode steps: its FLOP/s is the peak
the table's `frac_of_peak` refers to, and its tokens/s the ceiling for a sampler built on XLA's matmuls here.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax.bench import workloads
from sage_jax.models import kv_cache, decoder as model
from sage_jax.sampling import sampler as sampler_lib
from sage_jax.bench import common, flops
from sage_jax.bench.common import DTYPES, print_table

MATMULS_ONLY = "matmuls_only"  # the sampler table's ceiling row: see decode_matmuls_fn
ATTENTION_ONLY = "attention_only"  # the decode steps' cache attention alone: see decode_attention_fn
MATMULS_ATTENTION = "matmuls+attention"  # the two rows' seconds added: the ceiling once attention is counted
SCHEDULE_CEILING = "schedule_ceiling"  # long tail: every decode step at exactly its live rows (schedule_ceiling)

HF_EOS = 1  # the EOS id transformers is forced to emit in the longtail workload (prompts may contain it: harmless)


def _hf_generate_fn(model_dir: str, dtype: str, prompts_NxT: np.ndarray, new_tokens: int, threads: int | None = None,
                    lengths_N: np.ndarray | None = None) -> tuple[Callable[[], None], dict]:
    """(run, realised): greedy transformers generate of every row; with lengths_N each row is forced to emit HF_EOS
    after exactly lengths_N[n] tokens (and never before), so it stops as an EOS stops it. realised["lengths"]: the
    tokens before EOS of each row of the last run."""
    import torch
    import transformers

    torch.set_num_threads(threads or os.cpu_count() or 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPES[dtype])).eval()
    ids = torch.as_tensor(prompts_NxT, dtype=torch.long)
    mask = torch.ones_like(ids)
    P = prompts_NxT.shape[1]
    realised: dict = {}

    class ForceLengths(transformers.LogitsProcessor):
        def __init__(self):
            self.lengths_N = torch.as_tensor(lengths_N)

        def __call__(self, input_ids, scores):
            made = input_ids.shape[1] - P  # tokens generated so far
            scores[self.lengths_N > made, HF_EOS] = -torch.inf
            stop_N = self.lengths_N == made
            scores[stop_N] = -torch.inf
            scores[stop_N, HF_EOS] = 0.0
            return scores

    kw = (dict(min_new_tokens=new_tokens, eos_token_id=None) if lengths_N is None else
          dict(eos_token_id=HF_EOS, logits_processor=transformers.LogitsProcessorList([ForceLengths()])))

    def run():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0,
                              **kw)
        realised["lengths"] = workloads.tokens_before_eos(out[:, P:].numpy(), [HF_EOS] if lengths_N is not None else [])
    return run, realised


def _sage_generate_fn(cfg, params, prompts_BxT: np.ndarray, new_tokens: int, group: int = 1,
                      lengths_N: np.ndarray | None = None, slots: int | None = None
                      ) -> tuple[Callable[[], None], dict]:
    """(run, realised): greedy sampler.generate of group samples per prompt in `slots` decode slots (default: one
    per row), each row stopped after lengths_N[n] tokens when given (EOS ignored); realised["lengths"] as for
    _hf_generate_fn, realised["loops_per_step"] the program's data-dependent loop iterations per decode step (on
    XLA:GPU each a host round trip)."""
    prompts = prompts_BxT.tolist()
    limits = None if lengths_N is None else [int(n) for n in lengths_N]
    realised: dict = {}

    def run():
        out = sampler_lib.generate(cfg, params, prompts, max_new_tokens=new_tokens, temperature=0.0, eos_ids=(),
                               num_samples=group, row_max_new_tokens=limits, slots=slots)
        realised["lengths"] = np.asarray(jax.block_until_ready(out.lengths))
        realised["loops_per_step"] = int(out.loops) / max(1, int(out.steps))
    return run, realised


def decode_matmuls_fn(cfg, params, rows: int, steps: int) -> tuple[Callable[[], jax.Array], float]:
    """(fn, flops): `steps` decode steps of `rows` rows that do nothing but the model's matmuls (q, k, v, o, gate, up,
    down per layer and the unembedding, same weights and shapes) chained through one [rows, D] state: the time a
    decode step cannot go below with XLA's matmuls on this machine (no attention, sampling or cache)."""
    dt = jnp.dtype(cfg.compute_dtype)
    D, reps = cfg.hidden_size, cfg.num_heads // cfg.num_kv_heads
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    layers = [{k: lp[k].astype(dt).reshape(-1, lp[k].shape[-1]) if k in ("wo", "w_down")
               else lp[k].astype(dt).reshape(D, -1) for k in names}
              for lp in model.unstack_layers(cfg, params)["layers"]]

    @jax.jit
    def program(layers, params, x_NxD):
        w_DxV = model.unembed_matrix(cfg, params)

        def step(_, x):
            for lp in layers:
                x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)  # keeps x finite
                kv = (x @ lp["wk"]) * (x @ lp["wv"])
                x = x + (x @ lp["wq"] + jnp.tile(kv, (1, reps))) @ lp["wo"]
                x = x + (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"]
            logits = jnp.dot(x, w_DxV, preferred_element_type=jnp.float32)
            return x + 1e-3 * jnp.max(logits, axis=-1, keepdims=True).astype(x.dtype)  # uses every logit
        return jax.lax.fori_loop(0, steps, step, x_NxD)

    x = jax.random.normal(jax.random.key(0), (rows, D), dt)
    layer_matmuls = sum(int(np.prod(lp[k].shape)) for lp in layers for k in names)
    flops = 2.0 * rows * steps * (layer_matmuls + D * cfg.vocab_size)
    return (lambda: program(layers, params, x)), flops


def decode_attention_fn(cfg, rows: int, prompt_len: int, steps: int) -> Callable[[], jax.Array]:
    """`steps` decode steps of `rows` rows that do nothing but each layer's attention over its KV cache, as the
    sampler runs it (kv_cache.cached_attention on the sampler's cache shape, step i reading the prompt and the i
    tokens before it), chained through the query: the part of a decode step that the matmuls-only floor leaves
    out and that no decode step can skip."""
    dt = jnp.dtype(cfg.compute_dtype)
    P = sampler_lib.prompt_bucket(prompt_len)
    S = P + sampler_lib.new_tokens_bucket(steps)
    shape = (rows, cfg.num_kv_heads, S, cfg.head_dim)
    keys = jax.random.split(jax.random.key(2), 2 * cfg.num_layers + 1)
    cache = [(jax.random.normal(keys[2 * i], shape, dt), jax.random.normal(keys[2 * i + 1], shape, dt))
             for i in range(cfg.num_layers)]
    q = jax.random.normal(keys[-1], (rows, 1, cfg.num_heads, cfg.head_dim), dt)

    @jax.jit
    def program(cache, q_Bx1xNxH):
        def step(i, q):
            allowed_Bx1xS = jnp.broadcast_to(jnp.arange(S) <= P + i, (rows, 1, S))
            for k, v in cache:
                q = q + 1e-3 * kv_cache.cached_attention(q, k, v, allowed_Bx1xS)
            return q
        return jax.lax.fori_loop(0, steps, step, q_Bx1xNxH)
    return lambda: program(cache, q)


def _models(presets, dtype: str, seed: int, model_dir: str | None):
    """(name, cfg, params, HF directory) for each model timed: the HF directory model_dir (both sides load its
    weights; EOS ignored, lengths forced as for a preset), else each random-init preset saved to a temporary one."""
    if model_dir:
        cfg, params = model.load_hf(model_dir, dtype=jnp.dtype(DTYPES[dtype]))
        cfg = cfg.replace(compute_dtype=DTYPES[dtype], eos_token_ids=())
        yield os.path.basename(os.path.normpath(model_dir)), cfg, params, model_dir
        return
    for name in presets:
        cfg = model.preset(name, param_dtype=DTYPES[dtype], compute_dtype=DTYPES[dtype], eos_token_ids=())
        params = common.init_params(cfg, seed)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_hf(tmp, cfg, params)
            yield name, cfg, params, tmp


def schedule_ceiling(cfg, params, prompt_len: int, new_tokens: int, lengths_N: np.ndarray, repeats: int = 1
                     ) -> dict:
    """MEASURED seconds per decode step of static batches (W rows, every row to the same length) at W = 1 and the
    pool's widths (decode_pool.stage_widths): at three lengths n/16 < n/4 < n/2, the two differences give a step's
    cost at W rows as a + b j at position j (the cache it reads grows with j; the prefill cancels). From them,
    interpolated in W: "ideal_s", the decode of lengths_N with every step j computing exactly its live rows (a
    schedule no fixed set of widths beats, at this machine's costs), and "pool_s", the pool's own widths
    (sampling.schedule.decode_batches). Our sampler's time over ideal_s is what its schedule and its loop leave."""
    from sage_jax.sampling import schedule
    from sage_jax.sampling import decode_pool
    N = len(lengths_N)
    widths = sorted({1, *decode_pool.stage_widths(N, 1)})
    L0, L1, L2 = max(1, new_tokens // 16), max(2, new_tokens // 4), max(3, new_tokens // 2)
    rng = np.random.default_rng(1)
    a, b = {}, {}
    for w in widths:
        prompts = rng.integers(1, cfg.vocab_size, (w, prompt_len)).tolist()

        def run(n):
            return lambda: sampler_lib.generate(cfg, params, prompts, max_new_tokens=new_tokens, temperature=0.0,
                                                eos_ids=(), row_max_new_tokens=[n] * w).lengths
        t = {n: min(ts) for n, ts in common.interleaved_seconds({n: run(n) for n in (L0, L1, L2)}, repeats).items()}
        d1, d2 = (t[L1] - t[L0]) / (L1 - L0), (t[L2] - t[L1]) / (L2 - L1)  # at positions (L0+L1)/2, (L1+L2)/2
        b[w] = max(0.0, (d2 - d1) / ((L2 - L0) / 2))
        a[w] = max(0.0, d1 - b[w] * (L0 + L1) / 2)
    rows_J, live_J = schedule.decode_batches(lengths_N, None, stage_dp=1)

    def cost(r, j):
        return float(np.interp(r, widths, [a[w] + b[w] * j for w in widths]))
    return {"ideal_s": sum(cost(max(1, r), j) for j, r in enumerate(live_J, 1)),
            "pool_s": sum(cost(r, j) for j, r in enumerate(rows_J, 1)),
            "step_ms": {w: 1e3 * (a[w] + b[w] * new_tokens / 4) for w in widths}}


def bench_sampler(presets=("tiny", "small"), dtype: str = "fp32", batch: int = 64, prompt_len: int = 32,
                  new_tokens: int = 128, repeats: int = 3, latency: bool = True, seed: int = 0,
                  hf_threads: int | None = None, workload: str = "fixed", group: int = 1,
                  slots: tuple[int, ...] = (), model_dir: str | None = None, ceiling: bool = False,
                  peer: str = "transformers") -> list[dict]:
    """Rows of {preset, batch, impl, tokens_per_s, seconds, ...}; also prints a table with the ratios last.

    batch rows = batch / group prompts x group samples (transformers gets each prompt repeated group times). The
    fixed workload forces new_tokens on every row (EOS ignored) and adds the matmuls-only floor; longtail forces
    workloads.longtail_lengths on both sides. tokens = the tokens each side generated before EOS (last run).
    slots: also time this sampler with each of these numbers of decode slots (rows `sage_jax_slotsS`; the
    sage_jax row has one slot per row). ceiling (long tail): add the schedule_ceiling row, the decode at exactly
    each step's live rows from static-batch step costs measured in the same run (the prefill not counted).
    peer: the sampler beside ours, "transformers" or "tunix" (tunix_peer.sampler_fn: greedy, the same forced lengths).
    Each time is the median of the timed runs that compiled nothing (common.uncompiled_median); compiled_runs counts
    the runs of ours that did and were left out."""
    if batch % group:
        raise ValueError(f"--batch {batch} rows must be a multiple of --group {group} (rows = prompts x group)")
    rows = []
    load_before = os.getloadavg()[0]
    for name, cfg, params, tmp in _models(presets, dtype, seed, model_dir):
        rng = np.random.default_rng(seed)
        sizes = [batch, 1] if latency and batch != 1 and workload == "fixed" else [batch]
        for b in sizes:
            g = group if b == batch else 1
            prompts = rng.integers(1, cfg.vocab_size, (b // g, prompt_len))
            lengths = workloads.workload_lengths(workload, b, new_tokens, seed)
            forced = None if workload == "fixed" else lengths
            sides = {"sage_jax": _sage_generate_fn(cfg, params, prompts, new_tokens, g, forced),
                     peer: _peer_generate_fn(peer, cfg, params, tmp, dtype, np.repeat(prompts, g, axis=0),
                                             new_tokens, hf_threads, forced)}
            for n in slots if b == batch else ():
                sides[f"sage_jax_slots{n}"] = _sage_generate_fn(cfg, params, prompts, new_tokens, g, forced, n)
            fns = {k: fn for k, (fn, _) in sides.items()}
            if workload == "fixed":
                fns[MATMULS_ONLY], floor_flops = decode_matmuls_fn(cfg, params, b, new_tokens)
                fns[ATTENTION_ONLY] = decode_attention_fn(cfg, b, prompt_len, new_tokens)
            compiled_before, per_run = sampler_lib.compile_count(), {}
            seconds = {k: common.uncompiled_median(t, per_run[k])
                       for k, t in common.interleaved_seconds(fns, repeats, per_run).items()}
            if workload == "fixed":
                seconds[MATMULS_ATTENTION] = seconds[MATMULS_ONLY] + seconds[ATTENTION_ONLY]
            compiled = sampler_lib.compile_count() - compiled_before
            if ceiling and workload != "fixed" and b == batch:
                sc = schedule_ceiling(cfg, params, prompt_len, new_tokens, lengths)
                seconds[SCHEDULE_CEILING] = sc["ideal_s"]
                print(f"schedule ceiling ({name}, {b} rows): static-batch ms per decode step at position n/4 by rows "
                      + ", ".join(f"{w}: {ms:.2f}" for w, ms in sc["step_ms"].items())
                      + f"; every step at its live rows {sc['ideal_s']:.2f} s, at the pool's widths "
                        f"{sc['pool_s']:.2f} s (decode only; MEASURED step costs, the schedules computed)")
            group_rows = []
            for impl, s in seconds.items():
                made = sides[impl][1]["lengths"] if impl in sides else lengths
                row = dict(preset=name, dtype=dtype, workload=workload, batch=b, group=g, prompt_len=prompt_len,
                           new_tokens=new_tokens, impl=impl, seconds=s, tokens_per_s=int(np.sum(made)) / s,
                           **workloads.length_quantiles(made, new_tokens))
                if workload == "fixed" and impl == ATTENTION_ONLY:
                    row |= dict(ms_per_step=1e3 * s / new_tokens)
                elif workload == "fixed":
                    peak = floor_flops / seconds[MATMULS_ONLY]
                    f = floor_flops if impl in (MATMULS_ONLY, MATMULS_ATTENTION) else flops.decode_flops(
                        cfg, b // g, g, prompt_len, new_tokens)
                    row |= dict(ms_per_step=1e3 * s / new_tokens, model_gflops=f / 1e9, gflops_per_s=f / s / 1e9,
                                frac_of_peak=f / s / peak)
                group_rows.append(row)
            ours, theirs = group_rows[0], group_rows[1]
            if workload == "fixed":  # our fraction of the ceiling that counts the attention
                ceiling = next(r for r in group_rows if r["impl"] == MATMULS_ATTENTION)
                ours["frac_of_matmuls_attention"] = ours["frac_of_peak"] / ceiling["frac_of_peak"]
            ours["programs_compiled"] = compiled
            ours["loops_per_step"] = sides["sage_jax"][1]["loops_per_step"]
            ours["compiled_runs"] = sum(c > 0 for c in per_run["sage_jax"])
            ours[f"vs_{peer}"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
            rows += group_rows
    _print_sampler_table(rows)
    print(f"sampler programs compiled in this run: {sampler_lib.compile_count()}; 1-min load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)")
    return rows


def _peer_generate_fn(peer: str, cfg, params, model_dir: str, dtype: str, prompts_NxT: np.ndarray, new_tokens: int,
                      threads: int | None, lengths_N: np.ndarray | None) -> tuple[Callable[[], None], dict]:
    """The peer's (run, realised): transformers' generate from model_dir, or tunix's Sampler on params."""
    if peer == "tunix":
        from sage_jax.bench import tunix_peer
        return tunix_peer.sampler_fn(cfg, params, prompts_NxT, new_tokens, lengths_N, HF_EOS)
    return _hf_generate_fn(model_dir, dtype, prompts_NxT, new_tokens, threads, lengths_N)


def _print_sampler_table(rows: list[dict]) -> None:
    print()
    print_table(rows, [
        ("preset", ""), ("dtype", ""), ("workload", ""), ("batch", "d"), ("group", "d"), ("impl", ""),
        ("tokens", "d"), ("len_p10", ".0f"), ("len_p50", ".0f"), ("len_p90", ".0f"), ("len_max", "d"),
        ("frac_at_max", ".3f"), ("tokens_per_s", ".1f"), ("ms_per_step", ".2f"), ("seconds", ".3f"),
        ("gflops_per_s", ".1f"), ("frac_of_peak", ".2f"), ("frac_of_matmuls_attention", ".2f"),
        ("vs_transformers", ".2f"), ("vs_tunix", ".2f"), ("compiled_runs", "d"), ("loops_per_step", ".2f")])
    print(f"(loops_per_step: the program's data-dependent loop iterations per decode step; "
          f"tokens: generated before EOS by each side, with their length quantiles; model FLOPs as sage_jax computes "
          f"them; peak = the '{MATMULS_ONLY}' row: the same weights' matmuls and nothing else, timed in the same loop; "
          f"'{ATTENTION_ONLY}': the decode steps' cache attention and nothing else; '{MATMULS_ATTENTION}': the two "
          "added, a decode step's floor once its attention is counted; frac_of_matmuls_attention: ours against it)")
    peer = "tunix" if any(r["impl"] == "tunix" for r in rows) else "transformers"
    print(f"\nratio sage_jax / {peer} tokens/s (and the matmuls-only ceiling / {peer}):")
    by_key: dict[tuple, dict[str, float]] = {}
    for r in rows:
        by_key.setdefault((r["preset"], r["dtype"], r["workload"], r["batch"]), {})[r["impl"]] = r["tokens_per_s"]
    for (preset, dtype, workload, batch), v in by_key.items():
        ceiling = f" (ceiling {v[MATMULS_ONLY] / v[peer]:.2f}x)" if MATMULS_ONLY in v else ""
        if SCHEDULE_CEILING in v:
            ceiling = f" (every step at its live rows: {v[SCHEDULE_CEILING] / v[peer]:.2f}x)"
        print(f"  {preset:8} {dtype:5} {workload:8} batch {batch:>3}: {v['sage_jax'] / v[peer]:.2f}x"
              + ceiling)


def sampler_mode(args) -> list[dict]:
    if args.peer == "tunix":
        from sage_jax.bench import tunix_peer
        tunix_peer.require_tunix()
    presets = ("tiny", "small") if args.preset == "both" else (args.preset,)
    longtail = args.workload == "longtail"
    new_tokens = args.new_tokens or (512 if longtail else 128)
    group = args.group or (8 if longtail else 1)
    return bench_sampler(presets, args.dtype, args.batch, args.prompt_len, new_tokens, args.repeats,
                         hf_threads=args.hf_threads, workload=args.workload, group=group,
                         slots=tuple(int(n) for n in args.slots.split(",") if n), model_dir=args.model,
                         ceiling=args.schedule_ceiling, peer=args.peer)
