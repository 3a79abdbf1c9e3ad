"""One process of the multi-host test: a few RL steps of configs/tiny_test.py under jax.thread_guard (a multi-process
JAX operation issued from any other thread than this main one raises), then prints a params digest.

Run as: python tests/training/multihost_worker.py WORKDIR OFF_POLICY_STEPS [COORDINATOR NUM_PROCESSES PROCESS_ID]
"""

import json
import os
import sys

workdir, off_policy_steps = sys.argv[1], int(sys.argv[2])
if len(sys.argv) > 3:
    os.environ.update(SAGE_COORDINATOR=sys.argv[3], SAGE_NUM_PROCESSES=sys.argv[4], SAGE_PROCESS_ID=sys.argv[5])

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sage_jax.models import sharding
from sage_jax.run import config as config_lib
from sage_jax.training import trainer  # noqa: E402

sharding.initialize_distributed()
# 3 steps, a checkpoint at 2: with k = 1 the batch of step 2 is in flight there and is finished and saved
config = config_lib.load("configs/tiny_test.py", ["--config.train.steps=3", "--config.train.ckpt_every=2",
                                                  "--config.mesh.shape=1,-1,1",
                                                  f"--config.train.off_policy_steps={off_policy_steps}"])
with jax.thread_guard(True):
    params = sharding.to_host(trainer.run_rl(config, workdir).state["params"])
if jax.process_index() == 0:
    leaves = jax.tree.leaves(params)
    print("DIGEST " + json.dumps({"devices": jax.device_count(), "processes": jax.process_count(),
                                  "sums": [float(np.sum(x, dtype=np.float64)) for x in leaves],
                                  "abs": [float(np.abs(x).sum(dtype=np.float64)) for x in leaves]}), flush=True)
