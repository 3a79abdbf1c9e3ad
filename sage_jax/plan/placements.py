"""The placement PREDICTION alone (phase_model: analytic, no compilation):

    python -m sage_jax.plan.placements --config configs/qwen7b_branch.py --chip v5p --chips 32 [--no-decode-stages]
        [--every-split]
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from sage_jax.models import build
from sage_jax.plan import phase_check as plan_phases


def placements_main(argv: Sequence[str] | None = None) -> int:
    from sage_jax.run import config as config_lib
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m sage_jax.plan.placements")
    parser.add_argument("--config", required=True)
    parser.add_argument("--chip", default="v5p")
    parser.add_argument("--chips", type=int, default=32)
    parser.add_argument("--host-s", type=float, default=None, help="host seconds per step (default: "
                        "HOST_S_PER_ROLLOUT x rollouts / train.reward_workers)")
    parser.add_argument("--no-decode-stages", action="store_true", help="model a decode pool without its shrink "
                        "stages (once the queue is empty the sampler shrinks from S towards its live rows: "
                        "decode_pool.stage_widths)")
    parser.add_argument("--every-split", action="store_true", help="the split placement at every n rollout chips "
                        "(a multiple of the tensor axis), not only a quarter, half and three quarters of the chips")
    args = parser.parse_args([a for a in argv if not a.startswith("--config.")])
    config = config_lib.validate(config_lib.load(args.config, [a for a in argv if a.startswith("--config.")]))
    rows = plan_phases.placements_for(config, build.resolve_model(config)[0], args.chip, args.chips, args.host_s,
                                      stages=not args.no_decode_stages, every_split=args.every_split)
    print(plan_phases.format_placements(rows, args.chip, args.chips))
    return 0


if __name__ == "__main__":
    from sage_jax.run import cli
    cli.main_guard(placements_main)
