import json
import math

import pytest

from sage_jax.experiments import measure, report, reproduce, stats, worklist
from sage_jax.rewards import countdown

GOLD = {"numbers": [3, 4, 2], "target": 10}  # solutions: 4*3-2 (sub) and 3*2+4 (add)


# --------------------------------------------------------------------------------------------------- statistics

def test_mean_ci_against_hand_computed_values():
    mean, half = stats.mean_ci([1.0, 2.0, 3.0])  # sd 1, t_{0.975,2} = 4.303
    assert mean == pytest.approx(2.0)
    assert half == pytest.approx(4.303 / math.sqrt(3), rel=1e-6)
    mean, half = stats.mean_ci([2, 4, 4, 4, 5, 5, 7, 9])  # sd = sqrt(32/7), t_{0.975,7} = 2.365
    assert mean == pytest.approx(5.0)
    assert half == pytest.approx(2.365 * math.sqrt(32 / 7) / math.sqrt(8), rel=1e-6)
    assert stats.mean_ci([0.25, 0.25]) == (0.25, 0.0)
    mean, half = stats.mean_ci([0.5])
    assert mean == 0.5 and math.isnan(half)
    assert math.isnan(stats.mean_ci([])[0])
    assert stats.t_quantile_975(11) == 2.228  # between table rows: the wider interval
    assert stats.fmt(0.12345, 0.01) == "0.123 ± 0.010" and stats.fmt(0.5) == "0.500"


def test_paired_difference_uses_common_seeds():
    a = {0: {"x": 1.0}, 1: {"x": 2.0}, 2: {"x": 4.0}, 3: {"x": 9.0}}
    b = {0: {"x": 0.0}, 1: {"x": 1.0}, 2: {"x": 1.0}}
    mean, half, count = stats.paired_difference(a, b, "x")  # diffs 1, 1, 3: sd sqrt(4/3)
    assert count == 3
    assert mean == pytest.approx(5 / 3)
    assert half == pytest.approx(4.303 * math.sqrt(4 / 3) / math.sqrt(3), rel=1e-6)


def test_t_distribution_holm_and_minimum_detectable_effect():
    assert stats.t_cdf(4.303, 2) == pytest.approx(0.975, abs=1e-4)  # the table's t_{0.975, 2}
    assert stats.t_cdf(0.0, 7) == pytest.approx(0.5) and stats.t_cdf(-2.262, 9) == pytest.approx(0.025, abs=1e-4)
    assert stats.t_ppf(0.975, 9) == pytest.approx(2.262, abs=1e-3) and stats.t_ppf(0.8, 9) == pytest.approx(0.883,
                                                                                                      abs=1e-3)
    r = stats.paired_test([0.1, 0.2, -0.05, 0.15])  # mean 0.1, sd 0.108: t = 1.852 on 3 df
    assert r["p"] == pytest.approx(0.1612, abs=1e-4) and r["n"] == 4
    assert r["mde"] == pytest.approx((3.182 + 0.978) * r["sd"] / 2, rel=1e-3)
    assert math.isnan(stats.paired_test([0.3])["p"])
    # Holm: sorted p 0.01, 0.03, 0.04, 0.2 times 4, 3, 2, 1, kept monotone; NaN is not a comparison
    assert stats.holm([0.01, 0.04, 0.03, math.nan, 0.2])[:3] == pytest.approx([0.04, 0.09, 0.09])
    assert math.isnan(stats.holm([math.nan])[0])


def test_report_flags_a_guide_that_did_not_act():
    from sage_jax.experiments import report
    runs = lambda qs: {s: {"train/q_mean": q, "train/q_p90": q, "train/q_active": 0.1} for s, q in enumerate(qs)}
    per_seed = {"idle": runs([1.004, 1.006]), "live": runs([1.05, 1.08]), "plain": runs([1.0, 1.0]),
                "noise": runs([1.0, 1.001])}
    results = {"per_seed": per_seed, "aggregate": {a: stats.aggregate(list(r.values())) for a, r in per_seed.items()},
               "meta": {"arm_configs": {"idle": {"guide": "branch"}, "live": {"guide": "branch"},
                                        "plain": {"guide": "none"}, "noise": {"guide": "random"}}}}
    activity = report.guide_activity(results)
    assert set(activity) == {"idle", "live", "noise"}
    assert activity["idle"]["acted"] is False and activity["live"]["acted"] is True
    assert activity["noise"]["acted"] is None  # zero-mean noise: q_mean ~ 1 says nothing
    assert activity["idle"]["idle_seeds"] == [0, 1]
    table = report._activity_table(results)
    assert "| idle |" in table and "**did not act**" in table.split("| live |")[0]


def test_hand_written_reading_and_the_regime_report_are_included_a_level_down(tmp_path):
    assert report._included(str(tmp_path), report.READING, "Reading") == []
    (tmp_path / report.READING).write_text("# Title\n\nText.\n\n## Part\n\n```\n# a comment, not a heading\n```\n")
    head, source, body = report._included(str(tmp_path), report.READING, "Reading")
    assert head == "## Reading\n" and "reading.md" in source and "Title" not in body
    assert "### Part" in body and "\n# a comment, not a heading\n" in body


def test_caveats_name_only_the_arms_that_ran():
    from sage_jax.experiments import text
    config = reproduce.load_config("grpo", "tiny")
    some = text._caveats(config, 5, "5-10", ["grpo", "grpo_branch"])
    assert "5-10 seed(s) per arm" in some and "DAPO" not in some and "KL-Cov penalises" not in some
    assert "DAPO" in text._caveats(config, 5, "5", ["grpo", "dapo"])
    assert "KL-Cov penalises" in text._caveats(config, 5, "5", ["grpo_kl_cov"])


def test_pass_curve_is_the_unbiased_estimator():
    problems = [{"n": 4, "correct": c} for c in (0, 2, 4)]
    curve = stats.pass_curve(problems)
    assert len(curve) == 4
    assert curve[0] == pytest.approx((0 + 0.5 + 1) / 3)
    assert curve[1] == pytest.approx((0 + (1 - 1 / 6) + 1) / 3)  # c=2 of 4: 1 - C(2,2)/C(4,2)
    assert curve[3] == pytest.approx(2 / 3)


# --------------------------------------------------------------------------------------------------- mode coverage

def test_problem_stats_counts_distinct_correct_solutions():
    texts = ["4*3-2=10", "3*4-2=10", "(3*4)-2", "3*2+4=10", "4+3*2=10",  # 5 correct, 2 canonical forms
             "4*3-2=11", "4*3+2=10", "4*3=12", "4*3-2-2=8", "garbage"]
    s = measure.problem_stats(texts, GOLD)
    assert s == {"n": 10, "correct": 5, "distinct": 2, "solutions": 2, "strategies": {"sub": 3, "add": 2}}
    # the same classes as countdown.strategy_shares
    assert stats.shares(s["strategies"]) == {"add": 0.4, "sub": 0.6, "mul": 0.0, "div": 0.0}
    assert countdown.strategy_shares(texts, [GOLD] * len(texts)) == {"sub": 0.6, "add": 0.4}


def test_summarize_run_coverage_and_shares():
    record = {"eval": {"countdown": [measure.problem_stats(["4*3-2=10", "3*2+4=10"], GOLD),
                                     measure.problem_stats(["4*3-2=10", "nope"], GOLD)]},
              "curves": {"step": [0, 1, 2], "entropy": [0.9, 0.5, 0.3], "reward": [0.1, None, 0.4]}}
    s = stats.summarize_run(record)
    assert s["countdown/distinct"] == pytest.approx(1.5)
    assert s["countdown/coverage"] == pytest.approx((2 / 2 + 1 / 2) / 2)
    assert s["countdown/pass@1"] == pytest.approx((1.0 + 0.5) / 2)
    assert s["countdown/share/sub"] == pytest.approx(2 / 3)
    assert s["train/entropy_end"] == pytest.approx(0.3) and s["train/reward_end"] == pytest.approx(0.4)


def test_chunks_keep_few_shapes():
    assert measure._chunks(48, 64) == [(0, 48)]
    assert measure._chunks(24, 16) == [(0, 12), (12, 24)]
    assert measure._chunks(5, 2) == [(0, 2), (2, 4), (4, 5)]


def test_training_curves_merge_lines_of_a_step(tmp_path):
    lines = [{"step": 0, "rl/reward": 0.1}, {"step": 0, "rl/entropy": 0.8}, {"step": 1, "rl/reward": 0.2},
             {"step": 1, "rl/reward": 0.3, "rl/entropy": 0.7}]  # a resumed run re-logs step 1: the later wins
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    c = measure.training_curves(str(tmp_path))
    assert c["step"] == [0, 1] and c["reward"] == [0.1, 0.3] and c["entropy"] == [0.8, 0.7]


# --------------------------------------------------------------------------------------------------- end to end

def test_unknown_arm_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown nope"):
        reproduce.main(["--out", str(tmp_path), "--arms", "nope", "--tiny"])


def test_tiny_experiment_renders_every_arm_and_resumes(tmp_path):
    out, work, records = tmp_path / "out", tmp_path / "work", tmp_path / "records"
    args = ["--out", str(out), "--work", str(work), "--tiny", "--sweep", "--records", str(records)]
    reproduce.main(args)  # conftest's compile cache keeps it fast
    arms = list(reproduce.arms_module().ARMS)
    text = (out / "RESULTS.md").read_text()
    for arm in arms:
        assert f"| {arm} | 1 |" in text, arm
    assert "| base (SFT) |" in text and "## Branch sweep" in text and "## Guide activity" in text
    assert "Holm-adjusted over all" in text and "Minimum detectable effect" in text
    assert "quantile of the SFT base's token entropies" in text
    assert "RL-prompt pass@1" in text and "## pass@k, RL prompts (trained on)" in text  # experiment.rl_eval_problems
    for png in ("pass_at_k_countdown.png", "pass_at_k_countdown_ood.png", "training_curves.png",
                "strategy_shares.png", "sweep_heatmap.png"):
        assert (out / png).stat().st_size > 1000, png
    assert {p.suffix for p in out.iterdir()} <= {".md", ".json", ".png"}  # no checkpoints in the report
    results = json.loads((out / "results.json").read_text())
    assert set(results["aggregate"]) == set(arms)
    assert len(results["aggregate"]["grpo"]["countdown/curve"][0]) == 8  # pass@k for k = 1..n
    # tau from the base's entropies: the cross through the paper-form arm's (gamma 0.3, tau) reuses its runs
    tau = results["meta"]["tau"]["tau"]
    assert tau == worklist.tau_at(json.loads((work / "tiny" / "base" / "record.json").read_text())["entropy"], 0.8)
    assert len(results["sweep"]) == 3 and f"gamma=0.3,tau={tau}" in results["sweep"]
    assert not (work / "tiny" / "sweep" / f"gamma0.3_tau{tau}").exists()
    for name in ("grpo_branch", "grpo_branch_paper"):  # the guide's activity is logged per step
        rec = json.loads((work / "tiny" / "runs" / name / "seed0" / "record.json").read_text())
        assert all(v is not None for k in ("q_active", "q_p90", "q_mean") for v in rec["curves"][k])
        assert rec["base_checksum"]
    rec = json.loads((work / "tiny" / "runs" / "grpo_top_entropy" / "seed0" / "record.json").read_text())
    assert all(0.1 < v < 0.4 for v in rec["curves"]["pg_token_frac"])  # ~20% of the tokens get policy gradient
    # every finished run's record is kept, small, under --records
    kept = records / "tiny" / "runs" / "grpo_kl_cov" / "seed0" / "record.json"
    assert kept.stat().st_size < 60_000 and (records / "tiny" / "base" / "record.json").exists()

    # --report-only renders from the finished runs alone
    reproduce.main(["--out", str(tmp_path / "again"), "--work", str(work), "--tiny", "--report-only"])
    assert "| grpo_branch | 1 |" in (tmp_path / "again" / "RESULTS.md").read_text()

    # a rerun skips every finished run
    record = work / "tiny" / "runs" / "grpo" / "seed0" / "record.json"
    stamp = record.stat().st_mtime_ns
    reproduce.main(args)
    assert record.stat().st_mtime_ns == stamp
    # a later session with a fresh --work but the committed --records retrains only the base and reruns nothing
    fresh = tmp_path / "fresh"
    stamp = kept.stat().st_mtime_ns
    reproduce.main(["--out", str(tmp_path / "later"), "--work", str(fresh), "--tiny", "--sweep", "--records",
                    str(records)])
    assert kept.stat().st_mtime_ns == stamp and not (fresh / "tiny" / "runs").exists()
    # and refuses to mix runs made with other settings
    with pytest.raises(ValueError, match="different settings"):
        reproduce.main(args + ["--config.optim.lr=0.5"])


def test_study_budget_seeds_per_arm():
    mod = reproduce.arms_module()
    assert all(mod.SEEDS_PER_ARM[a] >= 10 for a in ("grpo", "grpo_branch", "grpo_branch_paper", "grpo_rkl"))
    assert min(mod.SEEDS_PER_ARM.values()) >= 5 and set(mod.SEEDS_PER_ARM) <= set(mod.ARMS)
    base = reproduce.load_config("grpo", "study")
    todo = reproduce.jobs(list(mod.SEEDS_PER_ARM), base.experiment.seeds, True, base, "study", [], "/w/study",
                          "/r", tau=0.5, sweep_taus=[0.4, 0.5, 0.6])
    count = lambda arm: sum(1 for j in todo if j.bucket == "arms" and j.key == arm)
    assert count("grpo_branch_paper") == 10 and count("grpo_entropy") == 5
    assert all(j.config.loss.tau == 0.5 for j in todo if j.bucket == "arms" and j.config.loss.guide == "branch")
    sweep = {j.key for j in todo if j.bucket == "sweep"}  # gamma 0.1, 0.3, 1.0 at tau 0.5; tau 0.4, 0.6 at 0.3
    assert sweep == {(0.1, 0.5), (0.3, 0.5), (1.0, 0.5), (0.3, 0.4), (0.3, 0.6)}
    assert todo[0].mirror == "/r/study/runs/grpo/seed0/record.json"


def test_claim_lets_one_process_run_a_directory(tmp_path):
    run_dir = str(tmp_path / "run")
    with reproduce.claim(run_dir) as first:
        assert first
        with reproduce.claim(run_dir) as second:  # the claim file names this (live) process
            assert not second
    with reproduce.claim(run_dir) as again:  # released
        assert again
    (tmp_path / "run" / "claim.pid").write_text("999999999")  # a process that is gone: a stale claim is taken over
    with reproduce.claim(run_dir) as stale:
        assert stale


def test_regime_search_smoke_records_every_candidate_and_why(tmp_path):
    from sage_jax.experiments import regime
    out = tmp_path / "regime.md"
    regime.main(["--out", str(out), "--work", str(tmp_path / "work"), "--tiny", "--seeds", "2",
                 "--candidates", "round1,steps200_skew"])
    text = out.read_text()
    assert "| round1 |" in text and "| steps200_skew |" in text and ("Selected:" in text or "No candidate" in text)
    found = json.loads((tmp_path / "regime.json").read_text())
    assert set(found["candidates"]) == {"round1", "steps200_skew"}
    for r in found["candidates"].values():
        assert r["seeds"] == 2 and (r["reason"].startswith("kept") or r["reason"].startswith("dropped"))
    # the skewed base is another base; the round-1 candidate keeps the study budget's
    prints = {r["base_fingerprint"] for r in found["candidates"].values()}
    assert len(prints) == 2
    assert {r["split"] for r in found["candidates"].values()} == {"countdown_rl"}  # judged on the RL prompts
    assert "countdown_rl" in text and "held-out pass@1 gain" in text


def test_a_split_added_later_is_sampled_from_the_finished_checkpoint(tmp_path):
    """A finished run whose record lacks an evaluation split gets it from its final checkpoint, with the samples a
    fresh run draws (the same key per split), and keeps its other splits untouched."""
    from sage_jax.experiments import regime
    args = ["--out", str(tmp_path / "r.md"), "--work", str(tmp_path / "work"), "--tiny", "--seeds", "2",
            "--candidates", "round1"]
    regime.main(args)
    run = tmp_path / "work" / "tiny" / "regime" / "round1" / "seed1" / "record.json"
    full = json.loads(run.read_text())
    assert len(full["eval"]["countdown_rl"]) == 2
    (base_path,) = (tmp_path / "work" / "tiny" / "regime" / "bases").glob("*/base/record.json")
    base_full = json.loads(base_path.read_text())
    for path, record in ((run, full), (base_path, base_full)):
        path.write_text(json.dumps({**record, "eval": {k: v for k, v in record["eval"].items()
                                                       if k != "countdown_rl"}}))
    regime.main(args)
    again, base_again = json.loads(run.read_text()), json.loads(base_path.read_text())
    assert again["eval"] == full["eval"] and base_again["eval"] == base_full["eval"]


def test_regime_verdicts():
    from sage_jax.experiments import regime
    base = {"countdown/pass@1": 0.30, "countdown/distinct": 1.5, "countdown/pass@8": 0.8}
    run = lambda p1, d: {"countdown/pass@1": p1, "countdown/distinct": d, "countdown/pass@8": 0.8}
    assert regime.verdict(base, [run(0.40, 1.2), run(0.41, 1.3), run(0.42, 1.1)], 8)["kept"]
    assert not regime.verdict(base, [run(0.40, 1.2), run(0.42, 1.3)], 8)["kept"]  # 2 seeds: t_{0.975,1} = 12.7
    assert "below 0.05" in regime.verdict(base, [run(0.31, 1.2), run(0.33, 1.3), run(0.32, 1.2)], 8)["reason"]
    assert "includes 0" in regime.verdict(base, [run(0.20, 1.2), run(0.60, 1.3), run(0.40, 1.2)], 8)["reason"]
    assert "no collapse" in regime.verdict(base, [run(0.40, 1.6), run(0.41, 1.7), run(0.42, 1.6)], 8)["reason"]
    assert "one seed" in regime.verdict(base, [run(0.40, 1.2)], 8)["reason"]


def test_a_primary_split_that_is_never_evaluated_fails_before_any_training(tmp_path):
    from sage_jax.experiments import regime
    with pytest.raises(ValueError, match="primary_split='countdown_rl' is not evaluated"):
        regime.main(["--out", str(tmp_path / "r.md"), "--work", str(tmp_path / "work"), "--tiny", "--seeds", "2",
                     "--candidates", "round1", "--config.experiment.rl_eval_problems=0"])
    assert not (tmp_path / "work").exists()
