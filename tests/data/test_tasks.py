"""Data for the real-model CPU task: GSM8K's held-out split of its test file, MATH levels 1-2, the generated
arithmetic word problems, and the pass@k intervals of the task-choice tool."""

from __future__ import annotations

from pathlib import Path

import pytest

from sage_jax.data import loaders, word_problems

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _gsm8k_dir(tmp_path):
    import json
    (tmp_path / "gsm8k").mkdir()
    rows = [{"question": f"q{i}", "answer": f"work\n#### {i}", "idx": i} for i in range(40)]
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_gsm8k_train_and_heldout_are_disjoint_and_fixed(tmp_path):
    data = _gsm8k_dir(tmp_path)
    train = loaders.load_dataset("gsm8k", "train", data_dir=data)
    held = loaders.load_dataset("gsm8k_heldout", "test", data_dir=data)
    ids = lambda xs: {ex.meta["id"] for ex in xs}
    assert len(train) == 30 and len(held) == 10 and not ids(train) & ids(held)
    assert ids(held) == {str(i) for i in range(0, 40, 4)} and held[1].answer == "4"
    assert len(loaders.load_dataset("gsm8k", "test", data_dir=data)) == 40  # the full test set is unchanged


@pytest.mark.skipif(not (DATA / "math_train").is_dir(), reason="shared MATH data not present")
def test_math_levels_1_to_2():
    rows = loaders.load_dataset("math_train_l1to2", "test", data_dir=DATA)
    assert len(rows) > 1000 and {ex.meta["level"] for ex in rows} == {"Level 1", "Level 2"}


def test_word_problems_deterministic_distinct_and_correct():
    a, b = word_problems.generate(200, 3), word_problems.generate(200, 3)
    assert [(x.problem, x.answer) for x in a] == [(x.problem, x.answer) for x in b]
    assert len({x.problem for x in a}) == 200 and all(int(x.answer) >= 0 for x in a)
    held = word_problems.generate(50, 4, exclude={x.problem for x in a})
    assert not {x.problem for x in held} & {x.problem for x in a}
    one = next(x for x in a if " gets " in x.problem)
    nums = [int(t) for t in one.problem.replace(".", " ").split() if t.isdigit()]
    assert int(one.answer) == sum(nums)


def test_bootstrap_intervals_and_paired_compare():
    from sage_jax.experiments import task_choice
    before = [{"id": i, "n": 4, "num_correct": c} for i, c in enumerate([0, 1, 2, 0, 4, 1])]
    after = [{"id": i, "n": 4, "num_correct": min(4, c + 1)} for i, c in enumerate([0, 1, 2, 0, 4, 1])]
    mean, low, high = task_choice.bootstrap_ci([0.0, 0.25, 0.5, 0.0, 1.0, 0.25])
    assert low <= mean <= high and mean == pytest.approx(2.0 / 6)
    out = task_choice.compare(before, after, [1, 4])
    assert out["pass@1"]["after_minus_before"][0] == pytest.approx(5 / 24, abs=1e-3)
    assert out["pass@1"]["after_minus_before"][1] > 0 and out["pass@1"]["problems"] == 6


def test_generator_candidates_are_worded_and_scored_by_their_own_rewards():
    from sage_jax.experiments import task_choice
    from sage_jax.rewards import countdown, kk
    examples, score = task_choice.generated_candidate("countdown_words", 6, seed=1)
    again, _ = task_choice.generated_candidate("countdown_words", 6, seed=1)
    assert [e.problem for e in examples] == [e.problem for e in again]  # deterministic in the seed
    for ex in examples:
        assert "Use the numbers" in ex.problem and str(ex.meta["target"]) in ex.problem
        solution = countdown.solve(ex.meta["numbers"], ex.meta["target"])[0]
        assert score(f"{solution}={ex.meta['target']}", ex) == 1.0
        assert score(f"{solution}={ex.meta['target'] + 1}", ex) == 0.0
    puzzles, kk_score = task_choice.generated_candidate("kk_2people", 4, seed=1)
    for ex in puzzles:
        assert ex.problem.count("inhabitants") >= 1 and len(ex.meta["gold"]["names"]) == 2
        right = kk.format_solution(ex.meta["gold"])
        wrong = kk.format_solution({**ex.meta["gold"], "solution": [not s for s in ex.meta["gold"]["solution"]]})
        assert kk_score(f"<answer>{right}</answer>", ex) == 1.0 and kk_score(f"<answer>{wrong}</answer>", ex) == 0.0
