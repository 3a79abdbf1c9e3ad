"""Seeing the run: metrics to JSONL + TensorBoard (+ optional wandb), samples, a progress bar, one-step-late
metric fetching, the NaN guard, and stdlib logging to console and WORKDIR/log.txt.

Import as `from sage_jax.run import metrics_log as slog` (named so that it shadows no standard-library module).
Only the primary process (jax.process_index() == 0) writes files. Every file goes through run/paths.py, so a gs://
workdir gets them in the bucket: metrics.jsonl and samples.jsonl are appended to with one compose per log call, and
log.txt is appended to in batches (run/log_files.py).
"""

from __future__ import annotations

import json
import logging as pylogging
import math
import os
import sys
import time
from typing import Any, Mapping, Sequence, TextIO

import jax
import numpy as np

from sage_jax.run import paths
from sage_jax.run.log_files import BucketLog as _BucketLog, Fenced as _Fenced

log = pylogging.getLogger(__name__)


def _is_primary(is_primary: bool | None) -> bool:
    return jax.process_index() == 0 if is_primary is None else bool(is_primary)


def _scalar(name: str, value: Any) -> float:
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"metric {name!r} has shape {arr.shape}; log scalars only (reduce it first, e.g. .mean())")
    return float(arr.reshape(()))


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def to_host(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Device scalars -> python floats, in one transfer."""
    host = jax.device_get(dict(metrics))
    return {k: _scalar(k, v) for k, v in host.items()}


class MetricsLogger:
    """Appends {"step", "time", **metrics} lines to WORKDIR/metrics.jsonl and scalars to WORKDIR/tb/.

    resume_step: a run resuming at that step first drops the rows of steps >= it (the killed run's last steps, which
    the resumed run logs again), so each step's rows appear once.
    """

    def __init__(self, workdir: str | os.PathLike, config_dict: Mapping[str, Any] | None = None,
                 use_tensorboard: bool = True, use_wandb: bool = False, is_primary: bool | None = None,
                 resume_step: int | None = None):
        self.workdir = os.fspath(workdir)
        self.enabled = _is_primary(is_primary)
        self._metrics_file: str | None = None  # the paths appended to (None once closed)
        self._samples_file: str | None = None
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        paths.makedirs(self.workdir)
        for name in ("metrics.jsonl", "samples.jsonl"):
            paths.remove_parts(os.path.join(self.workdir, name))  # a killed append's leftovers (on a bucket)
            if resume_step is not None:
                _drop_rows_from(os.path.join(self.workdir, name), int(resume_step))
        self._metrics_file = os.path.join(self.workdir, "metrics.jsonl")
        self._samples_file = os.path.join(self.workdir, "samples.jsonl")
        config_json = None
        if config_dict is not None:
            config_json = json.dumps(_plain(config_dict), indent=2, sort_keys=True, default=str)
            paths.write_text(os.path.join(self.workdir, "config.json"), config_json + "\n")
        if use_tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(self.workdir, "tb"), flush_secs=30)
            if config_json is not None:
                self._tb.add_text("config", _indent(config_json), 0)
        if use_wandb:
            try:
                import wandb
            except ImportError:
                log.warning("use_wandb=True but wandb is not installed (pip install wandb); logging without it")
            else:
                local = None if paths.is_remote(self.workdir) else self.workdir  # wandb writes ./wandb then
                self._wandb = wandb.init(dir=local, name=os.path.basename(paths.absolute(self.workdir).rstrip("/")),
                                         config=_plain(config_dict) if config_dict is not None else None,
                                         resume="allow")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        step = int(step)
        values = {k: _scalar(k, v) for k, v in metrics.items()}
        row = {"step": step, "time": time.time(), **{k: _finite_or_none(v) for k, v in values.items()}}
        paths.append_text(self._metrics_file, json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Each sample: {"prompt", "completion", "reward", ...}; extra keys are kept in the JSONL."""
        if not self.enabled or not samples:
            return
        step = int(step)
        paths.append_text(self._samples_file, "".join(json.dumps({"step": step, **_plain(dict(s))}, default=str) + "\n"
                                                      for s in samples))
        if self._tb is not None:
            self._tb.add_text("samples", _samples_markdown(samples), step)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self._metrics_file = self._samples_file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _drop_rows_from(path: str, step: int) -> None:
    """Rewrite a JSONL log without the rows of steps >= step (and any line cut off by a kill)."""
    try:
        lines = paths.read_text(path).splitlines(keepends=True)
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < step:
            kept.append(line if line.endswith("\n") else line + "\n")
    paths.write_text(path, "".join(kept))


def _plain(x: Any) -> Any:
    """ConfigDicts, numpy scalars and tuples -> JSON-friendly python values."""
    if hasattr(x, "to_dict"):
        x = x.to_dict()
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        arr = np.asarray(x)
        return arr.item() if arr.size == 1 and arr.ndim == 0 else arr.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _indent(text: str, max_chars: int = 4000) -> str:
    """Markdown code block by indentation: model text may contain backticks, so fences could break."""
    if len(text) > max_chars:
        text = text[:max_chars] + "\n... (truncated)"
    return "\n".join("    " + line for line in text.splitlines())


def _samples_markdown(samples: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    for i, s in enumerate(samples):
        parts.append(f"**sample {i}** reward: {s.get('reward')}\n\n"
                     f"{_indent(str(s.get('prompt', '')), 1500)}\n\n---\n\n{_indent(str(s.get('completion', '')))}")
    return "\n\n".join(parts)


# -- console progress ---------------------------------------------------------------------------------------------
_POSTFIX_KEYS = (("reward", "rl/reward"), ("kl", "rl/kl"), ("entropy", "rl/entropy"),
                 ("q_mean", "sage/q_mean"), ("q_max", "sage/q_max"))


def _short(x: float) -> str:
    return f"{x:.3g}" if (x == 0 or 1e-3 <= abs(x) < 1e4) else f"{x:.2e}"


COMPILING = "compiling the step's programs (the first step; the ETA counts the steps after it)"


class Progress:
    """tqdm bar on stderr with ETA; postfix shows reward, KL, entropy, q mean/max and seconds per step.

    Each postfix field keeps its last value, so updates carrying different metric subsets (this step's host
    values, last step's late device values) do not blank each other out. enabled=None: primary process only.
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool | None = None, file: TextIO | None = None,
                 desc: str = "train"):
        from tqdm.auto import tqdm
        self.enabled = _is_primary(None) if enabled is None else bool(enabled)
        self._fields: dict[str, str] = {}
        self._step = int(initial)
        self.desc, self.total = desc, int(total)
        self._time = time.perf_counter()
        self._bar = tqdm(total=int(total), initial=int(initial), desc=desc, unit="step",
                         file=file if file is not None else sys.stderr, disable=not self.enabled,
                         dynamic_ncols=True, mininterval=1.0, smoothing=0.1)
        self._compiling = True  # the first step compiles its programs: said, and left out of the ETA
        if self.enabled:
            self._bar.set_postfix_str(COMPILING)

    @property
    def postfix(self) -> str:
        return ", ".join(f"{label}={self._fields[label]}" for label, _ in _POSTFIX_KEYS + (("step_s", ""),)
                         if label in self._fields)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Move the bar to `step` (steps done so far) and refresh the postfix from `metrics`."""
        step, now = int(step), time.perf_counter()
        steps_done = step - self._step
        for label, key in _POSTFIX_KEYS:
            if metrics and key in metrics:
                self._fields[label] = _short(_scalar(key, metrics[key]))
        if steps_done > 0:
            self._fields["step_s"] = f"{(now - self._time) / steps_done:.2f}"
            self._step, self._time = step, now
            self._log_line(step)
        if not self.enabled:
            return
        self._bar.set_postfix_str(self.postfix, refresh=False)
        if steps_done > 0:
            self._bar.update(steps_done)
            if self._compiling:  # the rate (and so the ETA) from the steps after the compiles only
                self._compiling = False
                self._bar.reset(total=self.total)
                self._bar.initial = self._bar.n = step
                self._bar.refresh()
        else:
            self._bar.refresh()

    def _log_line(self, step: int) -> None:
        """Each step's one-line summary goes to log.txt always, and to the console when there is no bar (with
        train.progress=False a run is otherwise silent until its end); the bar's own line is the console's."""
        if not _is_primary(None):
            return
        record = log.makeRecord(log.name, pylogging.INFO, __file__, 0,
                                f"{self.desc} step {step}/{self.total}: {self.postfix}", None, None)
        if not self.enabled:
            log.handle(record)
        for handler in pylogging.getLogger().handlers:
            if self.enabled and isinstance(handler, (pylogging.FileHandler, _BucketLog)) and \
                    record.levelno >= handler.level:
                handler.handle(record)
            if isinstance(handler, _BucketLog):  # each step's line is in the bucket when the step's metrics are
                handler.flush()

    def close(self) -> None:
        self._bar.close()


# -- asynchronous dispatch -----------------------------------------------------------------------------------------
class LateMetrics:
    """Fetch step N-1's metrics while step N runs: handing step N's device dict in returns step N-1's host floats.

    Pulling the current step's values to the host would block until it finishes and stall dispatch of the next.
    """

    def __init__(self):
        self._pending: tuple[int, Mapping[str, Any]] | None = None

    def push(self, step: int, device_metrics: Mapping[str, Any]) -> tuple[int, dict[str, float]] | None:
        """Store step's metrics; return (previous step, its host metrics), or None on the first call."""
        previous, self._pending = self._pending, (int(step), device_metrics)
        return None if previous is None else (previous[0], to_host(previous[1]))

    def flush(self) -> tuple[int, dict[str, float]] | None:
        """The held step's host metrics (at the end of training); None if nothing is held."""
        previous, self._pending = self._pending, None
        return None if previous is None else (previous[0], to_host(previous[1]))


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf."""


def check_finite(step: int, metrics: Mapping[str, Any], last_good_checkpoint_step: int | None,
                 workdir: str | os.PathLike | None = None) -> None:
    """Raise NonFiniteLossError if any "loss", "loss/*" or "opt/grad_norm" metric is NaN/Inf, or the step's update
    was dropped as non-finite ("opt/nonfinite_update" > 0); metrics are host values."""
    watched = lambda k: k == "loss" or k.startswith("loss/") or k == "opt/grad_norm"
    bad = sorted(k for k, v in metrics.items() if watched(k) and not math.isfinite(_scalar(k, v)))
    bad += [k for k, v in metrics.items() if k == "opt/nonfinite_update" and _scalar(k, v) > 0]
    if not bad:
        return
    where = os.path.join(os.fspath(workdir), "checkpoints") if workdir is not None else "the workdir's checkpoints"
    if last_good_checkpoint_step is None:
        resume = (f"no good checkpoint in {where} (restart from scratch, e.g. with a lower learning rate)")
    else:
        resume = (f"last good checkpoint: step {last_good_checkpoint_step} in {where} "
                  f"(restart to resume from it, e.g. with a lower learning rate)")
    raise NonFiniteLossError(f"loss became NaN/Inf at step {int(step)} ({', '.join(bad)}); {resume}")


# -- stdlib logging --------------------------------------------------------------------------------------------------
_NOISY_LOGGERS = ("absl", "jax._src", "orbax", "tensorstore", "urllib3", "filelock", "fsspec", "gcsfs", "google")


def setup_python_logging(workdir: str | os.PathLike | None = None, level: int | str = "INFO",
                         is_primary: bool | None = None) -> None:
    """Root logger -> stderr (all processes; non-primary only warnings) and WORKDIR/log.txt (primary only).

    Safe to call again: replaces the handlers it installed before (and a logging.basicConfig() one).
    """
    primary = _is_primary(is_primary)
    level = pylogging.getLevelName(level.upper()) if isinstance(level, str) else int(level)
    if not isinstance(level, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
    prefix = "" if jax.process_count() == 1 else f"[p{jax.process_index()}] "
    formatter = pylogging.Formatter(f"%(asctime)s %(levelname).1s {prefix}%(name)s] %(message)s", "%H:%M:%S")
    root = pylogging.getLogger()
    # ours from an earlier call, and the stderr handler of logging.basicConfig(), which absl calls when a library
    # logs through it before anything configured logging (orbax does at import): it would print every line twice
    basic = lambda h: getattr(h.formatter, "_fmt", None) == pylogging.BASIC_FORMAT
    for h in [h for h in root.handlers if getattr(h, "_sage_jax", False) or basic(h)]:
        root.removeHandler(h)
        h.close()
    handlers: list[pylogging.Handler] = [pylogging.StreamHandler(sys.stderr)]
    handlers[0].setLevel(level if primary else max(level, pylogging.WARNING))
    if primary and workdir is not None:
        paths.makedirs(workdir)
        log_txt = os.path.join(os.fspath(workdir), "log.txt")
        paths.remove_parts(log_txt)  # a killed append's leftovers (on a bucket)
        handlers.append(_BucketLog(log_txt) if paths.is_remote(log_txt) else
                        pylogging.FileHandler(log_txt, encoding="utf-8"))
        handlers[-1].setLevel(level)
        handlers[-1].addFilter(_Fenced())
    for h in handlers:
        h.setFormatter(formatter)
        h._sage_jax = True
        root.addHandler(h)
    root.setLevel(level)
    for name in _NOISY_LOGGERS:
        pylogging.getLogger(name).setLevel(max(level, pylogging.WARNING))
