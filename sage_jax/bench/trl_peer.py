"""The peer of the rl_step mode: trl.GRPOTrainer (torch, CPU, fp32) on the same weights, prompts and completion
lengths, one step at a time with our steps run in between (so load from other processes hits both alike)."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable

import numpy as np

from sage_jax.bench.common import OPTIM


def word_level_tokenizer(vocab_size: int):
    """A PreTrainedTokenizerFast with the model's ids: "<pad>" 0, "<eos>" 1, "t<i>" i; a prompt of n space-separated
    words is exactly n tokens (no special tokens added)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.padding_side = "left"
    return fast


def _force_lengths_in_generate(hf_model, lengths_N: np.ndarray | None, eos_id: int, realised: list) -> None:
    """Make hf_model.generate end row n with EOS at step lengths[n] - 1 (never earlier), as our side's rollouts do
    (lengths_N None: as it is); appends each call's completion lengths (the EOS included) to `realised`."""
    import torch
    import transformers

    class ForcedLengths(transformers.LogitsProcessor):
        def __init__(self, prompt_width):
            self.prompt_width = prompt_width

        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - self.prompt_width
            stop = torch.as_tensor(lengths_N - 1 == step)
            scores[:, eos_id] = -float("inf")
            scores[stop] = torch.where(torch.arange(scores.shape[1]) == eos_id, 0.0, -float("inf"))
            return scores

    generate = hf_model.generate

    def forced(*args, **kw):
        width = kw["input_ids"].shape[1]
        if lengths_N is not None:
            kw["logits_processor"] = transformers.LogitsProcessorList([ForcedLengths(width)])
        out = generate(*args, **kw)
        is_eos = (out[:, width:] == eos_id).numpy()
        realised.append(np.where(is_eos.any(1), is_eos.argmax(1) + 1, is_eos.shape[1]))
        return out
    hf_model.generate = forced


def trl_interleaved(model_dir: str, vocab_size: int, prompts_BxP: np.ndarray, group: int, lengths_N: np.ndarray,
                    beta: float, steps: int, between: Callable[[], None], reward: Callable[[Any], float],
                    eos_id: int, seed: int = 0, realised: list | None = None) -> list[dict[str, float]]:
    """`steps` trl.GRPOTrainer steps on model_dir (8 prompts x G per step when B = 8); between() runs after each.
    Completion n of a step has lengths_N[n] tokens (min_new_tokens when all are equal, else a logits processor);
    the lengths TRL generated are appended to `realised`. reward(completion ids) scores each completion, as on our
    side; eos_id: the token a forced-length completion ends with.

    Per step: seconds from on_step_begin to on_step_end (the whole step: generate, reward, reference log-probs,
    update) and the time inside `_generate` and `_generate_and_score_completions` (what remains is the update)."""
    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(os.cpu_count() or 1)
    B = prompts_BxP.shape[0]
    new_tokens, fixed = int(lengths_N.max()), bool(np.all(lengths_N == lengths_N.max()))
    texts = [" ".join(f"t{i}" for i in row) for row in prompts_BxP]
    with tempfile.TemporaryDirectory() as out_dir:
        args = trl.GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=B * group, num_generations=group,
            max_completion_length=new_tokens, generation_kwargs={"min_new_tokens": new_tokens} if fixed else {},
            beta=beta,
            num_iterations=1, loss_type="grpo", use_vllm=False, report_to="none", bf16=False, use_cpu=True,
            max_steps=steps, learning_rate=OPTIM.lr, weight_decay=OPTIM.weight_decay, max_grad_norm=OPTIM.grad_clip,
            logging_steps=1, save_strategy="no", shuffle_dataset=False, disable_tqdm=True, seed=seed)
        rows: list[dict[str, float]] = []
        parts = {"generate_s": 0.0, "score_s": 0.0}

        class Interleave(transformers.TrainerCallback):
            def on_step_begin(self, *_, **__):
                parts.update(generate_s=0.0, score_s=0.0)
                self.start = time.perf_counter()

            def on_step_end(self, *_, **__):
                s = time.perf_counter() - self.start
                rows.append(dict(seconds=s, generate_s=parts["generate_s"],
                                 reward_ref_s=parts["score_s"] - parts["generate_s"], update_s=s - parts["score_s"]))
                between()

        ids_reward = lambda completions, completion_ids, **_: [reward(ids) for ids in completion_ids]
        gen = trl.GRPOTrainer(model=model_dir, reward_funcs=ids_reward, args=args,
                              train_dataset=datasets.Dataset.from_dict({"prompt": texts * steps}),
                              processing_class=word_level_tokenizer(vocab_size), callbacks=[Interleave()])
        _force_lengths_in_generate(gen.model, None if fixed else lengths_N, eos_id,
                                   [] if realised is None else realised)

        def timed(key: str, fn: Callable) -> Callable:
            def wrapper(*a, **kw):
                start = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    parts[key] += time.perf_counter() - start
            return wrapper
        gen._generate = timed("generate_s", gen._generate)
        gen._generate_and_score_completions = timed("score_s", gen._generate_and_score_completions)
        gen.train()
    return rows
