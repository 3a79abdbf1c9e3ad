"""The CPU-scale SAGE comparison on countdown: one SFT base, RL with every arm and seed, evaluation, RESULTS.md.

    python -m sage_jax.experiments.reproduce --out DIR --quick                # 8.2 min measured on 2 quiet CPU cores
    python -m sage_jax.experiments.reproduce --out DIR                        # every arm x 3 seeds
    python -m sage_jax.experiments.reproduce --out DIR --sweep                # + Branch gamma x tau grid

Everything runs in this one process (compiled sampler and log-prob programs are shared between runs, and a persistent
compilation cache, default WORK/jax_cache, serves the per-run jits). The training problems are split once: the
first experiment.sft_problems make the SFT demonstrations, the rest are RL prompts. Checkpoints and per-run records
go under --work/BUDGET (default /tmp/sage_reproduce): base/ (the SFT model, trained once), runs/ARM/seedK/ and
sweep/gammaG_tauT/seedK/, each finished run holding record.json; rerunning the command skips what is finished and
resumes the rest, and --report-only renders whatever has finished. Two processes started with the same command (on
a machine with cores to spare) split the runs between them through a claim file in each run directory; start the
second once the base has finished, and render the report with --report-only when both are done. --out gets only
RESULTS.md, results.json, PNGs. --records DIR (the study uses docs/results/study_countdown/runs) keeps a copy of every finished
run's small record.json under DIR/BUDGET/..., the same layout: commit it, and a later session (with a fresh --work)
skips those runs and reports them; it retrains only the base (same settings; its parameter checksum is compared).
Under the study budget each arm gets configs/countdown_arms.SEEDS_PER_ARM seeds and, with experiment.tau_quantile,
Branch's tau is that quantile of the base's token entropies on its own samples (entropy_profile).
Arms and budgets live in configs/countdown_arms.py; `--config.key=value` overrides apply to every arm.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import jax
import numpy as np

from sage_jax.run import config as config_lib
from sage_jax.data import tasks
from sage_jax.eval import passk as evaluation
from sage_jax.training import rollouts, supervised, state as train_state, trainer
from sage_jax.experiments import measure, report, text
from sage_jax.experiments.worklist import Job, arms_module, branch_taus, jobs, load_config
from sage_jax.rewards import countdown

# evaluation splits in fold-in order (each split's samples are keyed by its index here, so a split added later
# leaves the others' samples unchanged); countdown_rl (experiment.rl_eval_problems > 0): RL prompts, trained on
SPLITS = ("countdown", "countdown_ood", "countdown_rl")
BASE_SECTIONS = ("model", "data", "sft", "eval", "seed")  # config sections a finished base / run must match
RUN_SECTIONS = BASE_SECTIONS + ("rollout", "loss", "optim", "train")


def fingerprint(config, sections: Sequence[str]) -> str:
    d = config.to_dict()
    picked = {k: d[k] for k in sections}
    picked["experiment"] = {k: d["experiment"][k] for k in ("sft_problems", "ood_problems")}
    return hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()[:16]


def use_compile_cache(path: str) -> None:
    """Persist compiled programs: each run makes fresh jits (init, train state, train_step), which otherwise
    recompile identical programs for every seed and every rerun."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def split_task(task: tasks.Task, sft_problems: int) -> tuple[tasks.Task, tasks.Task]:
    """(SFT task, RL task): disjoint training problems, the same evaluation sets, plus countdown_rl: the RL
    problems in their stored order (the experiment evaluates the first experiment.rl_eval_problems of them)."""
    if not 0 < sft_problems < len(task.train):
        raise ValueError(f"experiment.sft_problems={sft_problems} must leave RL problems among the "
                         f"{len(task.train)} training problems (data.num_train)")
    evals = {**task.evals, "countdown_rl": task.train[sft_problems:]}
    return (dataclasses.replace(task, train=task.train[:sft_problems], evals=evals),
            dataclasses.replace(task, train=task.train[sft_problems:], evals=evals))


def _read(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _check_same(record: dict[str, Any], fp: str, where: str) -> dict[str, Any]:
    if record.get("fingerprint") != fp:
        raise ValueError(f"{where} was made with different settings (budget or --config overrides); pass a fresh "
                         f"--work directory or delete {os.path.dirname(where)}")
    return record


# --------------------------------------------------------------------------------------------------- evaluation

def eval_sizes(config) -> dict[str, int]:
    """Problems per evaluation split (0: not evaluated)."""
    return {"countdown": config.eval.problems, "countdown_ood": config.experiment.ood_problems,
            "countdown_rl": config.experiment.rl_eval_problems}


def eval_sets(task: tasks.Task, config) -> dict[str, list[dict[str, Any]]]:
    sizes = eval_sizes(config)
    return {s: [task.gold(ex) for ex in task.evals[s][:sizes[s]]] for s in SPLITS if sizes[s] and s in task.evals}


def evaluate_policy(task, cfg, params, config, key, only: Sequence[str] | None = None
                    ) -> dict[str, list[dict[str, Any]]]:
    """Per-problem sample statistics on each evaluation split (or the splits in `only`)."""
    ev = config.eval
    return {s: measure.sample_problems(cfg, params, task.tokenizer, golds, n=ev.n, max_new_tokens=ev.max_new_tokens,
                                       temperature=ev.temperature, min_p=ev.min_p,
                                       key=jax.random.fold_in(key, SPLITS.index(s)),
                                       rows_per_call=config.experiment.rows_per_call)
            for s, golds in eval_sets(task, config).items() if only is None or s in only}


def missing_splits(task, config, record: Mapping[str, Any]) -> list[str]:
    """Evaluation splits the config asks for that a finished record lacks (a split added after it ran)."""
    return [s for s in eval_sets(task, config) if s not in record.get("eval", {})]


def entropy_profile(task, cfg, params, config, taus: Sequence[float]) -> dict[str, Any]:
    """Per-token entropy of the policy on its own held-out samples (what Branch's tau is compared against)."""
    ro_cfg = config.rollout.copy_and_resolve_references()
    with ro_cfg.unlocked():
        ro_cfg.group_size = 8
    ro = rollouts.rollout(task, cfg, params, task.evals["countdown"][:32], ro_cfg, jax.random.key(12345),
                          config.data.max_prompt_len)
    batch = rollouts.build_batch(ro, np.zeros(len(ro["texts"]), np.float32), cfg.pad_token_id, ro_cfg.max_new_tokens)
    _, entropy_NxC = train_state.sequence_logprobs(cfg, params, batch["tokens"], batch["mask"],
                                               prompt_len=ro["prompt_tokens"].shape[1],
                                               temperature=ro_cfg.temperature or 1.0)
    ent = np.asarray(entropy_NxC)[batch["completion_mask"] > 0]
    qs = (0.5, 0.75, 0.9, 0.95, 0.99)
    return {"mean": float(ent.mean()), "quantiles": {str(q): float(v) for q, v in zip(qs, np.quantile(ent, qs))},
            "frac_above": {str(t): float((ent > t).mean()) for t in taus}, "tokens": int(ent.size),
            "grid": [float(v) for v in np.quantile(ent, np.linspace(0.0, 1.0, 101))]}  # quantiles 0, 0.01, ..., 1


def params_checksum(params) -> str:
    """A short fingerprint of parameter values: tells whether a retrained base is the one earlier runs used."""
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
    return f"{sum(float(x.sum()) for x in leaves):.10e}/{sum(float(np.abs(x).sum()) for x in leaves):.10e}"


# --------------------------------------------------------------------------------------------------- runs

def train_base(task, config, work: str, command: str = "") -> tuple[Any, Any, dict[str, Any]]:
    """The shared SFT model (resumable) and its record: evaluation, entropy profile, demo strategy shares, times."""
    path = os.path.join(work, "base", "record.json")
    fp = fingerprint(config, BASE_SECTIONS)
    record = _read(path)
    while record is None:
        with claim(os.path.join(work, "base")) as mine:
            if mine:
                return _train_base(task, config, work, command, path, fp)
        print("[base] another process is training the base; waiting for it", flush=True)
        time.sleep(30)
        record = _read(path)
    _check_same(record, fp, path)
    cfg, params = supervised.run_sft(config, os.path.join(work, "base"), task)  # restores the finished checkpoint
    print(f"[base] reusing {os.path.dirname(path)}", flush=True)
    if missing := missing_splits(task, config, record):
        record["eval"].update(evaluate_policy(task, cfg, params, config, jax.random.key(10_000), only=missing))
        evaluation.write_json(path, record)
        print(f"[base] evaluated the splits its record lacked: {', '.join(missing)}", flush=True)
    return cfg, jax.device_get(params), record


def _train_base(task, config, work: str, command: str, path: str, fp: str) -> tuple[Any, Any, dict[str, Any]]:
    t0, c0 = time.perf_counter(), time.process_time()
    cfg, params = supervised.run_sft(config, os.path.join(work, "base"), task)
    host_params = jax.device_get(params)  # each run gets fresh device buffers from it (the train state is donated)
    sft_s, sft_cpu = time.perf_counter() - t0, time.process_time() - c0
    demos = supervised.demonstrations(config, task)
    demo_counts: dict[str, int] = {}
    for _, completion in demos:
        s = countdown.strategy(countdown.extract_expression(completion)[0])
        demo_counts[s] = demo_counts.get(s, 0) + 1
    t1 = time.perf_counter()
    evals = evaluate_policy(task, cfg, params, config, jax.random.key(10_000))
    record = {"fingerprint": fp, "command": command, "eval": evals, "curves": {}, "sft_steps": config.sft.steps,
              "demo_shares": {s: c / len(demos) for s, c in demo_counts.items()},
              "entropy": entropy_profile(task, cfg, params, config, config.experiment.sweep_taus),
              "params_checksum": params_checksum(host_params),
              "times": {"sft_wall_s": sft_s, "sft_cpu_s": sft_cpu, "eval_wall_s": time.perf_counter() - t1}}
    evaluation.write_json(path, record)
    del params
    print(f"[base] SFT {config.sft.steps} steps {sft_s:.0f}s, eval {record['times']['eval_wall_s']:.0f}s", flush=True)
    return cfg, host_params, record


def finished(config, run_dir: str, mirror: str | None = None) -> dict[str, Any] | None:
    """The record of a finished run made with this config (in run_dir, else its --records copy), None if none."""
    for path in (os.path.join(run_dir, "record.json"), mirror):
        record = _read(path) if path else None
        if record is not None:
            return _check_same(record, fingerprint(config, RUN_SECTIONS), path)
    return None


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
                pid = int(Path(path).read_text().strip() or 0)
                os.kill(pid, 0)
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


def run_one(task, job: Job, base_params, command: str = "", base_checksum: str = "") -> dict[str, Any] | None:
    """RL from the base with the job's config (resumable), then the evaluation; the run's record (None when another
    process is running it)."""
    record = finished(job.config, job.run_dir, job.mirror)
    if record is not None and not missing_splits(task, job.config, record):
        return record
    with claim(job.run_dir) as mine:
        if not mine:
            print(f"[{job.label}] another process is running it; skipped here", flush=True)
            return None
        record = finished(job.config, job.run_dir, job.mirror)  # it may have finished between check and claim
        if record is not None:
            return _add_missing_splits(task, job, base_params, record)
        return _run_one(task, job, base_params, command, base_checksum)


def _add_missing_splits(task, job: Job, base_params, record: dict[str, Any]) -> dict[str, Any]:
    """A finished run's record with the evaluation splits it lacks, sampled from its final checkpoint with the
    keys a fresh run would have used."""
    missing = missing_splits(task, job.config, record)
    if not missing:
        return record
    if not os.path.isdir(os.path.join(job.run_dir, "rl", "checkpoints")):  # where run_rl keeps them
        print(f"[{job.label}] its record lacks {', '.join(missing)} and its checkpoint is gone; left as it is",
              flush=True)
        return record
    result = trainer.run_rl(job.config, job.run_dir, task=task, params_override=base_params)  # restores, no steps
    t0 = time.perf_counter()
    record["eval"].update(evaluate_policy(task, result.cfg, result.state["params"], job.config,
                                          jax.random.key(20_000 + job.config.seed), only=missing))
    record["times"]["eval_wall_s"] += time.perf_counter() - t0
    for path in (os.path.join(job.run_dir, "record.json"), job.mirror):
        if path:
            evaluation.write_json(path, record)
    print(f"[{job.label}] evaluated the splits its record lacked: {', '.join(missing)}", flush=True)
    return record


def _run_one(task, job: Job, base_params, command: str, base_checksum: str) -> dict[str, Any]:
    config, run_dir = job.config, job.run_dir
    t0, c0 = time.perf_counter(), time.process_time()
    result = trainer.run_rl(config, run_dir, task=task, params_override=base_params)
    train_s, train_cpu = time.perf_counter() - t0, time.process_time() - c0
    t1 = time.perf_counter()
    evals = evaluate_policy(task, result.cfg, result.state["params"], config, jax.random.key(20_000 + config.seed))
    del result
    curves = measure.training_curves(run_dir)
    steps = [s for s in curves["step_s"][1:] if s is not None]
    times = {"train_wall_s": train_s, "train_cpu_s": train_cpu, "eval_wall_s": time.perf_counter() - t1,
             "step_s": statistics.median(steps) if steps else float("nan")}
    record = {"fingerprint": fingerprint(config, RUN_SECTIONS), "command": command, "label": job.label,
              "seed": config.seed, "base_checksum": base_checksum, "eval": evals, "curves": curves, "times": times}
    for path in (os.path.join(run_dir, "record.json"), job.mirror):
        if path:
            evaluation.write_json(path, record)
    ev = report.summarize_run(record)
    n = config.eval.n
    print(f"[{job.label}] RL {config.train.steps} steps {train_s:.0f}s, eval {times['eval_wall_s']:.0f}s | "
          f"ID pass@1 {ev['countdown/pass@1']:.3f} pass@{n} {ev[f'countdown/pass@{n}']:.3f} | "
          f"OOD pass@1 {ev['countdown_ood/pass@1']:.3f} pass@{n} {ev[f'countdown_ood/pass@{n}']:.3f}", flush=True)
    return record


def _base_record(work: str, records: str | None, base_config) -> dict[str, Any]:
    """The finished base's record from --work, else from --records (report-only from committed records)."""
    for path in (os.path.join(work, "base", "record.json"),
                 os.path.join(records, os.path.basename(work), "base", "record.json") if records else None):
        if path and (record := _read(path)) is not None:
            return _check_same(record, fingerprint(base_config, BASE_SECTIONS), path)
    raise FileNotFoundError(f"no finished base in {work}/base" + (f" or {records}" if records else "")
                            + ": run without --report-only first")


def _mirror_base(record: dict[str, Any], work: str, records: str | None) -> None:
    if not records:
        return
    path = os.path.join(records, os.path.basename(work), "base", "record.json")
    kept = _read(path)
    if kept is None:
        evaluation.write_json(path, record)
    elif kept.get("params_checksum") != record.get("params_checksum"):
        print(f"[base] WARNING: this base's parameters differ from those of {path} (checksum "
              f"{record.get('params_checksum')} vs {kept.get('params_checksum')}): runs recorded there started "
              "from another base; the report counts the bases its runs came from", flush=True)


def run_experiment(out: str, work: str, budget: str, seeds: int | None, arms: Sequence[str], sweep: bool,
                   overrides: Sequence[str], command: str, report_only: bool = False,
                   records: str | None = None) -> dict[str, Any]:
    t_start, c_start, load_start = time.perf_counter(), time.process_time(), os.getloadavg()
    work = os.path.join(work, budget)
    base_config = load_config("grpo", budget, overrides)
    seeds = seeds or base_config.experiment.seeds
    if report_only:  # whatever has finished, nothing new
        base_record = _base_record(work, records, base_config)
    else:
        sft_task, rl_task = split_task(tasks.build(base_config), base_config.experiment.sft_problems)
        # the task is built once from the base config: tasks.build draws the problems from config.seed, which
        # would tie the problem sets to the RL seed, so config.seed keys only sampling, guides and prompt order
        _, base_params, base_record = train_base(sft_task, base_config, work, command)
        _mirror_base(base_record, work, records)
    tau, sweep_taus = branch_taus(base_config, base_record)
    todo = jobs(arms, seeds, sweep, base_config, budget, overrides, work, records, tau, sweep_taus)
    if not report_only:
        for job in todo:
            run_one(rl_task, job, base_params, command, base_record.get("params_checksum", ""))
    # every finished run, this process's or another's (runs another process still holds are left out)
    found: dict[str, dict[Any, dict[int, Any]]] = {"arms": {arm: {} for arm in arms}, "sweep": {}}
    for job in todo:
        if (record := finished(job.config, job.run_dir, job.mirror)) is not None:
            found[job.bucket].setdefault(job.key, {})[job.seed] = record
    runs = {arm: by_seed for arm, by_seed in found["arms"].items() if by_seed}
    if not runs:
        raise ValueError(f"no finished runs under {work} for arms {', '.join(arms)}")
    wall, cpu = time.perf_counter() - t_start, time.process_time() - c_start
    meta = text.meta(base_config, budget, seeds, list(runs), sweep,
                     min(seeds, base_config.experiment.sweep_seeds), command, base_record, runs, found["sweep"],
                     wall, cpu, (load_start, os.getloadavg()), arms_module(), load_config("grpo", "full"))
    meta["tau"] = {"tau": tau, "quantile": base_config.experiment.tau_quantile, "sweep_taus": sweep_taus}
    updates = lambda optim: optim.num_iterations * optim.mini_batches
    meta["arm_configs"] = {job.key: {"guide": job.config.loss.guide, "kl_cov": job.config.loss.kl_cov_ratio > 0,
                                     "updates_per_batch": updates(job.config.optim)}
                           for job in todo if job.bucket == "arms"}
    results = report.build(base_record, runs, found["sweep"], meta)
    report.write(out, results)
    print(f"wrote {os.path.join(out, 'RESULTS.md')} ({wall / 60:.1f} min wall, {cpu / 60:.1f} min CPU)", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides, rest = config_lib.split_config_flags(argv)
    parser = argparse.ArgumentParser(description="SAGE vs GRPO-family arms on countdown (CPU scale)")
    parser.add_argument("--out", required=True, help="report directory: RESULTS.md, results.json, PNGs")
    parser.add_argument("--work", default="/tmp/sage_reproduce", help="checkpoints and run records (resumable)")
    parser.add_argument("--quick", action="store_true", help="the ~15-minute budget (1 seed, smaller eval)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--budget", choices=("tiny", "quick", "full", "study"), default=None,
                        help="a budget of configs/countdown_arms.py (study: round 2, SEEDS_PER_ARM)")
    parser.add_argument("--records", default=None,
                        help="also keep each finished run's record.json here (commit it; later sessions resume)")
    parser.add_argument("--seeds", type=int, default=None, help="RL seeds per arm (default: the budget's)")
    parser.add_argument("--arms", default="", help="comma-separated subset of the arms (default: all; STUDY: "
                        "countdown_arms.SEEDS_PER_ARM's)")
    parser.add_argument("--sweep", action="store_true", help="also run the Branch gamma x tau grid")
    parser.add_argument("--report-only", action="store_true",
                        help="render RESULTS.md from the finished runs under --work; train nothing")
    parser.add_argument("--compile-cache", default=None,
                        help="JAX persistent compilation cache (default WORK/jax_cache; 'off' disables)")
    args = parser.parse_args(rest)
    budget = args.budget or ("tiny" if args.tiny else "quick" if args.quick else "full")
    known = list(arms_module().ARMS)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] or known
    if arms == ["STUDY"]:
        arms = list(arms_module().SEEDS_PER_ARM)
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise ValueError(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.seeds is not None and args.seeds < 1:
        raise ValueError(f"--seeds={args.seeds}: need at least 1")
    command = "python -m sage_jax.experiments.reproduce " + " ".join(argv)
    cache = args.compile_cache or os.path.join(args.work, "jax_cache")
    if cache != "off" and not jax.config.jax_compilation_cache_dir:
        use_compile_cache(cache)
    run_experiment(args.out, args.work, budget, args.seeds, arms, args.sweep, overrides, command, args.report_only,
                   args.records)
    return 0


if __name__ == "__main__":
    from sage_jax.run import cli
    cli.main_guard(main)
