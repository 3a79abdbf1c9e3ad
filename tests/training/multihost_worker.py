"""One process of the multi-host test: a few RL steps of configs/tiny_test.py, then prints a params digest.

Run as: python tests/training/multihost_worker.py WORKDIR [COORDINATOR NUM_PROCESSES PROCESS_ID]
"""

import json
import os
import sys

workdir = sys.argv[1]
if len(sys.argv) > 2:
    os.environ.update(SAGE_COORDINATOR=sys.argv[2], SAGE_NUM_PROCESSES=sys.argv[3], SAGE_PROCESS_ID=sys.argv[4])

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sage_jax.models import sharding
from sage_jax.run import config as config_lib
from sage_jax.training import trainer  # noqa: E402

sharding.initialize_distributed()
config = config_lib.load("configs/tiny_test.py", ["--config.train.steps=2", "--config.train.ckpt_every=2",
                                                  "--config.mesh.shape=1,-1,1"])
params = sharding.to_host(trainer.run_rl(config, workdir).state["params"])
if jax.process_index() == 0:
    leaves = jax.tree.leaves(params)
    print("DIGEST " + json.dumps({"devices": jax.device_count(), "processes": jax.process_count(),
                                  "sums": [float(np.sum(x, dtype=np.float64)) for x in leaves],
                                  "abs": [float(np.abs(x).sum(dtype=np.float64)) for x in leaves]}), flush=True)
