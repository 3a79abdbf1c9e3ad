"""One run of the SmolLM2 study (smollm2_study.py): the arm's config, its fingerprint, RL from the pretrained model
(LoRA, resumable from the run's workdir), the held-out evaluation and the run's one small result file.

A result file (JSON, a few kB) holds everything the report reads: the config's fingerprint and its differences from
configs/smollm2_cpu.py, per-problem correct counts among n samples (pass@1..n by the unbiased estimator), distinct
correct replies and arithmetic forms per problem, the training curves from the run's metrics (reward, entropy, KL,
the guide's sage/q_mean and sage/q_active: the share of tokens with q != 1), times and the command.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from sage_jax.run import config as config_lib

ROOT = Path(__file__).resolve().parents[2]
CONFIG_FILE = ROOT / "configs" / "smollm2_arms.py"
SCHEMA = "smollm2_study/1"
EVAL_SEED = 20_000  # evaluation sampling key: EVAL_SEED + seed, the same for every arm (common random numbers)
ENTROPY_SEED = 12_345
SPLIT = "heldout"  # the report's name for the one evaluation set
# settings that do not change what a run computes: left out of its fingerprint
IGNORED = ("model.path", "tokenizer_path", "mesh.", "sft.", "rollout.slots", "eval.at_start", "eval.at_end",
           "train.allow_config_change", "train.ckpt_every", "train.eval_every", "train.export_hf", "train.keep_ckpts",
           "train.progress", "train.reward_memory_mb", "train.reward_timeout", "train.reward_workers",
           "train.sample_every", "train.use_tensorboard", "train.use_wandb", "train.logprob_rows", "experiment.arm",
           "experiment.preset", "experiment.tau_quantile", "experiment.entropy_")  # tau itself is loss.tau
BASE_KEYS = ("model.", "data.", "eval.", "seed", "experiment.data_seed", "experiment.eval_rows")
ENTROPY_KEYS = ("model.", "data.", "rollout.", "experiment.data_seed", "experiment.entropy_")
# settings added after results were made, left out while they hold the value that computes what the results did
# (so a committed result keeps its fingerprint): with rollout.partial off, oversample and max_lag are never read
INERT = {"rollout.partial": (False, ("rollout.partial", "rollout.oversample", "rollout.max_lag"))}


class Job(NamedTuple):
    arm: str
    seed: int
    config: Any
    path: str          # the result file (under --out: committed)
    workdir: str       # checkpoints, metrics and samples (under --work)
    label: str
    fingerprint: str


# --------------------------------------------------------------------------------------------------- configs

def arms_module():
    config_lib.load_file(f"{CONFIG_FILE}:grpo")  # puts the repository root on sys.path for `configs`
    from configs import smollm2_arms
    return smollm2_arms


def load_config(arm: str, preset: str = "study", overrides: Sequence[str] = (), seed: int = 0,
                settings: Mapping[str, Any] | None = None, tau: float | None = None):
    """The arm's config, with `settings` (a regime candidate's, dotted keys) and Branch's resolved tau."""
    config = config_lib.load(f"{CONFIG_FILE}:{arm},{preset}", overrides)
    for key, value in (settings or {}).items():
        *path, leaf = key.split(".")
        node = config
        for part in path:
            node = node[part]
        node[leaf] = value
    config.seed = seed
    if tau is not None and config.loss.guide == "branch" and config.experiment.tau_quantile > 0:
        config.loss.tau = float(tau)
    return config


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


def _picked(config, keep: Sequence[str] | None) -> dict[str, Any]:
    """The flat settings in `keep` (None: all but IGNORED)."""
    items = flat(config.to_dict())
    inert = {k for key, (off, keys) in INERT.items() if items.get(key) == off for k in keys}
    return {k: v for k, v in items.items()
            if k not in inert and (_matches(k, keep) if keep is not None else not _matches(k, IGNORED))}


def fingerprint(config) -> str:
    """What a finished result is matched on: every setting that changes the run (the base: its evaluation only)."""
    kind = "run" if config.experiment.rl else "base"
    picked = _picked(config, None if kind == "run" else BASE_KEYS)
    text = json.dumps({"kind": kind, **picked}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entropy_fingerprint(config) -> str:
    return hashlib.sha256(json.dumps(_picked(config, ENTROPY_KEYS), sort_keys=True, default=str).encode()
                          ).hexdigest()[:16]


def differences(config) -> dict[str, Any]:
    """Every setting that differs from configs/smollm2_cpu.py (its `quick` preset under `quick`), model.path aside."""
    ref = flat(config_lib.load(str(ROOT / "configs" / "smollm2_cpu.py")
                               + (":quick" if config.experiment.preset == "quick" else "")).to_dict())
    mine = flat(config.to_dict()).items()
    return {k: v for k, v in sorted(mine) if ref.get(k, "<absent>") != v and k != "model.path"}


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


def read_result(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    return record if isinstance(record, dict) and record.get("schema") == SCHEMA else None


# --------------------------------------------------------------------------------------------------- measures

_MUL = re.compile(r"(?<=\d)\s*[x×X*]\s*(?=\d)")
_EXPR = re.compile(r"\d+(?:\.\d+)?(?:\s*[-+*/=]\s*\d+(?:\.\d+)?)*")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def arithmetic_form(text: str) -> str:
    """The arithmetic a reply writes out, wording dropped: "Sam has 10 + 3 = 13 balloons." -> "10+3=13"."""
    text = _MUL.sub("*", text).replace("÷", "/")
    return ";".join(re.sub(r"\s+", "", m) for m in _EXPR.findall(text))


def _normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower()).rstrip(" .!")


def problem_stats(records: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """Per problem (in the given order): correct samples of n, distinct correct replies (normalised text),
    distinct arithmetic forms among the correct ones, distinct last numbers over all n samples."""
    out: dict[str, list] = {"ids": [], "n": [], "correct": [], "distinct_correct": [], "distinct_forms": [],
                            "distinct_answers": []}
    for r in records:
        good = [t for t, x in zip(r["completions"], r["rewards"]) if x >= 1.0]
        answers = {(_NUMBER.findall(t) or [""])[-1].replace(",", "") for t in r["completions"]}
        for key, value in (("ids", str(r["id"])), ("n", int(r["n"])), ("correct", int(r["num_correct"])),
                           ("distinct_correct", len({_normalized(t) for t in good})),
                           ("distinct_forms", len({arithmetic_form(t) for t in good})),
                           ("distinct_answers", len(answers - {""}))):
            out[key].append(value)
    return out


def pass_at_k(stats: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """Mean unbiased pass@k over problems for k = 1..n."""
    from sage_jax.experiments.stats import pass_curve
    curve = pass_curve([{"n": n, "correct": c} for n, c in zip(stats["n"], stats["correct"])])
    return {str(k): v for k, v in enumerate(curve, start=1)}


# --------------------------------------------------------------------------------------------------- the model

def build_task(config):
    """The task with the problem sets of experiment.data_seed (tasks.build draws them from config.seed)."""
    from sage_jax.data import tasks
    data_config = config.copy_and_resolve_references()
    data_config.seed = int(config.experiment.data_seed)
    task = tasks.build(data_config)
    if "arith_words" in task.evals and len(task.evals["arith_words"]) < config.eval.problems:
        raise ValueError(f"the held-out set has {len(task.evals['arith_words'])} problems, eval.problems asks for "
                         f"{config.eval.problems}: raise data.num_eval")
    return task


@contextlib.contextmanager
def on_mesh(config) -> Iterator[Any]:
    import jax
    from sage_jax.models import sharding
    mesh, _ = sharding.make_meshes(tuple(config.mesh.shape), 0)
    with jax.set_mesh(mesh), sharding.use_rules(dict(config.mesh.rules)):
        yield mesh


def load_base(config, task) -> tuple[Any, Any, str]:
    """(model config, host parameters, weights fingerprint) of the pretrained model at config.model.path."""
    import jax
    from sage_jax.models import build, sharding
    if not os.path.isdir(config.model.path):
        raise FileNotFoundError(f"no model at {config.model.path}: convert the GGUF (configs/smollm2_cpu.py's "
                                "docstring) or pass --config.model.path=DIR")
    with on_mesh(config) as mesh:
        cfg, params = build.load_or_init_params(config, mesh, dict(config.mesh.rules), task.tokenizer)
        weights = sharding.fingerprint(params)
        return cfg, jax.device_get(params), weights


def eval_examples(task, config) -> list:
    return task.evals[config.data.eval][:config.eval.problems]


def evaluate_policy(task, cfg, params, config, out_dir: str) -> dict[str, list]:
    """n samples per held-out problem (resumable: out_dir/samples.jsonl), scored as in training: problem_stats."""
    from sage_jax.eval import passk as evaluation
    from sage_jax.rewards import math as math_reward
    ev = config.eval
    batch_problems = max(1, config.experiment.eval_rows // ev.n)
    sampling = dict(max_new_tokens=ev.max_new_tokens, temperature=ev.temperature, top_p=ev.top_p, min_p=ev.min_p)
    generate_fn = evaluation.make_generate_fn(cfg, params, task.tokenizer.decode, sampling, EVAL_SEED + config.seed,
                                              max_rows=batch_problems * ev.n)
    examples = eval_examples(task, config)
    evaluation.evaluate(task.tokenizer, examples, lambda text, ex: math_reward.score(text, task.gold(ex)), n=ev.n,
                        ks=list(ev.ks), out_dir=out_dir, generate_fn=generate_fn, batch_problems=batch_problems,
                        template=task.template, run_name=config.experiment.arm, progress=False)
    by_id = {str(r["id"]): r for r in evaluation.read_samples(os.path.join(out_dir, "samples.jsonl"))}
    return problem_stats([by_id[str(ex.meta["id"])] for ex in examples])


def entropy_profile(task, cfg, params, config) -> dict[str, Any]:
    """Per-token entropy of the base policy on its own held-out samples, at the rollout's temperature (what Branch
    compares with tau): mean, count and the quantile grid 0, 0.01, ..., 1 (worklist.tau_at reads it)."""
    import jax
    from sage_jax.training import rollouts, state as train_state
    ex = config.experiment
    ro_cfg = config.rollout.copy_and_resolve_references()
    with ro_cfg.unlocked():
        ro_cfg.group_size = int(ex.entropy_group)
    ro = rollouts.rollout(task, cfg, params, eval_examples(task, config)[:ex.entropy_prompts], ro_cfg,
                          jax.random.key(ENTROPY_SEED), config.data.max_prompt_len)
    batch = rollouts.build_batch(ro, np.zeros(len(ro["texts"]), np.float32), cfg.pad_token_id, ro_cfg.max_new_tokens)
    _, entropy_NxC = train_state.sequence_logprobs(cfg, params, batch["tokens"], batch["mask"],
                                                   prompt_len=ro["prompt_tokens"].shape[1],
                                                   temperature=ro_cfg.temperature or 1.0,
                                                   rows_per_pass=int(config.train.logprob_rows))
    ent = np.asarray(entropy_NxC)[batch["completion_mask"] > 0]
    return {"mean": float(ent.mean()), "tokens": int(ent.size),
            "grid": [float(v) for v in np.quantile(ent, np.linspace(0.0, 1.0, 101))]}


# --------------------------------------------------------------------------------------------------- one run

def _host() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()],
            "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def _record(job: Job, stats, curves, times, weights: str, command: str, tau: float | None) -> dict[str, Any]:
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
            "arm_fingerprint": fingerprint(same_arm),
            "settings": differences(config), "tau": tau if config.loss.guide == "branch" else None,
            "weights": weights, "problems": len(stats["ids"]), "n": int(config.eval.n), "eval": stats,
            "pass_at_k": pass_at_k(stats), "guide": guide, "curves": curves, "times": times,
            "command": command, "host": _host()}


def _spent(workdir: str, **phase: float) -> dict[str, float]:
    """Add a finished phase's times to workdir/times.json and return the totals: a resumed run's file counts every
    attempt (an attempt stopped mid-phase loses only that phase's part)."""
    path = os.path.join(workdir, "times.json")
    totals: dict[str, float] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            totals = json.load(f)
    for key, value in phase.items():
        totals[key] = totals.get(key, 0) + value
    write_result(path, totals)
    return totals


def run_job(job: Job, task, base, command: str) -> dict[str, Any]:
    """Train (unless the base arm) and evaluate; writes job.path and returns its record. base: load_base's. Both
    phases resume: RL from the workdir's last checkpoint, the evaluation from its samples.jsonl."""
    import jax
    from sage_jax.experiments import measure
    from sage_jax.training import trainer
    cfg, host_params, weights = base
    config = job.config
    _spent(job.workdir, attempts=1)  # processes that started this run (more than 1: it was resumed)
    t0, c0 = time.perf_counter(), time.process_time()
    curves: dict[str, list] = {}
    run_cfg, policy = cfg, None
    if config.experiment.rl:
        result = trainer.run_rl(config, job.workdir, task=task, params_override=host_params)
        _spent(job.workdir, train_wall_s=time.perf_counter() - t0, train_cpu_s=time.process_time() - c0)
        curves = measure.training_curves(job.workdir)
        run_cfg, policy = result.cfg, result.policy
    t1, c1 = time.perf_counter(), time.process_time()
    with on_mesh(config) as mesh:
        if policy is None:
            from sage_jax.models import decoder as model_lib
            policy = jax.device_put(host_params, model_lib.param_shardings(cfg, mesh, dict(config.mesh.rules)))
        stats = evaluate_policy(task, run_cfg, policy, config, os.path.join(job.workdir, "eval"))
    times = _spent(job.workdir, eval_wall_s=time.perf_counter() - t1, eval_cpu_s=time.process_time() - c1)
    steps = [s for s in curves.get("step_s", []) if s is not None]
    times |= {"eval_rows": int(sum(stats["n"])), "this_attempt_wall_s": time.perf_counter() - t0}
    if steps:  # wall time of every RL step, whichever attempt ran it; the median leaves the compiling first out
        times |= {"steps_s_sum": float(sum(steps)), "step_s": statistics.median(steps[1:] or steps)}
    record = _record(job, stats, curves, times, weights, command,
                     float(config.loss.tau) if config.experiment.tau_quantile > 0 else None)
    write_result(job.path, record)
    p = record["pass_at_k"]
    print(f"[{job.label}] " + (f"RL {config.train.steps} steps {times['train_wall_s']:.0f}s, " if curves else "")
          + f"eval {times['eval_wall_s']:.0f}s | pass@1 {p['1']:.3f} pass@{record['n']} {p[str(record['n'])]:.3f}"
          + (f" (times over {times['attempts']:.0f} attempts)" if times.get("attempts", 1) > 1 else ""), flush=True)
    return record
