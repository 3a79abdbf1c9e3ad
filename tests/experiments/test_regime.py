"""The regime rule of both settings files (report.regime_*) and the --regime mode of the harness."""

import json
import os

import pytest

from sage_jax.experiments import report, runs, study
from tests.experiments.test_report import fake

SMOL = runs.settings("configs/smollm2_arms.py")
COUNTDOWN = runs.settings("configs/countdown_arms.py")
# n = 32 on 3 problems: GRPO's pass@1 rises while it loses the 3rd problem, which the base solves once in 32
BASE = {0: [10, 30, 1], 1: [11, 30, 1], 2: [10, 31, 1]}
SHARPENS = {0: [20, 32, 0], 1: [22, 32, 0], 2: [21, 32, 0]}


def _records(counts, arm="grpo"):
    return {s: fake(arm, s, f"{arm}{s}", c, n=32) for s, c in counts.items()}


def test_smollm2_rule_verdicts_and_selection():
    base = _records(BASE, "base")
    sharpens = report.regime_verdict(SMOL, base, _records(SHARPENS))
    assert sharpens["kept"] and sharpens["reason"].startswith("kept") and sharpens["seeds"] == 3
    keeps_k = report.regime_verdict(SMOL, base, _records({0: [20, 32, 1], 1: [22, 32, 1], 2: [21, 32, 1]}))
    assert not keeps_k["kept"] and "none of pass@n fell" in keeps_k["reason"]
    flat = report.regime_verdict(SMOL, base, _records({0: [11, 30, 0], 1: [10, 31, 0], 2: [11, 30, 0]}))
    assert not flat["kept"] and "pass@1's gain" in flat["reason"]
    assert "one seed" in report.regime_verdict(SMOL, base, _records({0: SHARPENS[0]}))["reason"]
    with_cost = lambda v, c: {**v, "rollouts": c}
    assert report.regime_select({"a": with_cost(keeps_k, 1), "b": with_cost(sharpens, 2),
                          "c": with_cost(sharpens, 1)}) == ("c", True)  # the cheapest kept
    # none kept: the smallest shortfall (keeps_k misses only the fall; flat misses the rise)
    choice = report.regime_select({"flat": with_cost(flat, 1), "keeps_k": with_cost(keeps_k, 2)})
    assert choice == ("keeps_k" if keeps_k["shortfall"] < flat["shortfall"] else "flat", False)


def _countdown(seed, correct, distinct):
    return {"n": 4, "eval": {"countdown_rl": {"n": [4] * 3, "correct": correct, "distinct": distinct,
                                              "solutions": [3] * 3}}}


def test_countdown_rule_needs_a_gain_of_005_against_its_one_base():
    base = {0: _countdown(0, [1, 2, 1], [2, 2, 2])}  # pass@1 1/3, one SFT base for every seed
    up = {s: _countdown(s, [2, 3, 1 + (s == 1)], [1, 2, 2]) for s in range(3)}  # pass@1 +0.17, fewer solutions
    assert report.regime_verdict(COUNTDOWN, base, up)["kept"]
    small = {s: _countdown(s, [1, 2, 1 + (s > 0)], [1, 2, 2]) for s in range(3)}  # +0.06 on 2 seeds, 0 on one
    assert "not above 0.05" in report.regime_verdict(COUNTDOWN, base, small)["reason"]
    wider = {s: _countdown(s, [2, 3, 1 + (s == 1)], [3, 3, 3]) for s in range(3)}
    up_all = {s: {**r, "eval": {"countdown_rl": {**r["eval"]["countdown_rl"], "correct": [4, 4, 4]}}}
              for s, r in wider.items()}  # pass@n 1 >= the base's, distinct up: no collapse
    assert "no collapse" in report.regime_verdict(COUNTDOWN, base, up_all)["reason"]


def test_regime_mode_stops_at_the_first_candidate_that_meets_the_rule(tmp_path, monkeypatch):
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    first, second = list(SMOL.REGIME_CANDIDATES)[:2]
    jobs = study.make_jobs(SMOL, ["base", "grpo"], 3, "study", [], out, work, None,
                           sub=os.path.join("regime", first), settings_=SMOL.candidate(first, "study"))
    for j in jobs:
        runs.write_result(j.path, fake(j.arm, j.seed, j.fingerprint, (BASE if j.arm == "base" else SHARPENS)[j.seed],
                                       n=32))
    monkeypatch.setattr(study, "run_job", lambda *a: pytest.fail("a finished regime must not run anything"))
    study.main(["--settings", "configs/smollm2_arms.py", "--regime", "--out", out, "--work", work,
                "--candidates", f"{first},{second}"])
    found = json.loads((tmp_path / "out" / "regime.json").read_text())
    assert found["selected"] == first and found["meets_rule"] and list(found["candidates"]) == [first]
    text = (tmp_path / "out" / "regime.md").read_text()
    assert f"Selected: **{first}**" in text and f"REGIME = {SMOL.REGIME_CANDIDATES[first][0]!r}" in text
    assert not (tmp_path / "out" / "regime" / second).exists()  # never tried
