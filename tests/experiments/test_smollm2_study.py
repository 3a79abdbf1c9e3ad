"""The SmolLM2 study's harness (sage_jax.experiments.smollm2_*): arm configs, fingerprints and resume from committed
result files, the regime rule, the report from files. Tiny fake result files stand in for runs; the one end-to-end
run on the real model is marked slow (16.5 min under pytest on the shared 2-core machine at load ~11)."""

import json
import math
import os
import types

import pytest

from sage_jax.experiments import smollm2_regime, smollm2_report, smollm2_run, smollm2_study, stats
from sage_jax.run import config as config_lib

ARMS = ("base", "grpo", "branch", "nokl", "top_entropy")


def _cpu(preset="study"):
    return smollm2_run.flat(config_lib.load("configs/smollm2_cpu.py" + (":quick" if preset == "quick" else ""))
                            .to_dict())


# --------------------------------------------------------------------------------------------------- configs

@pytest.mark.parametrize("arm", ARMS)
def test_each_arm_differs_from_smollm2_cpu_only_where_intended(arm):
    mod = smollm2_run.arms_module()
    cpu, mine = _cpu(), smollm2_run.flat(config_lib.load(f"configs/smollm2_arms.py:{arm}").to_dict())
    intended = {**mod.STUDY, **mod.REGIME, **mod.ARMS[arm]}
    changed = {k for k, v in mine.items() if cpu.get(k, "<absent>") != v}
    expected = {k for k, v in intended.items() if cpu.get(k, "<absent>") != (list(v) if isinstance(v, tuple) else v)}
    # nothing else differs, but for the harness's own section (absent from smollm2_cpu)
    assert changed == expected | {k for k in mine if k.startswith("experiment.")}
    # the shared evaluation: >= 96 held-out problems (disjoint from training by the generator), n >= 32, pass@1..32
    assert mine["eval.problems"] >= 96 and mine["data.num_eval"] >= mine["eval.problems"] and mine["eval.n"] >= 32
    assert not mine["eval.at_start"] and not mine["eval.at_end"]  # the harness evaluates, not the trainer
    assert mine["loss.kl_estimator"] == ("none" if arm == "nokl" else "k3")
    assert mine["loss.beta"] == (0.0 if arm == "nokl" else 0.05)
    assert mine["loss.guide"] == ("branch" if arm == "branch" else "none")
    assert mine["experiment.rl"] == (arm != "base")


def test_branch_is_the_authors_form_with_tau_from_the_base():
    c = config_lib.load("configs/smollm2_arms.py:branch")
    assert (c.loss.guide, c.loss.kl_estimator, c.loss.beta, c.loss.gamma, c.loss.q_min, c.loss.q_max) == (
        "branch", "k3", 0.05, 0.3, 0.6, 1.4)
    assert c.experiment.tau_quantile == 0.8 and not c.loss.kl_in_reward
    assert config_lib.load("configs/smollm2_arms.py:top_entropy").loss.top_entropy_quantile == 0.2
    quick = smollm2_run.flat(config_lib.load("configs/smollm2_arms.py:grpo,quick").to_dict())
    assert quick["train.steps"] == _cpu("quick")["train.steps"] == 2 and quick["eval.n"] == 4


@pytest.mark.parametrize("arg", ["nope", "grpo,quik", "quik", "grpo,study,x"])
def test_an_unknown_arm_or_preset_is_an_error(arg):
    with pytest.raises(config_lib.ConfigError, match="unknown"):
        config_lib.load(f"configs/smollm2_arms.py:{arg}")


def test_unknown_arm_on_the_command_line(tmp_path):
    with pytest.raises(ValueError, match="unknown nope"):
        smollm2_study.main(["--out", str(tmp_path), "--arms", "grpo,nope"])


def test_seeds_per_arm_and_the_work_list():
    seeds = smollm2_run.arms_module().SEEDS_PER_ARM
    assert seeds["grpo"] >= 5 and seeds["branch"] >= 5 and min(seeds.values()) >= 3 and set(seeds) == set(ARMS)
    assert seeds["base"] == max(seeds.values())  # every run pairs with a base evaluation of its seed
    jobs = smollm2_study.make_jobs(list(ARMS), None, "study", [], "/o", "/w", tau=0.91)
    assert len(jobs) == sum(seeds.values())
    assert [(j.arm, j.seed) for j in jobs[:5]] == [(a, 0) for a in ARMS]  # seed-major
    assert jobs[0].path == "/o/runs/base/seed0.json" and jobs[0].workdir.startswith("/w/runs/base/seed0-")
    branch = [j for j in jobs if j.arm == "branch"]
    assert all(j.config.loss.tau == 0.91 for j in branch)
    assert all(j.config.loss.tau == 1.2 for j in jobs if j.arm == "grpo")  # unused without the guide
    other = smollm2_study.make_jobs(["branch"], 1, "study", [], "/o", "/w", tau=0.5)
    assert other[0].fingerprint != branch[0].fingerprint  # tau is part of Branch's settings
    with pytest.raises(ValueError, match="entropy profile"):
        smollm2_study.make_jobs(["branch"], 1, "study", [], "/o", "/w", tau=None)


def test_fingerprint_tracks_what_changes_a_run():
    fp = lambda arm, *o, seed=0: smollm2_run.fingerprint(smollm2_run.load_config(arm, "study", list(o), seed))
    assert fp("grpo") == fp("grpo", "--config.model.path=/elsewhere", "--config.train.ckpt_every=8")
    assert fp("grpo") != fp("grpo", "--config.optim.lr=1.5e-5") != fp("grpo", seed=1)
    # the base is evaluated only: RL settings leave it alone (the regime's candidates share one base), eval does not
    assert fp("base") == fp("base", "--config.optim.lr=5e-4", "--config.train.steps=16")
    assert fp("base") != fp("base", "--config.eval.n=16") and fp("base") != fp("grpo")
    # partial rollouts' settings (added after the first results) count only when partial rollouts are on
    assert fp("grpo") == fp("grpo", "--config.rollout.oversample=2", "--config.rollout.max_lag=1")
    assert fp("grpo", "--config.rollout.partial=True") != fp("grpo")
    assert (fp("grpo", "--config.rollout.partial=True", "--config.rollout.oversample=2")
            != fp("grpo", "--config.rollout.partial=True"))


def test_arithmetic_forms_and_problem_stats():
    assert smollm2_run.arithmetic_form("Sam has 10 + 3 = 13 balloons now.") == "10+3=13"
    assert smollm2_run.arithmetic_form("Ravi has 5 x 12 = 60 marbles.") == "5*12=60"
    assert smollm2_run.arithmetic_form("Tom has 33 cards left.") == "33"
    rec = {"id": "p", "n": 4, "num_correct": 3, "rewards": [1.0, 1.0, 1.0, 0.0],
           "completions": ["Sam has 13.", "sam has 13", "He has 10 + 3 = 13 now.", "He has 12."]}
    s = smollm2_run.problem_stats([rec])
    assert s == {"ids": ["p"], "n": [4], "correct": [3], "distinct_correct": [2], "distinct_forms": [2],
                 "distinct_answers": [2]}
    assert smollm2_run.pass_at_k({"n": [4, 4], "correct": [2, 0]})["1"] == pytest.approx(0.25)


# --------------------------------------------------------------------------------------------------- fakes

def fake(arm, seed, fp, correct, n=4, q=None, reward=0.5):
    curves = {"step": [0, 1], "reward": [0.2, reward], "entropy": [0.8, 0.6], "kl": [0.0, 0.01]}
    if q is not None:
        curves |= {"q_mean": [q, q], "q_active": [0.2, 0.2]}
    return {"schema": smollm2_run.SCHEMA, "arm": arm, "seed": seed, "fingerprint": fp, "arm_fingerprint": arm,
            "weights": "w0", "n": n, "problems": len(correct), "command": f"fake {arm}", "tau": 0.9 if q else None,
            "eval": {"ids": [f"p{i}" for i in range(len(correct))], "n": [n] * len(correct), "correct": correct,
                     "distinct_correct": [min(c, 1) for c in correct], "distinct_forms": [min(c, 2) for c in correct],
                     "distinct_answers": [2] * len(correct)},
            "guide": None if arm == "base" else {"name": "branch" if q else "none", "q_mean": q or 1.0,
                                                  "q_active": 0.2 if q else 0.0},
            "curves": {} if arm == "base" else curves, "times": {"train_cpu_s": 60.0, "eval_cpu_s": 30.0},
            "host": {"finished_utc": "today"}}


def _write_fakes(jobs, correct_of):
    for j in jobs:
        smollm2_run.write_result(j.path, fake(j.arm, j.seed, j.fingerprint, correct_of(j.arm, j.seed),
                                              q=1.06 if j.arm == "branch" else None))


def _no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a finished study must not load the model or run anything")
    monkeypatch.setattr(smollm2_study, "run_job", refuse)
    monkeypatch.setattr(smollm2_study, "load_base", refuse)


def test_finished_files_are_skipped_and_a_mismatched_fingerprint_is_not(tmp_path, monkeypatch):
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    grpo, nokl = smollm2_study.make_jobs(["grpo", "nokl"], 1, "study", [], out, work, tau=None)
    smollm2_run.write_result(grpo.path, fake("grpo", 0, grpo.fingerprint, [1, 2]))
    smollm2_run.write_result(nokl.path, fake("nokl", 0, "made-with-other-settings", [1, 2]))
    assert smollm2_study.finished(grpo) and not smollm2_study.finished(nokl)
    ran = []
    monkeypatch.setattr(smollm2_study, "run_job", lambda job, task, base, command: ran.append(job.label))
    session = types.SimpleNamespace(task=None, base=None, command="cmd", check=lambda config: None)
    smollm2_study.run_all([grpo, nokl], session, out)
    assert ran == ["runs/nokl/seed0"]
    assert not os.path.exists(os.path.join(nokl.workdir, "claim.pid"))  # released after the run
    # a result file elsewhere under --out with the same settings (the regime's GRPO) is adopted, not rerun
    os.remove(grpo.path)
    elsewhere = tmp_path / "out" / "regime" / "cand" / "grpo" / "seed0.json"
    smollm2_run.write_result(str(elsewhere), fake("grpo", 0, grpo.fingerprint, [3, 4]))
    smollm2_study.run_all([grpo], session, out)
    assert ran == ["runs/nokl/seed0"] and smollm2_run.read_result(grpo.path)["eval"]["correct"] == [3, 4]
    # one session holds one model and one problem set: a run that changes either is refused
    real = smollm2_study.Session(grpo.config, "cmd", out)
    real.check(smollm2_run.load_config("nokl", seed=3, settings={"optim.lr": 1e-3}))
    with pytest.raises(ValueError, match="problem sets"):
        real.check(smollm2_run.load_config("grpo", settings={"data.num_train": 500}))


def test_a_rerun_of_a_finished_study_loads_nothing_and_reports(tmp_path, monkeypatch):
    out, work = tmp_path / "out", tmp_path / "work"
    config = smollm2_run.load_config("branch")
    entropy = {"fingerprint": smollm2_run.entropy_fingerprint(config), "mean": 0.7, "tokens": 100,
               "grid": [i / 100 for i in range(101)]}  # quantile q at q nats: tau = 0.8
    smollm2_run.write_result(str(out / "runs" / "base" / "entropy.json"), entropy)
    jobs = smollm2_study.make_jobs(["base", "grpo", "branch"], 2, "study", [], str(out), str(work), tau=0.8)
    _write_fakes(jobs, lambda arm, seed: [1 + seed, 2])
    _no_model(monkeypatch)
    smollm2_study.main(["--out", str(out), "--work", str(work), "--arms", "base,grpo,branch", "--seeds", "2"])
    text = (out / "RESULTS.md").read_text()
    assert "| branch | 2 |" in text and "| base | 2 |" in text  # (tau 0.8 from the committed entropy profile
    # gave the fakes' fingerprints: nothing ran)


# --------------------------------------------------------------------------------------------------- report

# per arm and seed: correct counts of n = 4 on 2 problems
COUNTS = {"base": {0: [2, 0], 1: [1, 1], 2: [2, 1]}, "grpo": {0: [3, 0], 1: [4, 1], 2: [3, 2]},
          "branch": {0: [3, 1], 1: [4, 2], 2: [4, 1]}}


def _holm_by_hand(ps):
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def test_report_from_files_has_the_right_numbers_holm_and_pngs(tmp_path):
    out = tmp_path / "out"
    for arm, by_seed in COUNTS.items():
        for seed, correct in by_seed.items():
            smollm2_run.write_result(str(out / "runs" / arm / f"seed{seed}.json"),
                                     fake(arm, seed, f"{arm}{seed}", correct, q=1.06 if arm == "branch" else None))
    (out / "runs" / "grpo" / "notes.json").write_text("{}")  # not a result file: ignored
    text = smollm2_report.write(str(out))
    p1 = lambda arm, s: sum(c / 4 for c in COUNTS[arm][s]) / 2
    mean, half = stats.mean_ci([p1("base", s) for s in range(3)])
    assert f"| base | 3 | {mean:.3f} ± {half:.3f} |" in text
    # pass@4 of a problem is 1 when any of the 4 samples is correct
    p4 = lambda arm, s: sum(c > 0 for c in COUNTS[arm][s]) / 2
    metrics = {"pass@1": p1, "pass@4": p4, "distinct forms": lambda arm, s: sum(min(c, 2) for c in COUNTS[arm][s]) / 2}
    pairs = [("branch", "grpo"), ("grpo", "base"), ("branch", "base")]
    raw = {(a, b, m): stats.paired_test([f(a, s) - f(b, s) for s in range(3)]) for a, b in pairs
           for m, f in metrics.items()}
    adjusted = dict(zip(raw, _holm_by_hand([r["p"] for r in raw.values()])))
    assert f"Holm-adjusted over all {len(raw)} comparisons" in text
    r = raw[("branch", "grpo", "pass@1")]
    cell = f"{r['mean']:+.3f} ± {r['half']:.3f} (p {adjusted[('branch', 'grpo', 'pass@1')]:.2f})"
    assert f"| branch − grpo | 3 | {cell}" in text
    assert adjusted[("branch", "grpo", "pass@1")] > r["p"]  # the correction made it larger
    assert f"| branch − grpo | 3 | {r['mde']:.3f} |" in text  # the minimum detectable effect
    assert "| branch | 0.900 | 1.060 ± 0.000 |" in text and "acted" in text  # guide activity
    for png in ("pass_at_k.png", "pass_at_k_vs_base.png", "training_curves.png"):
        assert (out / png).stat().st_size > 1000, png
    results = json.loads((out / "results.json").read_text())
    assert results["n"] == 4 and set(results["aggregate"]) == {"base", "grpo", "branch"}


def test_report_flags_an_arm_whose_seeds_disagree_and_a_guide_that_did_not_act(tmp_path):
    out = tmp_path / "out"
    for seed, arm_fp in ((0, "a"), (1, "b")):
        rec = fake("branch", seed, f"f{seed}", [1, 2], q=1.001)
        smollm2_run.write_result(str(out / "runs" / "branch" / f"seed{seed}.json"), {**rec, "arm_fingerprint": arm_fp})
    text = smollm2_report.write(str(out))
    assert "**Warnings:** branch: its seeds were made with different settings" in text
    assert "**did not act**" in text


# --------------------------------------------------------------------------------------------------- regime

def _runs(values):
    return {s: {"n": 4, "pass_at_k": {"1": p1, "4": p4}} for s, (p1, p4) in enumerate(values)}


def test_regime_verdict_and_selection():
    base = _runs([(0.20, 0.70), (0.22, 0.72), (0.21, 0.71)])
    sharpens = smollm2_regime.verdict(base, _runs([(0.30, 0.60), (0.33, 0.61), (0.31, 0.62)]))
    assert sharpens["kept"] and sharpens["reason"].startswith("kept")
    keeps_k = smollm2_regime.verdict(base, _runs([(0.30, 0.70), (0.33, 0.73), (0.31, 0.71)]))
    assert not keeps_k["kept"] and "pass@4's interval" in keeps_k["reason"]
    flat = smollm2_regime.verdict(base, _runs([(0.20, 0.60), (0.23, 0.61), (0.20, 0.62)]))
    assert not flat["kept"] and "pass@1's interval" in flat["reason"]
    assert "one seed" in smollm2_regime.verdict(base, _runs([(0.3, 0.6)]))["reason"]
    with_cost = lambda v, c: {**v, "rollouts": c}
    assert smollm2_regime.select({"a": with_cost(keeps_k, 1), "b": with_cost(sharpens, 2),
                                  "c": with_cost(sharpens, 1)}) == ("b", True)  # the first kept, in order
    # none kept: the smallest shortfall (keeps_k misses only the fall; flat misses the rise)
    choice = smollm2_regime.select({"flat": with_cost(flat, 1), "keeps_k": with_cost(keeps_k, 2)})
    assert choice == ("keeps_k" if keeps_k["shortfall"] < flat["shortfall"] else "flat", False)


def test_regime_mode_stops_at_the_first_candidate_that_meets_the_rule(tmp_path, monkeypatch):
    out, work = tmp_path / "out", tmp_path / "work"
    mod = smollm2_run.arms_module()
    first, second = list(mod.REGIME_CANDIDATES)[:2]
    settings = smollm2_study.candidate_settings(first)  # over a frozen REGIME too
    jobs = smollm2_study.make_jobs(["base", "grpo"], 3, "study", [], str(out), str(work), None,
                                   sub=os.path.join("regime", first), settings=settings)
    # n = 32: GRPO's pass@1 rises while it loses the 3rd problem, which the base solves once in 32 (pass@32 falls)
    counts = {"base": {0: [10, 30, 1], 1: [11, 30, 1], 2: [10, 31, 1]},
              "grpo": {0: [20, 32, 0], 1: [22, 32, 0], 2: [21, 32, 0]}}
    for j in jobs:
        smollm2_run.write_result(j.path, fake(j.arm, j.seed, j.fingerprint, counts[j.arm][j.seed], n=32))
    _no_model(monkeypatch)
    smollm2_study.main(["--regime", "--out", str(out), "--work", str(work), "--candidates", f"{first},{second}"])
    found = json.loads((out / "regime.json").read_text())
    assert found["selected"] == first and found["meets_rule"] and list(found["candidates"]) == [first]
    text = (out / "regime.md").read_text()
    assert f"Selected: **{first}**" in text and f"REGIME = {mod.REGIME_CANDIDATES[first][0]!r}" in text
    assert not (out / "regime" / second).exists()  # never tried


# --------------------------------------------------------------------------------------------------- end to end

@pytest.mark.slow
def test_quick_study_on_the_real_model_and_its_resume(tmp_path):
    """Base, GRPO and Branch, 1 seed each, then a resume. Measured on the shared 2-core machine: the study command
    8 min wall / 4.4 CPU-min at load ~6; this test (8 simulated devices, plus the resume) 16.5 min at load ~11."""
    from tests.helpers_smollm2 import smollm2_hf_dir
    path = smollm2_hf_dir()
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["--out", str(out), "--work", str(work), "--quick", "--arms", "base,grpo,branch", "--seeds", "1",
            f"--config.model.path={path}"]
    smollm2_study.main(args)
    for arm in ("base", "grpo", "branch"):
        rec = smollm2_run.read_result(str(out / "runs" / arm / "seed0.json"))
        assert rec["problems"] == 4 and rec["n"] == 4 and len(rec["pass_at_k"]) == 4
    branch = smollm2_run.read_result(str(out / "runs" / "branch" / "seed0.json"))
    assert branch["guide"]["q_mean"] > 1.0 and 0 < branch["guide"]["q_active"] < 1 and branch["tau"] > 0
    assert (out / "RESULTS.md").exists() and (out / "pass_at_k.png").stat().st_size > 1000
    stamp = (out / "runs" / "grpo" / "seed0.json").stat().st_mtime_ns
    smollm2_study.main(args)  # everything finished: skipped
    assert (out / "runs" / "grpo" / "seed0.json").stat().st_mtime_ns == stamp
    assert math.isfinite(branch["times"]["train_cpu_s"])
    # a run stopped before its result file was written resumes from its workdir: the final checkpoint (no new
    # step) and the evaluation's samples.jsonl (the same samples)
    grpo = smollm2_run.read_result(str(out / "runs" / "grpo" / "seed0.json"))
    (metrics,) = (work / "runs" / "grpo").glob("seed0-*/metrics.jsonl")
    lines = metrics.read_text().count("\n")
    os.remove(out / "runs" / "grpo" / "seed0.json")
    smollm2_study.main(args)
    again = smollm2_run.read_result(str(out / "runs" / "grpo" / "seed0.json"))
    assert again["eval"] == grpo["eval"] and again["curves"]["step"] == grpo["curves"]["step"]
    assert again["fingerprint"] == grpo["fingerprint"] and metrics.read_text().count("\n") == lines  # no new step
