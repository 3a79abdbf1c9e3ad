"""SFT data: what a demonstration row may hold, and rows the length limit leaves nothing to train on."""

import json
import logging

import pytest

from sage_jax.data import tasks
from sage_jax.run import config as config_lib
from sage_jax.training import supervised


def _config(**overrides):
    return config_lib.load("configs/tiny_test.py", [f"--config.{k}={v}" for k, v in overrides.items()])


def test_a_demonstration_with_no_completion_token_left_is_left_out_and_counted(caplog):
    """The limit is data.max_prompt_len + rollout.max_new_tokens (32 + 16): a prompt of 48+ tokens leaves no
    completion token (it trained on nothing, with a loss of 0); one that leaves some is cut and counted."""
    task = tasks.build(_config())
    pairs = [("1 1>2:", "1+1=2"), ("1 " * 30 + ">2:", "1+1=2"), ("2 2>4:", "2+2=4" * 10)]
    data = supervised.tokenize(task, pairs, max_len=48)
    assert (data.left_out, data.cut, data.max_len) == (1, 1, 48)
    assert data.tokens.shape == (2, 48) and data.loss_mask.shape == (2, 48)
    assert data.loss_mask.sum(axis=1).min() > 0  # every row trained on has a completion token
    caplog.set_level(logging.WARNING, logger="sage_jax")
    supervised._warn_left_out(data, "demos.jsonl")
    assert "1 of 3 SFT demonstrations in demos.jsonl have a prompt of 48 tokens or more" in caplog.text
    assert "1 of 3 SFT demonstrations in demos.jsonl are cut at 48 tokens" in caplog.text
    with pytest.raises(ValueError, match=r"demos.jsonl: every one of its 1 demonstrations has a prompt of at least "
                                         r"48 tokens \(the longest 64\)"):
        supervised.tokenize(task, pairs[1:2], max_len=48, source="demos.jsonl")


@pytest.mark.parametrize("rows,message", [
    ([], "demos.jsonl: no demonstrations in it"),
    ([{"prompt": "1 1>2:", "completion": None}], "demos.jsonl:1: field 'completion' is null"),
    ([{"prompt": "1 1>2:", "completion": "1+1=2"}, {"prompt": 7, "completion": "x"}],
     "demos.jsonl:2: field 'prompt' should be text, got int"),
    ([{"prompt": "1 1>2:", "completion": ["1+1=2"]}], "demos.jsonl:1: field 'completion' should be text, got list"),
    ([{"prompt": "1 1>2:"}], "demos.jsonl:1: row has no field 'completion'"),
], ids=["empty", "null completion", "numeric prompt", "list completion", "no completion"])
def test_bad_demonstration_rows_name_file_and_line(tmp_path, rows, message):
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config(**{"sft.data": str(path)})
    with pytest.raises(ValueError, match=message):
        supervised.prepare(config, tasks.build(config))
