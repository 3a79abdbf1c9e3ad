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

from sage_jax import phase_model


def measure_machine(repeats: int = 5) -> phase_model.Machine:
    """This machine's fp32 matmul peak (bench.common.matmul_peak_fn) and memory bandwidth (a jitted elementwise
    pass over 256 MiB: read once, written once), best of `repeats`."""
    import jax
    import jax.numpy as jnp
    from sage_jax.bench import common
    peak_fn, peak_flops = common.matmul_peak_fn("fp32")
    x = jnp.ones((64 * 2 ** 20,), jnp.float32)
    read = jax.jit(jnp.sum)  # reads every byte once, writes nothing (no fresh pages to fault in)
    best = lambda fn: min(_seconds(fn) for _ in range(repeats))
    jax.block_until_ready((peak_fn(), read(x)))
    return phase_model.Machine(flops_per_s=peak_flops / best(peak_fn), bytes_per_s=x.nbytes / best(lambda: read(x)),
                               name=f"cpu ({jax.devices()[0].device_kind}, {jax.device_count()} device)")


def shaped_rate(rows: int, cfg, repeats: int = 5) -> float:
    """FLOP/s of this machine's matmul at a model's own shape, [rows, hidden] @ [hidden, intermediate] (small
    matmuls run far below the 2048^3 peak on a CPU)."""
    import jax
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (rows, cfg.hidden_size), jnp.float32)
    # eight distinct weights (one scaled weight would let XLA factor the scale out and run one matmul)
    b = jax.random.normal(jax.random.key(1), (8, cfg.hidden_size, cfg.intermediate_size), jnp.float32)
    mm = jax.jit(lambda a, b: [a @ b[i] for i in range(8)])
    jax.block_until_ready(mm(a, b))
    return 8 * 2.0 * rows * cfg.hidden_size * cfg.intermediate_size / min(_seconds(lambda: mm(a, b))
                                                                          for _ in range(repeats))


def _seconds(fn) -> float:
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


PHASES = ("generate_s", "ref_s", "update_s")


def decode_step_overhead(cfg, params, machine: phase_model.Machine, rows: int = 4, short: int = 32,
                         long: int = 96) -> float:
    """The decode step's fixed cost beyond its roofline, measured: sampler.generate of `rows` rows (one decode
    bucket) to `long` and to `short` tokens, the difference per step, less the roofline's step at those rows."""
    import numpy as np
    from sage_jax import sampler
    prompts = [[2 + i for i in range(16)]] * rows

    def seconds(n):
        gen = lambda: sampler.generate(cfg, params, prompts, n, eos_ids=(), seed=0)
        _seconds(gen)  # compiles
        return min(_seconds(gen) for _ in range(3))
    per_step = (seconds(long) - seconds(short)) / (long - short)
    lengths = np.full(rows, long)
    model = phase_model.generation(cfg, rows, 16, lengths, machine)["decode_s"] / (long - 1)
    return max(0.0, per_step - model)


def validate(presets: Sequence[str], workloads: Sequence[str], prompts: int, group: int, prompt_len: int,
             new_tokens: int, repeats: int) -> tuple[phase_model.Machine, list[dict]]:
    import numpy as np
    from sage_jax import workloads as wl
    from sage_jax.bench import common, rl_step
    machine = measure_machine()
    rows = []
    for preset in presets:
        cfg = common.preset_config(preset, "fp32")
        params = common.init_params(cfg, 0)
        at = dataclasses.replace(machine, decode_step_s=decode_step_overhead(cfg, params, machine))
        prompts_BxP = np.random.default_rng(0).integers(2, cfg.vocab_size, (prompts, prompt_len))
        for workload in workloads:
            lengths = wl.workload_lengths(workload, prompts * group, new_tokens, 0)
            run = rl_step.sage_rl_runner(preset, "fp32", params, prompts_BxP, group, lengths, beta=0.05)
            run()  # compiles
            measured = [run() for _ in range(repeats)]
            tokens = int(phase_model.step_tokens(prompt_len, lengths, True)[0])
            shaped = {"train": shaped_rate(min(tokens, 8192), cfg), "decode": shaped_rate(prompts * group, cfg)}
            predicted = phase_model.predict_phases(cfg, prompts, prompt_len, lengths, at, shaped=shaped)
            row = {"preset": preset, "workload": workload, "decode_step_ms": at.decode_step_s * 1e3,
                   "train_gflops_per_s": shaped["train"] / 1e9,
                   "decode_gflops_per_s": shaped["decode"] / 1e9}
            for phase in PHASES:
                row[f"pred_{phase}"] = predicted[phase]
                row[f"meas_{phase}"] = statistics.median(m[phase] for m in measured)
                row[f"ratio_{phase}"] = row[f"pred_{phase}"] / row[f"meas_{phase}"]
            rows.append(row)
    return machine, rows


def format_validation(machine: phase_model.Machine, rows: list[dict]) -> str:
    lines = [f"{machine.name}: matmul peak {machine.flops_per_s / 1e9:.1f} GFLOP/s, memory {machine.bytes_per_s / 1e9:.1f}"
             " GB/s (MEASURED in this run)",
             f"{'preset':7}{'workload':>10}" + "".join(f"{p[:-2] + ' pred':>15}{'meas':>9}{'p/m':>6}" for p in PHASES)]
    for r in rows:
        lines.append(f"{r['preset']:7}{r['workload']:>10}" + "".join(
            f"{r[f'pred_{p}']:>15.3f}{r[f'meas_{p}']:>9.3f}{r[f'ratio_{p}']:>6.2f}" for p in PHASES)
            + f"   (matmul at the model's shapes: {r['train_gflops_per_s']:.1f} GFLOP/s training, "
              f"{r['decode_gflops_per_s']:.1f} decoding; decode step's fixed cost {r['decode_step_ms']:.2f} ms)")
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


def placements_for(config, cfg, chip: str, chips: int, host_s: float | None = None, seed: int = 0) -> list[dict]:
    """k = 0 / k = 1 colocated / k = 1 split (n = a quarter, half and three quarters of the chips) for config's
    rollout shape with long-tailed completion lengths (workloads.longtail_lengths), on `chips` TPU chips."""
    from sage_jax import roofline
    from sage_jax import workloads as wl
    c, ro = roofline.CHIPS[chip], config.rollout
    machine = phase_model.Machine(c.bf16_flops, c.hbm_bytes_per_s, chip, LINK_BYTES_PER_S)
    lengths = wl.longtail_lengths(ro.prompts_per_step * ro.group_size, ro.max_new_tokens, seed)
    if host_s is None:
        host_s = HOST_S_PER_ROLLOUT * len(lengths) / max(1, config.train.reward_workers)
    tensor = int(config.mesh.shape[2]) if int(config.mesh.shape[2]) > 0 else 1
    splits = [n for n in (chips // 4, chips // 2, 3 * chips // 4) if n % tensor == 0]
    return phase_model.placements(cfg, ro.prompts_per_step, config.data.max_prompt_len, lengths, machine, chips, tensor,
                                  host_s, splits, packed=config.train.packing)


def format_placements(rows: list[dict], chip: str, chips: int) -> str:
    lines = [f"PREDICTION (not a measurement): RL step by placement on {chips} {chip} chips, long-tailed lengths, "
             "decode steps at their live rows (weights + live KV cache read per step), weight copy counted",
             f"  {'placement':22}{'n':>4}{'generate':>10}{'(tail)':>9}{'train':>9}{'sync':>8}{'host':>8}{'step':>9}"
             f"{'tokens/s':>11}{'vs k=0':>8}"]
    for r in rows:
        lines.append(f"  {r['placement']:22}{r['n']:>4}{r['generate_s']:>9.1f}s{r['tail_s']:>8.1f}s{r['train_s']:>8.1f}s"
                     f"{r['sync_s']:>7.3f}s{r['host_s']:>7.1f}s{r['step_s']:>8.1f}s{r['tokens_per_s']:>11,.0f}"
                     f"{r['vs_on_policy']:>8.2f}")
    return "\n".join(lines)

