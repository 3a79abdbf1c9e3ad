"""A thin wrapper over a local Hugging Face tokenizer: chat/boxed prompts, stop ids, left padding to buckets.

Prompts are left padded so every row's last prompt token sits at the same column and generation starts in step;
lengths are rounded up to a few bucket sizes so jitted code compiles once per bucket, not once per batch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")

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
    """Wraps a transformers tokenizer loaded from a local directory."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        self.eos_ids = self._stop_ids()
        pad = hf_tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_ids[0] if self.eos_ids else 0)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        path = Path(path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {path} does not exist (download the model first, e.g. "
                                    f"`huggingface-cli download <repo> --local-dir {path}`)")
        if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            raise FileNotFoundError(f"{path} has no tokenizer.json / tokenizer_config.json")
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))

    def _stop_ids(self) -> tuple[int, ...]:
        ids = []
        if self.hf.eos_token_id is not None:
            ids.append(int(self.hf.eos_token_id))
        vocab = self.hf.get_vocab()
        ids += [vocab[t] for t in STOP_TOKENS if t in vocab]
        return tuple(dict.fromkeys(ids))  # dedupe, keep order

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as written: no BOS/EOS added (templates carry their own special tokens)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, id_lists: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in id_lists]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; use a plain prompt template instead "
                             "(e.g. sage_jax.data.tokenizer.boxed_prompt)")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def boxed_prompt(self, problem: str) -> str:
        return boxed_prompt(problem)

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def pad_left(self, token_lists: Sequence[Sequence[int]], bucket_sizes: Sequence[int] = DEFAULT_BUCKETS,
                 truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
        return pad_left(token_lists, bucket_sizes, self.pad_id, truncate)
