"""sage_jax: SAGE (Shaping Anchors for Guided Exploration) for RL with verifiable rewards, in JAX.

The package's folders, lowest floor first; each may import only the folders on the floors below it
(tests/test_layout.py checks it):

  rewards/      verifiers: math answers, Knights and Knaves, countdown; the reward process pool
  models/       the decoder as pure functions, its config, attention, KV cache, sharding, LoRA, HF and GGUF I/O
  tools/        tools the model calls mid-answer: Python in a sandbox (namespaces, limits), a calculator; their pool
  data/         problem sets, prompt templates, tokenizers, tasks                          -> rewards, models
  sampling/     the sampler: KV-cache decoding in a pool of slots; top-k/top-p filters             -> models
  rl/           group advantages, guides (q), objectives (the SAGE loss), packing                  -> models
  run/          config files and flags, checkpoints, metrics, the workdir lock and resume guard    -> models, rewards
  eval/         pass@k, offline evaluation, model sources, answer patterns        -> sampling, run, data, rewards
  training/     the RL step and loop, rollouts, off-policy pipeline, SFT, the train state   -> everything above
  bench/ experiments/ plan/   benchmarks, studies, the ahead-of-time planner: on top, outside the core

The faces `python -m sage_jax.train | sft | evaluate | patterns | convert_gguf` sit here beside this file; `plan` and
`bench` are folders with a __main__. This module imports nothing: the names below are resolved on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

# The public names that external code uses (`from sage_jax import model, sampler, ...`), by their place in the tree.
_ALIASES = {
    "model": "sage_jax.models.decoder",
    "sampler": "sage_jax.sampling.sampler",
    "objectives": "sage_jax.rl.objectives",
    "evaluation": "sage_jax.eval.passk",
    "trainer": "sage_jax.training.trainer",
}


def __getattr__(name: str) -> Any:
    if name in _ALIASES:
        module = importlib.import_module(_ALIASES[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'sage_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_ALIASES])
