#!/bin/bash
# k=0 vs k=1 colocated on CPU, math reward in the worker pool (2 workers); tiny tokenizer from tests/helpers_hf.py
set -e
# TOK: an HF tokenizer directory, e.g. python -c "import sys; sys.path.insert(0, 'tests'); from helpers_hf import tiny_tokenizer; tiny_tokenizer('/tmp/sage_tok')"
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
    --config.train.off_policy_steps=$k
done
