"""k-step off-policy rollouts: the CollectFn that trainer.rl_step calls, as a pipeline around it.

With train.off_policy_steps = k > 0, rl_step(t) is handed the batch the policy of step t - k sampled, and before
step t's update it dispatches the generation of batch t + k with the policy of step t on a background thread; that
thread also does the batch's host work (decoding, reward scoring in the worker pool), so the host work and (on a
rollout sub-mesh) the sampling run while the devices train. JAX dispatch is thread-safe; the sampler samples from
its own copy of the trained params in the compute dtype (train_step donates the state's), or from the rollout
sub-mesh's copy (split placement: one jax.device_put of the compute-dtype weights after each update,
time/weight_sync). The first k steps of a run have no earlier batch and sample on the spot (rl/staleness < k); a
batch older than k steps is never handed out.

At a checkpoint the in-flight batch is finished and saved beside it (WORKDIR/offpolicy/batch_<step>.npz), so a
resumed run trains on the very batch the uninterrupted one would have. k = 0 calls collect in place, as before.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax.models import sharding

# collect(params, rl_step) -> (rollouts, host stats): rollouts.collect_rollouts bound to its task, config and pool
Collect = Callable[[Any, int], tuple[dict[str, Any], dict[str, float]]]


class TimedPool:
    """A reward pool whose take_counts() also reports the seconds spent scoring since the last call
    (time/score_s: the host's reward work that an off-policy step can hide)."""

    def __init__(self, pool):
        self.pool, self.seconds = pool, 0.0

    def score(self, *args, **kwargs) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return self.pool.score(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def take_counts(self) -> dict[str, float]:
        counts, self.seconds = {**self.pool.take_counts(), "time/score_s": self.seconds}, 0.0
        return counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


def _own_copy(cfg, params, shared) -> Any:
    """params in the compute dtype (model.compute_params: new arrays where it casts), every other leaf that is not
    one of `shared`'s (LoRA: the frozen base) copied on its devices, so a later train_step that donates the state
    cannot free what the sampler still reads."""
    from sage_jax.models import decoder as model_lib
    cast = model_lib.compute_params(cfg, params)
    keep = {id(x) for x in jax.tree.leaves(shared)} | ({id(x) for x in jax.tree.leaves(cast)}
                                                       - {id(x) for x in jax.tree.leaves(params)})
    copy = jax.jit(jnp.copy)
    return jax.tree.map(lambda x: x if id(x) in keep else copy(x), cast)


def placement(ctx, rollout_mesh, rules, off_policy: bool) -> Callable[[Any], tuple[Any, dict[str, float]]]:
    """params -> (the params the sampler reads, stats): the same arrays (on-policy colocated), an own copy
    (off-policy colocated), or a copy on the rollout sub-mesh (split; its time is time/weight_sync). With LoRA the
    frozen base is shared (colocated) or copied to the sub-mesh once; only the adapters move after each update."""
    if rollout_mesh is None:
        return (lambda p: (_own_copy(ctx.cfg, p, ctx.base), {})) if off_policy else (lambda p: (p, {}))
    from sage_jax.models import lora
    from sage_jax.models import decoder as model_lib
    base_sh = model_lib.param_shardings(ctx.cfg, rollout_mesh, rules)
    lora_sh = None if ctx.lora_cfg is None else lora.shardings(ctx.cfg, ctx.lora_cfg, rollout_mesh, rules)
    base = None if ctx.lora_cfg is None else sharding.copy_to(ctx.base, base_sh)

    def to_rollout_mesh(params):
        t0 = time.perf_counter()
        params = model_lib.compute_params(ctx.cfg, params)  # what the sampler reads: half the bytes of float32
        if ctx.lora_cfg is None:
            placed = sharding.copy_to(params, base_sh)
        else:  # params = base with the (scaled) adapters on: move the adapters, keep the sub-mesh's base
            adapters = sharding.copy_to(params["layers"]["lora"], lora_sh)
            placed = {**base, "layers": {**base["layers"], "lora": adapters}}
        placed = jax.block_until_ready(placed)
        return placed, {"time/weight_sync": time.perf_counter() - t0}
    return to_rollout_mesh


class Pipeline:
    """rl_step's CollectFn with k steps of staleness (k = 0: collect in place). Use as a context manager: leaving
    it waits for the batch in flight."""

    def __init__(self, collect: Collect, k: int, steps: int, *, mesh, rules, place, workdir: str | None = None):
        self.collect, self.k, self.steps, self.mesh, self.rules, self.place = collect, k, steps, mesh, rules, place
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sage-rollouts") if k else None
        self.dir = os.path.join(workdir, "offpolicy") if workdir else None

    def _run(self, params, step: int, version: int):
        """(rollouts, stats, version): batch `step` sampled with the params of RL step `version`."""
        t0 = time.perf_counter()
        with jax.set_mesh(self.mesh), sharding.use_rules(self.rules):
            ro, stats = self.collect(params, step)
        return ro, {**stats, "time/collect_s": time.perf_counter() - t0}, version

    def __call__(self, params, step: int):
        t0 = time.perf_counter()
        if not self.k:
            placed, sync = self.place(params)
            ro, stats, _ = self._run(placed, step, step)
            return ro, {**stats, **sync}
        fut = self.pending.pop(step, None)
        got = fut.result() if fut is not None else self._load(step)
        dispatch = step + self.k < self.steps and step + self.k not in self.pending
        placed, sync = self.place(params) if dispatch or got is None else (None, {})
        ro, stats, version = got if got is not None else self._run(placed, step, step)
        if not 0 <= step - version <= self.k:
            raise RuntimeError(f"RL step {step} was handed a batch of step {version}'s policy; at most "
                               f"train.off_policy_steps={self.k} steps old is allowed")
        if dispatch:
            self.pending[step + self.k] = self.executor.submit(self._run, placed, step + self.k, step)
        waited = time.perf_counter() - t0
        hidden = max(0.0, stats["time/collect_s"] - waited) if fut is not None else 0.0
        return ro, {**stats, **sync, "rl/staleness": float(step - version), "time/hidden_s": hidden}

    def drain(self) -> None:
        """Wait for every batch in flight (before anything else uses the reward pool, e.g. an evaluation)."""
        for fut in self.pending.values():
            fut.result()

    # ------------------------------------------------------------------------------------------ checkpoints

    def _path(self, step: int) -> str:
        return os.path.join(self.dir, f"batch_{step}.npz")

    def save(self, step: int, keep: list[int] | tuple[int, ...] = ()) -> None:
        """Finish and save the batch in flight for `step` (the checkpoint at `step` resumes with it); remove the
        saved batches of steps not in `keep` (the checkpoints still kept)."""
        if not self.k or self.dir is None or step not in self.pending:
            return
        ro, stats, version = self.pending[step].result()
        if jax.process_index() != 0:
            return
        os.makedirs(self.dir, exist_ok=True)
        arrays = {k: v for k, v in ro.items() if isinstance(v, np.ndarray)}
        lists = {k: v for k, v in ro.items() if not isinstance(v, np.ndarray)}
        meta = json.dumps({"stats": stats, "version": version, "lists": lists}, default=str)
        buf = io.BytesIO()
        np.savez(buf, __meta__=np.array(meta), **arrays)
        with open(self._path(step) + ".tmp", "wb") as f:
            f.write(buf.getvalue())
        os.replace(self._path(step) + ".tmp", self._path(step))
        for name in os.listdir(self.dir):
            if name.startswith("batch_") and name.endswith(".npz") and int(name[6:-4]) not in (*keep, step):
                os.remove(os.path.join(self.dir, name))

    def _load(self, step: int):
        if self.dir is None or not os.path.exists(self._path(step)):
            return None
        with np.load(self._path(step), allow_pickle=False) as z:
            meta = json.loads(str(z["__meta__"]))
            ro = {k: z[k] for k in z.files if k != "__meta__"}
        return {**ro, **meta["lists"]}, meta["stats"], int(meta["version"])

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
