"""Hugging Face checkpoints (Qwen2 / Qwen3 / Llama, safetensors) <-> ModelConfig and the stacked params pytree.

Loading places every tensor straight onto its target sharding: each device's callback reads only its slice of the
safetensors file (memory-mapped), so no host ever holds a full copy of the model. Saving gathers one tensor at a
time to the host and writes shards of at most `max_shard_bytes`. Pickled checkpoints (.bin/.pt) are refused: they
can run arbitrary code when loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can hand out bf16 slices)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from sage_jax.models import config as model_lib
from sage_jax.models.hf_config import SUPPORTED, config_from_hf, config_to_hf  # noqa: F401  (public here too)
from sage_jax.models.config import ModelConfig, Params

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_CONVERT_HINT = ('python -c "from transformers import AutoModelForCausalLM as A; '
                 "A.from_pretrained('{p}').save_pretrained('{p}', safe_serialization=True)\"")


# --------------------------------------------------------------------------------------------------- name mapping

@dataclasses.dataclass(frozen=True)
class _Map:
    """How one params leaf relates to HF tensor(s).

    The HF tensor (per layer when `per_layer`) is reshaped so each HF dim splits into `groups[k]`, then transposed
    by `perm` to give the params leaf (without its leading layer axis).
    """
    hf_name: str  # "{i}" is the layer index
    groups: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    per_layer: bool

    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.groups)


def _mapping(cfg: ModelConfig) -> dict[tuple[str, ...], _Map]:
    D, H, KV, hd, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                          cfg.vocab_size)
    att, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    layer = lambda name, groups, perm: _Map(name, groups, perm, True)
    out = {
        ("embed",): _Map("model.embed_tokens.weight", ((V,), (D,)), (0, 1), False),
        ("final_norm",): _Map("model.norm.weight", ((D,),), (0,), False),
        ("layers", "attn_norm"): layer("model.layers.{i}.input_layernorm.weight", ((D,),), (0,)),
        ("layers", "mlp_norm"): layer("model.layers.{i}.post_attention_layernorm.weight", ((D,),), (0,)),
        # torch Linear stores [out, in]; params store [in, ...out].
        ("layers", "wq"): layer(att + "q_proj.weight", ((H, hd), (D,)), (2, 0, 1)),
        ("layers", "wk"): layer(att + "k_proj.weight", ((KV, hd), (D,)), (2, 0, 1)),
        ("layers", "wv"): layer(att + "v_proj.weight", ((KV, hd), (D,)), (2, 0, 1)),
        ("layers", "wo"): layer(att + "o_proj.weight", ((D,), (H, hd)), (1, 2, 0)),
        ("layers", "w_gate"): layer(mlp + "gate_proj.weight", ((F,), (D,)), (1, 0)),
        ("layers", "w_up"): layer(mlp + "up_proj.weight", ((F,), (D,)), (1, 0)),
        ("layers", "w_down"): layer(mlp + "down_proj.weight", ((D,), (F,)), (1, 0)),
    }
    if cfg.qkv_bias:
        out[("layers", "bq")] = layer(att + "q_proj.bias", ((H, hd),), (0, 1))
        out[("layers", "bk")] = layer(att + "k_proj.bias", ((KV, hd),), (0, 1))
        out[("layers", "bv")] = layer(att + "v_proj.bias", ((KV, hd),), (0, 1))
    if cfg.qk_norm:
        out[("layers", "q_norm")] = layer(att + "q_norm.weight", ((hd,),), (0,))
        out[("layers", "k_norm")] = layer(att + "k_norm.weight", ((hd,),), (0,))
    if not cfg.tie_embeddings:
        out[("lm_head",)] = _Map("lm_head.weight", ((V,), (D,)), (1, 0), False)
    return out


def _hf_names(m: _Map, num_layers: int) -> list[str]:
    return [m.hf_name.format(i=i) for i in range(num_layers)] if m.per_layer else [m.hf_name]


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(p.key) for p in path)


# --------------------------------------------------------------------------------------------------- reading

def _read_block(tensor_slice, m: _Map, bounds: list[tuple[int, int]]) -> np.ndarray:
    """Read the part of one HF tensor that lands in params bounds [(start, stop)] (per-layer dims only)."""
    flat = [n for g in m.groups for n in g]
    src_bounds: list[tuple[int, int]] = [(0, 0)] * len(flat)
    for j, b in enumerate(bounds):
        src_bounds[m.perm[j]] = b
    # Each HF dim is a row-major merge of its group: read the contiguous range covered by the group's leading dim.
    hf_index, reshaped, trailing = [], [], []
    pos = 0
    for g in m.groups:
        inner = math.prod(g[1:])
        start, stop = src_bounds[pos]
        hf_index.append(slice(start * inner, stop * inner))
        reshaped += [stop - start, *g[1:]]
        trailing += [slice(None)] + [slice(*src_bounds[pos + k]) for k in range(1, len(g))]
        pos += len(g)
    block = np.asarray(tensor_slice[tuple(hf_index)]).reshape(reshaped)[tuple(trailing)]
    return np.transpose(block, m.perm)


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file that holds it."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    files = [single] if single.exists() else sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickled:
            raise ValueError(
                f"{path} holds only pickled weights ({', '.join(pickled)}); they are not loaded because unpickling "
                f"can run arbitrary code. Convert them to safetensors once, from a trusted environment:\n  "
                + _CONVERT_HINT.format(p=path))
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    out = {}
    for f in files:
        try:
            with safe_open(f, framework="numpy") as handle:
                out |= {name: f for name in handle.keys()}
        except Exception as e:  # safetensors raises SafetensorError (not exported as a stable type) for a bad header
            raise ValueError(f"{f} is incomplete or not a safetensors file ({type(e).__name__}: {e}; "
                             f"{f.stat().st_size} bytes): download it again") from None
    return out


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist (download it first, e.g. "
                                f"`huggingface-cli download <repo> --local-dir {path}`)")
    config_path = path / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found; a Hugging Face model directory needs config.json")
    return json.loads(config_path.read_text())


def _target_shardings(cfg: ModelConfig, mesh, rules) -> Params:
    if mesh is None:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: single, model_lib.param_axes(cfg),
                            is_leaf=lambda x: isinstance(x, tuple))
    return model_lib.param_shardings(cfg, mesh, rules)


def load_hf(path: str | os.PathLike, dtype: Any = jnp.float32, mesh=None, rules=None) -> tuple[ModelConfig, Params]:
    """(cfg, params) from a local HF model directory, each leaf born on its sharding (single device if no mesh)."""
    path = Path(path).expanduser()
    np_dtype = np.dtype(jnp.dtype(dtype))
    cfg = config_from_hf(_read_config(path)).replace(param_dtype=np_dtype.name)
    files = _checkpoint_files(path)
    mapping = _mapping(cfg)
    shapes = model_lib.param_shapes(cfg)
    shardings = _target_shardings(cfg, mesh, rules)

    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def tensor_slice(name: str):
            if name not in files:
                raise ValueError(f"tensor {name!r} is missing from the checkpoint in {path}")
            f = files[name]
            if f not in handles:
                if not f.exists():
                    raise FileNotFoundError(f"{f} (listed in model.safetensors.index.json for {name}) not found")
                handles[f] = stack.enter_context(safe_open(f, framework="numpy"))
            return handles[f].get_slice(name)

        # Check every tensor before placing any, so a bad checkpoint fails fast with a clear message.
        for m in mapping.values():
            for name in _hf_names(m, cfg.num_layers):
                found = tuple(tensor_slice(name).get_shape())
                if found != m.hf_shape():
                    raise ValueError(f"tensor {name!r} has shape {found}, expected {m.hf_shape()} "
                                     f"from config.json in {path}")

        def place(path_, shard, shape):
            m = mapping[_path_key(path_)]
            cache: dict[tuple, np.ndarray] = {}  # replicated shards ask for the same block more than once

            def callback(index: tuple[slice, ...]) -> np.ndarray:
                bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
                if bounds not in cache:
                    if m.per_layer:
                        rest = list(bounds[1:])
                        block = np.stack([_read_block(tensor_slice(m.hf_name.format(i=i)), m, rest)
                                          for i in range(*bounds[0])])
                    else:
                        block = _read_block(tensor_slice(m.hf_name), m, list(bounds))
                    cache[bounds] = block.astype(np_dtype)
                return cache[bounds]

            return jax.make_array_from_callback(tuple(shape), shard, callback)

        params = jax.tree_util.tree_map_with_path(place, shardings, shapes,
                                                  is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return cfg, params


# --------------------------------------------------------------------------------------------------- writing

def _to_host(x: jax.Array) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _hf_tensor(block: np.ndarray, m: _Map) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(block, np.argsort(m.perm)).reshape(m.hf_shape()))


def save_hf(out_dir: str | os.PathLike, cfg: ModelConfig, params: Params, max_shard_bytes: int = 2 * 1024 ** 3
            ) -> None:
    """Write config.json, generation_config.json and safetensors shards that transformers loads.

    Tensors keep the params' dtype. Every process must call this (gathers are collective); only process 0 writes.
    """
    out = Path(out_dir)
    writer = jax.process_index() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    mapping = _mapping(cfg)
    leaves = {_path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    if set(leaves) != set(mapping):
        raise ValueError(f"params keys {sorted(leaves)} do not match the config's {sorted(mapping)}; "
                         f"is tie_embeddings / qkv_bias set as in the params?")

    # Plan the shards from shapes alone, then fetch and write one shard at a time.
    plan: list[list[tuple[str, Callable[[], np.ndarray]]]] = [[]]
    shard_bytes = 0
    for key, m in mapping.items():
        x = leaves[key]
        nbytes = math.prod(m.hf_shape()) * jnp.dtype(x.dtype).itemsize
        for i, name in enumerate(_hf_names(m, cfg.num_layers)):
            fetch = (lambda x=x, i=i, m=m: _hf_tensor(_to_host(x[i]), m)) if m.per_layer else \
                (lambda x=x, m=m: _hf_tensor(_to_host(x), m))
            if plan[-1] and shard_bytes + nbytes > max_shard_bytes:
                plan.append([])
                shard_bytes = 0
            plan[-1].append((name, fetch))
            shard_bytes += nbytes

    n = len(plan)
    weight_map, total = {}, 0
    for k, shard in enumerate(plan):
        fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        tensors = {name: fetch() for name, fetch in shard}
        total += sum(t.nbytes for t in tensors.values())
        weight_map |= {name: fname for name in tensors}
        if writer:
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
    if not writer:
        return
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf = config_to_hf(cfg.replace(param_dtype=jnp.dtype(leaves[("embed",)].dtype).name))
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": hf["eos_token_id"], "pad_token_id": cfg.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
