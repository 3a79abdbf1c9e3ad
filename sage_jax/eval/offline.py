"""Offline evaluation, the library behind `python -m sage_jax.evaluate` (its flags are in sage_jax/evaluate.py):
sample n completions per problem from a model source (source.py), score them in a reward process pool, and write the
unbiased pass@k per dataset and over all of them (passk.py). A rerun resumes from the samples already written;
OUT/eval_settings.json records what drew them, and resuming with other settings is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from sage_jax.eval import passk as evaluation
from sage_jax.eval import tool_eval
from sage_jax.eval.source import ModelSource, default_out, load_model, load_tokenizer, resolve_model
from sage_jax.run import paths

GENERATED_SETS = ("arith_words", "products")  # made by a generator from the run's seed, not read from files
COUNTDOWN_SETS = {"countdown": "test", "countdown_ood": "test_ood"}
SETTINGS_FILE = "eval_settings.json"


def parse_ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated integers such as 1,4,16") from None


def check_ks(ks: Sequence[int], n: int) -> list[int]:
    if n < 1:
        raise ValueError(f"--n {n}: need at least one sample per problem")
    if any(k < 1 for k in ks):
        raise ValueError(f"--k {','.join(map(str, ks))}: every k must be >= 1")
    too_big = [k for k in ks if k > n]
    if too_big:
        raise ValueError(f"--k {','.join(map(str, too_big))} larger than --n {n}: pass@k needs at least k samples "
                         f"per problem; raise --n or drop those k")
    return sorted(set(ks))

# ------------------------------------------------------------------------------------------------ task, data


def infer_task(task: str | None, source: ModelSource, names: Sequence[str]) -> str:
    if task:
        return task
    if source.run_config is not None:
        return str(source.run_config.data.task)
    bases = {split_name(n)[0] for n in names}
    if bases <= set(COUNTDOWN_SETS):
        return "countdown"
    return "kk" if bases == {"kk"} else "math"


def template_for(reward: str, flag: str, task: str, run_config: Any) -> str:
    if flag:
        return flag
    if reward == "countdown":
        return "plain"  # countdown prompts are complete as generated
    if run_config is not None and task != "countdown":
        return str(run_config.data.get("template", "qwen_math_boxed"))
    return "qwen_math_boxed"


def split_name(name: str) -> tuple[str, str]:
    """"kk:people5" -> ("kk", "people5"); names without a registered prefix (paths, hf://...) stay whole."""
    from sage_jax.data.loaders import DATASETS
    base, _, split = name.partition(":")
    return (base, split) if base in DATASETS or base in COUNTDOWN_SETS else (name, "")


def reward_for(name: str, task: str) -> str:
    from sage_jax.data.loaders import DATASETS
    base = split_name(name)[0]
    if base in COUNTDOWN_SETS:
        return "countdown"
    if base in GENERATED_SETS:
        if task == "countdown":
            raise ValueError(f"dataset {name!r} does not suit a countdown model (character tokenizer)")
        return "math"
    looks_like_a_path = "://" in base or os.sep in base or base.endswith((".jsonl", ".json", ".parquet"))
    if base not in DATASETS and not looks_like_a_path and not os.path.exists(base):
        raise ValueError(f"unknown dataset {name!r}: name one of {', '.join(sorted([*DATASETS, *COUNTDOWN_SETS, *GENERATED_SETS]))}, "
                         "or give a .jsonl / .parquet file or folder (or hf://...)")
    if task == "countdown":
        raise ValueError(f"dataset {name!r} does not suit a countdown model (character tokenizer); evaluate it on "
                         "countdown or countdown_ood")
    if base in DATASETS:
        return "kk" if base == "kk" else "math"
    return "kk" if task == "kk" else "math"  # a local file or hf:// set: the task says what it holds


def out_name(name: str) -> str:
    if os.sep in name or name.endswith((".jsonl", ".json", ".parquet")):
        name = Path(name).stem if Path(name).suffix else Path(name).name
    return name.replace(":", "_")


def load_examples(name: str, data_dir: str, limit: int, run_config: Any, data_seed: int) -> list[Any]:
    """Examples of one dataset; countdown sets are regenerated as sage_jax.data.tasks.build made them for the run."""
    from sage_jax.data import loaders
    base, split = split_name(name)
    if base in COUNTDOWN_SETS:
        if run_config is None:
            examples = loaders.load_dataset("countdown", COUNTDOWN_SETS[base], seed=data_seed)
        else:
            from sage_jax.data import tasks
            run_config = run_config.copy_and_resolve_references()
            with run_config.unlocked():
                run_config.seed = data_seed
            examples = tasks.countdown_sets(run_config).get(base)
            if examples is None:
                raise ValueError(f"the run's config has no {base} split (data.ood_max_number is 0)")
    elif base in GENERATED_SETS and run_config is not None:  # the trained task's own held-out set, as it made it
        from sage_jax.data import tasks
        examples = tasks.generated_eval_set(base, run_config)
    else:
        examples = loaders.load_dataset(base, split or "test", data_dir=data_dir or None)
    if not examples:
        raise ValueError(f"dataset {name!r} has no problems")
    return examples[:limit] if limit else examples

# ------------------------------------------------------------------------------------------------ sampling, scoring


def _gold_key(gold: Any) -> str:
    return json.dumps(gold, sort_keys=True, default=str)


class PooledScorer:
    """Scores each generated batch in one RewardPool call (the workers run in parallel); evaluation.evaluate then
    asks for rewards one completion at a time and gets them from here. Anything not pre-scored is scored alone."""

    def __init__(self, pool: Any, gold: Callable[[Any], Any], examples: Sequence[Any],
                 prompt_ids: Callable[[Any], list[int]]):
        self.pool, self.gold = pool, gold
        self.golds_by_prompt: dict[tuple[int, ...], dict[str, Any]] = {}
        for ex in examples:
            g = gold(ex)
            self.golds_by_prompt.setdefault(tuple(prompt_ids(ex)), {})[_gold_key(g)] = g
        self.cache: dict[tuple[str, str], float] = {}

    def wrap(self, generate_fn: evaluation.GenerateFn) -> evaluation.GenerateFn:
        def scored_generate_fn(prompts: list[list[int]], n: int) -> list[list[str]] | evaluation.Completions:
            out = generate_fn(prompts, n)
            texts = out.texts if isinstance(out, evaluation.Completions) else out  # the model's own text
            items = {(k, t): g for p, ts in zip(prompts, texts)
                     for k, g in self.golds_by_prompt.get(tuple(p), {}).items() for t in ts}
            rewards = self.pool.score([t for _, t in items], list(items.values())) if items else []
            self.cache = {key: float(r) for key, r in zip(items, rewards)}
            return out
        return scored_generate_fn

    def __call__(self, text: str, ex: Any) -> float:
        g = self.gold(ex)
        hit = self.cache.get((_gold_key(g), text))
        return hit if hit is not None else float(self.pool.score([text], [g])[0])

# ------------------------------------------------------------------------------------------------ outputs


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Samples in OUT are only resumed under the settings that drew them; the first read and write of OUT: one that
    cannot be used (a read-only workdir) is named here, before the model loads."""
    path = out / SETTINGS_FILE
    try:
        saved = paths.read_agreed(path)  # process 0's file on every process: all refuse or go on alike
        if saved is not None:
            old = json.loads(saved)
            changed = {k: (old.get(k), settings.get(k)) for k in [*settings, *(set(old) & tool_eval.TOOL_SETTINGS)]
                       if old.get(k) != settings.get(k)}  # samples with tools are not resumed without, nor back
            if changed:
                what = ", ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in changed.items())
                raise ValueError(f"{out} holds samples drawn with other settings ({what}); rerun with the same "
                                 "settings or pass another --out")
        evaluation.write_json(path, settings)
    except OSError as e:
        raise ValueError(f"cannot write the evaluation's results to {out} ({e.strerror or e}): pass --out with a "
                         "folder you can write to") from None


def write_summary(out: Path, results: dict[str, dict[str, Any]], ks: Sequence[int], settings: dict[str, Any]
                  ) -> dict[str, Any]:
    tables = {name: {int(k): float(v) for k, v in r["pass_at_k"].items()} for name, r in results.items()}
    average = {k: float(np.mean([t[k] for t in tables.values()])) for k in ks}
    summary = {"settings": settings, "ks": list(ks),
               "datasets": {name: {"num_problems": results[name]["num_problems"],
                                   **{f"pass@{k}": v for k, v in t.items()},
                                   **({"tools": results[name]["tools"]} if "tools" in results[name] else {})}
                            for name, t in tables.items()},
               "average": {f"pass@{k}": v for k, v in average.items()}}
    evaluation.write_json(out / "summary.json", summary)
    rows = {**{f"{name} ({results[name]['num_problems']})": t for name, t in tables.items()}, "average": average}
    title = (f"pass@k of {settings['model']} (n={settings['n']}, temperature={settings['temperature']}, "
             f"top_p={settings['top_p']}, max_new_tokens={settings['max_new_tokens']}"
             + (f", tools={','.join(settings['tools'])}" if settings.get("tools") else "") + ")")
    evaluation.write_markdown(out / "summary.md", rows, ks, title=title)
    evaluation.plot_pass_at_k({**tables, "average": average}, out / "pass_at_k.png", title=Path(settings["model"]).name)
    return summary


class LazySampler:
    """generate_fn(prompts, n, pad_to=0) for evaluation.evaluate: the model loads on the first batch to sample (a
    finished run never loads it), then samples plainly (evaluation.make_generate_fn) or with tools
    (tool_eval.make_eval_generate_fn, the calls in self.pool)."""

    def __init__(self, source: ModelSource, tokenizer: Any, placement: tuple, sampling: dict[str, Any], seed: int,
                 max_rows: int, tooling: tool_eval.Tooling | None):
        self.source, self.tokenizer, self.placement, self.sampling = source, tokenizer, placement, sampling
        self.seed, self.max_rows, self.tooling = seed, max_rows, tooling
        self.pool: Any = None
        self.fn: Callable | None = None

    def __call__(self, prompts: list[list[int]], n: int, pad_to: int = 0):
        if self.fn is None:
            source, decode = self.source, self.tokenizer.decode
            print(f"loading {source.kind} model from {source.path}" + (f" (step {source.step})" if source.step
                  else ""), file=sys.stderr)
            cfg, params = load_model(source, self.tokenizer, *self.placement)
            if self.tooling is None:
                self.fn = evaluation.make_generate_fn(cfg, params, decode, self.sampling, self.seed, self.max_rows)
            else:
                self.fn = tool_eval.make_eval_generate_fn(cfg, params, decode, self.sampling, self.seed,
                                                          self.max_rows, self.tooling.fmt, self.pool,
                                                          self.tooling.settings)
        return self.fn(prompts, n, pad_to)


# ------------------------------------------------------------------------------------------------ run


def run_defaults(args: argparse.Namespace, run_config: Any) -> list[str]:
    """Fill the flags left unset from a training run's own evaluation (its data.eval sets, its eval.* sampling), else
    the command's defaults; the datasets' names."""
    ev = run_config.eval if run_config is not None else None
    run_sampling = {} if ev is None else {
        "temperature": ev.temperature, "top_p": ev.get("top_p", 1.0), "min_p": ev.min_p,
        "top_k": run_config.rollout.get("top_k", 0),
        "max_new_tokens": ev.max_new_tokens or run_config.rollout.max_new_tokens}
    for name, default in SAMPLING_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, type(default)(run_sampling.get(name, default)))
    if args.datasets is None:
        if run_config is not None and run_config.data.task == "countdown":  # its held-out sets, regenerated
            args.datasets = "countdown" + (",countdown_ood" if run_config.data.get("ood_max_number", 0) else "")
        elif run_config is not None and run_config.data.eval:
            args.datasets = str(run_config.data.eval)
        else:
            args.datasets = "aime24,aime25,amc23,math500"
    return [s.strip() for s in args.datasets.split(",") if s.strip()]


SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_new_tokens": 3072}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.datasets is not None and not args.datasets.strip(" ,"):
        raise ValueError("--datasets is empty; name at least one dataset (e.g. math500)")
    source = resolve_model(args.model, args.step)
    run_config = source.run_config
    names = run_defaults(args, run_config)
    ks = check_ks(parse_ints(args.k, "--k") if args.k else evaluation.default_ks(args.n), args.n)
    if args.max_new_tokens < 1 or args.max_rows < 1 or args.batch_problems < 0 or args.limit < 0:
        raise ValueError("--max-new-tokens and --max-rows must be >= 1, --batch-problems and --limit >= 0")
    task = infer_task(args.task, source, names)
    data_seed = args.data_seed if args.data_seed is not None else int(run_config.seed) if run_config else 0
    data_dir = args.data_dir or (run_config.data.get("data_dir", "") if run_config is not None else "")
    datasets = {}
    for name in names:  # every dataset is checked before the model is loaded
        key = out_name(name)
        if key in datasets:
            raise ValueError(f"dataset {name!r} is listed twice (or two names map to the folder {key!r})")
        datasets[key] = (name, reward_for(name, task), load_examples(name, data_dir, args.limit, run_config, data_seed))
    tool_opts = tool_eval.tool_options(args, run_config)
    tokenizer = load_tokenizer(source, task, args.tokenizer)
    tooling = tool_eval.make_tooling(tool_opts, tokenizer)  # before the model loads: what cannot run is named first
    dtype = args.dtype or (str(run_config.model.compute_dtype) if run_config is not None else "bfloat16")
    out = paths.path(args.out) if args.out else default_out(source)  # a local folder or a gs:// prefix
    settings = {"model": paths.absolute(source.path), "source": source.kind, "step": source.step, "task": task,
                "n": args.n, "template": args.template or "auto", "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
                "max_new_tokens": args.max_new_tokens, "seed": args.seed, "data_seed": data_seed, "dtype": dtype,
                **{k: v for k, v in tool_opts.items() if k != "tool_workers"}}  # (no tool keys without tools)
    import jax
    from sage_jax.data import tasks
    from sage_jax.models import sharding
    from sage_jax.data.templates import render, resolve_for as resolve_template
    from sage_jax.rewards.pool import RewardPool
    from sage_jax.tools.base import ToolPool
    try:
        mesh = sharding.make_mesh(tuple(parse_ints(args.mesh, "--mesh")))
    except ValueError as e:
        raise ValueError(f"--mesh {args.mesh}: {e}") from None
    check_settings(out, settings)
    rules = dict(run_config.mesh.rules) if run_config is not None else dict(sharding.DEFAULT_RULES)
    batch_problems = args.batch_problems or max(1, args.max_rows // args.n)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, min_p=args.min_p)
    generate_fn = LazySampler(source, tokenizer, (dtype, mesh, rules), sampling, args.seed, args.max_rows, tooling)

    results = {}
    pools: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.set_mesh(mesh))
        stack.enter_context(sharding.use_rules(rules))
        if tooling is not None:
            generate_fn.pool = stack.enter_context(ToolPool(tooling.tools, num_workers=tool_opts["tool_workers"]))
        for key, (name, reward, examples) in datasets.items():
            template = template_for(reward, args.template, task, run_config)
            if reward != "countdown":  # "chat" / "auto": the model's own chat template around the run's prompts
                template = resolve_template(run_config.data if run_config is not None else None, tokenizer, template,
                                            tools=tooling.schemas if tooling is not None else None)
            if reward not in pools:
                pools[reward] = stack.enter_context(RewardPool(reward, num_workers=args.reward_workers,
                                                               timeout_s=args.reward_timeout))
            gold = tasks.Task(reward, reward, tokenizer, template, [], {}).gold
            scorer = PooledScorer(pools[reward], gold, examples,
                                  lambda ex, t=template: tasks.encode_prompt_text(tokenizer, t, render(t, ex.problem)))
            print(f"{key}: {len(examples)} problems, reward {reward}, template {template}", file=sys.stderr)
            results[key] = evaluation.evaluate(
                tokenizer, examples, scorer, n=args.n, ks=ks, out_dir=out / key,
                generate_fn=scorer.wrap(functools.partial(generate_fn, pad_to=min(batch_problems, len(examples)))),
                batch_problems=batch_problems, template=template,
                run_name=key, progress=not args.no_progress)
    summary = write_summary(out, results, ks, settings)
    summary["out"] = str(out)
    return summary
