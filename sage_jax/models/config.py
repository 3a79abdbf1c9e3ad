"""The decoder's shape: ModelConfig, presets, the params pytree's logical axes, shapes, random init and shardings.

Apart from the model's math (sage_jax.models.decoder) so that the checkpoint readers (hf_io, lora) can build and place params
without importing the model that imports them (model.load_hf / save_hf).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from sage_jax.models import attention as attention_lib
from sage_jax.models import sharding

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qkv_bias: bool = True
    max_position_embeddings: int = 32768
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head, before RoPE
    # HF rope_parameters beyond rope_theta, as sorted (key, value) pairs; () is plain RoPE. See rope.frequencies.
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    architecture: str = "qwen2"  # "qwen2" | "qwen3" | "llama" (weights differ only by the switches above)
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = False  # True: the backward recomputes each layer's matmuls too (least memory); see hidden()
    scan_layers: bool = True
    logits_chunk: int = 512
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    attention: str = "auto"  # training / no-grad attention: one of attention.IMPLEMENTATIONS
    attention_block: int = 512  # the blockwise / splash tile

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{name}={getattr(self, name)!r}: use 'float32' or 'bfloat16'")
        if self.attention not in attention_lib.IMPLEMENTATIONS:
            raise ValueError(f"model.attention={self.attention!r} is unknown; choose one of "
                             f"{attention_lib.IMPLEMENTATIONS}")

    @property
    def num_params(self) -> int:
        d, f, v, l = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        qd, kd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = (d * (qd + 2 * kd) + qd * d + 3 * d * f + 2 * d + (qd + 2 * kd) * self.qkv_bias
                     + 2 * self.head_dim * self.qk_norm)
        return v * d * (1 if self.tie_embeddings else 2) + l * per_layer + d

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def _qwen(v, d, l, h, kv, f, tied=True, theta=1e6, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=v, hidden_size=d, num_layers=l, num_heads=h, num_kv_heads=kv, head_dim=d // h,
                       intermediate_size=f, tie_embeddings=tied, rope_theta=theta, **kw)


PRESETS: dict[str, ModelConfig] = {
    "tiny": _qwen(512, 128, 4, 4, 2, 384),
    "small": _qwen(8192, 512, 8, 8, 2, 1536),
    "qwen2.5-0.5b": _qwen(151936, 896, 24, 14, 2, 4864),
    "qwen2.5-1.5b": _qwen(151936, 1536, 28, 12, 2, 8960),
    "qwen2.5-3b": _qwen(151936, 2048, 36, 16, 2, 11008),
    "qwen2.5-math-7b": _qwen(152064, 3584, 28, 28, 4, 18944, tied=False, theta=1e4),
    "qwen2.5-7b": _qwen(152064, 3584, 28, 28, 4, 18944, tied=False),
    # Qwen3 heads are 128 wide whatever the hidden size; no q/k/v biases, RMSNorm on each q and k head.
    "qwen3-4b": _qwen(151936, 2560, 36, 32, 8, 9728, qkv_bias=False, qk_norm=True, architecture="qwen3").replace(
        head_dim=128, max_position_embeddings=40960),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)


# --------------------------------------------------------------------------------------------------- parameters

def param_axes(cfg: ModelConfig) -> Params:
    layers = {
        "attn_norm": ("layers", "norm"),
        "wq": ("layers", "embed", "heads", "head_dim"),
        "wk": ("layers", "embed", "kv_heads", "head_dim"),
        "wv": ("layers", "embed", "kv_heads", "head_dim"),
        "wo": ("layers", "heads", "head_dim", "embed"),
        "mlp_norm": ("layers", "norm"),
        "w_gate": ("layers", "embed", "mlp"),
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
    }
    if cfg.qkv_bias:
        layers |= {"bq": ("layers", "heads", "head_dim"), "bk": ("layers", "kv_heads", "head_dim"),
                   "bv": ("layers", "kv_heads", "head_dim")}
    if cfg.qk_norm:
        layers |= {"q_norm": ("layers", "norm"), "k_norm": ("layers", "norm")}
    axes = {"embed": ("vocab", "embed"), "final_norm": ("norm",), "layers": layers}
    if not cfg.tie_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def param_shapes(cfg: ModelConfig) -> Params:
    L, D, H, KV, hd, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.intermediate_size, cfg.vocab_size)
    layers = {"attn_norm": (L, D), "wq": (L, D, H, hd), "wk": (L, D, KV, hd), "wv": (L, D, KV, hd),
              "wo": (L, H, hd, D), "mlp_norm": (L, D), "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D)}
    if cfg.qkv_bias:
        layers |= {"bq": (L, H, hd), "bk": (L, KV, hd), "bv": (L, KV, hd)}
    if cfg.qk_norm:
        layers |= {"q_norm": (L, hd), "k_norm": (L, hd)}
    shapes = {"embed": (V, D), "final_norm": (D,), "layers": layers}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> Params:
    """Random init (normal(std) weights, unit norms, zero biases), for tests, benchmarks and from-scratch runs."""
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    dtype = jnp.dtype(cfg.param_dtype)
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            leaves.append(jnp.ones(shape, dtype))
        elif name.endswith("['bq']") or name.endswith("['bk']") or name.endswith("['bv']"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            leaves.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, leaves)


def param_shardings(cfg: ModelConfig, mesh, rules=None) -> Params:
    """NamedShardings of cfg's params on mesh, from their logical axes and the rules table."""
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    return sharding.tree_shardings(abstract, param_axes(cfg), mesh, rules)


def shard_params(params: Params, mesh, rules=None, cfg: ModelConfig | None = None) -> Params:
    """Place params onto the mesh by their logical axes (cfg is needed to know the axes)."""
    if cfg is None:
        raise ValueError("shard_params needs the ModelConfig (cfg=...) to look up logical axes")
    return jax.tree.map(jax.device_put, params, sharding.tree_shardings(params, param_axes(cfg), mesh, rules))


def narrows_to_compute(cfg: ModelConfig, x) -> bool:
    """Whether compute_params casts this leaf: a float array (not a scalar, e.g. a LoRA dropout's keep probability)
    wider than the compute dtype."""
    cdt = jnp.dtype(cfg.compute_dtype)
    return (jnp.issubdtype(x.dtype, jnp.floating) and getattr(x, "ndim", 0) >= 1
            and jnp.dtype(x.dtype).itemsize > cdt.itemsize)


@functools.partial(jax.jit, static_argnums=1)
def _cast(leaves: list, dtype) -> list:
    return [x.astype(dtype) for x in leaves]


def compute_params(cfg: ModelConfig, params: Params) -> Params:
    """params as the forward uses them: float arrays wider than the compute dtype cast to it (float32 master
    weights -> bfloat16 for sampling), every other leaf the same array (not copied); params itself when nothing
    narrows.

    Exact: every use of a weight in sage_jax.models.decoder casts it to the compute dtype first (_project, rms_norm, the
    embedding and the unembedding), so the forward computes the same bits either way. A decode loop reads its
    weights at every step: cast once, it reads half the bytes of float32 weights, and XLA keeps no converted copy
    of them inside the loop. The copy is the caller's to hold beside the float32 weights (the plan counts it)."""
    leaves, tree = jax.tree.flatten(params)
    narrow = [i for i, x in enumerate(leaves) if narrows_to_compute(cfg, x)]
    if not narrow:
        return params
    cast = dict(zip(narrow, _cast([leaves[i] for i in narrow], jnp.dtype(cfg.compute_dtype))))
    return jax.tree.unflatten(tree, [cast.get(i, x) for i, x in enumerate(leaves)])
