"""GRPO against SAGE-Branch on SmolLM2-135M-Instruct, on CPU (issue 39): every arm of configs/smollm2_arms.py from
the same pretrained model, seeds paired, a held-out evaluation per run, resumable across sessions.

    python -m sage_jax.experiments.smollm2_study --regime --out docs/results/smollm2_study --work /tmp/smol_study
    python -m sage_jax.experiments.smollm2_study --out docs/results/smollm2_study --work /tmp/smol_study
    python -m sage_jax.experiments.smollm2_study --out docs/results/smollm2_study --report-only
    python -m sage_jax.experiments.smollm2_study --out /tmp/smoke --quick --arms base,grpo,branch --seeds 1

--out gets one small JSON per finished run, runs/ARM/seedK.json (regime runs: regime/CANDIDATE/ARM/seedK.json),
runs/base/entropy.json (the base's token entropies, from which Branch's tau is taken), regime.md/.json, RESULTS.md,
results.json and PNGs: commit it as runs finish. --work/runs/ARM/seedK-FINGERPRINT/ holds a run's checkpoints,
metrics and evaluation samples. A run is skipped when its result file holds the fingerprint of its current config;
when another result file under --out does (the regime's GRPO runs are the study's when the regime is frozen), that
one is copied; otherwise it runs, resuming from its workdir's checkpoint and samples (a file with another
fingerprint is replaced). Seeds are run seed-major so an interrupted study has every arm at its first seeds. Two
processes started with the same command split the runs through a claim file in each workdir.
`--config.key=value` applies to every arm (e.g. --config.model.path=/tmp/sage_jax_test_cache/smollm2/hf).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
from typing import Any, Sequence

from sage_jax.experiments import smollm2_regime, smollm2_report
from sage_jax.experiments.smollm2_run import (ROOT, Job, arms_module, build_task, entropy_fingerprint, entropy_profile,
                                              fingerprint, flat, load_base, load_config, on_mesh, read_result,
                                              run_job, write_result)
from sage_jax.run import config as config_lib

CPU_CONFIG = ROOT / "configs" / "smollm2_cpu.py"


# --------------------------------------------------------------------------------------------------- the work list

def seeds_for(arm: str, seeds: int | None) -> int:
    return seeds if seeds is not None else arms_module().SEEDS_PER_ARM[arm]


def make_jobs(arms: Sequence[str], seeds: int | None, preset: str, overrides: Sequence[str], out: str, work: str,
              tau: float | None, sub: str = "runs", settings: dict[str, Any] | None = None) -> list[Job]:
    """Every (arm, seed), seed-major. Branch jobs need tau when their config takes it from the base's entropies."""
    todo = []
    for seed in range(max(seeds_for(a, seeds) for a in arms)):
        for arm in arms:
            if seed >= seeds_for(arm, seeds):
                continue
            config = load_config(arm, preset, overrides, seed, settings, tau)
            if config.loss.guide == "branch" and config.experiment.tau_quantile > 0 and tau is None:
                raise ValueError("Branch's tau comes from the base's entropy profile, which is not there yet")
            fp = fingerprint(config)
            todo.append(Job(arm, seed, config, os.path.join(out, sub, arm, f"seed{seed}.json"),
                            os.path.join(work, "runs", arm, f"seed{seed}-{fp[:8]}"),
                            f"{sub}/{arm}/seed{seed}", fp))
    return todo


def index(out: str) -> dict[tuple[str, int], str]:
    """(fingerprint, seed) -> a result file under out holding it."""
    found = {}
    for path in sorted(glob.glob(os.path.join(out, "**", "seed*.json"), recursive=True)):
        record = read_result(path)
        if record is not None:
            found.setdefault((record.get("fingerprint"), record.get("seed")), path)
    return found


def finished(job: Job, known: dict[tuple[str, int], str] | None = None, quiet: bool = False) -> bool:
    """Whether job's result is there: its own file with its fingerprint, or another file under --out with it
    (copied to job.path). A file with another fingerprint is not (the run is redone and the file replaced)."""
    record = read_result(job.path)
    if record is not None and record.get("fingerprint") == job.fingerprint:
        return True
    source = (known or {}).get((job.fingerprint, job.seed))
    if source and os.path.abspath(source) != os.path.abspath(job.path):
        os.makedirs(os.path.dirname(job.path), exist_ok=True)
        shutil.copyfile(source, job.path)
        print(f"[{job.label}] same settings as {source}: copied", flush=True)
        return True
    if record is not None and not quiet:
        print(f"[{job.label}] {job.path} was made with other settings (fingerprint {record.get('fingerprint')}, "
              f"now {job.fingerprint}): rerunning it", flush=True)
    return False


class Session:
    """The task and the pretrained model, loaded on first use (a rerun with nothing to do loads neither)."""

    def __init__(self, config, command: str, out: str):
        self.config, self.command, self.out, self._task, self._base = config, command, out, None, None

    @property
    def task(self):
        if self._task is None:
            self._task = build_task(self.config)
        return self._task

    @property
    def base(self):
        if self._base is None:
            self._base = load_base(self.config, self.task)
            self._check_weights()
        return self._base

    def check(self, config) -> None:
        """A job's model and problems must be the session's (a candidate may change RL settings only)."""
        shared = lambda c: {k: v for k, v in flat(c.to_dict()).items() if k.startswith(("model.", "data."))}
        if shared(config) != shared(self.config) or config.experiment.data_seed != self.config.experiment.data_seed:
            raise ValueError("this run changes the model or the problem sets: run it in a study of its own")

    def _check_weights(self) -> None:
        """The committed results must come from these weights: a mismatch stops the study before it mixes them."""
        weights = self._base[2]
        for path in glob.glob(os.path.join(self.out, "**", "seed*.json"), recursive=True):
            record = read_result(path)
            if record is not None and record.get("weights") not in (None, weights):
                raise ValueError(f"{path} was made from other weights ({record['weights']}, these are {weights}): "
                                 "use the same model (configs/smollm2_cpu.py's conversion) or move --out aside")


def tau_for(session: Session, out: str, arms: Sequence[str], preset: str, overrides, compute: bool) -> float | None:
    """Branch's tau: the experiment.tau_quantile quantile of the base's token entropies (runs/base/entropy.json,
    computed once and committed with the runs); None when no arm takes tau from it."""
    from sage_jax.experiments.worklist import tau_at
    configs = [load_config(a, preset, overrides) for a in arms]
    takers = [c for c in configs if c.loss.guide == "branch" and c.experiment.tau_quantile > 0]
    if not takers:
        return None
    config, path = takers[0], os.path.join(out, "runs", "base", "entropy.json")
    fp = entropy_fingerprint(config)
    kept = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            kept = json.load(f)
    if kept is None or kept.get("fingerprint") != fp:
        if not compute:
            return None
        with on_mesh(config) as mesh:
            import jax
            from sage_jax.models import decoder as model_lib
            cfg, host, weights = session.base
            params = jax.device_put(host, model_lib.param_shardings(cfg, mesh, dict(config.mesh.rules)))
            kept = {"fingerprint": fp, "weights": weights, **entropy_profile(session.task, cfg, params, config)}
        write_result(path, kept)
        print(f"[base] token entropy: mean {kept['mean']:.3f} over {kept['tokens']} tokens", flush=True)
    return tau_at(kept, config.experiment.tau_quantile)


def run_all(jobs: Sequence[Job], session: Session, out: str) -> None:
    from sage_jax.experiments.reproduce import claim
    known = index(out)
    for job in jobs:
        if finished(job, known):
            continue
        with claim(job.workdir) as mine:
            if not mine:
                print(f"[{job.label}] another process is running it; skipped here", flush=True)
            elif not finished(job, index(out), quiet=True):  # it may have finished between the check and the claim
                session.check(job.config)
                run_job(job, session.task, session.base, session.command)


def finished_records(jobs: Sequence[Job]) -> dict[str, dict[int, dict[str, Any]]]:
    """{arm: {seed: record}} of the jobs whose result file holds their current fingerprint."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for job in jobs:
        record = read_result(job.path)
        if record is not None and record.get("fingerprint") == job.fingerprint:
            out.setdefault(job.arm, {})[job.seed] = record
    return out


# --------------------------------------------------------------------------------------------------- modes

def study(args, arms: Sequence[str], overrides: Sequence[str], command: str, session: Session) -> None:
    if not args.report_only:
        tau = tau_for(session, args.out, arms, args.preset, overrides, compute=True)
        run_all(make_jobs(arms, args.seeds, args.preset, overrides, args.out, args.work, tau), session, args.out)
    smollm2_report.write(args.out)
    print(f"wrote {os.path.join(args.out, 'RESULTS.md')}", flush=True)


def candidate_settings(name: str, preset: str = "study") -> dict[str, Any]:
    """A regime candidate's settings over the arms' config. They are relative to smollm2_cpu, so a frozen REGIME is
    undone first (a rerun after the freeze still finds the candidates' committed runs)."""
    mod = arms_module()
    cpu = flat(config_lib.load(str(CPU_CONFIG) + (":quick" if preset == "quick" else "")).to_dict())
    return {**{k: cpu[k] for k in mod.REGIME}, **mod.REGIME_CANDIDATES[name][0]}


def regime(args, overrides: Sequence[str], command: str, session: Session) -> dict[str, Any]:
    """Each candidate (in order) on GRPO and the base with --seeds seeds (default 3), stopping at the first kept
    one unless --regime-all; writes regime.md and regime.json in --out."""
    mod = arms_module()
    names = [c.strip() for c in args.candidates.split(",") if c.strip()] or list(mod.REGIME_CANDIDATES)
    if unknown := [c for c in names if c not in mod.REGIME_CANDIDATES]:
        raise ValueError(f"--candidates: unknown {', '.join(unknown)}; choose from {', '.join(mod.REGIME_CANDIDATES)}")
    seeds = args.seeds or 3
    found, costs, tried = {}, {}, []
    for name in names:
        settings = candidate_settings(name, args.preset)
        jobs = make_jobs(["base", "grpo"], seeds, args.preset, overrides, args.out, args.work, None,
                         sub=os.path.join("regime", name), settings=settings)
        costs[name] = smollm2_regime.rollouts(jobs[-1].config)
        if not args.report_only:
            run_all(jobs, session, args.out)
        found[name] = finished_records(jobs)
        tried.append(name)
        if smollm2_regime.summarize([name], mod.REGIME_CANDIDATES, found, costs)[name]["kept"] and not args.regime_all:
            break
    results = smollm2_regime.summarize(tried, mod.REGIME_CANDIDATES, found, costs)
    choice, meets = smollm2_regime.select(results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "regime.md"), "w", encoding="utf-8") as f:
        f.write(smollm2_regime.render(results, command))
    write_result(os.path.join(args.out, "regime.json"), {"rule": smollm2_regime.RULE, "selected": choice,
                                                         "meets_rule": meets, "candidates": results})
    print(f"wrote {os.path.join(args.out, 'regime.md')}; selected: {choice} (meets the rule: {meets})", flush=True)
    return results


def parse(argv: Sequence[str]):
    overrides, rest = config_lib.split_config_flags(argv)
    p = argparse.ArgumentParser(description="GRPO vs SAGE-Branch on SmolLM2-135M-Instruct (CPU), resumable")
    p.add_argument("--out", required=True, help="result files (commit them), RESULTS.md, PNGs")
    p.add_argument("--work", default="/tmp/smol_study", help="checkpoints, metrics and samples (resumable)")
    p.add_argument("--arms", default="", help="comma-separated subset of configs/smollm2_arms.ARMS (default: all)")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 for every arm (default: SEEDS_PER_ARM; "
                   "--regime: 3)")
    p.add_argument("--quick", action="store_true", help="the smoke preset (2 RL steps, 4 problems, n = 4)")
    p.add_argument("--report-only", action="store_true", help="render from the result files; run nothing")
    p.add_argument("--regime", action="store_true", help="the regime search on GRPO + base (before any arm)")
    p.add_argument("--candidates", default="", help="--regime: comma-separated subset of REGIME_CANDIDATES")
    p.add_argument("--regime-all", action="store_true", help="--regime: run every candidate (default: stop at the "
                   "first that meets the rule)")
    p.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache (default WORK/jax_cache; "
                   "'off' disables)")
    args = p.parse_args(rest)
    args.preset = "quick" if args.quick else "study"
    known = list(arms_module().ARMS)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] or known
    if unknown := [a for a in arms if a not in known]:
        raise ValueError(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.seeds is not None and args.seeds < 1:
        raise ValueError(f"--seeds={args.seeds}: need at least 1")
    return args, arms, overrides


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, arms, overrides = parse(argv)
    command = "python -m sage_jax.experiments.smollm2_study " + " ".join(argv)
    session = Session(load_config("grpo", args.preset, overrides), command, args.out)
    if not args.report_only:
        import jax
        from sage_jax.experiments.reproduce import use_compile_cache
        cache = args.compile_cache or os.path.join(args.work, "jax_cache")
        if cache != "off" and not jax.config.jax_compilation_cache_dir:
            use_compile_cache(cache)
    if args.regime:
        regime(args, overrides, command, session)
    else:
        study(args, arms, overrides, command, session)
    return 0


if __name__ == "__main__":
    from sage_jax.run import cli
    cli.main_guard(main)
