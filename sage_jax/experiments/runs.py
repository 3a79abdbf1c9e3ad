"""One run of a study (study.py): the settings file, an arm's config and fingerprint, the base model (an SFT model
trained once, or pretrained weights), RL from it, the evaluation, and the run's one small result file.

A result file (JSON, a few kB) holds everything the report reads: the config's fingerprint, per split the
per-problem counts (n, correct, and the task's distinct-solution counts: measure.py), the training curves, the
guide's statistics, times (every attempt's, a stopped one included) and the command.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from sage_jax.experiments import measure
from sage_jax.experiments.measure import option
from sage_jax.run import config as config_lib

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "study/1"
SCHEMAS = (SCHEMA, "smollm2_study/1")  # result files of the SmolLM2 study's own harness are read as they are
# settings that do not change what a run computes: left out of its fingerprint (a settings file may replace them)
IGNORED = ("model.path", "tokenizer_path", "mesh.", "sft.", "rollout.slots", "eval.at_start", "eval.at_end",
           "train.allow_config_change", "train.ckpt_every", "train.eval_every", "train.export_hf", "train.keep_ckpts",
           "train.progress", "train.reward_memory_mb", "train.reward_timeout", "train.reward_workers",
           "train.sample_every", "train.use_tensorboard", "train.use_wandb", "train.logprob_rows", "experiment.arm",
           "experiment.preset", "experiment.tau_quantile", "experiment.entropy_")  # tau itself is loss.tau
BASE_KEYS = ("model.", "data.", "eval.", "seed", "experiment.data_seed", "experiment.eval_rows")
ENTROPY_KEYS = ("model.", "data.", "rollout.", "experiment.data_seed", "experiment.entropy_")
# settings added after results were made, left out while they hold the value that computes what the results did
# (so a committed result keeps its fingerprint): with rollout.partial off, oversample and max_lag are never read;
# the decode attention's platform default is the form the results were made with; without tools, none of their
# settings is read (a tuple setting reads as a list here).
# tests/experiments/test_study.py re-renders both committed studies: a setting added without an entry here fails it.
INERT = {"rollout.partial": (False, ("rollout.partial", "rollout.oversample", "rollout.max_lag")),
         "rollout.decode_attention": ("auto", ("rollout.decode_attention",)),
         "rollout.tools": ([], ("rollout.tools", "rollout.tool_format", "rollout.max_turns", "rollout.tool_timeout",
                                "rollout.max_tool_tokens", "rollout.tool_workers", "rollout.tool_return_share")),
         "sft.tool_share": (0.0, ("sft.tool_share",))}


class Job(NamedTuple):
    arm: str
    seed: int
    config: Any
    path: str          # the result file (under --out: committed)
    workdir: str       # checkpoints, metrics and samples (under --work)
    label: str
    fingerprint: str


# --------------------------------------------------------------------------------------------------- settings

def settings(path: str):
    """The settings file as a module (its ARMS, SEEDS_PER_ARM, REGIME_CANDIDATES, ...; get_config(arg))."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no settings file {path}: pass e.g. --settings configs/smollm2_arms.py")
    root = str(Path(path).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)  # settings files import their siblings as `from configs import base`
    name = "configs." + Path(path).stem if Path(path).resolve().parent.name == "configs" else Path(path).stem
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(Path(path).resolve()):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    module.PATH = str(path)
    return module


def load_config(mod, arm: str, preset: str, overrides: Sequence[str] = (), seed: int = 0,
                settings_: Mapping[str, Any] | None = None, tau: float | None = None,
                loss: Mapping[str, float] | None = None):
    """The arm's config, with `settings_` (a regime candidate's, dotted keys), loss overrides (a sweep cell's) and
    Branch's resolved tau."""
    config = config_lib.load(f"{mod.PATH}:{arm},{preset}", overrides)
    loss = loss or {}
    for key, value in {**(settings_ or {}), **{f"loss.{k}": v for k, v in loss.items()}}.items():
        *path, leaf = key.split(".")
        node = config
        for part in path:
            node = node[part]
        node[leaf] = value
    config.seed = seed
    if tau is not None and config.loss.guide == "branch" and "tau" not in loss and takes_tau(config):
        config.loss.tau = float(tau)
    return config


def takes_tau(config) -> bool:
    return config.experiment.get("tau_quantile", 0) > 0


def flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def _matches(key: str, patterns: Sequence[str]) -> bool:
    """key is one of patterns, or starts with one that ends in "." or "_" (a section or a family of keys)."""
    return any(key == p or (p.endswith((".", "_")) and key.startswith(p)) for p in patterns)


def _picked(mod, config, keep: Sequence[str] | None) -> dict[str, Any]:
    """The flat settings in `keep` (None: all but the ignored ones)."""
    items = flat(config.to_dict())
    inert = {k for key, (off, keys) in INERT.items() if items.get(key) == off for k in keys}
    ignored = option(mod, "IGNORED", IGNORED)
    return {k: v for k, v in items.items()
            if k not in inert and not _matches(k, ignored) and (keep is None or _matches(k, keep))}


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(mod, config) -> str:
    """What a finished result is matched on: every setting that changes the run (the base: its evaluation only)."""
    kind = "run" if config.experiment.rl else "base"
    return _hash({"kind": kind, **_picked(mod, config, None if kind == "run" else option(mod, "BASE_KEYS", BASE_KEYS))})


def sft_fingerprint(mod, config) -> str:
    """What an SFT base is matched on: the settings' SFT_KEYS where it names them (so base arms that differ in their
    evaluation alone share one base), else the base arm's fingerprint."""
    keys = option(mod, "SFT_KEYS")
    return fingerprint(mod, config) if keys is None else _hash({"kind": "sft", **_picked(mod, config, keys)})


def entropy_fingerprint(mod, config) -> str:
    return _hash(_picked(mod, config, option(mod, "ENTROPY_KEYS", ENTROPY_KEYS)))


def differences(mod, config) -> dict[str, Any]:
    """Every setting that differs from the settings file's REFERENCE config, model.path aside."""
    preset = config.experiment.get("preset", config.experiment.get("budget"))
    ref = flat(config_lib.load(mod.reference(preset)).to_dict())
    mine = sorted(flat(config.to_dict()).items())
    return {k: v for k, v in mine if ref.get(k, "<absent>") != v and k != "model.path"}


# --------------------------------------------------------------------------------------------------- result files

def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        x = x.item()
    return None if isinstance(x, float) and not math.isfinite(x) else x


def write_result(path: str, record: Mapping[str, Any]) -> None:
    """One top-level key per line (small diffs when a run is redone), written under a temporary name first."""
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v, sort_keys=True, separators=(',', ':'))}"
                      for k, v in sorted(_jsonable(record).items()))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("{\n" + body + "\n}\n")
    os.replace(tmp, path)


def read_json(path: str) -> Any:
    """A JSON file, or one line naming it when it is cut short or not JSON (a copy interrupted, a bad merge)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is cut short or not JSON (at line {e.lineno}): restore it (git checkout) or "
                         "delete it to redo that run") from None


def read_result(path: str) -> dict[str, Any] | None:
    """A result file (either schema), its evaluation as {split: {column: per-problem list}}; None if absent."""
    if not os.path.exists(path):
        return None
    record = read_json(path)
    if not isinstance(record, dict) or record.get("schema") not in SCHEMAS:
        return None
    if "n" in record.get("eval", {}):  # the SmolLM2 harness's one split
        record["eval"] = {"heldout": record["eval"]}
    return record


@contextlib.contextmanager
def claim(run_dir: str) -> Iterator[bool]:
    """Whether this process may run `run_dir`: False while another live process holds its claim file, so several
    processes started with the same command share one work list (each run is done once)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "claim.pid")
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                os.kill(int(Path(path).read_text().strip() or 0), 0)
            except (ValueError, ProcessLookupError, FileNotFoundError):  # stale: its process is gone
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                continue
            except PermissionError:
                pass
            yield False
            return
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        try:
            yield True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        return
    yield False


# --------------------------------------------------------------------------------------------------- times

def spent(workdir: str, **phase: float) -> dict[str, float]:
    """Add a phase's times to workdir/times.json and return the totals: a resumed run's file counts every attempt."""
    path = os.path.join(workdir, "times.json")
    totals: dict[str, float] = read_json(path) if os.path.exists(path) else {}
    for key, value in phase.items():
        totals[key] = totals.get(key, 0) + value
    write_result(path, totals)
    return totals


@contextlib.contextmanager
def timed(workdir: str, phase: str) -> Iterator[None]:
    """Record the phase's wall and CPU time however it ends: a run stopped by SIGINT / SIGTERM at a step boundary
    (guard.Stopped) keeps the time its steps took, and the resumed attempt adds its own."""
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        spent(workdir, **{f"{phase}_wall_s": time.perf_counter() - t0, f"{phase}_cpu_s": time.process_time() - c0})


def host() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()],
            "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


# --------------------------------------------------------------------------------------------------- one run

def record(mod, job: Job, evals, curves, times, weights: str, command: str) -> dict[str, Any]:
    config = job.config
    guide = None
    if curves.get("step"):  # the guide's statistics, averaged over all RL steps
        mean = lambda name: (statistics.fmean(v for v in curves[name] if v is not None)
                             if any(v is not None for v in curves.get(name, [])) else None)
        guide = {"name": config.loss.guide, "q_mean": mean("q_mean"), "q_active": mean("q_active"),
                 "q_p90": mean("q_p90")}
    same_arm = config.copy_and_resolve_references()
    same_arm.seed = 0  # the arm's settings without the seed: the report checks an arm's seeds share them
    return {"schema": SCHEMA, "arm": job.arm, "seed": job.seed, "fingerprint": job.fingerprint,
            "arm_fingerprint": fingerprint(mod, same_arm), "settings": differences(mod, config),
            "tau": float(config.loss.tau) if config.loss.guide == "branch" else None, "weights": weights,
            "n": int(config.eval.n), "eval": evals, "guide": guide, "curves": curves, "times": times,
            "command": command, "host": host()}


def run_job(mod, job: Job, task, base, command: str) -> dict[str, Any]:
    """Train (unless the base arm) and evaluate; writes job.path and returns its record. base: measure.load_base's.
    Both phases resume: RL from the workdir's last checkpoint, the evaluation from its samples."""
    cfg, host_params, weights = base
    config = job.config
    spent(job.workdir, attempts=1)  # processes that started this run (more than 1: it was resumed)
    t0 = time.perf_counter()
    curves: dict[str, list] = {}
    run_cfg, policy = cfg, None
    if config.experiment.rl:
        from sage_jax.training import trainer
        with timed(job.workdir, "train"):
            result = trainer.run_rl(config, job.workdir, task=task, params_override=host_params)
        curves = measure.training_curves(job.workdir)
        run_cfg, policy = result.cfg, result.policy
    with timed(job.workdir, "eval"):
        evals = measure.evaluate(mod, task, run_cfg, policy, host_params, config, job.workdir)
    times = spent(job.workdir)
    steps = [s for s in curves.get("step_s", []) if s is not None]
    times |= {"eval_rows": int(sum(sum(e["n"]) for e in evals.values())),
              "this_attempt_wall_s": time.perf_counter() - t0}
    if steps:  # wall time of every RL step, whichever attempt ran it; the median leaves the compiling first out
        times |= {"steps_s_sum": float(sum(steps)), "step_s": statistics.median(steps[1:] or steps)}
    out = record(mod, job, evals, curves, times, weights, command)
    write_result(job.path, out)
    print(f"[{job.label}] " + (f"RL {config.train.steps} steps {times['train_wall_s']:.0f}s, " if curves else "")
          + f"eval {times['eval_wall_s']:.0f}s | " + ", ".join(
              f"{s} pass@1 {np.mean(e['correct']) / config.eval.n:.3f}" for s, e in evals.items()), flush=True)
    return out
