import numpy as np
import pytest

from sage_jax.data import tokenizer as tok_lib
from sage_jax.data.tokenizer import Tokenizer, bucket_length, pad_left
from tests.helpers_hf import tiny_tokenizer

BOXED = ("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
         "<|im_start|>user\nWhat is $\\frac{1}{2}$?<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_pretrained(tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def test_special_ids(tok):
    vocab = tok.hf.get_vocab()
    assert set(tok.eos_ids) == {vocab["<|im_end|>"], vocab["<|endoftext|>"]}
    assert tok.eos_ids[0] == tok.hf.eos_token_id and tok.pad_id == vocab["<|endoftext|>"]


def test_encode_decode_round_trip(tok):
    ids = tok.encode(BOXED)
    assert ids[0] == tok.hf.get_vocab()["<|im_start|>"]  # specials are single tokens; no BOS is added
    assert tok.decode(ids, skip_special_tokens=False) == BOXED
    assert "<|im_start|>" not in tok.decode(ids)
    assert tok.encode_prompts(["hello", "What is 1 + 1?"]) == [tok.encode("hello"), tok.encode("What is 1 + 1?")]


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_boxed_template(tok):
    assert tok.boxed_prompt("What is $\\frac{1}{2}$?") == BOXED
    assert tok_lib.QWEN_MATH_BOXED.replace("{problem}", "What is $\\frac{1}{2}$?") == BOXED


def test_bucket_length():
    assert [bucket_length(n) for n in (1, 32, 33, 4096)] == [32, 32, 64, 4096]
    assert bucket_length(5, (16, 8)) == 8
    with pytest.raises(ValueError, match="4097"):
        bucket_length(4097)


def test_pad_left_buckets():
    tokens, mask = pad_left([[5, 6, 7], [8]], bucket_sizes=(2, 4, 8), pad_id=0)
    np.testing.assert_array_equal(tokens, [[0, 5, 6, 7], [0, 0, 0, 8]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])
    assert tokens.dtype == np.int32 and mask.dtype == np.int32
    tokens, _ = pad_left([list(range(40))], pad_id=9)
    assert tokens.shape == (1, 64) and (tokens[0, :24] == 9).all()


def test_pad_left_too_long_and_truncate(tok):
    with pytest.raises(ValueError, match="10 tokens.*truncate=True"):
        pad_left([list(range(10))], bucket_sizes=(4, 8))
    tokens, mask = pad_left([list(range(10)), [1]], bucket_sizes=(4, 8), truncate=True)
    np.testing.assert_array_equal(tokens[0], range(2, 10))  # rightmost tokens kept
    assert mask[1].sum() == 1
    tokens, _ = tok.pad_left([[3]], bucket_sizes=(2,))
    np.testing.assert_array_equal(tokens, [[tok.pad_id, 3]])


def test_missing_tokenizer_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def _math_task(tmp_path, tok_dir, **overrides):
    import json
    from sage_jax.data import tasks
    from sage_jax.run import config as config_lib
    data = tmp_path / "set"
    data.mkdir(exist_ok=True)
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text(json.dumps({"problem": "What is {1} + 1?", "answer": "2"}) + "\n")
    flags = {"model.path": str(tok_dir), "data.task": "math", "data.train": str(data), "data.eval": str(data),
             **overrides}
    return tasks.build(config_lib.load("configs/base.py", [f"--config.{k}={v}" for k, v in flags.items()]))


def test_training_prompts_use_the_models_chat_template(tmp_path, tok):
    """The default data.template ('auto') renders training prompts with the tokenizer's own chat template around
    the config's instruction; rollouts encode exactly task.encode_prompt."""
    from sage_jax.data import templates
    tok_dir = tiny_tokenizer(tmp_path / "tok")
    task = _math_task(tmp_path, tok_dir)
    ex = task.train[0]
    user = templates.MATH_INSTRUCTION.replace("{problem}", ex.problem)
    assert task.prompt_text(ex) == tok.apply_chat_template([{"role": "user", "content": user}])
    assert task.encode_prompt(ex) == tok.encode(tok.apply_chat_template([{"role": "user", "content": user}]))
    with_system = _math_task(tmp_path, tok_dir,
                             **{"data.system_prompt": "Be brief.", "data.instruction": "Q: {problem}"})
    assert with_system.prompt_text(ex) == tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: What is {1} + 1?"}])
    # a named template is used as is (the paper configs state qwen_math_boxed)
    boxed = _math_task(tmp_path, tok_dir, **{"data.template": "qwen_math_boxed"})
    assert boxed.prompt_text(ex) == tok_lib.QWEN_MATH_BOXED.replace("{problem}", ex.problem)


def test_auto_template_without_a_chat_template_and_errors(tok):
    from sage_jax.data import templates

    class NoChat:
        hf = type("HF", (), {"chat_template": None})()
    name = templates.resolve("auto", NoChat(), "Sys.", "Solve: {problem}")
    assert templates.render(name, "1+1") == "Sys.\n\nSolve: 1+1"
    with pytest.raises(ValueError, match="no chat template"):
        templates.resolve("chat", NoChat())
    with pytest.raises(ValueError, match="placeholder"):
        templates.resolve("chat", tok, "", "no slot")
    with pytest.raises(ValueError, match="resolve it first"):
        templates.render("chat", "x")
    assert templates.resolve("qwen_math_boxed", tok) == "qwen_math_boxed"
    with pytest.raises(ValueError, match="unknown prompt template"):
        templates.resolve("nope", tok)


def test_paper_configs_keep_their_templates():
    from sage_jax.run import config as config_lib
    for name, want in [("qwen7b_branch", "qwen_math_boxed"), ("qwen7b_grpo", "qwen_math_boxed"),
                       ("r1distill7b_branch", "r1_think"), ("base", "auto")]:
        assert config_lib.load(f"configs/{name}.py").data.template == want, name
