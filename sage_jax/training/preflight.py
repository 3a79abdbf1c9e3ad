"""What a run checks before it writes anything or loads a model: the mesh, the task's data files (tasks.build), the
SFT demonstrations, the workdir's checkpoints (made with this model and these settings) and its summary.json.

The `train` and `sft` faces call `check` with the workdir locked and before its log is opened
(cli.setup_runtime), so a refused run leaves the workdir as it found it; the run is handed what was read
(`Prepared`), so nothing is read twice. The model's weights are not read: the fingerprint of loaded weights is
compared later, when they are loaded (trainer.run_rl).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from sage_jax.data import tasks
from sage_jax.models import build, sharding
from sage_jax.run import checkpoint, paths, record as run_record
from sage_jax.training import supervised, trainer


class Prepared(NamedTuple):
    task: tasks.Task
    sft_data: supervised.SFTData | None  # None when the run trains no SFT


def check(config, workdir: str, rl: bool = True) -> Prepared:
    """rl: `train` (SFT in WORKDIR/sft first when config.sft.steps > 0, then RL in WORKDIR); else `sft` (WORKDIR/sft
    only). Raises the error the run would have stopped with later (ValueError, ConfigError, CheckpointError)."""
    mesh_shape = tuple(config.mesh.shape)
    if rl:
        sharding.make_meshes(mesh_shape, config.mesh.get("rollout_devices", 0))
    else:
        sharding.make_mesh(mesh_shape)
    task = tasks.build(config)
    sft = config.sft.steps > 0 or not rl
    data = supervised.prepare(config, task) if sft else None
    model = checkpoint.model_meta(build.config_without_weights(config, task.tokenizer))
    if rl:
        _check_checkpoints(config, os.path.join(workdir, "rl"), workdir, model, sft=False)
        trainer.Summary(os.path.join(workdir, "summary.json"))  # a corrupt one is named now, not after training
    if sft:
        _check_checkpoints(config, os.path.join(workdir, "sft"), os.path.join(workdir, "sft"), model, sft=True)
    return Prepared(task, data)


def _check_checkpoints(config, directory: str, workdir: str, model: dict, sft: bool) -> None:
    """The newest checkpoint under `directory` was made with this model and (unless allow_config_change: the run
    records the change itself, once) these settings; a finished SFT is not checked (it trains no more)."""
    if not paths.exists_agreed(os.path.join(directory, "checkpoints")):  # made by nothing but a save
        return
    ckpt = checkpoint.Checkpointer(directory, keep=1)
    try:
        if sft and (ckpt.latest_step() or 0) >= config.sft.steps:
            return
        ckpt.check_model(model)
        if not config.train.get("allow_config_change", False):
            run_record.check_resume(config, ckpt, workdir, sft=sft)
    finally:
        ckpt.close()
