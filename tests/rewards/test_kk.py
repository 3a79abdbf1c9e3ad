import json
import random
from pathlib import Path

import pytest

from sage_jax.rewards import kk

KK_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "kk"


@pytest.fixture(scope="module")
def rows():
    if not KK_DIR.exists():
        pytest.skip(f"{KK_DIR} absent")
    return kk.load(KK_DIR)


def _answer(gold, flip=None, drop=None):
    lines = []
    for i, (name, knight) in enumerate(zip(gold["names"], gold["solution"])):
        if i == drop:
            continue
        knight = not knight if i == flip else knight
        lines.append(f"({i + 1}) {name} is a {'knight' if knight else 'knave'}")
    return "<think>Assume the first is a knight...</think>\n<answer>\n" + "\n".join(lines) + "\n</answer>"


def test_all_shared_golds_score_one_and_perturbations_zero(rows):
    assert len(rows) == 700
    assert sorted({len(r["names"]) for r in rows}) == [2, 3, 4, 5, 6, 7, 8]
    rng = random.Random(0)
    for row in rows:
        gold = kk.parse_row(row)
        assert kk.score(_answer(gold), gold) == 1.0
        assert kk.score("<answer>" + row["solution_text_format"] + "</answer>", gold) == 1.0
        assert kk.score("Reasoning...\nCONCLUSION: " + row["solution_text"], row["solution_text_format"]) == 1.0
        i = rng.randrange(len(gold["names"]))
        assert kk.score(_answer(gold, flip=i), gold) == 0.0
        assert kk.score(_answer(gold, drop=i), gold) == 0.0
        contradictory = _answer(gold).replace("</answer>", f"{gold['names'][i]} is a "
                                              f"{'knave' if gold['solution'][i] else 'knight'}\n</answer>")
        assert kk.score(contradictory, gold) == 0.0


def test_shared_statements_have_the_given_unique_solution(rows):
    for row in rows:
        assert kk.solve(kk.parse_statements(row["statements"])) == [tuple(row["solution"])]


def test_gold_from_solution_text(rows):
    row = rows[150]
    gold = kk.parse_row({"solution_text_format": row["solution_text_format"]})
    assert gold["names"] == row["names"] and gold["solution"] == row["solution"]
    assert kk.format_solution(row) == row["solution_text_format"]


def test_answer_parsing_is_tolerant_but_strict():
    names = ["Zoey", "Mia", "Amelia"]
    gold = {"names": names, "solution": [True, False, True]}
    ok = [
        "<answer>**Zoey** is a **knight**, Mia is a knave, and Amelia is a knight.</answer>",
        "<answer>(1) Zoey: knight\n(2) Mia - knave\n(3) Amelia is a Knight</answer>",
        "<answer>Zoey is a knight. Mia is not a knight. Amelia is a knight.</answer>",
        "Let me think.\n\nCONCLUSION:\n(1) Zoey is a knight\n(2) Mia is a knave\n(3) Amelia is a knight",
        "reasoning: Zoey is a knave? no.\n</think> Zoey is a knight, Mia is a knave, Amelia is a knight",
        "<answer>Zoey is a knave</answer> wait <answer>Zoey is a knight\nMia is a knave\nAmelia is a knight",
    ]
    bad = [
        "",
        "<answer></answer>",
        "<answer>Zoey is a knight, Mia is a knave</answer>",  # Amelia missing
        "<answer>Zoey and Amelia are knights, Mia is a knave</answer>",  # no per-name role
        "<answer>Zoey is a knight, Mia is a knave, Amelia is a knight, Zoey is a knave</answer>",
        "<answer>Zoey is a knight, Mia is a knave, Amelia is a knave</answer>",
        "I think Zoey is a knight.",  # no answer block: the last paragraph names only Zoey
    ]
    for text in ok:
        assert kk.score(text, gold) == 1.0, text
    for text in bad:
        assert kk.score(text, gold) == 0.0, text
    # "Mia" inside "Amelia" is not Mia.
    assert kk.parse_roles("Amelia is a knight", ["Mia"]) == [None]


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_generator_unique_and_checkable(n, rows):
    rng = random.Random(n)
    for _ in range(10):
        puzzle = kk.generate_puzzle(n, rng)
        assert set(puzzle) == set(rows[0])
        assert kk.solve(kk.parse_statements(puzzle["statements"])) == [tuple(puzzle["solution"])]
        assert len(set(puzzle["names"])) == n and all(name in puzzle["quiz"] for name in puzzle["names"])
        gold = kk.parse_row(puzzle)
        assert kk.score(_answer(gold), gold) == 1.0
        assert kk.score(_answer(gold, flip=n - 1), gold) == 0.0
        assert kk.score("<answer>" + puzzle["solution_text_format"] + "</answer>",
                        puzzle["solution_text_format"]) == 1.0
        assert puzzle["quiz"] in kk.prompt(puzzle) and "<answer>" in kk.prompt(puzzle)


def test_generate_dataset_deterministic_and_round_trips(tmp_path):
    a = kk.generate_dataset([3, 4], 5, seed=1)
    assert a == kk.generate_dataset([3, 4], 5, seed=1)
    assert a != kk.generate_dataset([3, 4], 5, seed=2)
    assert [len(r["names"]) for r in a] == [3] * 5 + [4] * 5
    path = tmp_path / "people3_num5.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in a[:5]))
    assert kk.load(path) == a[:5]
    assert kk.load(tmp_path, n_people=[3]) == a[:5]


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kk.load(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no people"):
        kk.load(tmp_path)
    bad = tmp_path / "people2_num1.jsonl"
    bad.write_text(json.dumps({"quiz": "q", "names": ["A"]}) + "\n")
    with pytest.raises(ValueError, match="solution"):
        kk.load(bad)
    with pytest.raises(ValueError, match="between|must be"):
        kk.generate_puzzle(1, 0)
