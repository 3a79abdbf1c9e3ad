#!/bin/bash
# k=0 vs k=1 colocated on CPU, math reward in the worker pool (2 workers); tiny tokenizer from tests/helpers_hf.py.
# Prints, per k, the medians of steps 2-7 (steps 0-1 compile) from metrics.jsonl and the wall time of steps 2-7.
#   TOK: an HF tokenizer directory, e.g.
#     python -c "import sys; sys.path.insert(0, 'tests'); from helpers_hf import tiny_tokenizer; tiny_tokenizer('/tmp/sage_tok')"
#   OUT: the workdirs' prefix (default /tmp/sage_offpolicy)
set -e
cd "$(dirname "$0")/.."
for k in 0 1; do
  rm -rf ${OUT:-/tmp/sage_offpolicy}_k$k
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1 python -m sage_jax.train \
    --config configs/tiny_test.py --workdir ${OUT:-/tmp/sage_offpolicy}_k$k \
    --config.data.task=math --config.data.train=math_train --config.data.eval= --config.tokenizer_path=${TOK:-/tmp/sage_tok} \
    --config.data.max_prompt_len=128 --config.train.reward=math --config.train.reward_workers=2 \
    --config.rollout.prompts_per_step=8 --config.rollout.group_size=8 --config.rollout.max_new_tokens=128 \
    --config.model.hidden_size=256 --config.model.intermediate_size=768 --config.model.num_layers=4 \
    --config.train.steps=8 --config.train.ckpt_every=100 --config.train.sample_every=0 \
    --config.train.off_policy_steps=$k > ${OUT:-/tmp/sage_offpolicy}_k$k.log 2>&1
done
python - ${OUT:-/tmp/sage_offpolicy} <<'PY'
import json, statistics, sys
keys = ["time/step_s", "time/rollout_s", "time/collect_s", "time/score_s", "time/hidden_s", "time/batch_s",
        "time/ref_s", "time/update_s", "rl/staleness", "rl/gen_len"]
for k in (0, 1):
    rows = [json.loads(l) for l in open(f"{sys.argv[1]}_k{k}/metrics.jsonl")]
    steps = [r for r in rows if "time/step_s" in r and 2 <= r["step"] <= 7]
    med = {key: statistics.median(r.get(key, 0.0) for r in steps) for key in keys}
    # wall of steps 2-7: from the log time of step 1's line to step 7's
    t = {r["step"]: r["time"] for r in rows if "time/step_s" in r}
    print(f"k={k} steps={len(steps)} wall_2_7={t[7] - t[1]:.2f}s " + " ".join(f"{key}={v:.3f}" for key, v in med.items()))
PY
