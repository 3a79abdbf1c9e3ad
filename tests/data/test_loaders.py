import json
import sys
import types
from pathlib import Path

import pytest

from sage_jax.data import loaders, templates
from sage_jax.data.loaders import Example, load_dataset, load_file

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared data folder {DATA} not present")

# Row counts from each set's SOURCE.txt.
COUNTS = [("math500", "test", 500), ("aime24", "test", 30), ("aime25", "test", 30), ("amc23", "test", 40),
          ("gsm8k", "test", 1319), ("math_train", "train", 12000), ("math_train_l3to5", "train", 8888),
          ("kk", "test", 700), ("kk", "people2", 100), ("kk", "people8", 100)]


@needs_data
@pytest.mark.parametrize("name,split,count", COUNTS)
def test_shared_sets_load_with_expected_counts(name, split, count):
    examples = load_dataset(name, split, data_dir=DATA)
    assert len(examples) == count
    assert all(isinstance(ex.problem, str) and ex.problem and isinstance(ex.answer, str) for ex in examples)
    assert len({ex.meta["id"] for ex in examples}) == count
    assert all(ex.meta["dataset"] == name for ex in examples)


@needs_data
def test_shared_sets_answers():
    aime25 = [ex.answer for ex in load_dataset("aime25", data_dir=DATA)]
    assert aime25[:5] == ["70", "588", "16", "117", "279"] and aime25[-1] == "240"
    assert all(not a.startswith("0") for a in (ex.answer for ex in load_dataset("aime24", data_dir=DATA)))
    assert load_dataset("amc23", data_dir=DATA)[0].answer == "27"
    gsm = load_dataset("gsm8k", data_dir=DATA)
    assert gsm[0].answer == "18" and gsm[0].problem.startswith("Janet")
    assert all("," not in ex.answer and "####" not in ex.answer for ex in gsm)
    l3to5 = load_dataset("math_train_l3to5", "train", data_dir=DATA, limit=200)
    assert len(l3to5) == 200 and {ex.meta["level"] for ex in l3to5} <= {"Level 3", "Level 4", "Level 5"}
    kk = load_dataset("kk", "people3", data_dir=DATA)
    assert kk[0].problem.startswith("A very special island") and kk[0].answer.startswith("(1) ")
    assert len(kk[0].meta["names"]) == 3


def test_unknown_name_split_and_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="unexpected options"):
        load_dataset("math500", data_dir=tmp_path, high=9)
    with pytest.raises(ValueError, match="no split"):
        load_dataset("math500", "train", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="SAGE_DATA_DIR"):
        load_dataset("math500", "test", data_dir=tmp_path)


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2", "answer": 4\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: invalid JSON"):
        load_file(path)
    path.write_text('{"problem": "1+1", "answer": "2"}\n{"question": "2+2", "answer": "4"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: missing field 'problem'"):
        load_file(path)
    path.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": "4"}\n')
    examples = load_file(path, problem_key="question")
    assert [ex.answer for ex in examples] == ["2", "4"]
    path.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1.*####"):
        load_file(path, problem_key="question", answer_format="gsm8k")


def test_parquet_round_trip_with_nested_fields(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
             "reward_model": {"style": "rule", "ground_truth": {"target": str(2 * i)}},
             "level": f"Level {i}"} for i in range(1, 4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    examples = load_dataset(str(tmp_path), "train", problem_key="prompt.0.content",
                            answer_key="reward_model.ground_truth.target")
    assert [(ex.problem, ex.answer) for ex in examples] == [(f"What is {i}+{i}?", str(2 * i)) for i in range(1, 4)]
    assert examples[1].meta["level"] == "Level 2" and examples[1].meta["id"].endswith("train.parquet:2")
    with pytest.raises(ValueError, match=r"train\.parquet:1: missing field"):
        load_file(tmp_path / "train.parquet")


def test_jsonl_file_and_folder_and_limit(tmp_path):
    rows = [{"problem": f"p{i}", "answer": 1.0 * i, "uid": f"u{i}"} for i in range(5)]
    loaders.write_jsonl(tmp_path / "test.jsonl", rows)
    examples = load_dataset(str(tmp_path), id_key="uid", answer_format="number", limit=3)
    assert [(ex.problem, ex.answer, ex.meta["id"]) for ex in examples] == [("p0", "0", "u0"), ("p1", "1", "u1"),
                                                                           ("p2", "2", "u2")]
    assert len(load_dataset(str(tmp_path / "test.jsonl"))) == 5


def test_countdown_dataset():
    train = load_dataset("countdown", "train", num_examples=30, seed=0)
    test = load_dataset("countdown", "test", num_examples=10, seed=0, num_train=30)
    ood = load_dataset("countdown", "test_ood", num_examples=3, seed=0, high=9)
    assert len(train) == 30 and len(test) == 10 and len(ood) == 3
    assert not {ex.problem for ex in train} & {ex.problem for ex in test}
    assert all(len(ex.meta["numbers"]) == 4 for ex in ood)
    assert train[0].problem.endswith(f">{train[0].answer}:")


def test_hf_path_uses_datasets_and_reports_errors(monkeypatch):
    calls = []

    def fake_load(repo, config, split):
        calls.append((repo, config, split))
        if repo == "org/offline":
            raise ConnectionError("no network")
        return [{"question": "q1", "final": 3}, {"question": "q2", "final": 4}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake_load))
    examples = load_dataset("hf://org/name:main", "test", problem_key="question", answer_key="final")
    assert calls[0] == ("org/name", "main", "test")
    assert [(ex.problem, ex.answer) for ex in examples] == [("q1", "3"), ("q2", "4")]
    with pytest.raises(ValueError, match="network"):
        load_dataset("hf://org/offline", "train")


def test_templates():
    rendered = templates.render("qwen_math_boxed", r"Find $\frac{1}{2}$ of {x}.")
    assert rendered == ("<|im_start|>system\nPlease reason step by step, and put your final answer within "
                        "\\boxed{}.<|im_end|>\n<|im_start|>user\nFind $\\frac{1}{2}$ of {x}.<|im_end|>\n"
                        "<|im_start|>assistant\n")
    r1 = templates.render("r1_think", "What is 2+2?")
    assert "<think>" in r1 and "<answer>" in r1 and "What is 2+2?" in r1 and r1.endswith("Assistant:")
    assert templates.render("plain", "x{y}") == "x{y}"
    with pytest.raises(ValueError, match="unknown prompt template"):
        templates.render("nope", "x")
    with pytest.raises(ValueError, match="placeholder"):
        templates.register("broken", "no slot")


def test_tfds_builder_builds_and_reads_back(tmp_path):
    tfds_builders = pytest.importorskip("sage_jax.data.tfds_builders", reason="tensorflow_datasets not importable")
    source = tmp_path / "src"
    (source / "aime24").mkdir(parents=True)
    rows = [{"id": i, "problem": f"Problem {i} with $\\frac{{1}}{{{i + 2}}}$ ü", "answer": f"00{i}", "url": "u"}
            for i in range(4)]
    loaders.write_jsonl(source / "aime24" / "test.jsonl", rows)
    out = tmp_path / "tfds"
    version_dir = tfds_builders.build("aime24", source_dir=source, tfds_data_dir=out)
    assert any(p.name.startswith("sage_aime24-test.array_record") for p in version_dir.iterdir())
    back = tfds_builders.load_from_tfds("aime24", "test", out)
    expected = load_dataset("aime24", "test", data_dir=source)
    assert [(e.problem, e.answer, e.meta["id"]) for e in back] == [(e.problem, e.answer, e.meta["id"])
                                                                   for e in expected]
    assert back[0].answer == "0" and back[2].meta["url"] == "u"
    with pytest.raises(ValueError, match="no split"):
        tfds_builders.load_from_tfds("aime24", "train", out)
    with pytest.raises(FileNotFoundError, match="build"):
        tfds_builders.load_from_tfds("math500", "test", out)
    with pytest.raises(FileNotFoundError, match="source_dir"):
        tfds_builders.build("math500", source_dir=source, tfds_data_dir=out)


def test_example_is_plain_dataclass():
    ex = Example("p", "a")
    assert ex.meta == {} and json.dumps(ex.__dict__)


def test_non_utf8_bytes_and_a_null_answer_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"problem": "a", "answer": "1"}\n{"problem": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not UTF-8 text"):
        loaders.load_file(bad)
    null = tmp_path / "null.jsonl"
    null.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": null}\n')
    with pytest.raises(ValueError, match=r"null.jsonl:2: field 'answer' is null"):
        loaders.load_file(null)
