"""A study: the arms of a settings file from one base model, seeds paired, a held-out evaluation per run, one small
result file per run, resumable across sessions, and the report from the result files alone.

    S="python -m sage_jax.experiments.study"
    $S --settings configs/smollm2_arms.py --regime --out docs/results/smollm2_study
    $S --settings configs/smollm2_arms.py --out docs/results/smollm2_study
    $S --settings configs/smollm2_arms.py --out docs/results/smollm2_study --report-only
    $S --settings configs/countdown_arms.py --preset study --sweep --out OUT --results RUNS/study
    $S --settings configs/countdown_arms.py --preset tiny --out /tmp/smoke   # a minute

A settings file (configs/*_arms.py) holds the arms (ARMS, each a difference from one config), seeds per arm
(SEEDS_PER_ARM; the `base` arm is the base model evaluated), presets, the regime's candidates and rule
(REGIME_CANDIDATES, REGIME_RULE), the evaluation splits (SPLITS), the base model (BASE_MODEL = "sft": trained once
from experiment.sft_problems; else pretrained weights), the report's comparisons (PAIRS, PRIMARY) and its title.

--results (default --out) gets one small JSON per finished run, runs/ARM/seedK.json (regime runs:
regime/CANDIDATE/ARM/seedK.json; sweep cells: sweep/gammaG_tauT/seedK.json), runs/base/entropy.json (the base's
token entropies, from which Branch's tau is taken); --out gets regime.md/.json, RESULTS.md, results.json and PNGs:
commit them as runs finish. --work/runs/ARM/seedK-FINGERPRINT/ holds a run's checkpoints, metrics and samples. A run
is skipped when its result file holds the fingerprint of its current config; when another result file does (the
regime's GRPO runs are the study's when the regime is frozen), that one is copied; otherwise it runs, resuming from
its workdir (a file with another fingerprint is replaced). Seeds run seed-major, so an interrupted study has every
arm at its first seeds. Two processes started with the same command split the runs through a claim file.
`--config.key=value` applies to every arm (e.g. --config.model.path=/tmp/sage_jax_test_cache/smollm2/hf).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import sys
from typing import Any, Sequence

from sage_jax.experiments import measure, report
from sage_jax.experiments.runs import (Job, entropy_fingerprint, fingerprint, flat, load_config, option, read_json,
                                       read_result, run_job, settings, sft_fingerprint, takes_tau, timed,
                                       write_result)
from sage_jax.run import config as config_lib


# --------------------------------------------------------------------------------------------------- the work list

def baseline(mod) -> str:
    """The arm the regime is chosen on and whose config the session loads (BASELINE_ARM; GRPO by default)."""
    return option(mod, "BASELINE_ARM", "grpo")


def seeds_for(mod, arm: str, preset: str, seeds: int | None) -> int:
    return seeds if seeds is not None else mod.seeds_for(arm, preset)


def make_jobs(mod, arms: Sequence[str], seeds: int | None, preset: str, overrides: Sequence[str], results: str,
              work: str, tau: float | None, sub: str = "runs", settings_: dict[str, Any] | None = None) -> list[Job]:
    """Every (arm, seed), seed-major. Branch jobs need tau when their config takes it from the base's entropies."""
    todo = []
    for seed in range(max(seeds_for(mod, a, preset, seeds) for a in arms)):
        for arm in arms:
            if seed < seeds_for(mod, arm, preset, seeds):
                todo.append(job(mod, arm, seed, preset, overrides, results, work, tau, sub, settings_))
    return todo


def job(mod, arm, seed, preset, overrides, results, work, tau, sub, settings_=None, cell: str = "",
        loss: dict[str, float] | None = None) -> Job:
    loss = loss or {}
    config = load_config(mod, arm, preset, overrides, seed, settings_, tau, loss)
    if config.loss.guide == "branch" and takes_tau(config) and tau is None and "tau" not in loss:
        raise ValueError("Branch's tau comes from the base's entropy profile, which is not there yet")
    fp = fingerprint(mod, config)
    where = os.path.join(sub, cell or arm)
    return Job(arm, seed, config, os.path.join(results, where, f"seed{seed}.json"),
               os.path.join(work, "runs", cell or arm, f"seed{seed}-{fp[:8]}"), f"{where}/seed{seed}", fp)


def sweep_jobs(mod, preset: str, seeds: int | None, overrides, results: str, work: str, tau, sweep_taus) -> list[Job]:
    """The Branch sweep's cells (experiment.sweep_*): the gamma x tau grid, or a cross through the arm's own point."""
    ex = load_config(mod, baseline(mod), preset, overrides).experiment
    arm = ex.sweep_arm
    centre = load_config(mod, arm, preset, overrides, tau=tau)
    gamma0, tau0 = centre.loss.gamma, centre.loss.tau
    cells = [(g, t) for g in ex.sweep_gammas for t in sweep_taus]
    if ex.sweep_design == "cross":
        cells = [(g, tau0) for g in ex.sweep_gammas] + [(gamma0, t) for t in sweep_taus if t != tau0]
    count = min(seeds or ex.seeds, ex.sweep_seeds)
    return [job(mod, arm, seed, preset, overrides, results, work, tau, "sweep", cell=f"gamma{g}_tau{t}",
                loss={"gamma": g, "tau": t}) for g, t in cells for seed in range(count)]


def index(results: str) -> dict[tuple[str, int], str]:
    """(fingerprint, seed) -> a result file under results holding it."""
    found = {}
    for path in sorted(glob.glob(os.path.join(results, "**", "seed*.json"), recursive=True)):
        record = read_result(path)
        if record is not None:
            found.setdefault((record.get("fingerprint"), record.get("seed")), path)
    return found


def lookup(job: Job, known: dict[tuple[str, int], str]) -> dict[str, Any] | None:
    """The job's result: its own file with its fingerprint, else another file holding it; None if none."""
    record = read_result(job.path)
    if record is not None and record.get("fingerprint") == job.fingerprint:
        return record
    source = known.get((job.fingerprint, job.seed))
    return read_result(source) if source else None


def finished(job: Job, known: dict[tuple[str, int], str], quiet: bool = False) -> bool:
    """Whether job's result is there (one found elsewhere is copied to job.path). A file with another fingerprint
    is not (the run is redone and the file replaced)."""
    record = read_result(job.path)
    if record is not None and record.get("fingerprint") == job.fingerprint:
        return True
    source = known.get((job.fingerprint, job.seed))
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
    """The settings, the task and the base models, loaded on first use (a rerun with nothing to do loads neither).
    An SFT base is trained once per distinct SFT setting (a regime candidate may change it); a pretrained one is one."""

    def __init__(self, mod, config, command: str, results: str, work: str):
        self.mod, self.config, self.command, self.results, self.work = mod, config, command, results, work
        self._tasks, self._bases = None, {}

    @property
    def task(self):
        if self._tasks is None:
            self._tasks = measure.build_task(self.mod, self.config)
        return self._tasks[0]

    @property
    def base(self):
        return self.base_for(self.config)

    def base_for(self, config):
        """(model config, host parameters, weights fingerprint) of the base the config's runs start from."""
        task, sft_task = self.task, self._tasks[1]
        base = config.copy_and_resolve_references()
        base.experiment.rl, base.seed = False, 0
        key = sft_fingerprint(self.mod, base) if sft_task is not None else "pretrained"
        if key not in self._bases:
            workdir = os.path.join(self.work, "base", f"sft-{key[:8]}")
            with timed(workdir, "sft") if sft_task is not None else contextlib.nullcontext():
                self._bases[key] = measure.load_base(self.mod, base, task, sft_task, workdir)
            self._check_weights(self._bases[key][2], sft_task is not None)
        return self._bases[key]

    def check(self, config) -> None:
        """A job's model and problems must be the session's (a candidate may change RL and SFT settings only)."""
        shared = lambda c: {k: v for k, v in flat(c.to_dict()).items() if k.startswith(("model.", "data."))}
        if shared(config) != shared(self.config) or config.experiment.get("data_seed") != \
                self.config.experiment.get("data_seed"):
            raise ValueError("this run changes the model or the problem sets: run it in a study of its own")

    def _check_weights(self, weights: str, trained: bool) -> None:
        """The committed results must come from these weights: a mismatch stops the study before it mixes them. An
        SFT base retrained in a fresh --work may differ in its last bits: its own evaluations are compared, with a
        warning."""
        pattern = os.path.join(self.results, "runs", "base", "seed*.json") if trained else \
            os.path.join(self.results, "**", "seed*.json")
        for path in glob.glob(pattern, recursive=True):
            record = read_result(path)
            if record is not None and record.get("weights") not in (None, weights):
                message = f"{path} was made from other weights ({record['weights']}, these are {weights})"
                if trained:
                    print(f"[base] WARNING: {message}: the runs recorded there started from another SFT base",
                          flush=True)
                    continue
                raise ValueError(f"{message}: use the same model or move the result files aside")


def tau_for(session: Session, arms: Sequence[str], preset: str, overrides, compute: bool) -> tuple[Any, list]:
    """(Branch's tau, the sweep's taus): quantiles of the base's token entropies (runs/base/entropy.json, computed
    once and committed with the runs) when a config takes tau from them; (None, experiment.sweep_taus) else."""
    mod = session.mod
    configs = [load_config(mod, a, preset, overrides) for a in arms]
    takers = [c for c in configs if c.loss.guide == "branch" and takes_tau(c)]
    ex = configs[0].experiment
    if not takers:
        return None, list(ex.get("sweep_taus", ()))
    config, path = takers[0], os.path.join(session.results, "runs", "base", "entropy.json")
    fp = entropy_fingerprint(mod, config)
    kept = read_json(path) if os.path.exists(path) else None
    # --report-only takes the committed profile as it is: the Branch runs' own fingerprints hold the tau it gives
    if kept is None or (compute and kept.get("fingerprint") != fp):
        if not compute:
            raise FileNotFoundError(f"{path} holds no entropy profile of this base (fingerprint {fp}): run the "
                                    "study without --report-only first")
        cfg, host, weights = session.base
        kept = {"fingerprint": fp, "weights": weights,
                **measure.entropy_profile(mod, session.task, cfg, host, config)}
        write_result(path, kept)
        print(f"[base] token entropy: mean {kept['mean']:.3f} over {kept['tokens']} tokens", flush=True)
    quantiles = ex.get("sweep_tau_quantiles", ())
    sweep = [measure.tau_at(kept, q) for q in quantiles] if quantiles else list(ex.get("sweep_taus", ()))
    return measure.tau_at(kept, config.experiment.tau_quantile), sweep


def run_all(jobs: Sequence[Job], session: Session) -> None:
    from sage_jax.experiments.runs import claim
    known = index(session.results)
    for one in jobs:
        if finished(one, known):
            continue
        with claim(one.workdir) as mine:
            if not mine:
                print(f"[{one.label}] another process is running it; skipped here", flush=True)
            elif not finished(one, index(session.results), quiet=True):  # it may have finished since the check
                session.check(one.config)
                run_job(session.mod, one, session.task, session.base_for(one.config), session.command)


def found_records(jobs: Sequence[Job], results: str, by_cell: bool = False) -> dict[str, dict[int, dict[str, Any]]]:
    """{arm (or sweep cell): {seed: record}} of the jobs whose result is there."""
    known, out = index(results), {}
    for one in jobs:
        if (record := lookup(one, known)) is not None:
            out.setdefault(one.label.split("/")[1] if by_cell else one.arm, {})[one.seed] = record
    return out


# --------------------------------------------------------------------------------------------------- modes

def study(args, arms: Sequence[str], overrides: Sequence[str], session: Session) -> None:
    mod = session.mod
    if args.sweep and "sweep_arm" not in session.config.experiment:
        raise ValueError(f"--sweep: {args.settings} defines no sweep (experiment.sweep_arm, sweep_gammas, ...)")
    tau, sweep_taus = tau_for(session, arms, args.preset, overrides, compute=not args.report_only)
    jobs = make_jobs(mod, arms, args.seeds, args.preset, overrides, args.results, args.work, tau)
    cells = sweep_jobs(mod, args.preset, args.seeds, overrides, args.results, args.work, tau, sweep_taus) \
        if args.sweep else []
    if not args.report_only:
        run_all(jobs + cells, session)
    runs = found_records(jobs, args.results)
    if not runs:
        raise FileNotFoundError(f"no result files of these settings under {args.results}: run the study first")
    guides = {one.arm: one.config.loss.guide for one in jobs}
    report.write(mod, args.out, runs, found_records(cells, args.results, by_cell=True), guides)
    print(f"wrote {os.path.join(args.out, 'RESULTS.md')}", flush=True)


def regime(args, overrides: Sequence[str], session: Session) -> dict[str, Any]:
    """Each candidate (in order) on GRPO and the base with --seeds seeds (default 3), stopping at the first kept
    one unless --regime-all; writes regime.md and regime.json in --out."""
    mod = session.mod
    names = [c.strip() for c in args.candidates.split(",") if c.strip()] or list(mod.REGIME_CANDIDATES)
    if unknown := [c for c in names if c not in mod.REGIME_CANDIDATES]:
        raise ValueError(f"--candidates: unknown {', '.join(unknown)}; choose from {', '.join(mod.REGIME_CANDIDATES)}")
    found, costs = {}, {}
    for name in names:
        jobs = make_jobs(mod, ["base", baseline(mod)], args.seeds or 3, args.preset, overrides, args.results, args.work,
                         None, sub=os.path.join("regime", name), settings_=mod.candidate(name, args.preset))
        costs[name] = report.rollouts(jobs[-1].config)
        if not args.report_only:
            run_all(jobs, session)
        found[name] = found_records(jobs, args.results)
        if args.report_only and baseline(mod) not in found[name]:
            del found[name]  # never run: not part of the search's report
            continue
        if report.regime_summary(mod, [name], found, costs)[name]["kept"] and not args.regime_all:
            break
    results = report.regime_summary(mod, list(found), found, costs)
    report.regime_write(mod, args.out, results, session.command)
    return results


def parse(argv: Sequence[str], command: str = "python -m sage_jax.experiments.study"):
    overrides, rest = config_lib.split_config_flags(argv)
    p = argparse.ArgumentParser(description="a study's arms from one base model, resumable", prog=command)
    p.add_argument("--settings", required=True, help="the study's settings file, e.g. configs/smollm2_arms.py")
    p.add_argument("--out", required=True, help="RESULTS.md, results.json, PNGs, regime.md (and the result files)")
    p.add_argument("--results", default=None, help="where the result files live (default: --out); commit them")
    p.add_argument("--work", default="/tmp/sage_study", help="checkpoints, metrics and samples (resumable)")
    p.add_argument("--arms", default="", help="comma-separated subset of the settings' ARMS (default: those of "
                   "SEEDS_PER_ARM)")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 for every arm (default: the settings'; "
                   "--regime: 3)")
    p.add_argument("--preset", default=None, help="a preset of the settings file (default: its own)")
    p.add_argument("--quick", action="store_true", help="the settings' quick preset (a smoke)")
    p.add_argument("--sweep", action="store_true", help="also the Branch gamma x tau cells (experiment.sweep_*)")
    p.add_argument("--report-only", action="store_true", help="render from the result files; run nothing")
    p.add_argument("--regime", action="store_true", help="the regime search on GRPO + base (before any arm)")
    p.add_argument("--candidates", default="", help="--regime: comma-separated subset of REGIME_CANDIDATES")
    p.add_argument("--regime-all", action="store_true", help="--regime: every candidate (default: stop at the "
                   "first that meets the rule)")
    p.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache (default WORK/jax_cache; "
                   "'off' disables)")
    args = p.parse_args(rest)
    mod = settings(args.settings)
    if missing := [n for n in ("ARMS", "SEEDS_PER_ARM", "REGIME_CANDIDATES", "parse_arg", "seeds_for", "reference",
                               "candidate") if not hasattr(mod, n)]:
        raise ValueError(f"{args.settings} is not a study's settings file (it lacks {', '.join(missing)}): see "
                         "configs/smollm2_arms.py")
    args.preset = "quick" if args.quick else args.preset or mod.parse_arg(None)[1]
    mod.parse_arg(f"{baseline(mod)},{args.preset}")  # an unknown preset: one line naming the presets
    args.results = args.results or args.out
    known = list(mod.ARMS)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] or list(mod.SEEDS_PER_ARM)
    if unknown := [a for a in arms if a not in known]:
        raise ValueError(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.seeds is not None and args.seeds < 1:
        raise ValueError(f"--seeds={args.seeds}: need at least 1")
    return mod, args, arms, overrides


def main(argv: Sequence[str] | None = None, command: str = "python -m sage_jax.experiments.study",
         shown: Sequence[str] | None = None) -> int:
    """shown: the flags as the user gave them (an alias's), for the command each result records."""
    argv = list(sys.argv[1:] if argv is None else argv)
    mod, args, arms, overrides = parse(argv, command)
    session = Session(mod, load_config(mod, baseline(mod), args.preset, overrides),
                      f"{command} {' '.join(argv if shown is None else shown)}", args.results, args.work)
    if not args.report_only:
        import jax
        cache = args.compile_cache or os.path.join(args.work, "jax_cache")
        if cache != "off" and not jax.config.jax_compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if args.regime:
        regime(args, overrides, session)
    else:
        study(args, arms, overrides, session)
    return 0


if __name__ == "__main__":
    from sage_jax.run import cli
    cli.main_guard(main)
