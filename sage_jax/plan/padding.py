"""Padded fraction of a config's loss batch, padded vs packed, from completion lengths alone (no model, no devices).

    python -m sage_jax.plan.padding --config configs/r1distill7b_branch.py --devices 64 --workload longtail

Builds the step's loss batch the way trainer.rl_step does (rollouts.build_batch with the slices of the config's mesh
data axes x optim.grad_accum x optim.mini_batches) for one step of `rollout.prompts_per_step` x `group_size` rows
whose completion lengths are a benchmark workload (workloads.py; longtail with median --median-frac of the max) and
whose prompts all hold --prompt-len tokens, and prints the share of computed positions that hold no token in each
layout. --steps K > 1: K steps whose lengths are random draws from the long-tail law (exponential, capped at the
max), as a run's steps vary: the packed fraction's mean and max and the distinct packed shapes (one compiled
program each).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import numpy as np

from sage_jax.bench import workloads
from sage_jax.models import sharding
from sage_jax.rl import packing
from sage_jax.run import cli
from sage_jax.training import rollouts
from sage_jax.run import config as config_lib


def step_lengths(workload: str, rows: int, max_new_tokens: int, seed: int, median_frac: float = 0.2,
                 draw: bool = False) -> np.ndarray:
    """int [rows] completion lengths: the workload's (longtail: its quantiles at median_frac), or with draw random
    draws from the same capped exponential law."""
    if draw:
        scale = median_frac * max_new_tokens / np.log(2)
        drawn = np.ceil(np.random.default_rng(seed).exponential(scale, rows))
        return np.clip(drawn, 1, max_new_tokens).astype(np.int32)
    if workload == "longtail":
        return workloads.longtail_lengths(rows, max_new_tokens, seed, median_frac)
    return workloads.workload_lengths(workload, rows, max_new_tokens, seed)


def report(config, devices: int, workload: str = "longtail", prompt_len: int = 256, seed: int = 0,
           median_frac: float = 0.2, draw: bool = False) -> dict[str, Any]:
    """{rows, slices, padded_shape, packed_shape, padded_frac_padded, padded_frac_packed, length quantiles} of one
    step of `config` on `devices` devices (lengths: step_lengths)."""
    ro_cfg, optim = config.rollout, config.optim
    data, fsdp, _ = sharding.resolve_mesh_shape(tuple(config.mesh.shape), devices)
    G, C = ro_cfg.group_size, ro_cfg.max_new_tokens
    N = ro_cfg.prompts_per_step * G
    if not 1 <= prompt_len <= config.data.max_prompt_len:
        raise ValueError(f"--prompt-len {prompt_len}: choose 1..data.max_prompt_len ({config.data.max_prompt_len})")
    lengths = step_lengths(workload, N, C, seed, median_frac, draw)
    ro = {"prompt_tokens": np.ones((N, prompt_len), np.int32), "prompt_mask": np.ones((N, prompt_len), bool),
          "tokens": np.ones((N, C), np.int32), "lengths": lengths, "finished": lengths < C,
          "sampler_logp": np.zeros((N, C), np.float32)}
    slices = packing.slice_options(N, G, data * fsdp, optim.grad_accum, optim.mini_batches)
    groups = rollouts.mini_batch_rows(N, optim.mini_batches, G, 0) if optim.mini_batches > 1 else None
    adv = np.zeros(N, np.float32)
    padded = rollouts.build_batch(ro, adv, 0, C)
    packed = rollouts.build_batch(ro, adv, 0, C, packed=True, slices=slices, row_groups=groups)
    return dict(rows=N, data_parallel=data * fsdp, grad_accum=optim.grad_accum, mini_batches=optim.mini_batches,
                slices=packed["tokens"].shape[0] if packing.is_packed(packed) else slices[-1],
                micro_batches=packing.micro_batches(packed, data * fsdp * optim.mini_batches, optim.grad_accum),
                padded_shape=list(padded["tokens"].shape), packed_shape=list(packed["tokens"].shape),
                padded_frac_padded=packing.padded_fraction(padded), padded_frac_packed=packing.padded_fraction(packed),
                **workloads.length_quantiles(lengths, C))


def format_report(r: dict[str, Any]) -> str:
    shape = lambda s: " x ".join(str(x) for x in s)
    return "\n".join([
        f"{r['rows']} rows; completions p10 {r['len_p10']:.0f}, p50 {r['len_p50']:.0f}, p90 {r['len_p90']:.0f}, "
        f"max {r['len_max']}, {100 * r['frac_at_max']:.1f}% at the max",
        f"{r['slices']} slices = data-parallel {r['data_parallel']} x {r['micro_batches']} micro-batches (grad_accum "
        f"{r['grad_accum']}) x mini_batches {r['mini_batches']}",
        f"padded  [{shape(r['padded_shape'])}]  padded fraction {100 * r['padded_frac_padded']:.1f}%",
        f"packed  [{shape(r['packed_shape'])}]  padded fraction {100 * r['padded_frac_packed']:.1f}%"])


def main(argv: Sequence[str] | None = None) -> int:
    overrides, rest = config_lib.split_config_flags(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(prog="python -m sage_jax.plan.padding", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="configs/NAME.py[:arg]")
    parser.add_argument("--devices", type=int, required=True, help="devices (chips) the config's mesh spans")
    parser.add_argument("--workload", choices=workloads.WORKLOADS, default="longtail")
    parser.add_argument("--prompt-len", type=int, default=256, help="real tokens of every prompt")
    parser.add_argument("--median-frac", type=float, default=0.2, help="longtail: median length / max")
    parser.add_argument("--seed", type=int, default=0, help="which row gets which workload length")
    parser.add_argument("--steps", type=int, default=1, help="K > 1: K steps of random long-tail draws")
    args = parser.parse_args(rest)
    config = config_lib.validate(config_lib.load(args.config, overrides))
    run = lambda seed, draw: report(config, args.devices, args.workload, args.prompt_len, seed, args.median_frac, draw)
    print(format_report(run(args.seed, False)))
    if args.steps > 1:
        steps = [run(args.seed + k, True) for k in range(args.steps)]
        fracs = [r["padded_frac_packed"] for r in steps]
        shapes = sorted({tuple(r["packed_shape"]) for r in steps})
        print(f"{args.steps} steps of random draws: packed padded fraction mean {100 * np.mean(fracs):.1f}%, max "
              f"{100 * max(fracs):.1f}%; {len(shapes)} packed shapes: {', '.join(map(str, shapes))}")
    return 0


if __name__ == "__main__":
    cli.main_guard(main)
