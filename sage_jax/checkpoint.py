"""Train-state checkpoints under WORKDIR/checkpoints/<step> (orbax), a JSON sidecar, and fallback past corrupt steps.

Each step directory holds two items: `state` (the sharded array pytree: params, opt_state, step) and `meta` (a JSON
dict: data position, rng key data, config snapshot, ...). Orbax writes into a temporary directory and renames it
when complete, so a crash mid-save leaves only a tmp directory that never counts as a step. Arrays are written by
every process (each its own shards); the JSON item is written by the primary process only (orbax's JsonSave).
"""

from __future__ import annotations

import datetime
import json
import logging as pylogging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

log = pylogging.getLogger(__name__)

_ITEMS = ("state", "meta")


class CheckpointError(RuntimeError):
    """No checkpoint in the workdir could be restored."""


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.ndarray, jax.Array)):
        return np.asarray(x).tolist()
    if isinstance(x, np.generic):
        return x.item()
    if hasattr(x, "to_dict"):  # ml_collections.ConfigDict
        return x.to_dict()
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    raise TypeError(f"{type(x).__name__} is not JSON-serialisable")


def _jsonable(meta: dict[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(meta, default=_json_default))
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint meta must be JSON-serialisable (numbers, strings, lists, dicts): {e}; "
                         f"convert that value before calling save") from e


def _as_abstract(x: Any) -> Any:
    """Target leaf for restore: keep ShapeDtypeStruct shardings; give unsharded leaves the first local device."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x


def _all_processes(ok: bool) -> bool:
    """True only if every process succeeded, so all of them restore the same step."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))


# Files orbax 0.12 writes in every step; only used to explain a failure, never to decide one.
_EXPECTED_FILES = ("state/_METADATA", "state/manifest.ocdbt", "meta/metadata")


def _reason(e: BaseException, step_dir: epath.Path) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    reason = f"{type(e).__name__}: {first[:300]}"
    try:
        missing = [f for f in _EXPECTED_FILES if not (step_dir / f).exists()]
    except OSError:
        missing = []
    return f"{reason}; missing {', '.join(missing)}" if missing else reason


class Checkpointer:
    """Save / restore the train state; keeps the newest `keep` steps.

    Every process must call save/restore (array writes and reads are collective across hosts).
    """

    def __init__(self, workdir: str | os.PathLike, keep: int = 3, async_save: bool = False):
        if keep < 1:
            raise ValueError(f"keep={keep}: must keep at least one checkpoint")
        self.workdir = str(workdir)
        self.directory = epath.Path(workdir) / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # leftovers of a crashed save
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

    # -- saving -------------------------------------------------------------------------------------------------
    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None, force: bool = False) -> bool:
        """Write `state` and `meta` as checkpoint `step`; False if orbax skipped it (step not newer than latest).

        With async_save the call returns once arrays are copied off the devices, so the caller may donate `state`
        right after; call wait() before reading the files.
        """
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(_jsonable(dict(meta or {}))))
        return bool(self._manager.save(int(step), args=args, force=force))

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    # -- listing ------------------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- restoring ----------------------------------------------------------------------------------------------
    def _restore_step(self, step: int, abstract_state: Any) -> tuple[int, Any, dict[str, Any]]:
        target = jax.tree.map(_as_abstract, abstract_state)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        restored = self._manager.restore(step, args=args)
        meta = restored.meta
        if not isinstance(meta, dict):
            raise ValueError(f"meta item is {type(meta).__name__}, expected a JSON object")
        return step, restored.state, meta

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any, dict[str, Any]] | None:
        """(step, state, meta) with arrays placed on the shardings of `abstract_state`; None if there is nothing.

        step=None: the newest readable step; a corrupt newer one is logged, moved to WORKDIR/checkpoints_corrupt/
        (so later saves can reuse its step number) and skipped. An explicit step is restored or raises.
        """
        steps = self.all_steps()
        if step is not None:
            if int(step) not in steps:
                raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; available steps: "
                                        f"{steps or 'none'}")
            try:
                return self._restore_step(int(step), abstract_state)
            except Exception as e:
                raise CheckpointError(f"checkpoint step {step} in {self.directory} is unreadable "
                                      f"({_reason(e, self.directory / str(step))})") from e
        if not steps:
            return None
        failures: list[tuple[int, str]] = []
        for s in reversed(steps):
            result, reason = None, ""
            try:
                result = self._restore_step(s, abstract_state)
            except Exception as e:  # any unreadable piece (missing file, bad json, tensorstore error) means skip it
                reason = _reason(e, self.directory / str(s))
            if _all_processes(result is not None):
                if failures:
                    self._quarantine([f for f, _ in failures])
                return result
            reason = reason or "unreadable on another process"
            log.warning("checkpoint step %d in %s is unreadable (%s); trying an older one", s, self.directory, reason)
            failures.append((s, reason))
        tried = "; ".join(f"step {s}: {r}" for s, r in failures)
        raise CheckpointError(
            f"no readable checkpoint in {self.directory} (workdir {self.workdir}); tried {tried}. If the model or "
            f"optimizer config changed since they were written, restore with the original config; otherwise move "
            f"the checkpoints directory away to start fresh.")

    def restore_raw(self, step: int | None = None) -> tuple[int, Any, dict[str, Any]] | None:
        """(step, state, meta) with state as host numpy arrays in the saved structure (namedtuples come back as
        lists); None if there is no checkpoint. For inspection and tests: every host loads every array in full."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            return None
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; available steps: "
                                    f"{self.all_steps() or 'none'}")
        state_dir = self.directory / str(step) / "state"
        try:
            with ocp.PyTreeCheckpointer() as reader:
                metadata = reader.metadata(state_dir)
                tree = metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata.tree
                restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
                state = reader.restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is unreadable "
                                  f"({_reason(e, self.directory / str(step))})") from e
        return step, state, meta

    def _quarantine(self, bad_steps: list[int]) -> None:
        """Move corrupt steps out of the step listing; otherwise orbax skips saves at steps <= the corrupt one."""
        corrupt_dir = epath.Path(self.workdir) / "checkpoints_corrupt"
        if jax.process_index() == 0:
            corrupt_dir.mkdir(parents=True, exist_ok=True)
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            for s in bad_steps:
                dest = corrupt_dir / f"{s}-{stamp}"
                try:
                    (self.directory / str(s)).rename(dest)
                    log.warning("moved corrupt checkpoint step %d to %s", s, dest)
                except OSError as e:
                    log.warning("could not move corrupt checkpoint step %d to %s (%s); saves at steps <= %d will be "
                                "skipped until it is removed", s, dest, e, s)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("sage_jax.checkpoint.quarantine")
        self._manager.reload()


def export_hf(workdir: str | os.PathLike, cfg: Any, params: Any) -> str:
    """Write params as a Hugging Face model directory WORKDIR/hf_export; returns that path. Call on every process."""
    from sage_jax import model
    out = os.path.join(os.fspath(workdir), "hf_export")
    model.save_hf(out, cfg, params)
    return out


def restore_params(workdir: str | os.PathLike, step: int, abstract_params: Any, dtype: Any) -> Any:
    """Only the params of an RL checkpoint, read straight onto their shardings. Read-only: unlike
    Checkpointer it never cleans up temporary folders, so a run still training there is left alone."""
    state_dir = (epath.Path(workdir) / "checkpoints" / str(step) / "state").resolve()
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape,
                                                               dtype=np.dtype(dtype)), abstract_params)
    try:
        with ocp.PyTreeCheckpointer() as reader:
            state = reader.restore(state_dir, args=ocp.args.PyTreeRestore(
                item={"params": abstract_params}, restore_args={"params": restore_args}, partial_restore=True))
    except Exception as e:  # orbax / tensorstore raise many types for a missing or mismatched file
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"cannot read the params of checkpoint step {step} in {workdir} ({type(e).__name__}: "
                         f"{first}); the workdir's config.json must be the one that run was trained with") from None
    return state["params"]
