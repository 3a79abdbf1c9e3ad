"""Evaluation / training problem sets as lists of `Example(problem, answer, meta)`.

`load_dataset` accepts a registered name (laid out as in the shared data folder: math500/test.jsonl, ...), a local
.jsonl / .parquet file or a folder holding {split}.jsonl|parquet, "countdown" (generated on the fly) or
"hf://org/name[:config]" (Hugging Face hub, needs network and the `datasets` package).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

Row = dict[str, Any]


@dataclasses.dataclass
class Example:
    problem: str
    answer: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    files: dict[str, tuple[str, ...]]  # split -> paths (globs allowed) relative to data_dir
    problem_key: str = "problem"
    answer_key: str = "answer"
    answer_format: str = "raw"  # key of ANSWER_FORMATS
    id_key: str | None = None


_KK_TEST = "kk/mem_kk_logic_regenerated/test/people{}_num100.jsonl"
_KK = dict(problem_key="quiz", answer_key="solution_text_format")  # "index" repeats across files: ids are file:line

DATASETS: dict[str, DatasetSpec] = {
    "math500": DatasetSpec({"test": ("math500/test.jsonl",)}, id_key="unique_id"),
    "aime24": DatasetSpec({"test": ("aime24/test.jsonl",)}, answer_format="number", id_key="id"),
    "aime25": DatasetSpec({"test": ("aime25/test.jsonl",)}, answer_format="number", id_key="id"),
    "amc23": DatasetSpec({"test": ("amc23/test.jsonl",)}, answer_format="number", id_key="id"),
    "gsm8k": DatasetSpec({"test": ("gsm8k/test.jsonl",), "train": ("gsm8k/test.jsonl",)}, problem_key="question",
                         answer_format="gsm8k", id_key="idx"),
    # The shared data has GSM8K's test split only: "train" is that file minus a held-out quarter (idx % 4 == 0),
    # which is "gsm8k_heldout" (330 problems); disjoint and fixed (see _SPLIT_ROWS).
    "gsm8k_heldout": DatasetSpec({"test": ("gsm8k/test.jsonl",)}, problem_key="question", answer_format="gsm8k",
                                 id_key="idx"),
    "math_train": DatasetSpec({"train": ("math_train/math12k_train.jsonl",)}),
    "math_train_l3to5": DatasetSpec({"train": ("math_train/math12k_level3to5.jsonl",)}),
    "math_train_l1to2": DatasetSpec({"train": ("math_train/math12k_train.jsonl",),
                                     "test": ("math_train/math12k_train.jsonl",)}),  # MATH levels 1-2 (3110)
    "kk": DatasetSpec(
        {"test": tuple(_KK_TEST.format(n) for n in range(2, 9)),
         **{f"people{n}": (_KK_TEST.format(n),) for n in range(2, 9)},
         "logic_rl_train": ("kk/logic_rl_instruct/*ppl/train.parquet",),
         "logic_rl_test": ("kk/logic_rl_instruct/*ppl/test.parquet",)},
        **_KK),
}

_heldout = lambda ex: int(ex.meta["id"]) % 4 == 0
# (dataset, split) -> which rows of its files it keeps
_easy = lambda ex: ex.meta.get("level") in ("Level 1", "Level 2")
_SPLIT_ROWS = {("gsm8k", "train"): lambda ex: not _heldout(ex), ("gsm8k_heldout", "test"): _heldout,
               ("math_train_l1to2", "train"): _easy, ("math_train_l1to2", "test"): _easy}

# ------------------------------------------------------------------------------------------------ answers


def _number_string(value: Any) -> str:
    """27.0 -> "27", "025" -> "25"; anything that is not a plain number is returned as text."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    text = str(value).strip()
    sign, digits = (text[0], text[1:]) if text[:1] in "+-" else ("", text)
    if digits.isdigit():
        return ("-" if sign == "-" and int(digits) else "") + str(int(digits))
    return text


def _gsm8k_answer(value: Any) -> str:
    text = str(value)
    if "####" not in text:
        raise ValueError("gsm8k answer has no '#### <final answer>' line; use answer_format='raw' for other sets")
    return text.rsplit("####", 1)[1].strip().replace(",", "")


def _raw_answer(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return _number_string(value)


ANSWER_FORMATS: dict[str, Callable[[Any], str]] = {
    "raw": _raw_answer, "number": _number_string, "gsm8k": _gsm8k_answer}

# ------------------------------------------------------------------------------------------------ raw rows


def read_jsonl(path: str | os.PathLike) -> Iterable[tuple[int, Row]]:
    """(line number, row) for every non-blank line; a line that is not a JSON object raises ValueError."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at column "
                                 f"{e.start + 1}); re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); fix or delete"
                                 " this line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def read_parquet(path: str | os.PathLike) -> Iterable[tuple[int, Row]]:
    """(row number starting at 1, row) of a parquet file, nested columns as dicts / lists."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    for i, row in enumerate(table.to_pylist(), start=1):
        yield i, row


def write_jsonl(path: str | os.PathLike, rows: Iterable[Row]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def get_field(row: Row, key: str) -> Any:
    """row["a"]["b"][0] for key "a.b.0" (verl-style nested parquet columns); KeyError when absent."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(key)
    return node


def rows_to_examples(
    rows: Iterable[tuple[int, Row]],
    source: str,
    problem_key: str = "problem",
    answer_key: str = "answer",
    answer_format: str = "raw",
    id_key: str | None = None,
) -> list[Example]:
    """Examples from (position, row) pairs; meta keeps every other field plus "source" ("file:line") and "id"
    (row[id_key], else "folder/file:line")."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"unknown answer_format {answer_format!r}; choose one of {sorted(ANSWER_FORMATS)}")
    to_answer = ANSWER_FORMATS[answer_format]
    short = "/".join(Path(source).parts[-2:])
    examples = []
    for pos, row in rows:
        where = f"{source}:{pos}"
        try:
            problem = get_field(row, problem_key)
            answer = to_answer(get_field(row, answer_key))
        except KeyError as e:
            raise ValueError(f"{where}: missing field {e.args[0]!r} (row has {sorted(row)}); pass problem_key= /"
                             " answer_key= naming the right fields or fix the row") from None
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if not isinstance(problem, str):
            raise ValueError(f"{where}: field {problem_key!r} should be text, got {type(problem).__name__}")
        if get_field(row, answer_key) is None:  # str(None) would make "None" the gold answer
            raise ValueError(f"{where}: field {answer_key!r} is null; give the row its answer or drop the row")
        meta = {k: v for k, v in row.items() if k not in (problem_key, answer_key)}
        meta["id"] = str(row[id_key]) if id_key and id_key in row else f"{short}:{pos}"
        meta["source"] = where
        examples.append(Example(problem, answer, meta))
    return examples


def load_file(path: str | os.PathLike, **fields: Any) -> list[Example]:
    """Examples from one .jsonl/.json (JSON Lines) or .parquet file; `fields` go to rows_to_examples."""
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.endswith(".parquet"):
        rows = read_parquet(path)
    elif path.endswith((".jsonl", ".json")):
        rows = read_jsonl(path)
    else:
        raise ValueError(f"{path}: unsupported file type; use .jsonl or .parquet")
    return rows_to_examples(rows, path, **fields)

# ------------------------------------------------------------------------------------------------ registry


def default_data_dir() -> Path:
    """$SAGE_DATA_DIR, else ./data, else the shared data folder next to the repository."""
    if os.environ.get("SAGE_DATA_DIR"):
        return Path(os.environ["SAGE_DATA_DIR"])
    if Path("data").is_dir():
        return Path("data")
    return Path(__file__).resolve().parents[3] / "shared" / "data"


def _resolve(pattern: str, data_dir: Path) -> list[str]:
    full = str(data_dir / pattern)
    return sorted(glob.glob(full)) if any(ch in pattern for ch in "*?[") else [full]


def _load_registered(name: str, split: str, data_dir: Path, overrides: dict[str, Any]) -> list[Example]:
    spec = DATASETS[name]
    if split not in spec.files:
        raise ValueError(f"dataset {name!r} has no split {split!r}; available: {sorted(spec.files)}")
    paths = [p for pattern in spec.files[split] for p in _resolve(pattern, data_dir)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing or not paths:
        raise FileNotFoundError(f"dataset {name!r} split {split!r}: missing {missing or spec.files[split]} under"
                                f" {data_dir}; pass data_dir= or set SAGE_DATA_DIR to the folder holding {name}/")
    fields = dict(problem_key=spec.problem_key, answer_key=spec.answer_key, answer_format=spec.answer_format,
                  id_key=spec.id_key)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    examples = [ex for p in paths for ex in load_file(p, **fields)]
    keep = _SPLIT_ROWS.get((name, split))
    examples = [ex for ex in examples if keep(ex)] if keep else examples
    for ex in examples:
        ex.meta["dataset"] = name
    if name == "kk":
        _attach_kk_gold(examples)
    return examples


def _attach_kk_gold(examples: list[Example]) -> None:
    """Hands K&K rows to sage_jax.rewards.kk when it offers a row parser (kept optional: rewards may be absent)."""
    try:
        from sage_jax.rewards import kk
    except ImportError:
        return
    parse_row = getattr(kk, "parse_row", None) or getattr(kk, "gold_from_row", None)
    if parse_row is None:
        return
    for ex in examples:
        ex.meta["gold"] = parse_row({**ex.meta, "quiz": ex.problem, "solution_text_format": ex.answer})


def countdown_examples(problems: Iterable[dict[str, Any]]) -> list[Example]:
    from sage_jax.rewards import countdown

    return [Example(countdown.prompt(p), str(p["target"]),
                    {"numbers": list(p["numbers"]), "target": int(p["target"]), "id": str(i), "dataset": "countdown"})
            for i, p in enumerate(problems)]


def _load_countdown(split: str, num_examples: int | None, seed: int, **options: Any) -> list[Example]:
    from sage_jax.rewards import countdown

    sizes = {"train": 1000, "test": 200, "test_ood": 200}
    num_train = options.pop("num_train", sizes["train"])
    if split not in sizes:
        raise ValueError(f"countdown has splits {sorted(sizes)}, not {split!r}")
    n = sizes[split] if num_examples is None else num_examples
    if split == "train":
        return countdown_examples(countdown.generate_problems(n, seed, **options))
    if split == "test":
        train = countdown.generate_problems(num_train, seed, **options)
        return countdown_examples(countdown.generate_problems(n, seed + 1, exclude=train, **options))
    return countdown_examples(countdown.generate_problems(n, seed + 2, num_numbers=4, **options))


def _load_hf(path: str, split: str, overrides: dict[str, Any]) -> list[Example]:
    repo, _, config = path[len("hf://"):].partition(":")
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path}: loading from the Hugging Face hub needs `pip install datasets`") from None
    try:
        table = datasets.load_dataset(repo, config or None, split=split)
    except Exception as e:  # network / auth / missing repo all surface here
        raise ValueError(f"could not load {repo!r} split {split!r} from the Hugging Face hub ({type(e).__name__}:"
                         f" {e}). This needs network access; without it, export the data to jsonl/parquet on a"
                         " connected machine and pass that path instead.") from None
    fields = {"problem_key": "problem", "answer_key": "answer"}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return rows_to_examples(enumerate(table, start=1), f"{path}[{split}]", **fields)


def load_dataset(
    name_or_path: str,
    split: str = "test",
    data_dir: str | os.PathLike | None = None,
    problem_key: str | None = None,
    answer_key: str | None = None,
    answer_format: str | None = None,
    id_key: str | None = None,
    limit: int | None = None,
    num_examples: int | None = None,
    seed: int = 0,
    **countdown_options: Any,
) -> list[Example]:
    """Examples of a registered dataset, local file/folder, "countdown" or "hf://org/name[:config]".

    Names: math500, aime24, aime25, amc23, gsm8k (answer = text after '####'), math_train (12k), math_train_l3to5,
    kk (splits test, people2..people8, logic_rl_train, logic_rl_test), countdown (train, test, test_ood; generated
    with `seed`, `num_examples` and generate_problems options). `limit` keeps the first rows.
    """
    overrides = dict(problem_key=problem_key, answer_key=answer_key, answer_format=answer_format, id_key=id_key)
    if countdown_options and name_or_path != "countdown":
        raise ValueError(f"unexpected options {sorted(countdown_options)} for {name_or_path!r} (only countdown takes"
                         " generator options)")
    if name_or_path == "countdown":
        examples = _load_countdown(split, num_examples, seed, **countdown_options)
    elif name_or_path.startswith("hf://"):
        examples = _load_hf(name_or_path, split, overrides)
    elif name_or_path in DATASETS:
        examples = _load_registered(name_or_path, split, Path(data_dir) if data_dir else default_data_dir(), overrides)
    elif os.path.isdir(name_or_path):
        candidates = [os.path.join(name_or_path, f"{split}{ext}") for ext in (".jsonl", ".parquet", ".json")]
        found = [c for c in candidates if os.path.isfile(c)]
        if not found:
            raise FileNotFoundError(f"{name_or_path} has no {split}.jsonl or {split}.parquet")
        examples = load_file(found[0], **{k: v for k, v in overrides.items() if v is not None})
    elif os.path.isfile(name_or_path):
        examples = load_file(name_or_path, **{k: v for k, v in overrides.items() if v is not None})
    elif name_or_path.endswith((".jsonl", ".json", ".parquet")) or os.sep in name_or_path:
        raise FileNotFoundError(f"data file or folder {name_or_path} does not exist")
    else:
        raise ValueError(f"unknown dataset {name_or_path!r}: use one of {sorted(DATASETS) + ['countdown']}, a .jsonl /"
                         " .parquet file, a folder with {split}.jsonl, or hf://org/name")
    return examples[:limit] if limit is not None else examples
