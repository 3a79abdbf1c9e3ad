"""Stop tokens and BOS for any model, checked against transformers itself on tiny tokenizers built here.

Three kinds of tokenizer, each saved with save_pretrained next to a config.json / generation_config.json:
- Llama-3 style: BOS <|begin_of_text|> added by the tokenizer, eos <|end_of_text|>, chat turns end with <|eot_id|>
  (the base model's eos is not the chat model's turn end: a rollout that stops only on eos decodes to its limit);
- Qwen style: <|im_start|> / <|im_end|>, <|endoftext|>, no BOS (tests/helpers_hf.tiny_tokenizer);
- SmolLM2 style: bos <|im_start|>, eos <|im_end|>, unk <|endoftext|>, a default system prompt, no BOS added.
The stop set must hold the tokenizer's eos, config.json's and generation_config.json's eos ids and the chat template's
end of turn; prompts rendered without a chat template get the BOS exactly when the tokenizer's own encode adds one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sage_jax.data import tasks, templates
from sage_jax.data.loaders import Example
from sage_jax.data.tokenizer import Tokenizer
from tests.helpers_hf import byte_level_bpe, tiny_tokenizer

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eom_id|>", "<|eot_id|>", "<|turn_done|>"]
SMOL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PROBLEM = "What is 1 + 1?"


def llama3_template(turn_end: str = "<|eot_id|>") -> str:
    return ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
            "'<|end_header_id|>\n\n' + message['content'] | trim + '" + turn_end + "' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def build_tokenizer(out_dir: Path, specials: list[str], chat_template: str | None, add_bos: str | None = None,
                    config_eos=None, generation_eos=None, **special_tokens) -> Path:
    """A byte-level BPE tokenizer saved to out_dir (specials get ids 0, 1, ... in order) with a config.json and,
    when generation_eos is given, a generation_config.json. add_bos: the token its post-processor prepends."""
    import transformers
    from tokenizers import processors

    corpus = ["Please reason step by step, and put your final answer within \\boxed{}.", f"{PROBLEM} It is 2.",
              "system user assistant hello world A conversation between User and Assistant <think> </think>"] * 4
    raw = byte_level_bpe(corpus, 320, specials)
    if add_bos:
        raw.post_processor = processors.TemplateProcessing(single=f"{add_bos} $A", pair=f"{add_bos} $A {add_bos} $B",
                                                           special_tokens=[(add_bos, specials.index(add_bos))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, **special_tokens)
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(out_dir)
    ids = lambda v: v if v is None else ([specials.index(t) for t in v] if isinstance(v, list) else specials.index(v))
    (out_dir / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": ids(config_eos)}))
    if generation_eos is not None:
        (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": ids(generation_eos)}))
    return out_dir


def llama3(out_dir: Path, chat: bool = True, turn_end: str = "<|eot_id|>", config_eos="<|end_of_text|>",
           generation_eos=("<|end_of_text|>", "<|eot_id|>")) -> Path:
    return build_tokenizer(out_dir, LLAMA3_SPECIALS, llama3_template(turn_end) if chat else None,
                           add_bos="<|begin_of_text|>", config_eos=config_eos,
                           generation_eos=list(generation_eos) if generation_eos else None,
                           bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


def smol(out_dir: Path, add_bos: bool = False) -> Path:
    return build_tokenizer(out_dir, SMOL_SPECIALS, SMOL_TEMPLATE, add_bos="<|im_start|>" if add_bos else None,
                           config_eos="<|im_end|>", generation_eos="<|im_end|>", bos_token="<|im_start|>",
                           eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>")


def qwen(out_dir: Path) -> Path:
    """Qwen2.5-Instruct's layout: eos <|im_end|>; generation_config adds <|endoftext|>."""
    tiny_tokenizer(out_dir)
    vocab = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    (out_dir / "config.json").write_text(json.dumps({"model_type": "qwen2", "eos_token_id": vocab["<|im_end|>"]}))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [vocab["<|im_end|>"], vocab["<|endoftext|>"]]}))
    return out_dir


def ids_of(tok: Tokenizer, *names: str) -> set[int]:
    return {tok.hf.convert_tokens_to_ids(n) for n in names}


def generation_eos(path: Path) -> set[int]:
    """generation_config.json's eos ids as transformers reads them."""
    import transformers
    eos = transformers.GenerationConfig.from_pretrained(path).eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def hf_chat_ids(tok: Tokenizer, messages) -> list[int]:
    out = tok.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def task_for(tok: Tokenizer, template: str, system: str = "", instruction: str = "{problem}") -> tasks.Task:
    return tasks.Task("math", "math", tok, templates.resolve(template, tok, system, instruction), [], {})


# ---------------------------------------------------------------------------------------------------- stop sets

def test_llama3_stops_at_the_end_of_its_chat_turn(tmp_path):
    """Fails before the fix: the stop set was the tokenizer's eos plus two Qwen names, so <|end_of_text|> only."""
    tok = Tokenizer.from_pretrained(llama3(tmp_path))
    assert tok.hf.convert_tokens_to_ids("<|eot_id|>") in tok.eos_ids
    assert tok.eos_ids[0] == tok.hf.eos_token_id  # the tokenizer's own eos first (SFT ends completions with it)
    assert generation_eos(tmp_path) <= set(tok.eos_ids)


def test_stop_set_is_the_union_of_every_source(tmp_path):
    path = llama3(tmp_path, config_eos=["<|end_of_text|>", "<|eom_id|>"])
    tok = Tokenizer.from_pretrained(path)
    assert set(tok.eos_ids) == ids_of(tok, "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
    assert len(tok.eos_ids) == len(set(tok.eos_ids))
    config_eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    assert set(config_eos) | generation_eos(path) | {tok.hf.eos_token_id} == set(tok.eos_ids)


def test_end_of_turn_is_read_from_the_chat_template(tmp_path):
    """A turn-end token with no known name, in neither config: found by rendering an assistant turn."""
    tok = Tokenizer.from_pretrained(llama3(tmp_path, turn_end="<|turn_done|>", generation_eos=None))
    # <|eot_id|> is in the vocabulary, a known name: kept as well
    assert set(tok.eos_ids) == ids_of(tok, "<|end_of_text|>", "<|turn_done|>", "<|eot_id|>")
    plain = Tokenizer.from_pretrained(llama3(tmp_path / "base", chat=False, generation_eos=None))
    # no template: eos, plus the known turn-end names that the vocab has (<|eot_id|>), nothing else
    assert set(plain.eos_ids) == ids_of(plain, "<|end_of_text|>", "<|eot_id|>")


def test_qwen_and_smollm2_stop_sets(tmp_path):
    q = Tokenizer.from_pretrained(qwen(tmp_path / "qwen"))
    assert q.eos_ids[0] == q.hf.eos_token_id and set(q.eos_ids) == ids_of(q, "<|im_end|>", "<|endoftext|>")
    assert generation_eos(tmp_path / "qwen") <= set(q.eos_ids)
    s = Tokenizer.from_pretrained(smol(tmp_path / "smol"))
    assert s.eos_ids == (2, 0)  # <|im_end|> (eos, config, generation config, turn end), then <|endoftext|>
    assert s.hf.bos_token == "<|im_start|>" and 1 not in s.eos_ids  # its BOS never stops a rollout


def test_stop_set_is_logged_with_its_text(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="sage_jax"):
        Tokenizer.from_pretrained(llama3(tmp_path))
    said = [r.getMessage() for r in caplog.records if "stop" in r.getMessage()]
    assert len(said) == 1 and "<|eot_id|>" in said[0] and "<|end_of_text|>" in said[0]


def test_model_config_stops_on_config_and_generation_config_eos(tmp_path):
    """build.load_or_init_params keeps config.json's eos list and reads generation_config.json, even when the
    tokenizer comes from another directory."""
    from sage_jax.models import build
    from sage_jax.run import config as config_lib
    from tests.helpers_hf import tiny_hf_model
    model_dir = tiny_hf_model(tmp_path / "model", arch="llama")  # config.json eos_token_id [2, 3]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = Tokenizer.from_pretrained(qwen(tmp_path / "tok"))
    config = config_lib.load("configs/tiny_test.py", [f"--config.model.path={model_dir}"])
    cfg, _ = build.load_or_init_params(config, None, None, tok)
    assert cfg.eos_token_ids[:len(tok.eos_ids)] == tok.eos_ids
    assert set(cfg.eos_token_ids) == set(tok.eos_ids) | {2, 3, 7}


# ---------------------------------------------------------------------------------------------------- prompts

@pytest.mark.parametrize("template", ["plain", "r1_think", "qwen_math_boxed", "auto"])
def test_prompts_without_a_chat_template_get_the_tokenizers_bos(tmp_path, template):
    """Fails before the fix: HF's own encode adds <|begin_of_text|>; the rendered prompt had none."""
    tok = Tokenizer.from_pretrained(llama3(tmp_path, chat=False))
    task = task_for(tok, template, "Be brief.", "Solve: {problem}")
    ids = task.encode_prompt(Example(PROBLEM, "2"))
    text = task.prompt_text(Example(PROBLEM, "2"))
    assert ids == list(tok.hf(text)["input_ids"])
    assert ids[0] == tok.hf.bos_token_id and ids.count(tok.hf.bos_token_id) == 1


def test_chat_prompts_match_transformers_apply_chat_template(tmp_path):
    for path in (llama3(tmp_path / "llama3"), qwen(tmp_path / "qwen"), smol(tmp_path / "smol")):
        tok = Tokenizer.from_pretrained(path)
        for system in ("", "Be brief."):
            task = task_for(tok, "auto", system, "Solve: {problem}")
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": f"Solve: {PROBLEM}"}]
            ids = task.encode_prompt(Example(PROBLEM, "2"))
            assert ids == hf_chat_ids(tok, messages), path.name
            if path.name == "llama3":
                assert ids[0] == tok.hf.bos_token_id and ids.count(tok.hf.bos_token_id) == 1  # the template's own


def test_no_bos_is_added_when_the_tokenizer_adds_none(tmp_path):
    for path in (qwen(tmp_path / "qwen"), smol(tmp_path / "smol")):
        tok = Tokenizer.from_pretrained(path)
        for template in ("plain", "r1_think", "qwen_math_boxed"):
            task = task_for(tok, template)
            text = task.prompt_text(Example(PROBLEM, "2"))
            assert task.encode_prompt(Example(PROBLEM, "2")) == list(tok.hf(text)["input_ids"]) == tok.encode(text)


def test_bos_is_never_doubled(tmp_path):
    """A SmolLM2-like tokenizer whose encode adds <|im_start|> as BOS: a prompt that already starts with it keeps it
    once (HF's own encode would prepend a second)."""
    tok = Tokenizer.from_pretrained(smol(tmp_path, add_bos=True))
    bos = tok.hf.bos_token_id
    boxed = task_for(tok, "qwen_math_boxed")
    text = boxed.prompt_text(Example(PROBLEM, "2"))
    assert list(tok.hf(text)["input_ids"])[:2] == [bos, bos]
    assert boxed.encode_prompt(Example(PROBLEM, "2")) == tok.encode(text)
    plain = task_for(tok, "plain")
    assert plain.encode_prompt(Example(PROBLEM, "2")) == list(tok.hf(PROBLEM)["input_ids"])


def test_auto_fallback_is_logged_once(tmp_path, caplog):
    tok = Tokenizer.from_pretrained(llama3(tmp_path, chat=False))
    with caplog.at_level(logging.INFO, logger="sage_jax"):
        for _ in range(3):
            templates.resolve("auto", tok, "Once only.", "Fallback: {problem}")
    said = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
    assert len(said) == 1, said


# ---------------------------------------------------------------------------------------------------- real SmolLM2

def test_real_smollm2_stop_set_and_prompts():
    from tests.helpers_smollm2 import smollm2_hf_dir
    path = smollm2_hf_dir()  # skips when the model cannot be had
    tok = Tokenizer.from_pretrained(path)
    assert generation_eos(path) <= set(tok.eos_ids) and tok.eos_ids == (2, 0)
    plain = task_for(tok, "plain")
    assert plain.encode_prompt(Example(PROBLEM, "2")) == list(tok.hf(PROBLEM)["input_ids"])
    chat = task_for(tok, "auto", "", "{problem}")
    assert chat.encode_prompt(Example(PROBLEM, "2")) == hf_chat_ids(tok, [{"role": "user", "content": PROBLEM}])
