import itertools
import json

import numpy as np
import pytest

from sage_jax.eval import passk as ev
from sage_jax.data.loaders import Example, countdown_examples
from sage_jax.rewards import countdown as cd


def brute_pass_at_k(n, c, k):
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_subset_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = brute_pass_at_k(n, c, k)
                assert ev.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)
                assert ev.pass_at_k_array(n, [c], k)[0] == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_edges_and_errors():
    assert ev.pass_at_k(5, 0, 3) == 0.0
    assert ev.pass_at_k(5, 3, 3) == 1.0  # n - c < k
    assert ev.pass_at_k(10, 1, 1) == pytest.approx(0.1)
    assert 0.0 < ev.pass_at_k(1024, 1, 256) < 1.0  # large n stays finite
    with pytest.raises(ValueError, match="at least 9 samples"):
        ev.pass_at_k(8, 2, 9)
    with pytest.raises(ValueError):
        ev.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        ev.pass_at_k(4, 1, 0)
    with pytest.raises(ValueError):
        ev.pass_at_k_array(4, [1, 2], 5)


def test_pass_at_k_table_and_mixed_n():
    counts = [0, 1, 4, 8]
    table = ev.pass_at_k_table(counts, 8, [1, 2, 8])
    assert table[1] == pytest.approx(np.mean([c / 8 for c in counts]))
    assert table[8] == pytest.approx(0.75)
    mixed = ev.pass_at_k_array([4, 8], [1, 2], 2)
    assert mixed == pytest.approx([ev.pass_at_k(4, 1, 2), ev.pass_at_k(8, 2, 2)])
    assert ev.default_ks(16) == [1, 2, 4, 8, 16] and ev.default_ks(12) == [1, 2, 4, 8, 12]


def test_writers(tmp_path):
    results = {"base": {1: 0.25, 4: 0.5}, "sage": {1: 0.3, 4: 0.625}}
    table = ev.markdown_table(results)
    assert table.splitlines()[0] == "| run | pass@1 | pass@4 |"
    assert "| sage | 0.300 | 0.625 |" in table
    ev.write_markdown(tmp_path / "r.md", results, title="demo")
    assert (tmp_path / "r.md").read_text().startswith("# demo\n")
    ev.write_json(tmp_path / "r.json", {"pass_at_k": results["base"]})
    assert json.loads((tmp_path / "r.json").read_text()) == {"pass_at_k": {"1": 0.25, "4": 0.5}}
    ev.plot_pass_at_k(results, tmp_path / "plot.png", title="pass@k")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_recorder_resume_and_truncated_last_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    rec = ev.EvalRecorder(path)
    rec.add({"id": 1, "n": 2, "num_correct": 1})
    rec.add({"id": "b", "n": 2, "num_correct": 0})
    assert ev.EvalRecorder(path).done == {"1", "b"}
    with open(path, "a") as f:
        f.write('{"id": "c", "n": 2, "num_cor')  # crash mid-write
    rec = ev.EvalRecorder(path)
    assert rec.done == {"1", "b"} and "c" not in rec and 1 in rec
    assert path.read_text().endswith('"num_correct": 0}\n')
    rec.add({"id": "c", "n": 2, "num_correct": 2})
    assert [r["id"] for r in ev.read_samples(path)] == ["1", "b", "c"]
    assert ev.summarize(ev.read_samples(path), [1]) == {1: pytest.approx(0.5)}
    # a complete last record that lost its newline is kept
    path.write_text('{"id": "x", "n": 1, "num_correct": 1}')
    assert ev.EvalRecorder(path).done == {"x"} and path.read_text().endswith("\n")
    path.write_text('{"id": "x"}\nnot json\n{"id": "y"}\n')
    with pytest.raises(ValueError, match="samples.jsonl:2"):
        ev.EvalRecorder(path)
    with pytest.raises(ValueError, match="id"):
        ev.EvalRecorder(tmp_path / "other.jsonl").add({"n": 1})


class FakeTokenizer:
    def encode(self, text):
        return [ord(ch) for ch in text]


def _decode(ids):
    return "".join(chr(i) for i in ids)


def test_evaluate_countdown_with_fake_generator_and_resume(tmp_path):
    problems = cd.generate_problems(6, seed=0, high=9)
    examples = countdown_examples(problems)
    calls = []

    def generate(prompt_ids, num_samples):
        calls.append(len(prompt_ids))
        out = []
        for ids in prompt_ids:
            prompt = _decode(ids)
            problem = next(p for p in problems if cd.prompt(p) == prompt)
            good = cd.completion_text(cd.solve(problem["numbers"], problem["target"])[0], problem["target"])
            # first problem: never right; others: right on the first of 4 samples
            first = "1+1=2" if problem is problems[0] else good
            out.append([first] + ["1+1=2"] * (num_samples - 1))
        return out

    # interrupted run: the generator fails on the second batch
    def flaky(prompt_ids, num_samples):
        if calls:
            raise RuntimeError("preempted")
        return generate(prompt_ids, num_samples)

    with pytest.raises(RuntimeError):
        ev.evaluate(FakeTokenizer(), examples, "countdown", 4, [1, 2, 4], tmp_path, generate_fn=flaky,
                    batch_problems=4, progress=False)
    assert len(ev.read_samples(tmp_path / "samples.jsonl")) == 4
    calls.clear()
    results = ev.evaluate(FakeTokenizer(), examples, "countdown", 4, [1, 2, 4], tmp_path,
                          generate_fn=generate, batch_problems=4, progress=False, run_name="fake")
    assert calls == [2]  # only the two unfinished problems were sampled
    assert results["num_problems"] == 6
    assert results["pass_at_k"]["1"] == pytest.approx(5 / 6 * 0.25)
    assert results["pass_at_k"]["4"] == pytest.approx(5 / 6)
    for name in ("results.json", "results.md", "pass_at_k.png"):
        assert (tmp_path / name).exists()
    records = ev.read_samples(tmp_path / "samples.jsonl")
    assert records[0]["rewards"] == [0.0] * 4 and records[1]["num_correct"] == 1
    with pytest.raises(ValueError, match="same n"):
        ev.evaluate(FakeTokenizer(), examples, "countdown", 8, [1], tmp_path, generate_fn=generate,
                    progress=False)


def test_evaluate_writes_nothing_on_non_primary_processes(tmp_path, monkeypatch):
    """A multi-host run: every process samples and scores, only process 0 writes (same results everywhere)."""
    import jax
    problems = cd.generate_problems(3, seed=1, high=9)
    examples = countdown_examples(problems)
    generate = lambda prompt_ids, n: [["1+1=2"] * n for _ in prompt_ids]
    (tmp_path / "done").mkdir()
    ev.EvalRecorder(tmp_path / "done" / "samples.jsonl").add({"id": "0", "n": 2, "num_correct": 1})
    before = (tmp_path / "done" / "samples.jsonl").read_bytes()
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    results = ev.evaluate(FakeTokenizer(), examples, "countdown", 2, [1, 2], tmp_path / "done",
                          generate_fn=generate, progress=False)
    assert results["num_problems"] == 3 and results["pass_at_k"]["1"] == pytest.approx(1 / 6)  # read the resumed row
    assert (tmp_path / "done" / "samples.jsonl").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "done").iterdir()) == ["samples.jsonl"]


def test_evaluate_argument_errors(tmp_path):
    examples = [Example("p", "a", {"id": "1"})]
    gen = lambda ids, n: [["x"] * n for _ in ids]  # noqa: E731
    with pytest.raises(ValueError, match="k must be"):
        ev.evaluate(FakeTokenizer(), examples, "countdown", 2, [4], tmp_path, generate_fn=gen)
    with pytest.raises(ValueError, match="unknown reward"):
        ev.evaluate(FakeTokenizer(), examples, "nope", 2, [1], tmp_path, generate_fn=gen)
    with pytest.raises(ValueError, match="expected 2 per prompt"):
        ev.evaluate(FakeTokenizer(), examples, lambda t, ex: 1.0, 2, [1], tmp_path,
                    generate_fn=lambda ids, n: [["x"] for _ in ids], progress=False)
    dup = [Example("p", "a", {"id": "1"}), Example("q", "b", {"id": "1"})]
    with pytest.raises(ValueError, match="unique"):
        ev.evaluate(FakeTokenizer(), dup, lambda t, ex: 1.0, 2, [1], tmp_path, generate_fn=gen)
