"""The phase model (phase_model.py) checked where it can be measured, and its placement predictions.

    python -m sage_jax.plan --chip cpu [--presets tiny,small] [--workloads fixed,longtail] [--json FILE]

measures this machine's matmul peak and memory bandwidth, then times the RL-step benchmark's steps
(bench/rl_step.py: trainer.rl_step with forced lengths, no TRL) and prints the PREDICTED and MEASURED seconds of each
phase side by side. The TPU plan (`--compiler tpu`) adds the placement PREDICTION (format_placements).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Sequence

import numpy as np

from sage_jax.plan import phase_model


def measure_machine(repeats: int = 5) -> phase_model.Machine:
    """This machine's fp32 matmul peak (bench.common.matmul_peak_fn) and memory bandwidth (a jitted elementwise
    pass over 256 MiB: read once, written once), best of `repeats`; XLA:CPU's ops run one after another, so its
    compute and memory seconds add (Machine.overlap False)."""
    import jax
    import jax.numpy as jnp
    from sage_jax.bench import common
    peak_fn, peak_flops = common.matmul_peak_fn("fp32")
    x = jnp.ones((64 * 2 ** 20,), jnp.float32)
    read = jax.jit(jnp.sum)  # reads every byte once, writes nothing (no fresh pages to fault in)
    best = lambda fn: min(_seconds(fn) for _ in range(repeats))
    jax.block_until_ready((peak_fn(), read(x)))
    return phase_model.Machine(flops_per_s=peak_flops / best(peak_fn), bytes_per_s=x.nbytes / best(lambda: read(x)),
                               name=f"cpu ({jax.devices()[0].device_kind}, {jax.device_count()} device)",
                               overlap=False)


def _rates(fn, args, flops: float, repeats: int, backward: bool = True) -> tuple[float, float]:
    """(FLOP/s of fn(*args), of its forward + backward: jax.vjp against a random cotangent, 3 x the FLOPs; 0.0
    without `backward`)."""
    import jax
    jitted = jax.jit(fn)
    out = jax.block_until_ready(jitted(*args))
    # one call per timing: independent calls dispatched together run side by side on XLA:CPU's cores, which
    # would count one core's single-threaded small matmuls as if they had the machine to themselves
    best = lambda f: min(_seconds(f) for _ in range(repeats))
    if not backward:
        return flops / best(lambda: jitted(*args)), 0.0
    dy = jax.tree.map(lambda o: jax.random.normal(jax.random.key(2), o.shape, o.dtype), out)
    def both(args, dy):  # the primal output too: a linear fn's backward needs none of it, and XLA would drop it
        out, pullback = jax.vjp(fn, *args)
        return out, pullback(dy)
    both = jax.jit(both)
    jax.block_until_ready(both(args, dy))
    return flops / best(lambda: jitted(*args)), 3 * flops / best(lambda: both(args, dy))


def shaped_rates(cfg, rows: int, logit_rows: int, attn_rows: int, attn_len: int, repeats: int = 7,
                 update: bool = True) -> dict[str, float]:
    """FLOP/s of this machine at a model's own shapes (small matmuls run far below the 2048^3 peak on a CPU), by
    phase_model.forward_flops kind: "dense", one layer's seven matmuls at [rows, hidden] (distinct weights: one
    scaled weight would let XLA factor the scale out); "unembed", [logit_rows, hidden] @ [hidden, vocab];
    "attention", attention as attention.naive runs it (scores, mask, softmax, mixing) over attn_rows rows of
    attn_len positions; "pointwise", one layer's non-matmul work at `rows` positions (norms, residuals, RoPE, the
    gated product) in ELEMENTS/s (phase_model.pointwise_elements); and each kind's forward + backward, "KIND_update"
    (update: False leaves them 0)."""
    import jax
    import jax.numpy as jnp
    from sage_jax.models import decoder as model
    from sage_jax.models import rope as rope_lib
    D, I, V, H = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    N, K = cfg.num_heads, cfg.num_kv_heads
    key = iter(jax.random.split(jax.random.key(0), 32))
    normal = lambda *shape: jax.random.normal(next(key), shape, jnp.float32)
    shapes = [(D, N * H), (D, K * H), (D, K * H), (N * H, D), (D, I), (D, I), (I, D)]
    ws = [normal(i, o) for i, o in shapes]
    x, xi = normal(rows, D), normal(rows, I)
    dense = lambda x, xi, ws: [(xi if w.shape[0] == I else x) @ w for w in ws]
    kinds = {"dense": (dense, (x, xi, ws), sum(2.0 * rows * i * o for i, o in shapes)),
             "unembed": (lambda x, w: x @ w, (normal(logit_rows, D), normal(D, V)), 2.0 * logit_rows * D * V)}
    q, k, v = normal(attn_rows, K, N // K * attn_len, H), normal(attn_rows, K, attn_len, H), normal(attn_rows, K,
                                                                                                    attn_len, H)
    causal = jnp.tile(jnp.tril(jnp.ones((attn_len, attn_len), bool)), (N // K, 1))

    def attend(q, k, v):
        scores = jnp.where(causal, jnp.einsum("bkqh,bksh->bkqs", q, k) / H ** 0.5, -1e30)
        return jnp.einsum("bkqs,bksh->bkqh", jax.nn.softmax(scores, axis=-1), v)
    kinds["attention"] = (attend, (q, k, v), 4.0 * attn_rows * N * attn_len * attn_len * H)
    # the layer's non-matmul work (phase_model.pointwise_elements, one layer at `rows` positions), in elements/s
    pos = jnp.arange(rows) % 256
    inv_freq, scale = model.rope_frequencies(cfg)
    norm_w = normal(D)

    def pointwise(x, a, m, q, k, gate, up):
        rope = lambda t: rope_lib.apply(t[None], pos[None], inv_freq, scale)[0]
        x2 = x + a
        return (model.rms_norm(x, norm_w, cfg.rms_norm_eps), rope(q), rope(k), model.rms_norm(x2, norm_w,
                cfg.rms_norm_eps), jax.nn.silu(gate) * up, x2 + m)
    pw_args = (x, normal(rows, D), normal(rows, D), normal(rows, N, H), normal(rows, K, H), xi, normal(rows, I))
    kinds["pointwise"] = (pointwise, pw_args, float(phase_model.pointwise_elements(cfg.replace(
        num_layers=1, qkv_bias=False, qk_norm=False), rows, 0)))
    out = {}
    for kind, (fn, args, flops) in kinds.items():
        out[kind], out[f"{kind}_update"] = _rates(fn, args, flops, repeats, backward=update)
    return out


def _seconds(fn) -> float:
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


PHASES = ("generate_s", "ref_s", "update_s")


def decode_overhead(cfg, params, machine: phase_model.Machine, rows: Sequence[int] = (4, 16, 32), short: int = 32,
                    long: int = 96) -> tuple[float, float, dict]:
    """(fixed seconds per decode step, seconds per row it computes) beyond the roofline, measured on
    sampler.generate alone: at each row count, `rows` rows to `long` and to `short` tokens, the difference per step
    less the roofline's step at those rows (at the matmul rate measured at them); a least-squares line through
    them."""
    import numpy as np
    from sage_jax.sampling import sampler
    measured, model = [], []
    for r in rows:
        prompts = [[2 + i for i in range(16)]] * r

        def seconds(n):
            gen = lambda: sampler.generate(cfg, params, prompts, n, eos_ids=(), seed=0)
            _seconds(gen)  # compiles
            return min(_seconds(gen) for _ in range(3))
        measured.append((seconds(long) - seconds(short)) / (long - short))
        at_rows = dataclasses.replace(machine, flops_per_s=_decode_rate(cfg, shaped_rates(cfg, r, r, 1, 16,
                                                                                           update=False)))
        model.append(phase_model.generation(cfg, r, 16, np.full(r, long), at_rows)["decode_s"] / (long - 1))
    per_row, fixed = np.polyfit(np.asarray(rows, float), np.subtract(measured, model), 1)
    return max(0.0, float(fixed)), max(0.0, float(per_row)), {"rows": list(rows), "measured_step_s": measured,
                                                              "roofline_step_s": model}


def layer_seconds(cfg, params, prompt_len: int, lengths, repeats: int = 3) -> dict[str, float]:
    """MEASURED seconds of the decoder layers alone (model.hidden, no unembedding or loss) on the trainer's loss
    layout for these lengths (rollouts.build_batch, packed): forward, and forward + backward (jax.vjp): what of
    the reference pass and the update the layers take, to set beside the matmul kinds' predicted seconds."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from sage_jax.models import decoder as model
    from sage_jax.training import rollouts
    N, C = len(lengths), int(max(lengths))
    rng = np.random.default_rng(0)
    ro = dict(prompt_tokens=rng.integers(2, cfg.vocab_size, (N, prompt_len)), prompt_mask=np.ones((N, prompt_len)),
              tokens=rng.integers(2, cfg.vocab_size, (N, C)), lengths=np.asarray(lengths), finished=lengths < C,
              sampler_logp=np.zeros((N, C), np.float32))
    batch = rollouts.build_batch(ro, np.zeros(N, np.float32), 0, C, packed=True, slices=[1])
    if "segment_ids" in batch:
        args = tuple(jnp.asarray(batch[k]).reshape(-1, batch[k].shape[-1]) for k in ("tokens", "positions",
                                                                                    "segment_ids"))
        fwd = lambda p, t, pos, seg: model.hidden(cfg, p, t, pos, segment_ids_BxT=seg)
    else:
        args = (jnp.asarray(batch["tokens"]), jnp.asarray(batch["mask"]))
        fwd = lambda p, t, mask: model.hidden(cfg, p, t, mask_BxT=mask)
    f = jax.jit(fwd)
    dy = jax.random.normal(jax.random.key(3), jax.eval_shape(fwd, params, *args).shape, jnp.float32)
    def both(p, dy, *a):
        out, pullback = jax.vjp(lambda p: fwd(p, *a), p)
        return out, pullback(dy)
    both = jax.jit(both)
    jax.block_until_ready((f(params, *args), both(params, dy, *args)))
    best = lambda g: min(_seconds(g) for _ in range(repeats))
    return {"layers_fwd_s": best(lambda: f(params, *args)), "layers_fwd_bwd_s": best(lambda: both(params, dy, *args))}


def _decode_rate(cfg, rates: dict[str, float]) -> float:
    """One FLOP/s for a decode step's matmuls: the dense and unembedding rates at its rows, weighted by FLOPs."""
    from sage_jax.bench import flops as bench_flops
    dense, unembed = 2.0 * bench_flops.layer_params(cfg), 2.0 * cfg.hidden_size * cfg.vocab_size
    return (dense + unembed) / (dense / rates["dense"] + unembed / rates["unembed"])


def validate(presets: Sequence[str], workloads: Sequence[str], prompts: int, group: int, prompt_len: int,
             new_tokens: int, repeats: int) -> tuple[phase_model.Machine, list[dict]]:
    """Per preset and workload: the measured phases of the RL-step benchmark's steps beside phase_model's
    PREDICTION from rates measured in the same run (the reference phase without the host's batch building:
    time/ref_s + time/old_s; time/batch_s is reported beside it)."""
    import numpy as np
    from sage_jax.models import attention
    from sage_jax.bench import workloads as wl
    from sage_jax.bench import common, rl_step
    machine = measure_machine()
    rows = []
    for preset in presets:
        cfg = common.preset_config(preset, "fp32")
        params = common.init_params(cfg, 0)
        fixed, per_row, calib = decode_overhead(cfg, params, machine)
        at = dataclasses.replace(machine, decode_step_s=fixed, decode_row_s=per_row)
        prompts_BxP = np.random.default_rng(0).integers(2, cfg.vocab_size, (prompts, prompt_len))
        for workload in workloads:
            lengths = wl.workload_lengths(workload, prompts * group, new_tokens, 0)
            run = rl_step.sage_rl_runner(preset, "fp32", params, prompts_BxP, group, lengths, beta=0.05)
            run()  # compiles
            measured = [run() for _ in range(repeats)]
            for m in measured:
                m["ref_s"] -= m["batch_s"]
            lay = phase_model.loss_layout(prompt_len, lengths, True, 1, attention.AUTO_NAIVE_MAX_LEN)
            rates = shaped_rates(cfg, min(int(lay["positions"]), 8192), min(int(lay["logit_positions"]), 8192),
                                 max(1, min(64, int(lay["positions"] // lay["row_len"]))), int(lay["row_len"]))
            decode = shaped_rates(cfg, len(lengths), len(lengths), 1, 16, update=False)
            rates["decode"] = _decode_rate(cfg, decode)
            predicted = phase_model.predict_phases(cfg, prompts, prompt_len, lengths, at, rates=rates,
                                                   dense_attention_max=attention.AUTO_NAIVE_MAX_LEN)
            row = {"preset": preset, "workload": workload, "decode_step_ms": fixed * 1e3,
                   "decode_row_ms": per_row * 1e3, "decode_calibration": calib, "layout": lay,
                   **{f"{k}_gflops_per_s": v / 1e9 for k, v in rates.items()}}
            for phase in PHASES:
                row[f"pred_{phase}"] = predicted[phase]
                row[f"meas_{phase}"] = statistics.median(m[phase] for m in measured)
                row[f"ratio_{phase}"] = row[f"pred_{phase}"] / row[f"meas_{phase}"]
            row["meas_batch_s"] = statistics.median(m["batch_s"] for m in measured)
            # the layers alone, measured, beside the predicted seconds of their matmuls (dense + attention)
            row.update(layer_seconds(cfg, params, prompt_len, lengths))
            f = phase_model.forward_flops(cfg, lay["positions"], lay["logit_positions"], lay["keys"])
            layers_pw = phase_model.pointwise_elements(cfg, lay["positions"], 0)
            row["pred_layers_fwd_s"] = f["dense"] / rates["dense"] + f["attention"] / rates["attention"] \
                + layers_pw / rates["pointwise"]
            row["steps"] = measured
            rows.append(row)
    return machine, rows


def format_validation(machine: phase_model.Machine, rows: list[dict]) -> str:
    lines = [f"{machine.name}: matmul peak {machine.flops_per_s / 1e9:.1f} GFLOP/s, memory {machine.bytes_per_s / 1e9:.1f}"
             " GB/s (MEASURED in this run)",
             f"{'preset':7}{'workload':>10}" + "".join(f"{p[:-2] + ' pred':>15}{'meas':>9}{'p/m':>6}" for p in PHASES)]
    for r in rows:
        lines.append(f"{r['preset']:7}{r['workload']:>10}" + "".join(
            f"{r[f'pred_{p}']:>15.3f}{r[f'meas_{p}']:>9.3f}{r[f'ratio_{p}']:>6.2f}" for p in PHASES)
            + f"   (host batch {r['meas_batch_s']:.3f} s; GFLOP/s at the model's shapes: dense "
              f"{r['dense_gflops_per_s']:.1f}, attention {r['attention_gflops_per_s']:.1f}, unembed "
              f"{r['unembed_gflops_per_s']:.1f}, decode {r['decode_gflops_per_s']:.1f}; forward + backward: "
              f"dense {r['dense_update_gflops_per_s']:.1f}, attention {r['attention_update_gflops_per_s']:.1f}, "
              f"unembed {r['unembed_update_gflops_per_s']:.1f}; pointwise {r['pointwise_gflops_per_s']:.2f} G "
              f"elements/s (forward + backward {r['pointwise_update_gflops_per_s']:.2f}); decode step "
              f"+{r['decode_step_ms']:.2f} ms +{r['decode_row_ms']:.3f} ms/row; the layers alone MEASURED "
              f"{r['layers_fwd_s']:.3f} s forward (PREDICTED {r['pred_layers_fwd_s']:.3f} s: matmuls and pointwise), "
              f"{r['layers_fwd_bwd_s']:.3f} s forward + backward)")
    lines.append("pred: PREDICTION (phase_model), meas: MEASURED median seconds, p/m: their ratio (target 0.75-1.25)")
    return "\n".join(lines)


def cpu_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m sage_jax.plan --chip cpu")
    parser.add_argument("--chip", choices=("cpu",), required=True)
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--workloads", default="fixed,longtail")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    machine, rows = validate(args.presets.split(","), args.workloads.split(","), args.prompts, args.group,
                             args.prompt_len, args.new_tokens, args.repeats)
    print(format_validation(machine, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": dataclasses.asdict(machine),
                       "rows": rows, "args": vars(args)}, f)
            f.write("\n")
    return 0


# --------------------------------------------------------------------------------------------------- placements

# Host seconds per rollout per reward worker: the math verifier in the worker pool on MATH solutions, MEASURED here
# (0.38 ms, docs/PERFORMANCE.md "Off-policy steps"), scaled by rows / train.reward_workers; text decoding not counted
HOST_S_PER_ROLLOUT = 0.0004
# Per chip across the cut between the rollout and training sub-meshes: an ASSUMPTION (v5p's ICI is 4,800 Gbps = 600
# GB/s per chip over all its links, https://cloud.google.com/tpu/docs/v5p; a sixth of it crosses a cut)
LINK_BYTES_PER_S = 100e9


def placements_for(config, cfg, chip: str, chips: int, host_s: float | None = None, seed: int = 0,
                   stages: bool = True, every_split: bool = False) -> list[dict]:
    """k = 0 / k = 1 colocated / k = 1 split (n = a quarter, half and three quarters of the chips; every_split:
    every n that the tensor axis divides) for config's rollout shape with long-tailed completion lengths
    (workloads.longtail_lengths), on `chips` TPU chips."""
    from sage_jax.plan import roofline
    from sage_jax.bench import workloads as wl
    c, ro = roofline.CHIPS[chip], config.rollout
    machine = phase_model.Machine(c.bf16_flops, c.hbm_bytes_per_s, chip, LINK_BYTES_PER_S)
    lengths = wl.longtail_lengths(ro.prompts_per_step * ro.group_size, ro.max_new_tokens, seed)
    if host_s is None:
        host_s = HOST_S_PER_ROLLOUT * len(lengths) / max(1, config.train.reward_workers)
    tensor = int(config.mesh.shape[2]) if int(config.mesh.shape[2]) > 0 else 1
    splits = range(tensor, chips, tensor) if every_split else (chips // 4, chips // 2, 3 * chips // 4)
    splits = [n for n in splits if n % tensor == 0 and 0 < n < chips]  # one chip: no split placement
    # partial rollouts priced on a stream of such batches (rollout.oversample and max_lag as configured)
    stream = np.concatenate([wl.longtail_lengths(len(lengths), ro.max_new_tokens, seed + c) for c in range(40)])
    return phase_model.placements(cfg, ro.prompts_per_step, config.data.max_prompt_len, lengths, machine, chips, tensor,
                                  host_s, splits, packed=config.train.packing, stages=stages,
                                  max_new_tokens=ro.max_new_tokens,
                                  partial=(ro.get("oversample", 1.5), ro.get("max_lag", 4), stream),
                                  group=ro.group_size)


def format_placements(rows: list[dict], chip: str, chips: int) -> str:
    lines = [f"PREDICTION (not a measurement): RL step by placement on {chips} {chip} chips, long-tailed lengths, "
             "decode steps at their live rows (weights + live KV cache read per step), weight copy counted",
             f"  {'placement':22}{'n':>4}{'generate':>10}{'(tail)':>9}{'train':>9}{'sync':>8}{'host':>8}{'step':>9}"
             f"{'tokens/s':>11}{'vs k=0':>8}"]
    for r in rows:
        lines.append(f"  {r['placement']:22}{r['n']:>4}{r['generate_s']:>9.1f}s{r['tail_s']:>8.1f}s{r['train_s']:>8.1f}s"
                     f"{r['sync_s']:>7.3f}s{r['host_s']:>7.1f}s{r['step_s']:>8.1f}s{r['tokens_per_s']:>11,.0f}"
                     f"{r['vs_on_policy']:>8.2f}")
    part = [r for r in rows if r["placement"].startswith("partial")]
    if part:
        lines.append(f"  partial rollouts: steady state of phase_model.partial_schedule (tokens/s: tokens trained); "
                     f"mean token lag {part[0]['token_lag']:.2f} (k=0) / {part[-1]['token_lag']:.2f} (k=1) versions, "
                     f"of which the carried rows' prefill {part[0]['prefill_s']:.1f}s per step")
    return "\n".join(lines)

