"""A model from a run config: its ModelConfig (config.model: a preset or an HF config, plus size overrides) and its
params (loaded from an HF directory, or a seeded init born sharded), and the named checkpoints that can be planned
without their files. Used by training, evaluation, the benchmarks and the planner alike."""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from sage_jax.models import decoder as model_lib
from sage_jax.models import hf_io

log = logging.getLogger("sage_jax")

# HF checkpoint directory names -> (model preset, overrides), to plan without the checkpoint on this machine.
KNOWN_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": ("qwen2.5-0.5b", {}),
    "qwen2.5-1.5b": ("qwen2.5-1.5b", {}),
    "qwen2.5-3b": ("qwen2.5-3b", {}),
    "qwen2.5-7b": ("qwen2.5-7b", {}),
    "qwen2.5-math-1.5b": ("qwen2.5-1.5b", dict(rope_theta=1e4, max_position_embeddings=4096)),
    "qwen2.5-math-7b": ("qwen2.5-math-7b", dict(max_position_embeddings=4096)),
    "qwen3-4b-base": ("qwen3-4b", dict(max_position_embeddings=32768)),
    "deepseek-r1-distill-qwen-1.5b": ("qwen2.5-1.5b", dict(tie_embeddings=False, rope_theta=1e4,
                                                           max_position_embeddings=131072)),
    "deepseek-r1-distill-qwen-7b": ("qwen2.5-7b", dict(rope_theta=1e4, max_position_embeddings=131072)),
}


def model_config(config, vocab_size: int | None = None, base: model_lib.ModelConfig | None = None
                 ) -> model_lib.ModelConfig:
    """ModelConfig from config.model: a loaded HF config (base) or a preset, plus non-zero size overrides."""
    m = config.model
    if base is None:
        base = model_lib.preset(m.preset or "tiny")
        sizes = {k: m[k] for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                   "intermediate_size") if m[k]}
        if vocab_size and not m.vocab_size:
            sizes["vocab_size"] = vocab_size
        if "hidden_size" in sizes or "num_heads" in sizes:
            sizes["head_dim"] = sizes.get("hidden_size", base.hidden_size) // sizes.get("num_heads", base.num_heads)
        base = base.replace(**sizes)
    return base.replace(param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat,
                        scan_layers=m.scan_layers, logits_chunk=m.logits_chunk, attention=m.attention)


def load_or_init_params(config, mesh, rules, tokenizer=None, path: str | None = None):
    """(cfg, params) placed on the mesh: from an HF directory, or a seeded random init born sharded."""
    path = config.model.path if path is None else path
    if path:
        _check_path(path)
        base, params = model_lib.load_hf(path, dtype=jnp.dtype(config.model.param_dtype), mesh=mesh, rules=rules)
        cfg = model_config(config, base=base)
    else:
        cfg = model_config(config, vocab_size=getattr(tokenizer, "vocab_size", None))
        shardings = model_lib.param_shardings(cfg, mesh, rules)
        init = jax.jit(functools.partial(model_lib.init_params, cfg), out_shardings=shardings)
        params = init(jax.random.key(config.seed))
    if tokenizer is not None:
        cfg = cfg.replace(eos_token_ids=_stop_ids(tokenizer, path), pad_token_id=int(tokenizer.pad_id),
                          bos_token_id=getattr(tokenizer, "bos_id", cfg.bos_token_id))
    return cfg, params


def _check_path(path: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} does not exist: set --config.model.path to a local Hugging "
                                "Face directory (config.json + *.safetensors)")


def config_without_weights(config, tokenizer=None) -> model_lib.ModelConfig:
    """The ModelConfig load_or_init_params makes (but the tokenizer's special ids), read without the weights: to
    check a workdir's checkpoints before the model loads."""
    path = config.model.path
    if not path:
        return model_config(config, vocab_size=getattr(tokenizer, "vocab_size", None))
    _check_path(path)
    return model_config(config, base=hf_io.config_from_hf(hf_io._read_config(Path(path))))


def _stop_ids(tokenizer, path: str) -> tuple[int, ...]:
    """The tokenizer's stop ids, then the model directory's config.json / generation_config.json eos ids (the
    tokenizer may come from another directory, data.tokenizer_path), logged where the model adds any."""
    from sage_jax.models.hf_config import model_stop_ids
    ids = tuple(int(i) for i in tokenizer.eos_ids)
    extra = tuple(i for i in (model_stop_ids(path) if path else ()) if i not in ids)
    if extra:
        describe = getattr(tokenizer, "describe", lambda ids: ", ".join(map(str, ids)))
        log.info("stop tokens from %s's config.json / generation_config.json beyond the tokenizer's: %s", path,
                 describe(extra))
    return ids + extra


def resolve_model(config):
    """(ModelConfig, where it came from): a local config.json, a known checkpoint name, or config.model.preset."""
    path = config.model.path
    if not path:
        vocab = None
        if config.data.task == "countdown":
            from sage_jax.rewards.countdown import CountdownTokenizer
            vocab = CountdownTokenizer().vocab_size
        return model_config(config, vocab_size=vocab), f"preset {config.model.preset or 'tiny'!r}"
    config_json = os.path.join(path, "config.json")
    if os.path.isfile(config_json):
        with open(config_json) as f:
            return model_config(config, base=hf_io.config_from_hf(json.load(f))), config_json
    name = os.path.basename(os.path.normpath(path)).lower()
    if name not in KNOWN_MODELS:
        raise FileNotFoundError(
            f"model path {path!r} has no config.json on this machine and {name!r} is not a known checkpoint name "
            f"({', '.join(sorted(KNOWN_MODELS))}); copy its config.json there, or plan a preset with "
            "--config.model.path= --config.model.preset=NAME")
    preset, overrides = KNOWN_MODELS[name]
    return (model_config(config, base=model_lib.preset(preset, **overrides)),
            f"preset {preset!r} (by name: {path} is not on this machine)")
