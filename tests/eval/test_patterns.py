import json

import pytest

from sage_jax import patterns as patterns_face
from sage_jax.eval import patterns

CRAFTED = {
    "contradiction": [
        "Assume, to the contrary, that sqrt(2) is rational. Then p^2 = 2q^2 ...",
        "If Zoey were a knight, this would contradict her own statement.",
        "Then x > 5 and x < 3, which is impossible.",
    ],
    "case_analysis": [
        "Case 1: n is even. Then ... Case 2: n is odd.",
        "There are two cases to check. In the first case the sum is 4.",
        "If n is even then n^2 is even; otherwise n^2 is odd.",
    ],
    "equation_setup": [
        "Let $x$ be the number of apples. Then 3x + 2 = 11.",
        "We set up a system of equations: a + b = 10, a - b = 2.",
        "Solving for y gives y = 4.",
    ],
    "direct_computation": [
        "We compute the total directly.",
        "16 - 3 - 4 = 9 eggs are left, and 9 * 2 = 18 dollars.",
        "Plugging in gives the value.",
    ],
    "enumeration": [
        "Let's try x = 1: no. Then x = 2: yes.",
        "We list all the divisors of 12: 1, 2, 3, 4, 6, 12.",
        "By trial and error the answer is 7.",
        "Checking possible values n = 1, n = 2, n = 3, we find ...",
    ],
    "working_backwards": [
        "Let us work backwards from the final amount.",
        "Starting from the target 24, we need 6 * 4.",
        "To get 10, we need 12 - 2.",
    ],
}


@pytest.mark.parametrize("name,text", [(n, t) for n, texts in CRAFTED.items() for t in texts])
def test_each_rule_fires_on_crafted_text(name, text):
    assert name in patterns.tag(text)


def test_plain_text_gets_no_tags():
    assert patterns.tag("The answer is 42.") == set()
    assert patterns.tag("") == set()
    assert "contradiction" not in patterns.tag("The statement is consistent with the rest.")
    assert "case_analysis" not in patterns.tag("In any case, the answer is 5.")


def test_rules_are_documented():
    assert set(patterns.TAGS) == {"contradiction", "case_analysis", "equation_setup", "direct_computation",
                                  "enumeration", "working_backwards"}
    for description, rules in patterns.RULES.values():
        assert description and rules


def test_frequencies():
    texts = ["Case 1: x is even.", "Case 2: x is odd, which is a contradiction.", "42"]
    freqs = patterns.frequencies(texts)
    assert freqs["case_analysis"] == pytest.approx(2 / 3)
    assert freqs["contradiction"] == pytest.approx(1 / 3)
    assert freqs["enumeration"] == 0.0 and set(freqs) == set(patterns.TAGS)
    assert patterns.frequencies([]) == dict.fromkeys(patterns.TAGS, 0.0)


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_compare_two_runs(tmp_path, capsys):
    a = tmp_path / "grpo" / "samples.jsonl"
    b = tmp_path / "sage" / "samples.jsonl"
    _write(a, [{"id": "1", "completions": ["Case 1: x=1. Case 2: x=2.", "We compute 2 + 2 = 4."],
                "rewards": [1.0, 0.0]}])
    _write(b, [{"id": "1", "completions": ["Suppose, for contradiction, ...", "Let's try 3."], "rewards": [1.0, 1.0]}])
    table = patterns.compare(a, b)
    lines = table.splitlines()
    assert lines[0] == "| pattern | grpo (n=2) | sage (n=2) | Δ (2nd - 1st) |"
    assert "| case_analysis | 0.500 | 0.000 | -0.500 |" in lines
    assert "| contradiction | 0.000 | 0.500 | +0.500 |" in lines
    only = patterns.compare(a, b, only_correct=True)
    assert "grpo (n=1)" in only and "| direct_computation | 0.000 | 0.000 | +0.000 |" in only
    patterns_face.main([str(a), str(b), "--out", str(tmp_path / "t.md")])
    assert capsys.readouterr().out == table
    assert (tmp_path / "t.md").read_text() == table


def test_compare_plain_jsonl_and_errors(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write(a, [{"completion": "Working backwards from 24."}])
    _write(b, [{"text": "no pattern"}])
    assert "| working_backwards | 1.000 | 0.000 | -1.000 |" in patterns.compare(a, b)
    _write(b, [{"other": 1}])
    with pytest.raises(ValueError, match="b.jsonl:1"):
        patterns.compare(a, b)
