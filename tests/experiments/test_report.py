"""A study's report from its result files alone (sage_jax.experiments.report): numbers, Holm, guide activity."""

import json
import types

import pytest

from sage_jax.experiments import report, runs, stats

SMOL = runs.settings("configs/smollm2_arms.py")


def fake(arm, seed, fp, correct, n=4, q=None, reward=0.5):
    """A result file of the SmolLM2 harness's form: one split, per-problem counts of n samples."""
    curves = {"step": [0, 1], "reward": [0.2, reward], "entropy": [0.8, 0.6], "kl": [0.0, 0.01]}
    if q is not None:
        curves |= {"q_mean": [q, q], "q_active": [0.2, 0.2]}
    return {"schema": runs.SCHEMA, "arm": arm, "seed": seed, "fingerprint": fp, "arm_fingerprint": arm,
            "weights": "w0", "n": n, "command": f"fake {arm}", "tau": 0.9 if q else None,
            "eval": {"heldout": {"ids": [f"p{i}" for i in range(len(correct))], "n": [n] * len(correct),
                                 "correct": correct, "distinct_correct": [min(c, 1) for c in correct],
                                 "distinct_forms": [min(c, 2) for c in correct],
                                 "distinct_answers": [2] * len(correct)}},
            "guide": None if arm == "base" else {"name": "branch" if q else "none", "q_mean": q or 1.0,
                                                  "q_active": 0.2 if q else 0.0},
            "curves": {} if arm == "base" else curves, "times": {"train_cpu_s": 60.0, "eval_cpu_s": 30.0},
            "host": {"finished_utc": "today"}}


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
    found = {arm: {s: fake(arm, s, f"{arm}{s}", c, q=1.06 if arm == "branch" else None) for s, c in by.items()}
             for arm, by in COUNTS.items()}
    text = report.write(SMOL, str(tmp_path), found)
    p1 = lambda arm, s: sum(c / 4 for c in COUNTS[arm][s]) / 2
    mean, half = stats.mean_ci([p1("base", s) for s in range(3)])
    assert f"| base | 3 | {mean:.3f} ± {half:.3f} |" in text
    p4 = lambda arm, s: sum(c > 0 for c in COUNTS[arm][s]) / 2  # pass@4: any of the 4 samples correct
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
    assert "| branch | 0.9 | 1.060 ± 0.000 |" in text and "acted" in text  # guide activity
    for png in ("pass_at_k.png", "pass_at_k_vs_base.png", "training_curves.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["n"] == 4 and set(results["aggregate"]) == {"base", "grpo", "branch"}


def test_report_flags_an_arm_whose_seeds_disagree_and_a_guide_that_did_not_act(tmp_path):
    found = {"branch": {s: {**fake("branch", s, f"f{s}", [1, 2], q=1.001), "arm_fingerprint": fp}
                        for s, fp in ((0, "a"), (1, "b"))}}
    text = report.write(SMOL, str(tmp_path), found)
    assert "**Warnings:** branch: its seeds were made with different settings" in text
    assert "**did not act**" in text


def test_summary_of_a_countdown_record_coverage_shares_and_the_tail():
    countdown = runs.settings("configs/countdown_arms.py")
    record = {"eval": {"countdown": {"n": [2, 2], "correct": [2, 1], "distinct": [2, 1], "solutions": [2, 2],
                                     "strategies": [{"sub": 1, "add": 1}, {"sub": 1}]}},
              "curves": {"step": list(range(10)), "entropy": [0.9] * 9 + [0.3], "reward": [0.1] * 9 + [None],
                         "q_mean": [1.0, 1.1] * 5}}
    s = report.summarize(countdown, record)
    assert s["countdown/distinct"] == pytest.approx(1.5) and s["countdown/coverage"] == pytest.approx(0.75)
    assert s["countdown/pass@1"] == pytest.approx(0.75) and s["countdown/share/sub"] == pytest.approx(2 / 3)
    assert s["train/entropy_end"] == pytest.approx(0.3)  # countdown's tail: the last 10% of steps
    assert s["train/q_mean"] == pytest.approx(1.05)  # the guide's activity over all steps
    assert report.summarize(SMOL, record)["train/entropy_end"] == pytest.approx((0.9 + 0.3) / 2)  # the last ¼


def test_hand_written_reading_and_the_regime_report_are_included_a_level_down(tmp_path):
    assert report._included(str(tmp_path), report.READING, "Reading") == []
    (tmp_path / report.READING).write_text("# Title\n\nText.\n\n## Part\n\n```\n# a comment, not a heading\n```\n")
    head, source, body = report._included(str(tmp_path), report.READING, "Reading")
    assert head == "## Reading\n" and "reading.md" in source and "Title" not in body
    assert "### Part" in body and "\n# a comment, not a heading\n" in body


def test_noise_guides_are_not_judged_by_the_one_percent_rule(tmp_path):
    found = {arm: {0: fake(arm, 0, arm, [1, 2], q=1.0)} for arm in ("branch", "random")}
    text = report.write(SMOL, str(tmp_path), found, guides={"branch": "branch", "random": "random"})
    assert "| branch | 0.9 | 1.000 | 0.200 | 1.000 | **did not act** |" in text
    assert "| random | 0.9 | 1.000 | 0.200 | 1.000 | – (zero-mean noise: the 1% rule is for Branch) |" in text


def test_the_tool_study_reports_the_samples_and_rollouts_calling_the_tool(tmp_path):
    """configs/tools_arms.py's report: the share of evaluated samples that called the tool (per-problem counts) and
    of training rollouts that did (logged as rows_without_calls: 1 minus its tail), where a run has them."""
    from sage_jax.experiments import measure
    tools = runs.settings("configs/tools_arms.py")
    found = {}
    for arm, calling in (("base", None), ("tool", [3, 1]), ("no_tool", None)):
        for seed in range(2):
            r = fake(arm, seed, f"{arm}{seed}", [2 + seed, 1])
            r["arm_fingerprint"] = arm
            if calling is not None:
                r["eval"]["heldout"]["tool_rows"] = calling
                r["curves"]["tool_rows"] = [0.75, 0.25]  # rows that never called, per step
            found.setdefault(arm, {})[seed] = r
    summary = report.summarize(tools, found["tool"][0])
    assert summary["heldout/tool_rows"] == pytest.approx(4 / 8)
    assert summary["train/tool_rows_end"] == pytest.approx(0.75)  # the tail: the last step of 2
    assert "heldout/tool_rows" not in report.summarize(tools, found["no_tool"][0])
    text = report.write(tools, str(tmp_path), found)
    assert "samples calling the tool" in text and "rollouts calling the tool (end)" in text
    assert "| tool | 2 |" in text and "tool − no_tool" in text
    # problem_stats counts the samples of a problem that called a tool, from samples.jsonl's "tools"
    sample = {"id": "p0", "n": 2, "num_correct": 1, "completions": ["1", "2"], "rewards": [1.0, 0.0],
              "tools": [{"calls": 1}, {"calls": 0}]}
    ex = types.SimpleNamespace(meta={"id": "p0"})
    assert measure.problem_stats([sample], [ex], "math")["tool_rows"] == [1]
    assert "tool_rows" not in measure.problem_stats([{**sample, "tools": []}], [ex], "math")
