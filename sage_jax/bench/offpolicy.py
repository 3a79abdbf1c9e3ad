"""k = 0 against k = 1 (train.off_policy_steps, colocated) on this machine: two short math trainings, each in a
process of its own with one CPU device, the math reward in a pool of 2 workers.

    python -m sage_jax.bench offpolicy --tokenizer DIR [--out PREFIX] [--steps 8]

--tokenizer: any HF tokenizer directory (a tiny one: tests/helpers_hf.py's tiny_tokenizer(DIR) writes one).
Prints, for each k, the medians of steps 2 .. steps-1 (steps 0-1 compile) from its metrics.jsonl and the wall time
between the log lines of step 1 and the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from sage_jax.bench import common

KEYS = ("time/step_s", "time/rollout_s", "time/collect_s", "time/score_s", "time/hidden_s", "time/batch_s",
        "time/ref_s", "time/update_s", "rl/staleness", "rl/gen_len")


def _train(k: int, workdir: str, tokenizer: str, steps: int) -> None:
    shutil.rmtree(workdir, ignore_errors=True)
    overrides = {"data.task": "math", "data.train": "math_train", "data.eval": "", "tokenizer_path": tokenizer,
                 "data.max_prompt_len": 128, "train.reward": "math", "train.reward_workers": 2,
                 "rollout.prompts_per_step": 8, "rollout.group_size": 8, "rollout.max_new_tokens": 128,
                 "model.hidden_size": 256, "model.intermediate_size": 768, "model.num_layers": 4,
                 "train.steps": steps, "train.ckpt_every": 100, "train.sample_every": 0, "train.off_policy_steps": k}
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    cmd = [sys.executable, "-m", "sage_jax.train", "--config", "configs/tiny_test.py", "--workdir", workdir,
           *(f"--config.{key}={value}" for key, value in overrides.items())]
    with open(workdir + ".log", "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def summary(metrics_path: str, steps: int) -> dict:
    """The medians of KEYS over steps 2 .. steps - 1 and the wall seconds between step 1's line and the last's."""
    with open(metrics_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    timed = {r["step"]: r for r in rows if "time/step_s" in r}
    late = [timed[s] for s in range(2, steps) if s in timed]
    return {"steps": len(late), "wall_s": timed[steps - 1]["time"] - timed[1]["time"],
            **{key: statistics.median(r.get(key, 0.0) for r in late) for key in KEYS}}


def main(argv: list[str]) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m sage_jax.bench offpolicy", description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True, help="an HF tokenizer directory")
    parser.add_argument("--out", default="/tmp/sage_offpolicy", help="the workdirs' prefix (PREFIX_k0, PREFIX_k1)")
    parser.add_argument("--steps", type=common.count(1), default=8)
    args = parser.parse_args(argv[1:])
    if args.steps < 4:
        parser.error("--steps must be at least 4 (steps 0-1 compile)")
    rows = []
    for k in (0, 1):
        workdir = f"{args.out}_k{k}"
        _train(k, workdir, args.tokenizer, args.steps)
        row = {"bench": "offpolicy", "k": k, **summary(os.path.join(workdir, "metrics.jsonl"), args.steps)}
        print(f"k={k} steps={row['steps']} wall={row['wall_s']:.2f}s "
              + " ".join(f"{key}={row[key]:.3f}" for key in KEYS), flush=True)
        rows.append(row)
    return rows
