"""What the trainer trains on: tokenizer, train/eval examples, prompt rendering and the reward's name.

Three tasks share one shape: "math" (HF tokenizer, boxed answers, math-verify reward), "kk" (Knights and Knaves,
HF tokenizer) and "countdown" (a character tokenizer and procedurally generated problems: the CPU default).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
from typing import Any, Sequence

from sage_jax.data import loaders
from sage_jax.data.loaders import Example



def encode_prompt_text(tokenizer: Any, template: str, text: str) -> list[int]:
    """A rendered prompt's ids as training, evaluation and SFT all feed it: a chat-rendered prompt as written (its
    template wrote any BOS), a plain-text one with the BOS the tokenizer's own encode adds (never twice)."""
    from sage_jax.data.templates import is_chat
    ids = list(tokenizer.encode(text))
    with_bos = getattr(tokenizer, "with_bos", None)  # the countdown tokenizer's encode adds its own <bos>
    return ids if with_bos is None or is_chat(template) else with_bos(ids)


@dataclasses.dataclass
class Task:
    name: str
    reward: str  # a sage_jax.rewards.pool registry name
    tokenizer: Any  # encode(text) -> ids, decode(ids) -> text, eos_ids, pad_id
    template: str  # a sage_jax.data.templates name (for "chat" / "auto": the registered model template)
    train: list[Example]
    evals: dict[str, list[Example]]
    answer_extraction: str = "strict"  # "last_number": math answers may be the reply's last number (rewards.math)

    def prompt_text(self, ex: Example) -> str:
        from sage_jax.data.templates import render
        return render(self.template, ex.problem)

    def encode_prompt(self, ex: Example) -> list[int]:
        """The prompt's ids: a chat-rendered prompt as written (its template wrote any BOS, as transformers'
        apply_chat_template(tokenize=True)); a plain-text one with the BOS the tokenizer's own encode adds."""
        return encode_prompt_text(self.tokenizer, self.template, self.prompt_text(ex))

    def gold(self, ex: Example) -> Any:
        """What the reward function compares against."""
        if self.name == "countdown":
            return {"numbers": ex.meta["numbers"], "target": ex.meta["target"]}
        if self.name == "kk":
            return ex.meta.get("gold", ex.answer)
        if self.answer_extraction == "last_number":
            return {"answer": ex.answer, "last_number": True}
        return ex.answer

    def train_batch(self, step: int, num_prompts: int, seed: int) -> list[Example]:
        """Prompts for RL step `step`: epochs over a seeded permutation, so a resumed run sees the same data."""
        n = len(self.train)
        if n == 0:
            raise ValueError(f"task {self.name!r} has no training examples")
        out = []
        for i in range(step * num_prompts, (step + 1) * num_prompts):
            epoch, pos = divmod(i, n)
            out.append(self.train[_epoch_order(n, seed, epoch)[pos]])
        return out


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(hash((seed, epoch)) & 0xFFFFFFFF).shuffle(order)
    return order


class _CountdownTok:
    """CountdownTokenizer with the attribute names the trainer uses."""

    def __init__(self):
        from sage_jax.rewards.countdown import CountdownTokenizer
        self._tok = CountdownTokenizer()
        self.vocab_size = self._tok.vocab_size
        self.pad_id = self._tok.pad_id
        self.bos_id = self._tok.bos_id
        self.eos_ids = (self._tok.eos_id,)

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        return self._tok.encode(text, add_bos=True, add_eos=add_eos)

    def encode_completion(self, text: str) -> list[int]:
        return self._tok.encode(text, add_bos=False, add_eos=True)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids)


def countdown_sets(config) -> dict[str, list[Example]]:
    """train / countdown (held out) / countdown_ood (a wider number range) for the run's config and seed.

    The OOD split keeps 3 numbers but draws them from [2, data.ood_max_number], beyond the training range.
    """
    from sage_jax.rewards import countdown
    d = config.data
    train = countdown.generate_problems(d.num_train, config.seed, num_numbers=d.num_numbers, high=d.max_number)
    sets = {"train": loaders.countdown_examples(train),
            "countdown": loaders.countdown_examples(countdown.generate_problems(
                d.num_eval, config.seed + 1, num_numbers=d.num_numbers, high=d.max_number, exclude=train))}
    if d.ood_max_number:
        sets["countdown_ood"] = loaders.countdown_examples(countdown.generate_problems(
            min(d.num_eval, 100), config.seed + 2, num_numbers=d.ood_num_numbers, low=2, high=d.ood_max_number,
            exclude=train))
    return sets


def _split_names(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def build(config, tokenizer_path: str = "") -> Task:
    """The task named by config.data.task; ValueError naming data.train where it holds no example."""
    task = _build(config, tokenizer_path)
    if not task.train:
        d = config.data
        if d.task != "math":
            raise ValueError(f"data.num_train={d.num_train}: no training examples; raise it")
        split = " (its train split)" if os.path.isdir(d.train) else ""
        raise ValueError(f"data.train={d.train!r}{split}: no training examples (an empty file?); point "
                         "--config.data.train at a file or folder with rows")
    return task


def _build(config, tokenizer_path: str = "") -> Task:
    d = config.data
    limit = d.eval_problems or None
    if d.task == "countdown":
        sets = countdown_sets(config)
        train = sets.pop("train")
        return Task("countdown", "countdown", _CountdownTok(), "plain", train, sets)

    from sage_jax.data.tokenizer import Tokenizer
    path = tokenizer_path or config.tokenizer_path or config.model.path
    if not path:
        raise ValueError(f"task {d.task!r} needs a tokenizer: set --config.model.path (an HF directory) or "
                         "--config.tokenizer_path")
    tokenizer = Tokenizer.from_pretrained(path)
    from sage_jax.data import templates
    template = templates.resolve_for(d, tokenizer, tools=_tool_schemas(config))
    fields = dict(problem_key=d.problem_field or None, answer_key=d.answer_field or None)
    data_dir = d.data_dir or None
    if d.task == "kk":
        from sage_jax.rewards import kk
        train = [_kk_example(p, i) for i, p in enumerate(kk.generate_dataset(list(d.kk_people), d.num_train,
                                                                            config.seed))]
        evals = {name: loaders.load_dataset("kk", name, data_dir=data_dir, limit=limit)
                 for name in _split_names(d.eval)}
        return Task("kk", "kk", tokenizer, template, train, evals)
    if d.task != "math":
        raise ValueError(f"data.task={d.task!r}: choose 'math', 'kk' or 'countdown'")
    train = _math_set(d.train, "train", config, data_dir, fields=fields)
    evals = {name: _math_set(name, "test", config, data_dir, limit=limit, exclude=train)
             for name in _split_names(d.eval)}
    extraction = str(d.get("answer_extraction", "strict"))
    if extraction not in ("strict", "last_number"):
        raise ValueError(f"data.answer_extraction={extraction!r}: choose 'strict' or 'last_number'")
    return Task("math", "math", tokenizer, template, train, evals, extraction)


def _tool_schemas(config) -> list[dict] | None:
    """The schemas of rollout.tools for the chat template's `tools=`, where calls go through it (tool_format
    'hermes'); a ```python format needs none in the prompt."""
    ro = config.get("rollout", {})
    if not tuple(ro.get("tools", ())) or ro.get("tool_format", "markdown") != "hermes":
        return None
    from sage_jax.tools.registry import SCHEMAS
    return [SCHEMAS[name] for name in ro.tools]


def _math_set(name: str, split: str, config, data_dir, fields=None, limit=None, exclude=()) -> list[Example]:
    """A math-reward data set; "arith_words" and "products" are generated (train: data.num_train, eval:
    data.num_eval, disjoint)."""
    if name in ("arith_words", "products"):
        from sage_jax.data import word_problems
        make = word_problems.generate if name == "arith_words" else word_problems.products
        if split == "train":
            return make(config.data.num_train, config.seed)
        return make(limit or config.data.num_eval, config.seed + 1, exclude={ex.problem for ex in exclude})
    return loaders.load_dataset(name, split, data_dir=data_dir, limit=limit, **(fields or {}))


def generated_eval_set(name: str, config) -> list[Example]:
    """A generated held-out set (arith_words) exactly as a run of `config` evaluated on it (disjoint from its train)."""
    train = _math_set(name, "train", config, None)
    return _math_set(name, "test", config, None, limit=config.data.eval_problems or None, exclude=train)


def _kk_example(puzzle: dict, i: int) -> Example:
    from sage_jax.rewards import kk
    problem = puzzle.get("quiz") or kk.prompt(puzzle)
    ex = Example(problem, puzzle.get("solution_text_format", ""), {"id": f"gen{i}", **puzzle})
    parse_row = getattr(kk, "parse_row", None)
    ex.meta["gold"] = parse_row(puzzle) if parse_row else puzzle
    return ex
