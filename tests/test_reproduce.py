import json
import math

import pytest

from sage_jax.experiments import measure, reproduce, stats
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
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["--out", str(out), "--work", str(work), "--tiny", "--sweep"]  # conftest's compile cache keeps it fast
    reproduce.main(args)
    arms = list(reproduce.arms_module().ARMS)
    text = (out / "RESULTS.md").read_text()
    for arm in arms:
        assert f"| {arm} | 1 |" in text, arm
    assert "| base (SFT) |" in text and "## Branch sweep" in text
    for png in ("pass_at_k_countdown.png", "pass_at_k_countdown_ood.png", "training_curves.png",
                "strategy_shares.png", "sweep_heatmap.png"):
        assert (out / png).stat().st_size > 1000, png
    assert {p.suffix for p in out.iterdir()} <= {".md", ".json", ".png"}  # no checkpoints in the report
    results = json.loads((out / "results.json").read_text())
    assert set(results["aggregate"]) == set(arms)
    assert len(results["aggregate"]["grpo"]["countdown/curve"][0]) == 8  # pass@k for k = 1..n
    assert len(results["sweep"]) == 2

    # --report-only renders from the finished runs alone
    reproduce.main(["--out", str(tmp_path / "again"), "--work", str(work), "--tiny", "--report-only"])
    assert "| grpo_branch | 1 |" in (tmp_path / "again" / "RESULTS.md").read_text()

    # a rerun skips every finished run
    record = work / "tiny" / "runs" / "grpo" / "seed0" / "record.json"
    stamp = record.stat().st_mtime_ns
    reproduce.main(args)
    assert record.stat().st_mtime_ns == stamp
    # and refuses to mix runs made with other settings
    with pytest.raises(ValueError, match="different settings"):
        reproduce.main(args + ["--config.optim.lr=0.5"])


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
