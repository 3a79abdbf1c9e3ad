"""Train-state checkpoints under WORKDIR/checkpoints/<step> (orbax), a JSON sidecar, and fallback past corrupt steps.

Each step directory holds two items: `state` (the sharded array pytree: params, opt_state, step) and `meta` (a JSON
dict: data position, rng key data, config snapshot, ...). Orbax writes into a temporary directory and renames it
when complete, so a crash mid-save leaves only a tmp directory that never counts as a step. Arrays are written by
every process (each its own shards); the JSON item is written by the primary process only (orbax's JsonSave).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import logging as pylogging
import os
import signal
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from sage_jax.run import metrics_log as slog, paths, retry
from sage_jax.run.save_errors import quiet_failures as _quiet_failures, write_failure as _write_failure

log = pylogging.getLogger(__name__)
retry.bound_tensorstore_retries()  # a bucket that does not answer: about SAGE_STORAGE_RETRY_S, as run/paths.py

_ITEMS = ("state", "meta")


class CheckpointError(RuntimeError):
    """No checkpoint in the workdir could be restored, or one could not be written."""


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


_EXPECTED_FILES = ("state/_METADATA", "state/manifest.ocdbt", "meta/metadata")  # orbax 0.12's: to explain only


@contextlib.contextmanager
def deferred_interrupt():
    """Hold a Ctrl-C (SIGINT) or SIGTERM that arrives inside the block and deliver it when the block ends.

    orbax's wait for a previous save catches BaseException, so a KeyboardInterrupt raised inside a save or a wait was
    logged and dropped and the run went on (the interrupted run finished, or kept training). Held here, the signal
    reaches the caller once the checkpoint call has returned, with the checkpoint complete (a SIGTERM left at its
    default then ends the process only after the save). Main thread only (where Python runs signal handlers);
    elsewhere the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    hold = lambda signum, frame: held.append(signum)
    previous = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(held):
            signal.raise_signal(s)  # now to the handler the block replaced (KeyboardInterrupt for SIGINT by default)


def _cause_text(e: BaseException, limit: int = 300) -> str:
    """First line of the error without TensorStore's spec dump; a long one keeps its head and its innermost cause
    (the end: TensorStore nests "outer: inner: cause"), so "data corruption" or a byte-range error is never cut off."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    for marker in (" [tensorstore_spec", " [source locations"):
        first = first.split(marker)[0]
    return first if len(first) <= limit else f"{first[:limit // 3]} ... {first[-(2 * limit // 3):]}"


def _reason(e: BaseException, step_dir: epath.Path) -> str:
    reason = f"{type(e).__name__}: {_cause_text(e)}"
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
        right after; call wait() before reading the files."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(_jsonable(dict(meta or {}))))
        paths.fence(os.fspath(self.directory))  # a run that lost its workdir's lease writes (and prunes) nothing
        with deferred_interrupt(), _quiet_failures():
            try:
                return bool(self._manager.save(int(step), args=args, force=force))
            except Exception as e:
                self._raise_write_failure(e, int(step))
                raise

    def _raise_write_failure(self, e: BaseException, step: int | None) -> None:
        """CheckpointError naming the checkpoint, the cause and the fix, for a write that failed on the disk (no
        room, no permission, read-only, quota, I/O error) or any other OSError; other errors go on as they are."""
        cause = _write_failure(e) or (isinstance(e, OSError) and f"{e.strerror or _cause_text(e)} ({e.filename}); "
                                      "check that the folder is reachable and writable, or use another --workdir")
        if cause:
            done = [s for s in self.all_steps() if s != step]
            what = "the checkpoint in flight" if step is None else f"checkpoint step {step}"
            raise CheckpointError(f"cannot write {what} in {self.directory}: {cause} (the newest complete "
                                  f"checkpoint is step {done[-1] if done else 'none'})") from e

    def wait(self) -> None:
        with deferred_interrupt(), _quiet_failures():
            try:
                self._manager.wait_until_finished()
            except Exception as e:
                self._raise_write_failure(e, None)
                raise

    def close(self) -> None:
        with deferred_interrupt():
            self._manager.wait_until_finished()
            self._manager.close()

    # -- listing ------------------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        return (self.all_steps() or [None])[-1]

    def discard_after(self, step: int | None) -> list[int]:
        """Move the steps newer than `step` (all of them for None) to WORKDIR/checkpoints_corrupt/, so a rerun resumes
        from `step`; returns the steps moved. For checkpoints whose params turned out to give a non-finite loss."""
        self.wait()  # a save still in flight must be listed (and moved) too
        bad = [s for s in self.all_steps() if step is None or s > step]
        if bad:
            self._quarantine(bad)
        return bad

    def check_model(self, model_meta: dict[str, Any]) -> None:
        """Raise CheckpointError naming every field where the newest checkpoint's model differs from `model_meta`
        (see model_meta()); checked before restoring, since a restore into other shapes fails deep inside orbax."""
        step = self.latest_step()
        meta = None if step is None else self.read_meta(step)
        saved = meta.get("model") if isinstance(meta, dict) else None
        if not isinstance(saved, dict):
            return  # written before model meta was stored
        diff = [f"{k}: checkpoint {saved[k]!r}, config {model_meta.get(k)!r}" for k in sorted(saved)
                if k in model_meta and saved[k] != model_meta[k]]
        if diff:
            raise CheckpointError(f"the checkpoints in {self.directory} were made with a different model ("
                                  f"{'; '.join(diff)}): rerun with the original model config, or use a new --workdir")

    def read_meta(self, step: int) -> Any:
        """The JSON meta of checkpoint `step`, or None if it cannot be read (restore() handles unreadable steps)."""
        try:
            return self._manager.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception:  # noqa: BLE001 - an unreadable step is the fallback's business, in restore()
            return None

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
            paths.fence(corrupt_dir)
            corrupt_dir.mkdir(parents=True, exist_ok=True)
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            for s in bad_steps:
                dest = corrupt_dir / f"{s}-{stamp}"
                for i in itertools.count(1):  # the same step moved twice within a second needs its own name
                    if not dest.exists():
                        break
                    dest = corrupt_dir / f"{s}-{stamp}-{i}"
                try:
                    (self.directory / str(s)).rename(dest)
                    log.warning("moved corrupt checkpoint step %d to %s", s, dest)
                except OSError as e:
                    log.warning("could not move corrupt checkpoint step %d to %s (%s); saves at steps <= %d will be "
                                "skipped until it is removed", s, dest, e, s)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("sage_jax.run.checkpoint.quarantine")
        self._manager.reload()


class FiniteWatch:
    """Which checkpoint is known good, and what to do when a loss turns NaN/Inf.

    A checkpoint is saved before its params are used, so a finite state can still be one whose next loss is NaN
    (e.g. a huge learning rate). A saved step counts as good once a later step's metrics are finite; on a non-finite
    step the checkpoints not yet proven good are moved aside, so the step the error names is the one a rerun resumes.
    """

    def __init__(self, ckpt: Checkpointer, good: int | None):
        self.ckpt, self.good, self._unproven = ckpt, good, []

    def saved(self, step: int) -> None:
        self._unproven.append(step)

    def check(self, step: int, values) -> None:
        """values: host metrics of `step`, whose loss was computed with the params after `step` steps."""
        try:
            slog.check_finite(step, values, self.good, workdir=self.ckpt.workdir)
        except slog.NonFiniteLossError:
            moved = self.ckpt.discard_after(self.good)
            if moved:
                log.warning("moved checkpoint steps %s, whose params led to the non-finite loss, to %s", moved,
                            os.path.join(self.ckpt.workdir, "checkpoints_corrupt"))
            left = self.ckpt.all_steps()  # `keep` may have pruned the good step itself
            slog.check_finite(step, values, left[-1] if left else None, workdir=self.ckpt.workdir)
        proven = [s for s in self._unproven if s <= step]
        if proven:
            self.good = max(proven)
            self._unproven = [s for s in self._unproven if s > step]


# ModelConfig fields that decide the shapes and layout of the saved arrays.
_MODEL_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "tie_embeddings", "qkv_bias", "param_dtype", "scan_layers")


def model_meta(cfg: Any) -> dict[str, Any]:
    """The model fields a checkpoint stores in its meta under "model", for check_model on restore."""
    return {k: getattr(cfg, k) for k in _MODEL_FIELDS if hasattr(cfg, k)}


def export_hf(workdir: str | os.PathLike, cfg: Any, params: Any, tokenizer: Any = None,
              source: str | os.PathLike | None = None) -> str:
    """Write params (and the tokenizer, when given) as a Hugging Face model directory WORKDIR/hf_export, complete
    enough for AutoTokenizer / AutoModelForCausalLM; returns that path. Call on every process.

    `source` (default: the directory the HF tokenizer was loaded from, when it holds a config.json of the same
    shape) is the model the run started from: its config.json fields are kept as they were and the run's extra stop
    ids go to generation_config.json only (hf_config.export_configs)."""
    from sage_jax.models import decoder as model
    out = os.path.join(os.fspath(workdir), "hf_export")
    writer = jax.process_index() == 0
    with paths.staged_dir(out, writer) as local:  # safetensors and transformers write local files only
        model.save_hf(local, cfg, params)
        if tokenizer is not None and writer:
            hf_tokenizer(tokenizer).save_pretrained(local)
        hf = getattr(tokenizer, "hf", None)
        source = source or getattr(hf, "name_or_path", None)
        source_config = epath.Path(source) / "config.json" if source else None
        if source_config is not None and source_config.exists() and writer:
            from sage_jax.models import hf_config
            generation_file = source_config.parent / "generation_config.json"
            generation = json.loads(generation_file.read_text()) if generation_file.exists() else None
            config, generation = hf_config.export_configs(cfg, json.loads(source_config.read_text()), generation)
            (epath.Path(local) / "config.json").write_text(json.dumps(config, indent=2))
            (epath.Path(local) / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


def hf_tokenizer(tokenizer: Any) -> Any:
    """A transformers tokenizer for the project's tokenizers: the wrapped HF one, or the countdown character vocab
    rebuilt as a fast tokenizer (same ids, <bos> prepended like its encode())."""
    if getattr(tokenizer, "hf", None) is not None:
        return tokenizer.hf
    from sage_jax.rewards.countdown import CountdownTokenizer
    chars = getattr(tokenizer, "_tok", tokenizer)
    if not isinstance(chars, CountdownTokenizer):
        raise ValueError(f"cannot export a tokenizer of type {type(tokenizer).__name__}: pass an HF tokenizer wrapper "
                         "(sage_jax.data.tokenizer.Tokenizer) or the countdown tokenizer")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    # a byte-level BPE without merges: one token per character, in the form Qwen2's tokenizer class (which
    # transformers picks from config.json's model_type) rebuilds its pipeline from, so the ids stay the same
    byte_char = bytes_to_unicode()
    specials = set(chars.SPECIALS)
    vocab = {(s if s in specials else byte_char[ord(s)]): i for i, s in enumerate(chars.itos)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in chars.SPECIALS])
    pad, bos, eos = (chars.itos[i] for i in (chars.pad_id, chars.bos_id, chars.eos_id))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   add_bos_token=True)


def restore_params(workdir: str | os.PathLike, step: int, abstract_params: Any, dtype: Any) -> Any:
    """Only the params of an RL checkpoint, read straight onto their shardings. Read-only: unlike
    Checkpointer it never cleans up temporary folders, so a run still training there is left alone."""
    state_dir = epath.Path(paths.absolute(os.path.join(os.fspath(workdir), "checkpoints", str(step), "state")))
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
