import json
import types

import pytest

from sage_jax.experiments import measure
from sage_jax.rewards import countdown

GOLD = {"numbers": [3, 4, 2], "target": 10}  # solutions: 4*3-2 (sub) and 3*2+4 (add)


def test_countdown_counts_distinct_correct_solutions_and_strategies():
    texts = ["4*3-2=10", "3*4-2=10", "(3*4)-2", "3*2+4=10", "4+3*2=10",  # 5 correct, 2 canonical forms
             "4*3-2=11", "4*3+2=10", "4*3=12", "4*3-2-2=8", "garbage"]
    rewards = [countdown.score(t, GOLD) for t in texts]
    assert sum(rewards) == 5
    s = measure.countdown_stats(texts, rewards, types.SimpleNamespace(meta=GOLD))
    assert s == {"distinct": 2, "solutions": 2, "strategies": {"sub": 3, "add": 2}}
    assert countdown.strategy_shares(texts, [GOLD] * len(texts)) == {"sub": 0.6, "add": 0.4}  # the same classes


def test_arithmetic_forms_and_word_problem_stats():
    assert measure.arithmetic_form("Sam has 10 + 3 = 13 balloons now.") == "10+3=13"
    assert measure.arithmetic_form("Ravi has 5 x 12 = 60 marbles.") == "5*12=60"
    assert measure.arithmetic_form("Tom has 33 cards left.") == "33"
    sample = {"id": "p", "n": 4, "num_correct": 3, "rewards": [1.0, 1.0, 1.0, 0.0],
              "completions": ["Sam has 13.", "sam has 13", "He has 10 + 3 = 13 now.", "He has 12."]}
    s = measure.problem_stats([sample], [types.SimpleNamespace(meta={"id": "p"})], "math")
    assert s == {"ids": ["p"], "n": [4], "correct": [3], "distinct_correct": [2], "distinct_forms": [2],
                 "distinct_answers": [2]}


def test_training_curves_merge_lines_of_a_step(tmp_path):
    lines = [{"step": 0, "rl/reward": 0.1}, {"step": 0, "rl/entropy": 0.8}, {"step": 1, "rl/reward": 0.2},
             {"step": 1, "rl/reward": 0.3, "rl/entropy": 0.7}]  # a resumed run re-logs step 1: the later wins
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    c = measure.training_curves(str(tmp_path))
    assert c["step"] == [0, 1] and c["reward"] == [0.1, 0.3] and c["entropy"] == [0.8, 0.7]


def test_tau_is_the_entropy_quantile_on_the_grid():
    profile = {"grid": [i / 100 for i in range(101)]}  # quantile q at q nats
    assert measure.tau_at(profile, 0.8) == pytest.approx(0.8) and measure.tau_at(profile, 0.55) == 0.55
