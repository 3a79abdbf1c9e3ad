"""Knights and Knaves: data loading, prompts, a strict answer checker and a generator of new puzzles.

A puzzle row has the fields of the K&K benchmark files (see /work/shared/data/kk/SOURCE.txt): quiz, names,
knight_knave, solution (list[bool], True = knight), solution_text, solution_text_format, cot_head, cot_repeat_steps,
cot_foot, statements (a Python literal: one logic tree per person) and index. Generated puzzles have the same fields.

Statement trees: ("telling-truth", i) = person i is a knight, ("lying", i) = person i is a knave, ("not", s),
("and", s, t, ...), ("or", s, t, ...), ("->", s, t), ("<=>", s, t). Person i is a knight iff statement i is true.

The gold a checker needs is small: {"names": [...], "solution": [bool, ...]} (`parse_row`). A completion scores 1.0
only if its answer (the last <answer>...</answer>, else the text after "CONCLUSION:", else after </think>, else the
last paragraph) says "NAME is a knight|knave" for every name, with no name given both roles.
"""

from __future__ import annotations

import ast
import glob
import itertools
import json
import os
import random
import re
from typing import Any, Iterable, Sequence

KNIGHT_KNAVE = {"knight": "knight", "knave": "knave", "a_knight": "a knight", "a_knave": "a knave",
                "Knight": "Knight", "Knave": "Knave"}
INTRO = ("A very special island is inhabited only by knights and knaves. Knights always tell the truth, and knaves "
         "always lie. ")
COT_HEAD = "Let's think step by step, by considering whether each person is lying and if that leads to contradiction."
INSTRUCTIONS = ("Reason step by step, then give your final answer inside <answer> </answer> tags, one line per "
                "inhabitant in the order above, each of the form \"(k) NAME is a knight\" or \"(k) NAME is a knave\".")
NAMES = ("Aiden", "Amelia", "Aria", "Aurora", "Avery", "Benjamin", "Charlotte", "Chloe", "Daniel", "David", "Elizabeth",
         "Ella", "Emily", "Emma", "Ethan", "Evelyn", "Gabriel", "Grace", "Harper", "Henry", "Isabella", "Jack",
         "Jackson", "Jacob", "James", "Liam", "Logan", "Lucas", "Luke", "Mason", "Matthew", "Mia", "Michael", "Noah",
         "Oliver", "Olivia", "Owen", "Penelope", "Riley", "Samuel", "Scarlett", "Sebastian", "Sofia", "Sophia",
         "Victoria", "William", "Zoey")
_SAYING = ('{name} said, "{S}."', '{name} told you that {s}.', 'According to {name}, "{S}".', '{name} noted, "{S}".',
           "In {name}'s words: \"{S}\".", '"{S}," {name} claimed.', '{name} said that {s}.',
           '{name} was heard saying, "{S}".')
_REQUIRED = ("quiz", "names", "solution")


# ----------------------------------------------------------------------------------------------- data


def validate_row(row: dict, where: str = "row") -> dict:
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise ValueError(f"{where}: K&K row lacks fields {missing}; expected the fields listed in "
                         "/work/shared/data/kk/SOURCE.txt (quiz, names, solution, ...)")
    if len(row["names"]) != len(row["solution"]):
        raise ValueError(f"{where}: {len(row['names'])} names but {len(row['solution'])} solution entries")
    return row


def load_jsonl(path: str | os.PathLike) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno}); fix or remove "
                                     "the line") from None
                rows.append(validate_row(row, f"{path}:{line_no}"))
    return rows


def load(path: str | os.PathLike, n_people: Iterable[int] | None = None) -> list[dict]:
    """Rows of one .jsonl file, or of every people{N}_num*.jsonl under a directory (N in n_people if given)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return load_jsonl(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"K&K data {path!r} does not exist; point to a .jsonl file or a directory holding "
                                "people{N}_num100.jsonl files (e.g. /work/shared/data/kk)")
    wanted = set(n_people) if n_people is not None else None
    files = []
    for file in glob.glob(os.path.join(path, "**", "people*_num*.jsonl"), recursive=True):
        n = int(re.search(r"people(\d+)_", os.path.basename(file)).group(1))
        if wanted is None or n in wanted:
            files.append((n, file))
    if not files:
        raise FileNotFoundError(f"no people{{N}}_num*.jsonl files under {path!r} (n_people={n_people})")
    return [row for _, file in sorted(files) for row in load_jsonl(file)]


def parse_row(row: dict) -> dict:
    """The gold for `score`: {"names", "solution", "knight", "knave"} from a data row (or its solution text)."""
    roles = row.get("knight_knave") or KNIGHT_KNAVE
    if "names" in row and "solution" in row:
        names, solution = list(row["names"]), [bool(s) for s in row["solution"]]
    else:
        text = row.get("solution_text_format") or (row.get("reward_model") or {}).get("ground_truth", {}).get(
            "solution_text_format")
        if not text:
            raise ValueError("K&K row has neither names+solution nor solution_text_format; cannot build a gold")
        knight, knave = re.escape(roles["knight"]), re.escape(roles["knave"])
        pairs = re.findall(rf"([A-Z][\w'-]*) is an? ({knight}|{knave})\b", text)
        names, solution = [n for n, _ in pairs], [r == roles["knight"] for _, r in pairs]
    return {"names": names, "solution": solution, "knight": roles["knight"], "knave": roles["knave"]}


gold_from_row = parse_row


def _as_gold(gold: Any) -> dict:
    if isinstance(gold, str):
        return parse_row({"solution_text_format": gold})
    if isinstance(gold, dict):
        return gold if "knight" in gold and "names" in gold else parse_row(gold)
    raise ValueError(f"K&K gold must be a dict (names, solution) or a solution string, got {type(gold).__name__}")


def prompt(row: dict) -> str:
    """The quiz followed by the answer-format instructions."""
    return row["quiz"] + "\n\n" + INSTRUCTIONS


def format_solution(gold: Any) -> str:
    """'(1) NAME is a knight\\n(2) ...' for a gold / row."""
    gold = _as_gold(gold)
    return "\n".join(f"({i}) {name} is a {gold['knight'] if role else gold['knave']}"
                     for i, (name, role) in enumerate(zip(gold["names"], gold["solution"]), start=1))


# ----------------------------------------------------------------------------------------------- checking


def answer_region(completion: str) -> str | None:
    """The part of a completion that holds the final answer (see module doc)."""
    if not isinstance(completion, str) or not completion.strip():
        return None
    opens = [m.end() for m in re.finditer(r"<answer>", completion, re.IGNORECASE)]
    if opens:
        close = re.search(r"</answer>", completion[opens[-1]:], re.IGNORECASE)
        return completion[opens[-1]:opens[-1] + close.start()] if close else completion[opens[-1]:]
    conclusion = list(re.finditer(r"CONCLUSION\s*:", completion, re.IGNORECASE))
    if conclusion:
        return completion[conclusion[-1].end():]
    think = completion.rfind("</think>")
    if think >= 0:
        return completion[think + len("</think>"):]
    paragraphs = [p for p in re.split(r"\n\s*\n", completion) if p.strip()]
    return paragraphs[-1] if paragraphs else None


def parse_roles(text: str, names: Sequence[str], knight: str = "knight", knave: str = "knave") -> list[bool | None]:
    """Per name: True (knight), False (knave), or None when missing or given both roles."""
    roles: list[bool | None] = []
    for name in names:
        pattern = (rf"(?<![A-Za-z]){re.escape(name)}(?![A-Za-z])[\s*_]*(?:is|was|:|-|–|—|=)\s*(not\s+)?"
                   rf"(?:an?\s+)?[*_]*({re.escape(knight)}|{re.escape(knave)})(?![A-Za-z])")
        found = {(m.group(2).lower() == knight.lower()) != bool(m.group(1))
                 for m in re.finditer(pattern, text, re.IGNORECASE)}
        roles.append(found.pop() if len(found) == 1 else None)
    return roles


def score(completion: str, gold: Any) -> float:
    """1.0 iff every inhabitant's role in the answer matches the gold exactly, else 0.0."""
    gold = _as_gold(gold)
    region = answer_region(completion)
    if region is None or not gold["names"]:
        return 0.0
    roles = parse_roles(region, gold["names"], gold["knight"], gold["knave"])
    return 1.0 if roles == [bool(s) for s in gold["solution"]] else 0.0


# ----------------------------------------------------------------------------------------------- logic


def evaluate(stmt: tuple, knights: Sequence[bool]) -> bool:
    op, args = stmt[0], stmt[1:]
    if op == "telling-truth":
        return bool(knights[args[0]])
    if op == "lying":
        return not knights[args[0]]
    if op == "not":
        return not evaluate(args[0], knights)
    if op == "and":
        return all(evaluate(a, knights) for a in args)
    if op == "or":
        return any(evaluate(a, knights) for a in args)
    if op == "->":
        return (not evaluate(args[0], knights)) or evaluate(args[1], knights)
    if op == "<=>":
        return evaluate(args[0], knights) == evaluate(args[1], knights)
    raise ValueError(f"unknown K&K statement operator {op!r}")


def solve(statements: Sequence[tuple]) -> list[tuple[bool, ...]]:
    """Every consistent assignment (True = knight): person i is a knight iff statement i holds."""
    n = len(statements)
    return [knights for knights in itertools.product((True, False), repeat=n)
            if all(evaluate(s, knights) == knights[i] for i, s in enumerate(statements))]


def parse_statements(text: str) -> tuple:
    return ast.literal_eval(text)  # data files only: a literal parser, never eval


def _atom_text(stmt: tuple, names: Sequence[str]) -> str:
    op, who = stmt
    return f"{names[who]} is a {'knight' if op == 'telling-truth' else 'knave'}"


def render(stmt: tuple, names: Sequence[str]) -> str:
    """English for the statement shapes `generate_puzzle` makes."""
    op, args = stmt[0], stmt[1:]
    if op in ("telling-truth", "lying"):
        return _atom_text(stmt, names)
    if op == "not" and args[0][0] in ("telling-truth", "lying"):
        role = "knight" if args[0][0] == "telling-truth" else "knave"
        return f"{names[args[0][1]]} is not a {role}"
    if op == "not" and args[0][0] == "<=>":
        a, b = args[0][1:]
        if a[0] == b[0] == "telling-truth":
            return f"{names[a[1]]} and {names[b[1]]} are different types"
        return f"either {render(a, names)} or {render(b, names)}, but not both"
    if op == "and":
        a, b = args
        if a[0] == b[0] and a[0] in ("telling-truth", "lying"):
            return f"{names[a[1]]} and {names[b[1]]} are both {'knights' if a[0] == 'telling-truth' else 'knaves'}"
        return f"{render(a, names)} and {render(b, names)}"
    if op == "or":
        return f"{render(args[0], names)} or {render(args[1], names)}"
    if op == "->":
        return f"if {render(args[0], names)} then {render(args[1], names)}"
    if op == "<=>":
        a, b = args
        if a[0] == b[0] == "telling-truth":
            return f"{names[a[1]]} and {names[b[1]]} are the same type"
        return f"{render(a, names)} if and only if {render(b, names)}"
    raise ValueError(f"cannot render K&K statement {stmt!r}")


def _random_statement(rng: random.Random, speaker: int, n: int) -> tuple:
    def atom(who: int | None = None) -> tuple:
        return (rng.choice(("telling-truth", "lying")), rng.randrange(n) if who is None else who)

    def other() -> int:
        return rng.choice([i for i in range(n) if i != speaker])

    kind = rng.choices(("atom", "not", "and", "or", "->", "same", "different", "xor", "iff"),
                       weights=(4, 1, 2, 2, 2, 1, 1, 1, 1))[0]
    if kind == "atom":
        return atom(other())
    if kind == "not":
        return ("not", atom(other()))
    if kind in ("same", "different"):
        a, b = rng.sample(range(n), 2)
        same = ("<=>", ("telling-truth", a), ("telling-truth", b))
        return same if kind == "same" else ("not", same)
    a, b = atom(), atom()
    while b[1] == a[1]:
        b = atom()
    return {"and": ("and", a, b), "or": ("or", a, b), "->": ("->", a, b), "iff": ("<=>", a, b),
            "xor": ("not", ("<=>", a, b))}[kind]


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:]


def generate_puzzle(n_people: int, rng: random.Random | int, index: int = 0, max_tries: int = 10_000) -> dict:
    """A new puzzle with `n_people` inhabitants and exactly one consistent assignment, in the data-row format."""
    if not 2 <= n_people <= len(NAMES):
        raise ValueError(f"n_people must be in [2, {len(NAMES)}], got {n_people}")
    rng = rng if isinstance(rng, random.Random) else random.Random(rng)
    for _ in range(max_tries):
        statements = tuple(_random_statement(rng, i, n_people) for i in range(n_people))
        solutions = solve(statements)
        if len(solutions) == 1:
            break
    else:
        raise RuntimeError(f"no uniquely solvable {n_people}-person puzzle in {max_tries} tries")
    names = rng.sample(NAMES, n_people)
    said = []
    for i, stmt in enumerate(statements):
        text = render(stmt, names)
        said.append(rng.choice(_SAYING).format(name=names[i], s=text, S=_sentence(text)))
    listing = ", ".join(names[:-1]) + ", and " + names[-1]
    quiz = (f"{INTRO}You meet {n_people} inhabitants: {listing}. " + " ".join(said)
            + " So who is a knight and who is a knave?")
    solution = list(solutions[0])
    roles = [f"{name} is a {'knight' if k else 'knave'}" for name, k in zip(names, solution)]
    return {
        "quiz": quiz, "names": names, "knight_knave": dict(KNIGHT_KNAVE), "solution": solution,
        "solution_text": ", ".join(roles[:-1]) + ", and " + roles[-1] + ".",
        "solution_text_format": "\n".join(f"({i}) {r}" for i, r in enumerate(roles, start=1)),
        "cot_head": COT_HEAD, "cot_repeat_steps": [], "cot_foot": "This leads to a feasible solution.",
        "statements": repr(statements), "index": index,
    }


def generate_dataset(n_people_list: Sequence[int], count: int, seed: int) -> list[dict]:
    """`count` puzzles for each N in `n_people_list`, deterministic in `seed` (use disjoint seeds for train / eval)."""
    rows = []
    for n in n_people_list:
        rng = random.Random(f"kk-{seed}-{n}")
        rows.extend(generate_puzzle(n, rng, index=i) for i in range(count))
    return rows
