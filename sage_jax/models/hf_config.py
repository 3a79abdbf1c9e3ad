"""Hugging Face config.json (Qwen2 / Qwen3 / Llama, transformers 4 and 5 layouts) <-> ModelConfig."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sage_jax.models.config import ModelConfig

SUPPORTED = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
# rope_type -> (required keys, optional keys) of its rope_parameters, besides rope_type and rope_theta
_ROPE_KEYS = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor"), ("original_max_position_embeddings",)),
    "yarn": (("factor",), ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                           "mscale", "mscale_all_dim", "truncate")),
}


def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED:
            return SUPPORTED[arch]
    if not archs and hf.get("model_type") in _MODEL_TYPES:
        return hf["model_type"]
    found = archs or hf.get("model_type")
    raise ValueError(f"unsupported architecture {found!r}; supported: {sorted(SUPPORTED)} "
                     f"(model_type {sorted(_MODEL_TYPES)})")


def _rope(hf: dict) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """(rope_theta, ModelConfig.rope_scaling) from rope_parameters (transformers 5) or rope_scaling (4.x)."""
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    entry = dict(hf.get(field) or {})
    theta = float(entry.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = entry.pop("rope_type", entry.pop("type", None)) or "default"
    if kind not in _ROPE_KEYS:
        raise ValueError(f"config.json {field}.rope_type={kind!r} is not supported; implemented: "
                         f"{sorted(_ROPE_KEYS)}")
    if entry.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config.json {field}.partial_rotary_factor is not supported; only full-width RoPE is")
    required, optional = _ROPE_KEYS[kind]
    missing = [k for k in required if entry.get(k) is None]
    unknown = sorted(set(entry) - set(required) - set(optional))
    if missing or unknown:
        raise ValueError(f"config.json {field} (rope_type {kind!r}): " + (f"lacks {missing}; " if missing else "")
                         + (f"field(s) {unknown} not supported; " if unknown else "")
                         + f"expected {list(required)} and optionally {list(optional)}")
    if kind == "default":
        return theta, ()
    if kind in ("llama3", "yarn"):  # transformers fills this in from max_position_embeddings when absent
        entry.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 32768))
    return theta, tuple(sorted({"rope_type": kind, **{k: v for k, v in entry.items() if v is not None}}.items()))


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from a parsed HF config.json (transformers 4 or 5 layout)."""
    arch = _architecture(hf)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks required field(s) {missing}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf['hidden_act']!r} is not supported; only 'silu' is")
    if hf.get("mlp_bias", False):
        raise ValueError("config.json mlp_bias=true is not supported; only bias-free MLPs are")
    if hf.get("use_sliding_window", False):
        raise ValueError("config.json use_sliding_window=true is not supported; only full attention is")
    heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    pad = hf.get("pad_token_id")
    if arch != "qwen2" and hf.get("attention_bias", False):
        raise ValueError(f"config.json attention_bias=true is not supported for {arch}: it also adds an o_proj bias, "
                         "which this model does not have (Qwen2-style q/k/v-only biases are supported)")
    if any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise ValueError("config.json layer_types other than 'full_attention' are not supported; only full "
                         "attention is")
    theta, rope_scaling = _rope(hf)
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        intermediate_size=int(hf["intermediate_size"]),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        architecture=arch,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=int(pad if pad is not None else (eos_ids[0] if eos_ids else 0)),
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    """A config.json dict that transformers (4.x and 5.x) loads as Qwen2/Qwen3/LlamaForCausalLM."""
    if cfg.qkv_bias != (cfg.architecture == "qwen2") or cfg.qk_norm != (cfg.architecture == "qwen3"):
        raise ValueError(f"qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm} with architecture={cfg.architecture!r} "
                         f"has no HF equivalent: Qwen2 has q/k/v biases, Qwen3 q/k norms, Llama neither; set "
                         f"architecture to match")
    eos = list(cfg.eos_token_ids)
    scaling = dict(cfg.rope_scaling)
    hf = {
        "architectures": [_MODEL_TYPES[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", **scaling, "rope_theta": cfg.rope_theta},
        "rope_scaling": scaling or None,  # what transformers 4.x reads
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": cfg.pad_token_id,
        "dtype": cfg.param_dtype,
        "torch_dtype": cfg.param_dtype,
        "use_cache": True,
        "attention_dropout": 0.0,
    }
    if cfg.architecture == "llama":
        hf |= {"attention_bias": False, "mlp_bias": False}
    elif cfg.architecture == "qwen3":
        hf |= {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
               "max_window_layers": cfg.num_layers, "layer_types": ["full_attention"] * cfg.num_layers}
    else:
        hf |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers}
    return hf


_SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def export_configs(cfg: ModelConfig, source: dict | None = None, source_generation: dict | None = None
                   ) -> tuple[dict, dict]:
    """(config.json, generation_config.json) of an export. With the source model's config.json (same shape), its
    fields stay as they were (eos_token_id, unk_token_id, ...) and only the weights' dtype is updated; the run's
    stop ids beyond the model's own eos go to generation_config.json only, which is what generate() reads."""
    ours = config_to_hf(cfg)
    if not (source and all(source.get(k) == ours[k] for k in _SHAPE_KEYS)):
        source = source_generation = None  # another model's files: describe this one from cfg alone
    if source:
        config = dict(source)
        config.pop("quantization_config", None)  # the export is plain safetensors
        config["dtype"] = ours["dtype"]
        if "torch_dtype" in source:
            config["torch_dtype"] = ours["torch_dtype"]
    else:
        config = ours
    generation = dict(source_generation or {})
    as_list = lambda v: [] if v is None else [int(x) for x in (v if isinstance(v, list) else [v])]
    stops = list(dict.fromkeys(as_list(generation.get("eos_token_id", config.get("eos_token_id")))
                               + list(cfg.eos_token_ids)))
    generation["eos_token_id"] = stops[0] if len(stops) == 1 else (stops or None)
    for key in ("bos_token_id", "pad_token_id"):
        if generation.get(key) is None:
            generation[key] = config.get(key)
    return config, generation


def eos_list(value: Any) -> list[int]:
    """An eos_token_id field (absent, one id or a list) as a list of ids."""
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def model_stop_ids(model_dir: str | os.PathLike) -> tuple[int, ...]:
    """The eos ids of a model directory's config.json, then its generation_config.json (a missing file adds none)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        f = Path(model_dir).expanduser() / name
        if f.is_file():
            try:
                ids += eos_list(json.loads(f.read_text()).get("eos_token_id"))
            except ValueError as e:
                raise ValueError(f"{f} is not valid JSON with an integer eos_token_id: {e}") from None
    return tuple(dict.fromkeys(ids))
