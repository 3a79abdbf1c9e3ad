"""Benchmarks, one module per mode; `python -m sage_jax.bench MODE ...` (cli.py) runs them.

  sampler     sampler.py    this sampler vs transformers `generate`, fixed or long-tailed completion lengths
  train_step  train_step.py the jitted train step (and --ablate variants) against the matmul peak
  matmul      train_step.py the peak: jitted square matmuls
  flags       train_step.py XLA_FLAGS sets, each in a fresh process
  rl_step     rl_step.py    one trainer.rl_step vs trl.GRPOTrainer (trl_peer.py) on the same weights
  memory      memory.py     chunked vs naive log-probs: peak temporary memory
  scaling     scaling.py    tokens/s vs batch and completion length
  gpu         gpu.py        sampler and train step of a ~0.5B shape on an accelerator, with MFU
  lora        lora.py       LoRA: per-device memory of the 7B configs, rollouts with unmerged adapters
  decode_kernels decode_kernels.py  where a long-tail decode step's time goes on XLA:CPU (pool, matmuls, attention)
  score_time  score_time.py the math reward's host cost per completion in the worker pool
  offpolicy   offpolicy.py  k = 0 vs k = 1 off-policy trainings on this machine
  all         cli.py        sampler, then matmul, train_step, rl_step, memory and scaling with the same shapes

The FLOP model they share is flops.py; timing, tables and JSON output are common.py; the synthetic workloads
(fixed and long-tailed completion lengths) are workloads.py.

Imports: any core folder (top floor, beside experiments/ and plan/); plan/ may import bench/, never the reverse.
"""
