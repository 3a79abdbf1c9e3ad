"""k-step off-policy rollouts: the CollectFn that trainer.rl_step calls, as a pipeline around it.

With train.off_policy_steps = k > 0, rl_step(t) is handed the batch the policy of step t - k sampled, and before
step t's update it starts the generation of batch t + k with the policy of step t; a background thread does the
batch's host work (decoding, reward scoring in the worker pool), so the host work and (on a rollout sub-mesh) the
sampling run while the devices train. The collect comes in phases (rollouts.HOST / DEVICE). On one process the
background thread runs all of them. On several, every process must issue its multi-process operations (programs on
a mesh that spans processes, gathers) in the same order: the main thread issues them all, at fixed points (batch
t + k's sampling when it is started, the rest of its device work when step t + k takes it), and the background
thread runs only host stretches (checked under jax.thread_guard: tests/training/test_multihost.py). The sampler
samples from its own copy of the trained params in the compute dtype (train_step donates the state's), or from the
rollout sub-mesh's copy (split placement: one copy of the compute-dtype weights after each update,
time/weight_sync). The first k steps of a run have no earlier batch and sample on the spot (rl/staleness < k); a
batch older than k steps is never handed out.

At a checkpoint, after the state is written, every batch in flight (those of steps done .. done + k - 1) is finished
and saved beside it (WORKDIR/offpolicy/batch_<step>.npz), so a resumed run trains on the very batches the
uninterrupted one would have. A run stopped before they are written resumes by sampling the missing ones with the
restored policy (staleness 0, with a warning). Leaving the pipeline on an exception does not wait for the batches in
flight. k = 0 calls collect in place, as before.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import io
import json
import logging as pylogging
import os
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax.models import sharding
from sage_jax.run import paths
from sage_jax.training import rollouts

log = pylogging.getLogger("sage_jax")

# collect(params, rl_step) -> (rollouts, host stats), or a generator in phases that returns them
# (rollouts.collect_phases bound to its task, config and pool)
Collect = Callable[[Any, int], Any]


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
    (off-policy colocated), or a copy on the rollout sub-mesh (split); a copy's time is time/weight_sync. With LoRA the
    frozen base is shared (colocated) or copied to the sub-mesh once; only the adapters move after each update."""
    if rollout_mesh is None and not off_policy:
        return lambda p: (p, {})
    if rollout_mesh is None:  # waited for, so its time is its own, not part of the next phase's (time/batch_s, ...)
        def own_copy(params):
            t0 = time.perf_counter()
            placed = jax.block_until_ready(_own_copy(ctx.cfg, params, ctx.base))
            return placed, {"time/weight_sync": time.perf_counter() - t0}
        return own_copy
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


class _Cancelled(Exception):
    """A batch left unfinished: the pipeline was left on an exception."""


class _Batch:
    """One batch's collect in flight: its phases, what its next stretch is (None: done), its result and the seconds
    its stretches took (time/collect_s)."""

    def __init__(self, phases, version: int):
        self.phases, self.version, self.next, self.result, self.seconds = phases, version, rollouts.DEVICE, None, 0.0
        self.future: concurrent.futures.Future | None = None


class Pipeline:
    """rl_step's CollectFn with k steps of staleness (k = 0: collect in place). Use as a context manager: leaving
    it waits for the batches in flight, except on an exception. serial (default: on several processes): the
    background thread runs only the HOST stretches, the calling thread every DEVICE one (module doc)."""

    def __init__(self, collect: Collect, k: int, steps: int, *, mesh, rules, place, workdir: str | None = None,
                 serial: bool | None = None):
        self.collect, self.k, self.steps, self.mesh, self.rules, self.place = collect, k, steps, mesh, rules, place
        self.serial = jax.process_count() > 1 if serial is None else bool(serial)
        self.pending: dict[int, _Batch] = {}
        self.saved: set[int] = set()  # batches written for a checkpoint (each is written once)
        self.cancelled = threading.Event()
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sage-rollouts") if k else None
        self.dir = os.path.join(workdir, "offpolicy") if workdir else None
        self.takes_version = "version" in inspect.signature(collect).parameters

    def _phases(self, params, step: int, version: int):
        # a collect that takes `version` (partial rollouts: each token's policy version) is told whose params these are
        out = self.collect(params, step, version=version) if self.takes_version else self.collect(params, step)
        if inspect.isgenerator(out):
            out = yield from out
        return out

    def _advance(self, batch: _Batch, until: str | None = None) -> None:
        """Run batch's stretches on this thread until the next one is an `until` stretch (None: to the end)."""
        while batch.next is not None and batch.next != until:
            if self.cancelled.is_set():
                raise _Cancelled()
            t0 = time.perf_counter()
            try:
                with jax.set_mesh(self.mesh), sharding.use_rules(self.rules):
                    batch.next = next(batch.phases)
            except StopIteration as done:
                batch.next, batch.result = None, done.value
            finally:
                batch.seconds += time.perf_counter() - t0

    def _start(self, params, step: int, version: int) -> _Batch:
        """Batch `step` sampled with the params of RL step `version`, left running in the background."""
        batch = _Batch(self._phases(params, step, version), version)
        if self.serial:
            self._advance(batch, until=rollouts.HOST)  # its device work, dispatched from this thread
        batch.future = self.executor.submit(self._advance, batch, rollouts.DEVICE if self.serial else None)
        return batch

    def _finish(self, batch: _Batch):
        """(rollouts, stats, version) of a batch: waits for its background stretches, runs the rest here."""
        if batch.future is not None:
            batch.future.result()
        self._advance(batch)
        ro, stats = batch.result
        return ro, {**stats, "time/collect_s": batch.seconds}, batch.version

    def __call__(self, params, step: int):
        t0 = time.perf_counter()
        if not self.k:
            placed, sync = self.place(params)
            ro, stats, _ = self._finish(_Batch(self._phases(placed, step, step), step))
            return ro, {**stats, **sync}
        batch = self.pending.pop(step, None)
        got = self._finish(batch) if batch is not None else self._load(step)
        if got is None and step >= self.k:
            log.warning("no saved off-policy batch for RL step %d (the run stopped before writing it): sampling it "
                        "now with the restored policy (rl/staleness 0 at this step)", step)
        dispatch = step + self.k < self.steps and step + self.k not in self.pending
        placed, sync = self.place(params) if dispatch or got is None else (None, {})
        ro, stats, version = got if got is not None else self._finish(_Batch(self._phases(placed, step, step), step))
        if not 0 <= step - version <= self.k:
            raise RuntimeError(f"RL step {step} was handed a batch of step {version}'s policy; at most "
                               f"train.off_policy_steps={self.k} steps old is allowed")
        if dispatch:
            self.pending[step + self.k] = self._start(placed, step + self.k, step)
        waited = time.perf_counter() - t0
        hidden = max(0.0, stats["time/collect_s"] - waited) if batch is not None else 0.0
        return ro, {**stats, **sync, "rl/staleness": float(step - version), "time/hidden_s": hidden}

    def drain(self) -> None:
        """Finish every batch in flight (before anything else uses the reward pool, e.g. an evaluation); in step
        order, so on several processes their device work comes in the same order everywhere."""
        for step in sorted(self.pending):
            self._finish(self.pending[step])

    # ------------------------------------------------------------------------------------------ checkpoints

    def _path(self, step: int) -> str:
        return os.path.join(self.dir, f"batch_{step}.npz")

    def save(self, step: int, keep: list[int] | tuple[int, ...] = ()) -> None:
        """Finish and save every batch in flight: those of steps step .. step + k - 1, sampled by the policies of
        steps step - k .. step - 1, which the checkpoint at `step` resumes with. Call after the state is written.
        Saved batches that no checkpoint in `keep` (those still kept) or `step` needs are removed."""
        if not self.k or self.dir is None:
            return
        needed = {c + i for c in (*keep, step) for i in range(self.k)}
        for s in sorted(set(self.pending) - self.saved):
            self._save_batch(s, *self._finish(self.pending[s]), needed)
            self.saved.add(s)

    def _save_batch(self, step: int, ro, stats, version: int, needed: set[int]) -> None:
        if jax.process_index() != 0:
            return
        paths.makedirs(self.dir)  # a local folder or a gs:// bucket alike
        arrays = {k: v for k, v in ro.items() if isinstance(v, np.ndarray)}
        lists = {k: v for k, v in ro.items() if not isinstance(v, np.ndarray)}
        meta = json.dumps({"stats": stats, "version": version, "lists": lists}, default=str)
        buf = io.BytesIO()
        np.savez(buf, __meta__=np.array(meta), **arrays)
        paths.write_bytes(self._path(step), buf.getvalue())  # whole or not at all
        for name in paths.listdir(self.dir):
            if name.startswith("batch_") and name.endswith(".npz") and int(name[6:-4]) not in needed:
                paths.remove(os.path.join(self.dir, name))

    def _load(self, step: int):
        if self.dir is None or not paths.exists_agreed(self._path(step)):  # process 0's answer, on every process
            return None
        with np.load(io.BytesIO(paths.read_bytes(self._path(step))), allow_pickle=False) as z:
            meta = json.loads(str(z["__meta__"]))
            ro = {k: z[k] for k in z.files if k != "__meta__"}
        return {**ro, **meta["lists"]}, meta["stats"], int(meta["version"])

    def close(self, wait: bool = True) -> None:
        """wait=False (leaving on an exception): a batch in flight stops at its next stretch, unwaited for."""
        if not wait:
            self.cancelled.set()
        if self.executor is not None:
            self.executor.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(wait=exc_type is None)
