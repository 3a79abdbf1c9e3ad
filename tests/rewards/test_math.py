import threading
import time

import pytest

from sage_jax.rewards import math as mr

B = "\\boxed{{{}}}".format

# (completion, gold, expected)
CASES = [
    # fractions / \dfrac / decimals
    (B("\\dfrac{1}{2}"), "\\frac{1}{2}", True),
    (B("0.5"), "\\frac12", True),
    (B("\\tfrac{3}{4}"), "0.75", True),
    (B("\\frac{2}{3}"), "\\frac{3}{2}", False),
    (B("6"), "\\frac{12}{2}", True),
    (B("1+1"), "2", True),
    # radicals, pi
    (B("2\\sqrt{2}"), "\\sqrt{8}", True),
    (B("sqrt(8)"), "2\\sqrt2", True),
    (B("-\\frac{\\sqrt{3}}{2}"), "-\\frac{1}{2}\\sqrt{3}", True),
    (B("\\frac{\\sqrt{3}}{2}"), "-\\frac{\\sqrt{3}}{2}", False),
    (B("\\pi/2"), "\\frac{\\pi}{2}", True),
    (B("3/4*pi"), "\\frac{3\\pi}{4}", True),
    (B("3.14"), "\\pi", False),
    # percent, degrees, thousands separators, units, currency
    (B("50\\%"), "50", True),
    (B("50"), "50\\%", True),
    (B("0.5"), "50\\%", False),
    (B("30^\\circ"), "30", True),
    (B("30^{\\circ}"), "30", True),
    (B("30 degrees"), "30", True),
    (B("1,000"), "1000", True),
    (B("1{,}234{,}567"), "1234567", True),
    (B("1000"), "1,001", False),
    (B("5\\text{ cm}"), "5", True),
    (B("5 \\text{ cm}^2"), "5", True),
    (B("12 inches"), "12", True),
    (B("\\$5.00"), "5", True),
    (B("27"), 27.0, True),
    (B("3"), 3, True),
    # equations, expressions
    (B("x=5"), "5", True),
    (B("x = 5"), "x=5", True),
    (B("x=6"), "5", False),
    (B("x^2+2x+1"), "(x+1)^2", True),
    (B("x^2+1"), "(x+1)^2", False),
    # intervals vs inequalities
    (B("(2,5]"), "2 < x \\le 5", True),
    (B("2 < x \\leq 5"), "(2, 5]", True),
    (B("[2,5]"), "2<x\\le 5", False),
    (B("(-\\infty, 3)"), "x < 3", True),
    (B("x \\in (2,5]"), "(2,5]", True),
    # tuples vs column vectors
    (B("\\begin{pmatrix}1\\\\2\\end{pmatrix}"), "(1,2)", True),
    (B("(1,2)"), "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
    (B("\\begin{pmatrix}1\\\\3\\end{pmatrix}"), "(1,2)", False),
    (B("\\left( 3, \\frac{\\pi}{2} \\right)"), "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    # repeating decimals
    (B("0.\\overline{3}"), "\\frac{1}{3}", True),
    (B("1/3"), "0.\\overline{3}", True),
    (B("0.1\\overline{6}"), "\\frac16", True),
    (B("0.\\overline{3}"), "0.3", False),
    # number words
    (B("five"), "5", True),
    ("The final answer is twenty-one.", "21", True),
    (B("six"), "5", False),
    # sets (order does not matter)
    (B("\\{2,1\\}"), "\\{1,2\\}", True),
    (B("\\{1,3\\}"), "\\{1,2\\}", False),
    # answer extraction
    ("first \\boxed{1}, then \\boxed{2}", "2", True),
    ("first \\boxed{1}, then \\boxed{2}", "1", False),
    ("so \\fbox{7}.", "7", True),
    ("no answer here at all", "5", False),
    ("", "5", False),
    ("Final Answer: The final answer is $\\frac{1}{4}$. I hope it is correct.", "0.25", True),
    ("Answer: 18", "18", True),
    ("blah\n#### 18", "18", True),
    (B("\\boxed{\\frac{1}{2}}"), "1/2", True),
    (B("\\text{(C)}"), "C", True),
    (B("\\text{(C)}"), "D", False),
    (B("\\infty"), "\\infty", True),
    # the final-answer statements real models write (see also tests/fixtures/model_answers.jsonl)
    ("... so she makes 9 * 2 = 18 dollars. The answer is 8.", "8", True),
    ("The answer is: 18", "18", True),
    ("**Answer:** 18", "18", True),
    ("Final answer: $18$", "18", True),
    ("The answer is $\\frac{1}{2}$.", "0.5", True),
    ("The answer is 18 apples.", "18", True),
    ("The answer is 4 + 5 = 9.", "9", True),
    ("The answer is **$18.00**.", "18", True),
    ("The final answer is \\( 12 \\).", "12", True),
    ("Answer:\n\n18", "18", True),
    ("The answer is 5.\nChecking again... The answer is 6.", "6", True),
    ("The answer is 5.\nChecking again... The answer is 6.", "5", False),
    ("The answer is 18 or 20.", "18", False),
    ("The answer is not 18.", "18", False),
    ("I am not sure what the answer is.", "18", False),
    ("What is the answer? Let me add 10 + 8 = 18.", "18", False),
]


@pytest.mark.parametrize("completion,gold,expected", CASES)
def test_verify_table(completion, gold, expected):
    assert mr.verify(completion, gold) is expected
    assert mr.score(completion, gold) == float(expected)


def test_table_is_large():
    assert len(CASES) >= 40
    assert sum(e for _, _, e in CASES) >= 20 and sum(not e for _, _, e in CASES) >= 15


def test_extract_answer_nested_and_unbalanced():
    assert mr.extract_answer("x \\boxed{\\frac{a}{b^{2}}} y") == "\\frac{a}{b^{2}}"
    assert mr.extract_answer("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert mr.extract_answer("\\boxed{3} and \\boxed{4") == "3"  # truncated last box: fall back to an earlier one
    assert mr.extract_answer("\\boxed{4") is None
    assert mr.extract_answer("\\boxed 5$") == "5"


def test_normalize():
    assert mr.normalize("\\left( 1, 2 \\right)") == "(1,2)"
    assert mr.normalize("\\dfrac{1}{2}.") == "\\frac{1}{2}"
    assert mr.normalize("1,000,000") == "1000000"
    assert mr.normalize("one hundred and five") == "105"
    assert mr.normalize("-0.\\overline{6}") == "-\\frac{2}{3}"
    assert mr.normalize(27.0) == "27"


def _hostile(path):
    cmd = f"touch {path}"
    return [
        f"\\boxed{{__import__('os').system('{cmd}')}}",
        f"\\boxed{{eval(\"__import__('os').system('{cmd}')\")}}",
        f"\\boxed{{exec('import os; os.system(\"{cmd}\")')}}",
        "\\boxed{().__class__.__bases__[0].__subclasses__()}",
        f"\\boxed{{lambda: __import__('os').system('{cmd}')}}",
        f"The final answer is __import__('os').system('{cmd}')",
        f"Answer: open('{path}', 'w').write('x')",
    ]


def test_hostile_answers_have_no_side_effect(tmp_path):
    target = tmp_path / "pwned"
    for completion in _hostile(target):
        assert mr.verify(completion, "0") is False
        assert mr.verify("\\boxed{0}", completion) is False  # a hostile gold is no better
    assert not target.exists()


PATHOLOGICAL = [
    B("10^10^10^10"),
    B("10^{10^{10^{10}}}"),
    B("9^{9^{9^{9}}}-1"),
    B("100000000!"),
    B("1" * 100_000),
    "\\boxed{" + "{" * 50 + "5" + "}" * 49,  # unbalanced
    B("\\sqrt{" * 200 + "2" + "}" * 200),  # deeply nested
    B("{" * 400 + "5" + "}" * 400),
    "\\boxed{" * 3000 + "}" * 3000,
]


def test_pathological_answers_are_fast_and_false():
    for completion in PATHOLOGICAL:
        start = time.monotonic()
        assert mr.verify(completion, "7") is False
        assert time.monotonic() - start < 3.0, completion[:40]


def test_last_boxed_is_linear_in_unclosed_boxes():
    # a model stuck in a loop: the extraction must not rescan the rest of the text once per \boxed{
    # A ratio against the same text 10x shorter, timed in this run, not a wall-clock bound: linear work takes ~10x as
    # long, a rescan per \\boxed{ 100x; the suite's load scales both sides.
    def seconds(text):
        start = time.perf_counter()
        mr.extract_answer(text)
        return time.perf_counter() - start
    for unit, head in (("\\boxed{", ""), ("\\boxed{", "\\boxed{1} "), ("\\boxed ", "")):
        short = min(seconds(head + unit * 2000) for _ in range(3))
        long = min(seconds(head + unit * 20000) for _ in range(3))
        assert long < 40 * max(short, 1e-3), (unit, head, short, long)
    assert mr.extract_answer("\\boxed{1} " + "\\boxed{" * 20000) == "1"
    start = time.monotonic()
    assert mr.verify("\\boxed{" * 20000, "7") is False
    assert time.monotonic() - start < 3.0


def test_verify_with_timeout_from_a_thread(tmp_path):
    target = tmp_path / "pwned"
    out = {}

    def work():
        out["ok"] = mr.verify_with_timeout(B("\\dfrac{1}{2}"), "0.5", timeout_s=20.0)
        out["bad"] = mr.verify_with_timeout(B("3"), "4", timeout_s=20.0)
        start = time.monotonic()
        out["hostile"] = [mr.verify_with_timeout(c, "7", timeout_s=5.0) for c in PATHOLOGICAL + _hostile(target)]
        out["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(120)
    assert out["ok"] is True and out["bad"] is False
    assert out["hostile"] == [False] * len(out["hostile"])
    assert out["elapsed"] < 5.0 * len(out["hostile"])
    assert not target.exists()


def _model_answers():
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "fixtures" / "model_answers.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("row", _model_answers(), ids=lambda r: r["source"].rsplit(" ", 1)[-1])
def test_real_model_outputs_hand_labelled(row):
    """Real SmolLM2-135M-Instruct outputs on GSM8K, labelled by hand: the reward against the gold answer, and the
    final answer a reader takes from the text (None where it states no single answer) is what gets read."""
    assert mr.verify(row["completion"], row["gold"]) is row["correct"]
    if row["answer"] is not None:
        assert mr.verify(row["completion"], row["answer"]), mr.extract_answer(row["completion"])


def test_model_answer_set_has_both_kinds():
    rows = _model_answers()
    assert len(rows) >= 30 and sum(r["correct"] for r in rows) >= 3 and sum(not r["correct"] for r in rows) >= 20


def test_last_number_mode_reads_stated_answers_only_when_asked():
    stated = "Tom has 3 boxes with 11 cards in each box, so he has 3 * 11 = 33 cards in total."
    assert not mr.verify(stated, "33")  # strict (the default): no marked answer, no reward
    assert mr.verify(stated, {"answer": "33", "last_number": True})
    assert not mr.verify(stated, {"answer": "11", "last_number": True})
    # a marked answer still wins over the last number
    assert not mr.verify("The answer is 5. Then 33.", {"answer": "33", "last_number": True})
    assert not mr.verify("no digits here", {"answer": "33", "last_number": True})
