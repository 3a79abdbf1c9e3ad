"""The HF export keeps the source model's own config.json fields; the run's extra stop ids go to
generation_config.json only."""

from __future__ import annotations

import json

from sage_jax.models import decoder as model
from sage_jax.run import checkpoint
from tests.helpers_hf import tiny_hf_model, tiny_tokenizer


def test_export_keeps_source_config_fields(tmp_path):
    from sage_jax.data.tokenizer import Tokenizer
    src = tiny_hf_model(tmp_path / "src", arch="llama", tied=True, vocab=320, unk_token_id=5)
    cfg_json = json.loads((src / "config.json").read_text())
    cfg_json["eos_token_id"] = 2  # one eos, as SmolLM2 has; the tokenizer's stop ids add another
    (src / "config.json").write_text(json.dumps(cfg_json))
    tiny_tokenizer(src)
    tok = Tokenizer.from_pretrained(src)
    cfg, params = model.load_hf(src)
    run_cfg = cfg.replace(eos_token_ids=(2,) + tuple(tok.eos_ids))  # what train_state does with the tokenizer
    assert len(set(run_cfg.eos_token_ids)) > 1
    out = checkpoint.export_hf(tmp_path / "run", run_cfg, params, tok)
    exported = json.loads((tmp_path / "run" / "hf_export" / "config.json").read_text())
    source = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in exported.items() if k not in ("dtype", "torch_dtype")} == \
        {k: v for k, v in source.items() if k not in ("dtype", "torch_dtype")}
    assert exported["eos_token_id"] == 2 and exported["unk_token_id"] == 5
    generation = json.loads((tmp_path / "run" / "hf_export" / "generation_config.json").read_text())
    source_stops = json.loads((src / "generation_config.json").read_text())["eos_token_id"]
    assert generation["eos_token_id"] == list(dict.fromkeys(source_stops + list(run_cfg.eos_token_ids)))
    cfg2, _ = model.load_hf(out)  # still loads, with every stop id (generation_config is not read by load_hf)
    assert cfg2.vocab_size == cfg.vocab_size


def test_export_without_a_source_describes_the_model_from_cfg(tmp_path):
    src = tiny_hf_model(tmp_path / "src", arch="qwen2", vocab=96)
    cfg, params = model.load_hf(src)
    checkpoint.export_hf(tmp_path / "run", cfg, params)  # no tokenizer, no source: config from cfg, as before
    exported = json.loads((tmp_path / "run" / "hf_export" / "config.json").read_text())
    assert exported["eos_token_id"] == [2, 3] and "unk_token_id" not in exported
