"""`python -m sage_jax.bench MODE [flags]`: every benchmark mode behind one entry point.

  python -m sage_jax.bench sampler --preset both --dtype fp32 --batch 64
  python -m sage_jax.bench train_step --preset small --batch 16 --ablate   # remat / scan / chunk / bf16 / rows
  python -m sage_jax.bench flags --preset small --batch 16                  # XLA_FLAGS sets, a process each
  python -m sage_jax.bench matmul                                           # the peak: jitted square matmuls
  python -m sage_jax.bench rl_step --preset small                           # vs trl.GRPOTrainer, same weights
  python -m sage_jax.bench rl_step --preset small --new-tokens 512 --workload longtail --layout both
  python -m sage_jax.bench rl_step --preset small --batch 64 --group 8 --new-tokens 512 --workload longtail --steady 4
  python -m sage_jax.bench memory                                           # chunked vs naive log-probs
  python -m sage_jax.bench scaling --plot docs/perf_scaling.png
  python -m sage_jax.bench gpu --out gpu_bench.json                         # on an accelerator (--quick: any)
  python -m sage_jax.bench gpu_decode --baseline-commit 8fc7f94 --out F.json  # the decode path's GPU check
  python -m sage_jax.bench lora memory --devices 32
  python -m sage_jax.bench decode_kernels                                   # where XLA:CPU's decode time goes
  python -m sage_jax.bench score_time                                       # the math reward's host cost
  python -m sage_jax.bench offpolicy --tokenizer DIR                        # k = 0 vs k = 1 trainings
  python -m sage_jax.bench tools --tool-ms 100                              # tokens/s with tool calls vs without
  python -m sage_jax.bench all

`--batch` counts rows (prompts x samples). Each number is the median of `--repeats` runs after a warm-up run; the
runs of everything compared are interleaved, so load from other processes hits all alike. FLOP/s are given as a
fraction of a jitted square matmul's FLOP/s timed in the same loop: this machine's achievable peak, under the same
load. The training-side modes default to the tiny preset, the sampler to both presets.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

from sage_jax.bench import workloads
from sage_jax.bench import common, gpu, lora, memory, rl_steady, rl_step, sampler, scaling, train_step
from sage_jax.bench.common import DTYPES

Mode = Callable[[argparse.Namespace], list[dict]]
TRAINING_MODES: dict[str, Mode] = {
    "train_step": train_step.train_step_mode, "rl_step": lambda args: (rl_steady.rl_steady_mode if args.steady else rl_step.rl_step_mode)(args), "memory": memory.memory_mode,
    "scaling": scaling.scaling_mode, "matmul": train_step.matmul_mode, "flags": train_step.flags_mode,
}
SAMPLER_MODES: dict[str, Mode] = {"sampler": sampler.sampler_mode}


def _lazy(module: str) -> Callable[[list[str]], list[dict]]:
    """A mode whose module imports what the others need not (torch, the reward pool): imported when it runs."""
    def run(argv: list[str]) -> list[dict]:
        return importlib.import_module(f"sage_jax.bench.{module}").main(argv)
    return run


# modes with flags of their own: argv -> rows
OWN_FLAGS: dict[str, Callable[[list[str]], list[dict]]] = {
    "gpu": gpu.main, "lora": lora.main, "decode_kernels": _lazy("decode_kernels"), "score_time": _lazy("score_time"),
    "offpolicy": _lazy("offpolicy"), "gpu_decode": _lazy("gpu_decode"), "tools": _lazy("tools")}
ALL_TRAINING = ("matmul", "train_step", "rl_step", "memory", "scaling")  # what `all` runs after the sampler


def _shape_flags(parser: argparse.ArgumentParser, batch_help: str) -> None:
    """--batch, --prompt-len, --repeats: counts of at least 1, the same in both parsers."""
    parser.add_argument("--batch", type=common.count(1), default=64, help=batch_help)
    parser.add_argument("--prompt-len", type=common.count(1), default=32)
    parser.add_argument("--repeats", type=common.count(1), default=3, help="timed runs after the warm-up (at least 1)")


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="write the rows (and their ratios) as JSON to PATH (no PATH: one line on stdout)")


def training_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sage_jax.bench", description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=list(TRAINING_MODES))
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small", "both"])
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    _shape_flags(parser, "rows = prompts x group")
    parser.add_argument("--group", type=common.count(1), default=8, help="rl_step: samples per prompt")
    parser.add_argument("--new-tokens", type=common.count(1), default=128, help="completion length")
    parser.add_argument("--ablate", action="store_true", help="train_step: also time each of ABLATIONS")
    parser.add_argument("--no-trl", action="store_true", help="rl_step: our side only (as --peer none)")
    parser.add_argument("--peer", default="trl", choices=["trl", "tunix", "none"],
                        help="rl_step: the framework timed beside ours (tunix: pip install -r requirements-bench.txt)")
    parser.add_argument("--plot", default=None, help="scaling: write the two-panel PNG here")
    parser.add_argument("--sizes", default="1024,2048", help="matmul: square sizes")
    parser.add_argument("--workload", default="fixed", choices=list(workloads.WORKLOADS),
                        help="rl_step: every completion --new-tokens long, or long-tailed lengths up to it")
    parser.add_argument("--layout", default="packed", choices=["packed", "padded", "both"],
                        help="rl_step: our reference pass and update on packed or padded rows")
    parser.add_argument("--steady", type=common.count(0), default=0,
                        help="rl_step: N > 0 runs N consecutive steps after a warm-up, on-policy and with partial "
                        "rollouts interleaved (TRL: --repeats steps beside them, unless --no-trl)")
    parser.add_argument("--oversample", default="1.5", help="rl_step --steady: rollout.oversample (comma-separated: "
                        "one partial-rollout arm each)")
    parser.add_argument("--max-lag", type=common.count(0), default=4, help="rl_step --steady: rollout.max_lag")
    parser.add_argument("--warmup", type=common.count(0), default=3,
                        help="rl_step --steady: steps left out first (compiling)")
    _json_flag(parser)
    return parser


def sampler_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sage_jax.bench", description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=[*SAMPLER_MODES, *TRAINING_MODES, *OWN_FLAGS, "all"])
    parser.add_argument("--preset", default="both", choices=["tiny", "small", "both"])
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    _shape_flags(parser, "rows = prompts x group")
    parser.add_argument("--new-tokens", type=common.count(1), default=None,
                        help="max new tokens (default 128; longtail 512)")
    parser.add_argument("--hf-threads", type=common.count(1), default=None, help="torch threads (default: all cores)")
    parser.add_argument("--workload", default="fixed", choices=list(workloads.WORKLOADS),
                        help="sampler: completion lengths forced on both sides (see sage_jax.bench.workloads)")
    parser.add_argument("--group", type=common.count(1), default=None,
                        help="sampler: samples per prompt (default 1; longtail 8)")
    parser.add_argument("--peer", default="transformers", choices=["transformers", "tunix"],
                        help="sampler: the sampler timed beside ours (tunix: pip install -r requirements-bench.txt)")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="sampler: time this HF model directory (both sides load it) instead of the presets")
    parser.add_argument("--slots", default="", help="sampler: also time these numbers of decode slots, e.g. 32,16 "
                        "(the sage_jax row has one slot per row)")
    parser.add_argument("--schedule-ceiling", action="store_true",
                        help="sampler, long tail: add the decode time with every step at exactly its live rows, from "
                        "static-batch step costs measured in the same run (a few minutes more)")
    _json_flag(parser)
    return parser


def run_training_mode(argv: list[str]) -> list[dict]:
    parser = training_parser()
    args = parser.parse_args(argv)
    args.peer = None if args.no_trl or args.peer == "none" else args.peer
    if args.peer == "tunix" and (args.mode != "rl_step" or args.steady):
        parser.error("--peer tunix: only rl_step (without --steady) and sampler time tunix")
    rows = TRAINING_MODES[args.mode](args)
    if args.json:
        common.write_json(args.json, {args.mode: rows})
    return rows


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    """{mode: rows} of the mode run (`all`: of every mode it runs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TRAINING_MODES:
        return {argv[0]: run_training_mode(argv)}
    if argv and argv[0] in OWN_FLAGS:
        return {argv[0]: OWN_FLAGS[argv[0]](argv)}
    parser = sampler_parser()
    args = parser.parse_args(argv)
    if args.mode not in (*SAMPLER_MODES, "all"):
        parser.error(f"mode {args.mode} has flags of its own: name it first (python -m sage_jax.bench {args.mode} ...)")
    results = {}
    for mode in (SAMPLER_MODES if args.mode == "all" else [args.mode]):
        print(f"== {mode}")
        results[mode] = SAMPLER_MODES[mode](args)
    if args.mode == "all":  # the training-side modes with the same shapes
        shared = ["--preset", args.preset, "--dtype", args.dtype, "--batch", str(args.batch), "--prompt-len",
                  str(args.prompt_len), "--new-tokens", str(args.new_tokens or 128), "--repeats", str(args.repeats)]
        for mode in ALL_TRAINING:
            print(f"== {mode}")
            results[mode] = run_training_mode([mode, *shared])
    if args.json:
        common.write_json(args.json, results)
    return results
