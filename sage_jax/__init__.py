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
  eval/         pass@k, offline evaluation, model sources, answer patterns, the tool-call rollout loop
                                                                             -> sampling, run, data, rewards, tools
  training/     the RL step and loop, rollouts, off-policy pipeline, SFT, the train state   -> everything above
  bench/ experiments/ plan/   benchmarks, studies, the ahead-of-time planner: on top, outside the core

The faces `python -m sage_jax.train | sft | evaluate | patterns | convert_gguf` sit here beside this file; `plan` and
`bench` are folders with a __main__. This module imports nothing heavy: the names below are resolved on first use.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any


def _size_the_cpu_pool_for_simulated_devices() -> None:
    """XLA:CPU runs the programs of all simulated host devices (XLA_FLAGS=--xla_force_host_platform_device_count=N)
    on one thread pool of $NPROC threads, else of a size XLA picks (here, 2 cores: 8 threads were seen held at once
    with 8 devices). A collective holds its thread until every device reaches it, and a device may start two
    independent collectives in a different order than another device: with every thread held that way the program
    deadlocks, and XLA aborts the process after 40 s ("Termination timeout ... Exiting to ensure a consistent program
    state"). Measured on 2 cores with 8 devices: 2 of 2 runs of
    tests/training/test_partial.py aborted so (7 devices in one all-reduce, 1 in an all-gather, the 8 threads held);
    with NPROC=32 it passed. So, with simulated devices and no NPROC set, the pool gets 4 threads per device. It
    must be set before JAX makes its CPU client, so here, on the package's import."""
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if m and int(m.group(1)) > 1 and "NPROC" not in os.environ:
        os.environ["NPROC"] = str(max(os.cpu_count() or 1, 4 * int(m.group(1))))


_size_the_cpu_pool_for_simulated_devices()

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
