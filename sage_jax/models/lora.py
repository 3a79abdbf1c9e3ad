"""LoRA adapters on the decoder's linear layers, with PEFT's conventions, and PEFT / merged HF export.

An adapter on weight W [in, out] adds x A B * alpha / rank with A [in, r] drawn like PEFT's lora_A (uniform in
+-1/sqrt(in)) and B [r, out] = 0, so a fresh adapter leaves the model unchanged. Adapters are stacked over layers like
the weights they adapt ({"wq": {"a": [L, D, r], "b": [L, r, H, hd]}, ...}) and kept in fp32.

The model consumes `apply(base, adapters)`: the base params with the adapters under params["layers"]["lora"], which
model._project turns into two thin matmuls beside the frozen one; no merged copy of the weights is made. The
reference policy is the base itself (adapters off), so a LoRA run holds one copy of the weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from sage_jax.models import hf_io, sharding
from sage_jax.models.config import ModelConfig, Params

# our weight name -> the HF / PEFT module name it adapts
MODULES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
           "w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_HF_PREFIX = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_DROPOUT_STREAM = 0x4C6F5241  # "LoRA": folded into the step's key for the dropout masks


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(MODULES.values())  # HF module names, as PEFT's target_modules
    init_from: str = ""  # a PEFT adapter directory to start from instead of B = 0

    def __post_init__(self):
        unknown = sorted(set(self.targets) - set(MODULES.values()))
        if unknown or not self.targets:
            raise ValueError(f"model.lora.targets {list(self.targets)}: unknown {unknown}; choose from "
                             f"{list(MODULES.values())}")
        if self.rank < 1 or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora: rank={self.rank} must be >= 1 and dropout={self.dropout} in [0, 1)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def weights(self) -> tuple[str, ...]:
        """Our names of the adapted weights, in model order."""
        return tuple(w for w, m in MODULES.items() if m in self.targets)

    @classmethod
    def from_config(cls, c) -> "LoraConfig | None":
        """From config.model.lora; None when rank is 0 (full fine-tuning)."""
        if not c.rank:
            return None
        return cls(rank=int(c.rank), alpha=float(c.alpha), dropout=float(c.dropout), targets=tuple(c.targets),
                   init_from=c.init_from)


def _in_out(cfg: ModelConfig, weight: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple, tuple]:
    """(in shape, out shape, in logical axes, out logical axes) of one layer's weight."""
    D, H, KV, hd, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return {
        "wq": ((D,), (H, hd), ("embed",), ("heads", "head_dim")),
        "wk": ((D,), (KV, hd), ("embed",), ("kv_heads", "head_dim")),
        "wv": ((D,), (KV, hd), ("embed",), ("kv_heads", "head_dim")),
        "wo": ((H, hd), (D,), ("heads", "head_dim"), ("embed",)),
        "w_gate": ((D,), (F,), ("embed",), ("mlp",)),
        "w_up": ((D,), (F,), ("embed",), ("mlp",)),
        "w_down": ((F,), (D,), ("mlp",), ("embed",)),
    }[weight]


def adapter_shapes(cfg: ModelConfig, lcfg: LoraConfig) -> Params:
    L, r = cfg.num_layers, lcfg.rank
    return {w: {"a": (L, *i, r), "b": (L, r, *o)} for w in lcfg.weights for i, o, _, _ in [_in_out(cfg, w)]}


def adapter_axes(cfg: ModelConfig, lcfg: LoraConfig) -> Params:
    """Logical axes; the rank axis has no rule, so it is never split."""
    return {w: {"a": ("layers", *ia, "lora_rank"), "b": ("layers", "lora_rank", *oa)}
            for w in lcfg.weights for _, _, ia, oa in [_in_out(cfg, w)]}


def num_params(cfg: ModelConfig, lcfg: LoraConfig) -> int:
    leaves = jax.tree.leaves(adapter_shapes(cfg, lcfg), is_leaf=lambda x: isinstance(x, tuple))
    return sum(math.prod(s) for s in leaves)


def random_adapters(cfg: ModelConfig, lcfg: LoraConfig, key: jax.Array) -> Params:
    """A uniform in +-1/sqrt(fan_in) (PEFT's kaiming_uniform(a=sqrt(5)) on lora_A), B = 0."""
    out = {}
    for w, k in zip(lcfg.weights, jax.random.split(key, len(lcfg.weights))):
        shapes = adapter_shapes(cfg, lcfg)[w]
        bound = 1.0 / math.sqrt(math.prod(_in_out(cfg, w)[0]))
        out[w] = {"a": jax.random.uniform(k, shapes["a"], jnp.float32, -bound, bound),
                  "b": jnp.zeros(shapes["b"], jnp.float32)}
    return out


def shardings(cfg: ModelConfig, lcfg: LoraConfig, mesh, rules=None) -> Params:
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), adapter_shapes(cfg, lcfg),
                            is_leaf=lambda x: isinstance(x, tuple))
    return sharding.tree_shardings(abstract, adapter_axes(cfg, lcfg), mesh, rules)


def init_adapters(cfg: ModelConfig, lcfg: LoraConfig, key: jax.Array, mesh=None, rules=None) -> Params:
    """Adapters born on their shardings (when a mesh is given): random (B = 0), or read from lcfg.init_from."""
    if lcfg.init_from:
        loaded_cfg, adapters = load_peft(lcfg.init_from, cfg)
        if (loaded_cfg.rank, loaded_cfg.alpha, loaded_cfg.weights) != (lcfg.rank, lcfg.alpha, lcfg.weights):
            raise ValueError(f"{lcfg.init_from}: adapter has rank {loaded_cfg.rank}, alpha {loaded_cfg.alpha} on "
                             f"{list(loaded_cfg.targets)}, but model.lora asks for rank {lcfg.rank}, alpha "
                             f"{lcfg.alpha} on {list(lcfg.targets)}; set model.lora to match the adapter")
        return adapters if mesh is None else jax.device_put(adapters, shardings(cfg, lcfg, mesh, rules))
    init = lambda k: random_adapters(cfg, lcfg, k)
    if mesh is None:
        return jax.jit(init)(key)
    return jax.jit(init, out_shardings=shardings(cfg, lcfg, mesh, rules))(key)


# --------------------------------------------------------------------------------------------------- using them

def apply(base: Params, adapters: Params, lcfg: LoraConfig, key: jax.Array | None = None) -> Params:
    """The params view the model runs with the adapters on (see model._project). With a key and dropout > 0, each
    adapter's input is dropped out, with its own mask per layer and module (PEFT's lora_dropout)."""
    lora = {}
    for i, (w, ad) in enumerate(adapters.items()):
        lora[w] = {"a": ad["a"], "b": ad["b"] * lcfg.scale}
        if key is not None and lcfg.dropout > 0:
            L = ad["a"].shape[0]
            own = jax.random.fold_in(jax.random.fold_in(key, _DROPOUT_STREAM), i)  # apart from the caller's draws
            lora[w] |= {"key": jax.random.split(own, L),
                        "keep": jnp.full((L,), 1.0 - lcfg.dropout, jnp.float32)}
    return {**base, "layers": {**base["layers"], "lora": lora}}


def policy(base: Params, trained: Params, lcfg: LoraConfig | None) -> Params:
    """The params the policy is run with: `trained` itself in full fine-tuning, else base with the adapters on."""
    return trained if lcfg is None else apply(base, trained, lcfg)


def delta(cfg: ModelConfig, lcfg: LoraConfig, adapters: Params, weight: str) -> jax.Array:
    """scale * A B for one weight, stacked over layers, in the weight's own layout [L, in..., out...]."""
    ad = adapters[weight]
    L, r = cfg.num_layers, lcfg.rank
    i, o, _, _ = _in_out(cfg, weight)
    ab = jnp.einsum("lir,lro->lio", ad["a"].reshape(L, -1, r), ad["b"].reshape(L, r, -1))
    return (lcfg.scale * ab).reshape(L, *i, *o)


def merge(cfg: ModelConfig, lcfg: LoraConfig, base: Params, adapters: Params) -> Params:
    """Base params with W + scale * A B folded in (the base's dtype): a plain model, e.g. for save_hf."""
    layers = dict(base["layers"])
    for w in adapters:
        layers[w] = (layers[w].astype(jnp.float32) + delta(cfg, lcfg, adapters, w)).astype(layers[w].dtype)
    return {**base, "layers": layers}


# --------------------------------------------------------------------------------------------------- PEFT files

def _peft_name(layer: int, module: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_HF_PREFIX[module]}.{module}.lora_{which}.weight"


def save_peft(out_dir: str | os.PathLike, cfg: ModelConfig, lcfg: LoraConfig, adapters: Params,
              base_model: str = "") -> Path:
    """adapter_config.json + adapter_model.safetensors that peft.PeftModel.from_pretrained loads onto the HF model.

    PEFT stores lora_A as [r, in] and lora_B as [out, r] per layer, unscaled. Every process must call this."""
    out = Path(out_dir)
    host = jax.tree.map(lambda x: np.asarray(sharding.to_host(x), np.float32), adapters)
    tensors = {}
    for w, ad in host.items():
        module = MODULES[w]
        for layer in range(cfg.num_layers):
            tensors[_peft_name(layer, module, "A")] = np.ascontiguousarray(ad["a"][layer].reshape(-1, lcfg.rank).T)
            tensors[_peft_name(layer, module, "B")] = np.ascontiguousarray(ad["b"][layer].reshape(lcfg.rank, -1).T)
    if jax.process_index() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lcfg.rank, "lora_alpha": lcfg.alpha,
              "lora_dropout": lcfg.dropout, "target_modules": sorted(lcfg.targets), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
              "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
              "base_model_name_or_path": base_model or None}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return out


def _read_adapter_config(path: Path) -> LoraConfig:
    file = path / ADAPTER_CONFIG
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: a PEFT adapter directory holds {ADAPTER_CONFIG} and "
                                f"{ADAPTER_WEIGHTS}")
    c = json.loads(file.read_text())
    unsupported = {"peft_type": c.get("peft_type") != "LORA", "use_dora": bool(c.get("use_dora")),
                   "use_rslora": bool(c.get("use_rslora")), "bias": c.get("bias", "none") != "none",
                   "fan_in_fan_out": bool(c.get("fan_in_fan_out")), "modules_to_save": bool(c.get("modules_to_save")),
                   "layers_to_transform": c.get("layers_to_transform") is not None,
                   "rank_pattern": bool(c.get("rank_pattern")), "alpha_pattern": bool(c.get("alpha_pattern")),
                   "target_modules": not isinstance(c.get("target_modules"), list)}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"{file}: {', '.join(f'{k}={c.get(k)!r}' for k in bad)} not supported; only plain LoRA "
                         f"(peft_type LORA, a list of target_modules, no bias / DoRA / rsLoRA / patterns) is")
    return LoraConfig(rank=int(c["r"]), alpha=float(c["lora_alpha"]), dropout=float(c.get("lora_dropout") or 0.0),
                      targets=tuple(m for m in MODULES.values() if m in c["target_modules"]))


def load_peft(path: str | os.PathLike, cfg: ModelConfig) -> tuple[LoraConfig, Params]:
    """(LoraConfig, fp32 adapters on the default device) from a PEFT adapter directory."""
    path = Path(path).expanduser()
    lcfg = _read_adapter_config(path)
    shapes = adapter_shapes(cfg, lcfg)
    out = {}
    with safe_open(path / ADAPTER_WEIGHTS, framework="numpy") as f:
        names = set(f.keys())
        for w in lcfg.weights:
            module, layers = MODULES[w], {"a": [], "b": []}
            for layer in range(cfg.num_layers):
                for which, key in (("A", "a"), ("B", "b")):
                    name = _peft_name(layer, module, which)
                    if name not in names:
                        raise ValueError(f"{path / ADAPTER_WEIGHTS}: tensor {name!r} is missing")
                    t = f.get_tensor(name).astype(np.float32).T  # [in, r] / [r, out]
                    layers[key].append(t.reshape(shapes[w][key][1:]))
            out[w] = {k: jnp.asarray(np.stack(v)) for k, v in layers.items()}
    return lcfg, out


def export(merged_dir: str | os.PathLike, adapter_dir: str | os.PathLike, cfg: ModelConfig, lcfg: LoraConfig,
           base: Params, adapters: Params) -> None:
    """A plain HF model with the adapters folded in, and the PEFT adapter directory. Call on every process."""
    save_peft(adapter_dir, cfg, lcfg, adapters)
    hf_io.save_hf(merged_dir, cfg, jax.jit(lambda b, a: merge(cfg, lcfg, b, a))(base, adapters))
