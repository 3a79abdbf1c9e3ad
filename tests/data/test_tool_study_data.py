"""The tool study's data (configs/tools_arms.py): the character tokenizer with whole ``` fences, the generated
two-digit products, and the SFT tool traces, whose ids are exactly what the tool loop makes of the same call."""

import numpy as np
import pytest

from sage_jax.data import char_tokenizer, tasks, word_problems
from sage_jax.data.tokenizer import Tokenizer
from sage_jax.run import config as config_lib
from sage_jax.training import supervised

TRACE = "```python\nprint(37*48)\n```\n```output\n1776\n```\n1776"


def test_the_character_tokenizer_keeps_fences_whole_and_round_trips(tmp_path):
    hf = char_tokenizer.build()
    ids = hf.encode(TRACE, add_special_tokens=False)
    pieces = [hf.decode([i]) for i in ids]
    assert pieces[0] == "```python\n" and pieces.count("```") == 3 and "```output" not in pieces
    assert all(len(p) == 1 for p in pieces if not p.startswith("```"))
    assert hf.decode(ids) == TRACE
    text = "Any printable ASCII: ~!@#$%^&*()_+{}|:\"<>? and\ttabs"
    assert hf.decode(hf.encode(text, add_special_tokens=False)) == text.replace("\t", "<unk>")
    tok = Tokenizer(hf)
    assert tok.with_bos(tok.encode("12")) == [hf.bos_token_id] + tok.encode("12") and tok.eos_ids == (
        hf.eos_token_id,)
    hf.save_pretrained(tmp_path)  # a checkpoint's export: reloaded like any HF tokenizer
    again = Tokenizer.from_pretrained(tmp_path)
    assert again.encode(TRACE) == list(ids) and again.eos_ids == tok.eos_ids and len(again.hf) == len(hf)


def test_chars_names_the_tokenizer_for_training_and_for_evaluating_a_workdir(tmp_path):
    """tokenizer_path=chars: Tokenizer.from_pretrained builds it, and `evaluate --model WORKDIR` of such a run finds
    it through the run's config as it finds a tokenizer directory."""
    from sage_jax.eval.source import ModelSource, load_tokenizer
    tok = Tokenizer.from_pretrained("chars")
    assert tok.encode(TRACE) == char_tokenizer.build().encode(TRACE, add_special_tokens=False)
    source = ModelSource("checkpoint", tmp_path, 2, _config(), tmp_path)
    assert load_tokenizer(source, "math").encode(TRACE) == tok.encode(TRACE)


def test_the_markdown_format_pauses_only_on_the_closing_fence():
    from sage_jax.eval.tool_loop import format_for
    from sage_jax.tools.python_tool import PythonTool
    hf = char_tokenizer.build()
    fmt = format_for(hf, "markdown", {"python": PythonTool(timeout_s=1.0)})
    assert [hf.decode([i]) for i in fmt.end_ids] == ["```"]


def test_the_sft_trace_is_what_the_tool_loop_makes_of_the_same_call():
    """A scripted model writes the trace's call and answer; the loop runs the block in the sandbox and observes its
    output: the row's ids are the SFT demonstration's, and its sampled ids the model's own."""
    from sage_jax.eval import tool_loop
    from sage_jax.tools import sandbox
    from sage_jax.tools.base import ToolPool
    from sage_jax.tools.python_tool import PythonTool
    from tests.training.test_tool_rollouts import _scripted
    if sandbox.available_isolation() is None:
        pytest.skip("namespaces need root with unshare/mount/prlimit/setpriv")
    hf = char_tokenizer.build()
    ex = word_problems.products(1, 0)[0]
    call, answer = f"```python\nprint({ex.meta['expression']})\n```", ex.answer
    tools = {"python": PythonTool(timeout_s=5.0)}
    fmt = tool_loop.format_for(hf, "markdown", tools)
    with ToolPool(tools) as pool:
        ro = tool_loop.generate_with_tools(_scripted(hf, call + answer, "<eos>"), [[2]], 1, fmt, pool,
                                           tool_loop.ToolSettings(), 64, 0)
    L = ro["lengths"][0]
    ids, mask = list(ro["tokens"][0, :L]), ro["sampled_mask"][0, :L]
    assert ids == hf.encode(word_problems.tool_demonstration(ex, True), add_special_tokens=False) + [hf.eos_token_id]
    assert hf.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == call + answer + "<eos>"
    assert np.isnan(ro["sampler_logp"][0, :L][mask == 0]).all() and (mask == 0).sum() > 0


def _config(*overrides):
    return config_lib.load("configs/tools_arms.py:tool,tiny", list(overrides))


def test_products_are_distinct_right_and_held_out_apart():
    train = word_problems.products(300, 0)
    again = word_problems.products(300, 0)
    assert [e.problem for e in train] == [e.problem for e in again] and len({e.problem for e in train}) == 300
    for e in train:
        a, b = map(int, e.meta["expression"].split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and e.answer == str(a * b) and e.problem == f"{a}*{b}="
    task = tasks.build(_config())
    assert task.tokenizer.hf is not None and task.template == "plain"
    assert not {e.problem for e in task.train} & {e.problem for e in task.evals["products"]}
    with pytest.raises(ValueError, match="only 81 products"):
        word_problems.products(100, 0, low=1, high=9)


def test_sft_tool_traces_call_the_tool_in_their_share():
    config = _config("--config.data.num_train=400", "--config.sft.tool_share=0.3")
    task = tasks.build(config)
    pairs = supervised.demonstrations(config, task)
    calls = [c for _, c in pairs if c.startswith("```python\n")]
    assert len(pairs) == 400 and 0.22 < len(calls) / 400 < 0.38
    for (prompt, completion), ex in zip(pairs, task.train):
        assert prompt == ex.problem and completion.endswith(ex.answer)
    assert supervised.demonstrations(config, task) == pairs  # seeded
    with pytest.raises(ValueError, match="a share in"):
        supervised.demonstrations(_config("--config.sft.tool_share=1.5"), task)
    words = _config("--config.data.train=arith_words", "--config.data.eval=")
    with pytest.raises(ValueError, match="data.train=products"):
        supervised.demonstrations(words, tasks.build(words))


def test_the_tool_arms_differ_in_rollout_tools_alone():
    def flat(arm):
        c = config_lib.load(f"configs/tools_arms.py:{arm}").to_dict()
        assert c["experiment"].pop("arm") == arm
        return c
    tool, no_tool, base = flat("tool"), flat("no_tool"), flat("base_tool")
    assert tool["rollout"]["tools"] == ("python",) and no_tool["rollout"]["tools"] == ()
    assert {**tool, "rollout": None} == {**no_tool, "rollout": None}
    assert {k: v for k, v in tool["rollout"].items() if k != "tools"} == {
        k: v for k, v in no_tool["rollout"].items() if k != "tools"}
    assert base["experiment"]["rl"] is False and {**base, "experiment": None} == {**tool, "experiment": None}
