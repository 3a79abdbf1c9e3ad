"""What a study measures and starts from: the task and its evaluation splits, the base model (an SFT model trained
once, or pretrained weights), the held-out evaluation with per-problem counts, the base's token entropies, and the
training curves of a run.

Per problem an evaluation keeps the counts the report needs (pass@k for every k comes from the correct count):
countdown: distinct correct solutions (countdown.canonical forms), all solutions there are (countdown.solve) and the
strategy of every correct sample; other tasks: distinct correct replies, distinct arithmetic forms among them and
distinct final numbers among all samples.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
from collections import Counter
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

EVAL_SEED = 20_000  # evaluation sampling key: EVAL_SEED + seed, the same for every arm (common random numbers)
ENTROPY_SEED = 12_345
SPLITS = {"heldout": ("", "eval.problems")}  # report name: (task eval set, "" for data.eval; the size's setting)




def option(mod, name: str, default: Any = None) -> Any:
    """A settings file's NAME, else the harness's default."""
    return getattr(mod, name, default)


# --------------------------------------------------------------------------------------------------- per problem

def countdown_stats(texts: Sequence[str], rewards: Sequence[float], ex) -> dict[str, Any]:
    from sage_jax.rewards import countdown
    good = [countdown.extract_expression(t)[0] for t, r in zip(texts, rewards) if r >= 1.0]
    return {"distinct": len({countdown.canonical(e) for e in good}),
            "solutions": len(countdown.solve(ex.meta["numbers"], int(ex.meta["target"]))),
            "strategies": dict(Counter(countdown.strategy(e) for e in good))}


_MUL = re.compile(r"(?<=\d)\s*[x×X*]\s*(?=\d)")
_EXPR = re.compile(r"\d+(?:\.\d+)?(?:\s*[-+*/=]\s*\d+(?:\.\d+)?)*")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def arithmetic_form(text: str) -> str:
    """The arithmetic a reply writes out, wording dropped: "Sam has 10 + 3 = 13 balloons." -> "10+3=13"."""
    text = _MUL.sub("*", text).replace("÷", "/")
    return ";".join(re.sub(r"\s+", "", m) for m in _EXPR.findall(text))


def _normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower()).rstrip(" .!")


def words_stats(texts: Sequence[str], rewards: Sequence[float], ex=None) -> dict[str, Any]:
    good = [t for t, x in zip(texts, rewards) if x >= 1.0]
    answers = {(_NUMBER.findall(t) or [""])[-1].replace(",", "") for t in texts}
    return {"distinct_correct": len({_normalized(t) for t in good}),
            "distinct_forms": len({arithmetic_form(t) for t in good}), "distinct_answers": len(answers - {""})}


def problem_stats(samples: Sequence[Mapping[str, Any]], examples: Sequence[Any], task: str) -> dict[str, list]:
    """Columns over problems (in the examples' order): id, n, correct, and the task's distinct counts."""
    extra = countdown_stats if task == "countdown" else words_stats
    by_id = {str(r["id"]): r for r in samples}
    out: dict[str, list] = {}
    for ex in examples:
        r = by_id[str(ex.meta["id"])]
        row = {"ids": str(r["id"]), "n": int(r["n"]), "correct": int(r["num_correct"]),
               **extra(r["completions"], r["rewards"], ex)}
        if r.get("tools"):  # sampled with tools: the samples that called one
            row["tool_rows"] = sum(1 for t in r["tools"] if t["calls"] > 0)
        for key, value in row.items():
            out.setdefault(key, []).append(value)
    return out


# --------------------------------------------------------------------------------------------------- the task

def build_task(mod, config):
    """(task for RL, task whose train set makes the SFT demonstrations or None): the problem sets of
    experiment.data_seed (tasks.build draws them from config.seed, which keys only the run's randomness here)."""
    from sage_jax.data import tasks
    data_config = config.copy_and_resolve_references()
    data_config.seed = int(config.experiment.get("data_seed", 0))
    task, sft_task = tasks.build(data_config), None
    if option(mod, "BASE_MODEL") == "sft":
        n = int(config.experiment.sft_problems)
        if not 0 < n < len(task.train):
            raise ValueError(f"experiment.sft_problems={n} must leave RL problems among the {len(task.train)} "
                             "training problems (data.num_train)")
        evals = {**task.evals, "countdown_rl": task.train[n:]}  # the RL prompts, trained on
        task, sft_task = (dataclasses.replace(task, train=task.train[n:], evals=evals),
                          dataclasses.replace(task, train=task.train[:n], evals=evals))
    for name, examples in eval_sets(mod, task, config).items():
        if len(examples) < size(mod, config, name):
            raise ValueError(f"the evaluation set {name} has {len(examples)} problems, the settings ask for "
                             f"{size(mod, config, name)}: raise data.num_eval")
    return task, sft_task


def size(mod, config, split: str) -> int:
    section, key = option(mod, "SPLITS", SPLITS)[split][1].split(".")
    return int(config[section].get(key, 0))


def eval_sets(mod, task, config) -> dict[str, list]:
    """{split: examples} of the splits with a size > 0 that the task has."""
    out = {}
    for split, (name, *_) in option(mod, "SPLITS", SPLITS).items():
        examples = task.evals.get(name or config.data.eval)
        if examples is not None and size(mod, config, split):
            out[split] = examples[:size(mod, config, split)]
    return out


# --------------------------------------------------------------------------------------------------- the model

@contextlib.contextmanager
def on_mesh(config) -> Iterator[Any]:
    import jax
    from sage_jax.models import sharding
    mesh, _ = sharding.make_meshes(tuple(config.mesh.shape), 0)
    with jax.set_mesh(mesh), sharding.use_rules(dict(config.mesh.rules)):
        yield mesh


def load_base(mod, config, task, sft_task, workdir: str) -> tuple[Any, Any, str]:
    """(model config, host parameters, weights fingerprint): the SFT model trained once in workdir (resumable; a
    finished one is restored), or the pretrained model at config.model.path."""
    import jax
    from sage_jax.models import build, sharding
    if sft_task is not None:
        from sage_jax.training import supervised
        base = config.copy_and_resolve_references()
        base.experiment.rl, base.seed = False, 0
        cfg, params = supervised.run_sft(base, workdir, sft_task)
        return cfg, jax.device_get(params), sharding.fingerprint(params)
    if config.model.path and not os.path.isdir(config.model.path):
        raise FileNotFoundError(f"no model at {config.model.path}: convert the GGUF (configs/smollm2_cpu.py's "
                                "docstring) or pass --config.model.path=DIR")
    with on_mesh(config) as mesh:
        cfg, params = build.load_or_init_params(config, mesh, dict(config.mesh.rules), task.tokenizer)
        return cfg, jax.device_get(params), sharding.fingerprint(params)


def _on_device(cfg, config, mesh, policy, host_params):
    import jax
    from sage_jax.models import decoder as model_lib
    if policy is not None:
        return policy
    return jax.device_put(host_params, model_lib.param_shardings(cfg, mesh, dict(config.mesh.rules)))


def evaluate(mod, task, cfg, policy, host_params, config, workdir: str) -> dict[str, dict[str, list]]:
    """n samples per problem of every split (resumable: workdir/eval/SPLIT/samples.jsonl), scored as in training."""
    from sage_jax.eval import passk as evaluation
    ev = config.eval
    rows = int(config.experiment.get("eval_rows", config.experiment.get("rows_per_call", 256)))
    sampling = dict(max_new_tokens=ev.max_new_tokens, temperature=ev.temperature, top_p=ev.get("top_p", 1.0),
                    min_p=ev.min_p)
    from sage_jax.rewards import countdown, math as math_reward
    score = countdown.score if task.name == "countdown" else math_reward.score
    reward = lambda text, ex: score(text, task.gold(ex))
    out = {}
    with on_mesh(config) as mesh, _tools(config, task) as tooling:
        params = _on_device(cfg, config, mesh, policy, host_params)
        if tooling is None:
            generate_fn = evaluation.make_generate_fn(cfg, params, task.tokenizer.decode, sampling,
                                                      EVAL_SEED + config.seed, max_rows=max(rows, ev.n))
        else:  # the run's tools, as it trained: the reward reads the model's own tokens only
            from sage_jax.eval import tool_eval
            tools, pool = tooling
            generate_fn = tool_eval.make_eval_generate_fn(cfg, params, task.tokenizer.decode, sampling,
                                                          EVAL_SEED + config.seed, max(rows, ev.n), tools.fmt, pool,
                                                          tools.settings)
        for split, examples in eval_sets(mod, task, config).items():
            out_dir = os.path.join(workdir, "eval", split)
            evaluation.evaluate(task.tokenizer, examples, reward, n=ev.n, ks=list(ev.ks), out_dir=out_dir,
                                generate_fn=generate_fn, batch_problems=max(1, rows // ev.n), template=task.template,
                                run_name=config.experiment.arm, progress=False)
            out[split] = problem_stats(evaluation.read_samples(os.path.join(out_dir, "samples.jsonl")), examples,
                                       task.name)
    return out


@contextlib.contextmanager
def _tools(config, task) -> Iterator[Any]:
    """(tool_eval.Tooling, its ToolPool) for a config with rollout.tools, else None."""
    from sage_jax.eval import tool_eval
    from sage_jax.tools.base import ToolPool
    opts = tool_eval.tool_options(argparse.Namespace(tools=None), config)  # the run's own rollout.tools and limits
    if not opts:
        yield None
        return
    tooling = tool_eval.make_tooling(opts, task.tokenizer)
    with ToolPool(tooling.tools, num_workers=opts["tool_workers"]) as pool:
        yield tooling, pool


def entropy_profile(mod, task, cfg, host_params, config) -> dict[str, Any]:
    """Per-token entropy of the base policy on its own held-out samples, at the rollout's temperature (what Branch
    compares with tau): mean, count and the quantile grid 0, 0.01, ..., 1 (tau_at reads it)."""
    import jax
    from sage_jax.training import rollouts, state as train_state
    ex = config.experiment
    ro_cfg = config.rollout.copy_and_resolve_references()
    with ro_cfg.unlocked():
        ro_cfg.group_size = int(ex.get("entropy_group", 8))
    examples = next(iter(eval_sets(mod, task, config).values()))[:int(ex.get("entropy_prompts", 32))]
    with on_mesh(config) as mesh:
        params = _on_device(cfg, config, mesh, None, host_params)
        ro = rollouts.rollout(task, cfg, params, examples, ro_cfg, jax.random.key(ENTROPY_SEED),
                              config.data.max_prompt_len)
        batch = rollouts.build_batch(ro, np.zeros(len(ro["texts"]), np.float32), cfg.pad_token_id,
                                     ro_cfg.max_new_tokens)
        _, entropy_NxC = train_state.sequence_logprobs(cfg, params, batch["tokens"], batch["mask"],
                                                       prompt_len=ro["prompt_tokens"].shape[1],
                                                       temperature=ro_cfg.temperature or 1.0,
                                                       rows_per_pass=int(config.train.logprob_rows))
    ent = np.asarray(entropy_NxC)[batch["completion_mask"] > 0]
    return {"mean": float(ent.mean()), "tokens": int(ent.size),
            "grid": [float(v) for v in np.quantile(ent, np.linspace(0.0, 1.0, 101))]}


def tau_at(profile: Mapping[str, Any], quantile: float) -> float:
    """The base's token-entropy quantile (interpolated on its 1% grid), rounded so equal settings compare equal."""
    return round(float(np.interp(quantile, np.linspace(0.0, 1.0, 101), profile["grid"])), 4)


def training_curves(workdir: str) -> dict[str, list]:
    """Per-step rl/entropy, rl/reward, rl/kl, ... from a run's metrics.jsonl (a resumed run's later lines win)."""
    path = os.path.join(workdir, "metrics.jsonl")
    by_step: dict[int, dict[str, Any]] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    by_step.setdefault(int(row["step"]), {}).update(row)
    steps = sorted(by_step)
    names = {"entropy": "rl/entropy", "reward": "rl/reward", "accuracy": "rl/accuracy", "kl": "rl/kl",
             "kl_ref": "rl/kl_ref", "q_mean": "sage/q_mean", "q_p90": "sage/q_p90", "q_active": "sage/q_active",
             "kl_cov": "loss/kl_cov", "pg_token_frac": "rl/pg_token_frac", "step_s": "time/step_s",
             "tool_rows": "tools/rows_without_calls"}
    return {"step": steps, **{k: [by_step[s].get(v) for s in steps] for k, v in names.items()}}
