"""Partial rollouts do not harm learning (issue 38): the CPU demo (configs/cpu_demo.py) with rollout.partial = True
against without, seeds paired, after-RL pass@k and the mean token lag.

    python -m sage_jax.experiments.partial_demo --out docs/results/partial/demo --work /tmp/partial_demo
    python -m sage_jax.experiments.partial_demo --out docs/results/partial/demo --report-only

Each finished run writes --out/ARM_seedS.json (after-RL pass@k per held-out set, the run's mean token lag, carried
rows and dropped groups, wall and CPU seconds); a rerun skips the runs whose file is there and resumes the others
from their workdirs. Both arms of a seed share one SFT warm-start (the `on` arm's workdir starts from a copy of the
`off` arm's finished SFT checkpoint: SFT does not read the rollout settings). REPORT.md: the paired differences
(on - off) with 95% t-intervals, the number of comparisons (Holm over them) and the smallest effect detectable.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

from sage_jax.experiments.stats import fmt, holm, paired_test

ARMS = {"off": {}, "on": {"rollout.partial": True}}
METRICS = ("pass@1", "pass@16")


def _run(arm: str, seed: int, work: str, out: str) -> dict[str, Any]:
    from sage_jax.run import config as config_lib
    from sage_jax.training import trainer
    overrides = {"seed": seed, "train.progress": False, **ARMS[arm]}
    config = config_lib.load("configs/cpu_demo.py", [f"--config.{k}={v}" for k, v in overrides.items()])
    workdir = os.path.join(work, arm, f"seed{seed}")
    shared = os.path.join(work, "off", f"seed{seed}", "sft")
    if arm != "off" and os.path.isdir(shared) and not os.path.exists(os.path.join(workdir, "sft")):
        shutil.copytree(shared, os.path.join(workdir, "sft"))
    t0, c0 = time.perf_counter(), time.process_time()
    summary = trainer.run(config, workdir)
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    mean = lambda key: sum(r[key] for r in rows if key in r) / max(1, sum(key in r for r in rows))
    record = {"arm": arm, "seed": seed, "after": summary["after"]["datasets"],
              "before": summary.get("before", {}).get("datasets", {}),
              "token_lag_mean": mean("rl/token_lag_mean"), "carried_rows": mean("rl/carried_rows"),
              "dropped_groups": sum(r.get("rl/dropped_groups", 0.0) for r in rows),
              "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
              "command": " ".join(["python -m sage_jax.experiments.partial_demo", *sys.argv[1:]])}
    with open(os.path.join(out, f"{arm}_seed{seed}.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    return record


def report(out: str, seeds: int) -> str:
    runs = {}
    for arm in ARMS:
        for s in range(seeds):
            path = os.path.join(out, f"{arm}_seed{s}.json")
            if os.path.exists(path):
                runs[(arm, s)] = json.load(open(path))
    paired = [s for s in range(seeds) if ("off", s) in runs and ("on", s) in runs]
    sets = sorted(runs[("off", paired[0])]["after"]) if paired else []
    tests = [(name, metric, paired_test([runs[("on", s)]["after"][name][metric]
                                         - runs[("off", s)]["after"][name][metric] for s in paired]))
             for name in sets for metric in METRICS]
    adjusted = holm([t["p"] for _, _, t in tests])
    lines = ["# Partial rollouts on the CPU demo: learning with and without\n",
             f"configs/cpu_demo.py (SFT 400 steps, then 40 RL steps of 32 prompts x 8), rollout.partial True "
             f"(oversample and max_lag: configs/base.py's) against False; seeds {paired} paired (seed = SFT, "
             "sampling, prompt order; both arms share the seed's SFT checkpoint). Differences on - off: mean +- "
             f"95% t half-width over {len(paired)} seeds, p (Holm over the {len(tests)} comparisons), and the "
             "smallest difference detectable at 80% power (MDE).\n",
             "| held-out set | metric | off (mean) | on (mean) | on - off | p (Holm) | MDE |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for (name, metric, t), p in zip(tests, adjusted):
        mean = lambda arm: sum(runs[(arm, s)]["after"][name][metric] for s in paired) / len(paired)
        lines.append(f"| {name} | {metric} | {mean('off'):.3f} | {mean('on'):.3f} | {fmt(t['mean'], t['half'])} | "
                     f"{p:.2f} | {t['mde']:.3f} |")
    if paired:
        lag = [runs[("on", s)]["token_lag_mean"] for s in paired]
        carried = [runs[("on", s)]["carried_rows"] for s in paired]
        lines += ["", f"Partial rollouts' mean token lag {sum(lag) / len(lag):.3f} policy versions (per seed "
                  f"{', '.join(f'{x:.3f}' for x in lag)}), {sum(carried) / len(carried):.1f} rows carried per step, "
                  f"{sum(runs[('on', s)]['dropped_groups'] for s in paired):.0f} groups dropped. Wall seconds per "
                  f"run: off {', '.join(str(round(runs[('off', s)]['wall_s'])) for s in paired)}; on "
                  f"{', '.join(str(round(runs[('on', s)]['wall_s'])) for s in paired)} (the on arm starts from the off "
                  "arm's SFT checkpoint, and the machine is shared: not a speed comparison; `python -m "
                  "sage_jax.bench rl_step --steady` is).",
                  "", "Made by:", "", "```", "python -m sage_jax.experiments.partial_demo --out "
                  "docs/results/partial/demo --work /tmp/partial_demo", "```"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "REPORT.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sage_jax.experiments.partial_demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/results/partial/demo")
    p.add_argument("--work", default="/tmp/partial_demo")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if not args.report_only:
        for s in range(args.seeds):
            for arm in ARMS:  # off first: its SFT checkpoint is the on arm's
                if not os.path.exists(os.path.join(args.out, f"{arm}_seed{s}.json")):
                    print(f"[{arm} seed {s}]", flush=True)
                    _run(arm, s, args.work, args.out)
    print(report(args.out, args.seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
