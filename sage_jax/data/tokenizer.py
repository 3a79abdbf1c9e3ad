"""A thin wrapper over a local Hugging Face tokenizer: chat/boxed prompts, stop ids, left padding to buckets.

Prompts are left padded so every row's last prompt token sits at the same column and generation starts in step;
lengths are rounded up to a few bucket sizes so jitted code compiles once per bucket, not once per batch.

Stop ids are the union of the tokenizer's eos, the chat template's end of turn (the special token it writes after an
assistant message: <|eot_id|> for Llama-3, which is not its eos), the model directory's config.json and
generation_config.json eos ids, and the known turn-end names of STOP_TOKENS that the vocabulary has.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sage_jax.models.hf_config import eos_list, model_stop_ids  # noqa: F401  (public here too)

log = logging.getLogger("sage_jax")

DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
# End-of-turn / end-of-text names of common models (Qwen/ChatML, Llama-3, Gemma): stops where the vocabulary has them.
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>")
_TURN_PROBE = "sage-jax end-of-turn probe"
_LOGGED: set[tuple[str, tuple[int, ...]]] = set()

# Common evaluation prompt for Qwen2.5-Math base models (paper/IMPLEMENTATION_FACTS.md); used when
# sage_jax.data.templates is unavailable.
QWEN_MATH_BOXED = (
    "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
    "<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"
)


def boxed_prompt(problem: str) -> str:
    """The Qwen2.5-Math "reason step by step ... \\boxed{}" prompt around one problem."""
    try:
        from sage_jax.data import templates
    except ImportError:
        return QWEN_MATH_BOXED.replace("{problem}", problem)  # replace, not format: LaTeX is full of braces
    return templates.render("qwen_math_boxed", problem)


def bucket_length(n: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """Smallest bucket >= n."""
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"length {n} exceeds the largest bucket {max(buckets)}; raise the max prompt length / "
                     f"bucket sizes or truncate")


def end_of_turn_id(hf: Any) -> int | None:
    """The special token a chat template writes right after an assistant message's content, or None.

    Renders a two-message conversation and reads the tokens after the assistant's text: the first special token,
    passing over whitespace (a template may write a newline first); any other text first means there is none."""
    if not getattr(hf, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": _TURN_PROBE}]
    try:
        text = hf.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template may refuse any conversation (raise_exception): no turn end then
        return None
    at = text.rfind(_TURN_PROBE) if isinstance(text, str) else -1
    if at < 0:
        return None
    special = {int(i) for i, t in getattr(hf, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    special |= {int(i) for i in hf.all_special_ids}
    for i in hf.encode(text[at + len(_TURN_PROBE):], add_special_tokens=False):
        if i in special:
            return None if i == hf.bos_token_id else int(i)
        if hf.decode([i]).strip():
            return None
    return None


def pad_left(token_lists: Sequence[Sequence[int]], bucket_sizes: Sequence[int] = DEFAULT_BUCKETS, pad_id: int = 0,
             truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad to the smallest bucket that fits the longest row -> (tokens_BxP int32, mask_BxP int32).

    With truncate=True, rows longer than the largest bucket keep their rightmost tokens (the end of a prompt is
    where the question and the generation cue are).
    """
    if not token_lists:
        raise ValueError("pad_left got no rows")
    longest = max(len(t) for t in token_lists)
    if truncate:
        longest = min(longest, max(bucket_sizes))
    elif longest > max(bucket_sizes):
        raise ValueError(f"prompt of {longest} tokens exceeds the largest bucket {max(bucket_sizes)}; raise the "
                         f"bucket sizes / max prompt length, or pass truncate=True to keep the last tokens")
    P = bucket_length(longest, bucket_sizes)
    tokens_BxP = np.full((len(token_lists), P), pad_id, np.int32)
    mask_BxP = np.zeros((len(token_lists), P), np.int32)
    for b, row in enumerate(token_lists):
        row = list(row)[-P:] if row else []
        if row:
            tokens_BxP[b, P - len(row):] = row
            mask_BxP[b, P - len(row):] = 1
    return tokens_BxP, mask_BxP


class Tokenizer:
    """Wraps a transformers tokenizer loaded from a local directory.

    model_dir (default: the directory the tokenizer was loaded from) is where config.json / generation_config.json
    add their eos ids to the stop set."""

    def __init__(self, hf_tokenizer: Any, model_dir: str | os.PathLike | None = None):
        self.hf = hf_tokenizer
        where = model_dir or getattr(hf_tokenizer, "name_or_path", "") or ""
        self.eos_ids = self._stop_ids(where if where and os.path.isdir(where) else None)
        pad = hf_tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_ids[0] if self.eos_ids else 0)
        self.added_bos_id = self._added_bos()
        key = (str(where), self.eos_ids)
        if key not in _LOGGED:  # once per tokenizer directory and set
            _LOGGED.add(key)
            log.info("stop tokens (tokenizer eos, chat turn end, config.json / generation_config.json eos): %s",
                     self.describe(self.eos_ids))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        """A tokenizer directory, or "chars": the built-in character tokenizer (data/char_tokenizer.py)."""
        from sage_jax.data import char_tokenizer
        if str(path) == char_tokenizer.NAME:
            return cls(char_tokenizer.build())
        path = Path(path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {path} does not exist (download the model first, e.g. "
                                    f"`huggingface-cli download <repo> --local-dir {path}`)")
        if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            raise FileNotFoundError(f"{path} has no tokenizer.json / tokenizer_config.json")
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True), model_dir=path)

    def _stop_ids(self, model_dir: str | os.PathLike | None) -> tuple[int, ...]:
        ids = eos_list(self.hf.eos_token_id)
        turn = end_of_turn_id(self.hf)
        ids += [] if turn is None else [turn]
        if model_dir is not None:
            ids += model_stop_ids(model_dir)
        vocab = self.hf.get_vocab()
        ids += [vocab[t] for t in STOP_TOKENS if t in vocab]
        return tuple(dict.fromkeys(ids))  # dedupe, keep order: the tokenizer's eos stays first

    def _added_bos(self) -> int | None:
        """The BOS id the tokenizer's own encode (add_special_tokens=True) puts in front of a text, or None."""
        bos = self.hf.bos_token_id
        if bos is None:
            return None
        added, plain = (list(self.hf.encode("a", add_special_tokens=s)) for s in (True, False))
        return int(bos) if added[:1] == [bos] and plain[:1] != [bos] else None

    def describe(self, ids: Sequence[int]) -> str:
        """The ids as "id 'text', ..." for a log line."""
        return ", ".join(f"{int(i)} {self.hf.convert_ids_to_tokens(int(i))!r}" for i in ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as written: no BOS/EOS added (templates carry their own special tokens)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def with_bos(self, ids: Sequence[int]) -> list[int]:
        """ids behind the BOS that the tokenizer's own encode would add (none if it adds none), never a second one:
        for prompts rendered without a chat template (a chat template writes its own BOS)."""
        ids = list(ids)
        if self.added_bos_id is None or ids[:1] == [self.added_bos_id]:
            return ids
        return [self.added_bos_id] + ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, id_lists: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in id_lists]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; use a plain prompt template instead "
                             "(e.g. sage_jax.data.tokenizer.boxed_prompt)")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           tools=tools)

    def boxed_prompt(self, problem: str) -> str:
        return boxed_prompt(problem)

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def pad_left(self, token_lists: Sequence[Sequence[int]], bucket_sizes: Sequence[int] = DEFAULT_BUCKETS,
                 truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
        return pad_left(token_lists, bucket_sizes, self.pad_id, truncate)
