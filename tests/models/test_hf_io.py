import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from sage_jax.models import hf_io, decoder as model, sharding
from tests.helpers_hf import tiny_hf_model, torch_logits
from tests.tolerances import decoder_terms, f32_tols

VARIANTS = {  # name -> tiny_hf_model kwargs
    "qwen2_untied": dict(arch="qwen2", tied=False),
    "qwen2_tied": dict(arch="qwen2", tied=True, kv_heads=4),
    "llama_untied": dict(arch="llama", tied=False, head_dim=16),
    "llama_tied": dict(arch="llama", tied=True, kv_heads=1),
    "qwen3_untied": dict(arch="qwen3", tied=False, head_dim=16),
    "qwen3_tied": dict(arch="qwen3", tied=True, head_dim=8),
    # Llama 3.1/3.2 rope: with head_dim 16 and a 64-token original context, the frequencies fall in all three bands
    "llama3_rope_untied": dict(arch="llama", tied=False, head_dim=16, rope_parameters=dict(
        rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "llama3_rope_tied": dict(arch="llama", tied=True, head_dim=16, rope_parameters=dict(
        rope_type="llama3", rope_theta=5e5, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "llama_linear_rope": dict(arch="llama", tied=True, rope_parameters=dict(rope_type="linear", rope_theta=1e4,
                                                                            factor=4.0)),
    "qwen3_yarn": dict(arch="qwen3", tied=True, head_dim=16, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=64)),
}
TOKENS = np.array([[5, 17, 3, 60, 94, 1, 22, 8], [9, 9, 40, 2, 71, 33, 12, 0]], np.int32)
MASK = np.array([[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1]], np.int32)  # second row left padded
LONG = np.random.RandomState(0).randint(0, 96, (1, 160)).astype(np.int32)  # past a 64-token original context


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: tiny_hf_model(root / name, seed=i, **kw) for i, (name, kw) in enumerate(VARIANTS.items())}


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------------------------------- config

def test_config_from_hf_fields():
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
          "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "rope_theta": 100000.0,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 8192,
          "bos_token_id": 1, "eos_token_id": 2, "rope_scaling": None, "attention_bias": False}
    cfg = hf_io.config_from_hf(hf)
    assert (cfg.architecture, cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta) == ("llama", 64, 3, 1e5)
    assert cfg.tie_embeddings and not cfg.qkv_bias and cfg.eos_token_ids == (2,) and cfg.pad_token_id == 2
    qwen = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "eos_token_id": [5, 6]}
    cfg = hf_io.config_from_hf(qwen)
    assert cfg.qkv_bias and cfg.rope_theta == 1e6 and cfg.eos_token_ids == (5, 6) and cfg.head_dim == 8


@pytest.mark.parametrize("arch,bias,scaling", [
    ("qwen2", True, ()), ("llama", False, ()), ("qwen3", False, ()),
    ("llama", False, (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                      ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))),
    ("qwen3", False, (("factor", 4.0), ("original_max_position_embeddings", 32768), ("rope_type", "yarn")))])
def test_config_round_trip(arch, bias, scaling):
    cfg = model.preset("tiny", architecture=arch, qkv_bias=bias, qk_norm=arch == "qwen3", tie_embeddings=False,
                       bos_token_id=3, eos_token_ids=(4, 5), pad_token_id=7, rope_theta=5e5, rope_scaling=scaling)
    assert hf_io.config_from_hf(hf_io.config_to_hf(cfg)) == cfg


def test_config_from_hf_qwen3_and_llama31():
    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 2560, "head_dim": 128,
             "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 9728,
             "rope_theta": 1e6, "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": True,
             "use_sliding_window": False, "max_window_layers": 36, "max_position_embeddings": 32768}
    cfg = hf_io.config_from_hf(qwen3)
    assert (cfg.architecture, cfg.qk_norm, cfg.qkv_bias, cfg.head_dim, cfg.rope_scaling) == ("qwen3", True, False,
                                                                                             128, ())
    assert cfg.num_params == model.preset("qwen3-4b").num_params
    llama31 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "intermediate_size": 128, "rope_theta": 5e5,
               "max_position_embeddings": 131072, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    cfg = hf_io.config_from_hf(llama31)
    assert dict(cfg.rope_scaling)["rope_type"] == "llama3" and cfg.rope_theta == 5e5
    inv_freq, scale = model.rope_frequencies(cfg)
    plain, _ = model.rope_frequencies(cfg.replace(rope_scaling=()))
    assert scale == 1.0 and inv_freq[0] == plain[0] and np.isclose(inv_freq[-1], plain[-1] / 8)


# --------------------------------------------------------------------------------------------------- parity

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(hf_dirs, variant):
    cfg, params = hf_io.load_hf(hf_dirs[variant])
    assert ("lm_head" in params) != cfg.tie_embeddings
    ref = torch_logits(hf_dirs[variant], TOKENS)
    # JAX vs torch: the same sums in other orders, logits within 1 (the floor), up to LONG's 160 positions;
    # rtol 2.6e-5 (tests/tolerances.py): at most 5e-5, 200x below a RoPE or scaling defect of 1e-2
    tols = f32_tols(decoder_terms(cfg, LONG.shape[1]), floor=1.0)
    np.testing.assert_allclose(np.asarray(model.forward(cfg, params, TOKENS)), ref, **tols)
    ref = torch_logits(hf_dirs[variant], TOKENS, MASK)
    ours = np.asarray(model.forward(cfg, params, TOKENS, mask_BxT=MASK))
    real = MASK.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], **tols)
    if cfg.rope_scaling:
        np.testing.assert_allclose(np.asarray(model.forward(cfg, params, LONG)), torch_logits(hf_dirs[variant], LONG),
                                   **tols)


@pytest.mark.parametrize("variant", ["qwen2_untied", "llama_tied", "qwen3_untied", "qwen3_tied", "llama3_rope_untied",
                                     "qwen3_yarn"])
def test_save_round_trip_loads_in_transformers(hf_dirs, variant, tmp_path):
    cfg, params = hf_io.load_hf(hf_dirs[variant])
    out = tmp_path / "export"
    hf_io.save_hf(out, cfg, params, max_shard_bytes=20_000)  # tiny shards: exercises the index file
    assert (out / "model.safetensors.index.json").exists() and (out / "generation_config.json").exists()
    np.testing.assert_allclose(torch_logits(out, TOKENS), torch_logits(hf_dirs[variant], TOKENS), atol=1e-5)
    cfg2, params2 = hf_io.load_hf(out)
    assert cfg2 == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def test_save_single_file_when_small(hf_dirs, tmp_path):
    cfg, params = hf_io.load_hf(hf_dirs["qwen2_tied"])
    hf_io.save_hf(tmp_path, cfg, params)
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "model.safetensors.index.json").exists()
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")


def test_sharded_load_matches_single_device(hf_dirs):
    cfg, single = hf_io.load_hf(hf_dirs["qwen2_untied"])
    mesh = sharding.make_mesh((1, 2, 4))
    rules = {**sharding.DEFAULT_RULES, "kv_heads": None}  # 2 kv heads do not divide the 4-way tensor axis
    cfg_s, sharded = hf_io.load_hf(hf_dirs["qwen2_untied"], mesh=mesh, rules=rules)
    assert cfg_s == cfg
    wq = sharded["layers"]["wq"]
    assert wq.sharding.spec == P(None, "fsdp", "tensor", None)
    assert len(wq.sharding.device_set) == 8 and wq.addressable_shards[0].data.shape == (2, 16, 1, 8)
    assert sharded["embed"].sharding.spec == P("tensor", "fsdp")
    assert sharded["layers"]["wk"].sharding.spec == P(None, "fsdp", None, None)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), single, sharded)
    logits = jax.jit(lambda p, t: model.forward(cfg, p, t))(sharded, TOKENS)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model.forward(cfg, single, TOKENS)),
                               **f32_tols(decoder_terms(cfg, TOKENS.shape[1]), floor=1.0))  # sharded: other orders


def test_sharded_load_qwen3_matches_single_device(hf_dirs):
    cfg, single = hf_io.load_hf(hf_dirs["qwen3_untied"])
    mesh = sharding.make_mesh((1, 4, 2))
    cfg_s, sharded = hf_io.load_hf(hf_dirs["qwen3_untied"], mesh=mesh)
    assert cfg_s == cfg and sharded["layers"]["q_norm"].sharding.spec == P(None, None)
    assert sharded["layers"]["wq"].sharding.spec == P(None, "fsdp", "tensor", None)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), single, sharded)


def test_bf16_load_and_save(hf_dirs, tmp_path):
    src = tiny_hf_model(tmp_path / "bf16", arch="qwen2", dtype="bfloat16")
    cfg, params = hf_io.load_hf(src, dtype=jnp.bfloat16)
    assert cfg.param_dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    with safe_open(src / "model.safetensors", framework="numpy") as f:
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
    np.testing.assert_array_equal(np.asarray(params["layers"]["wq"][1]).reshape(32, 32).T, q)
    _, params32 = hf_io.load_hf(src, dtype=jnp.float32)  # bf16 -> fp32 widening is exact
    np.testing.assert_array_equal(np.asarray(params32["embed"]), np.asarray(params["embed"]).astype(np.float32))
    hf_io.save_hf(tmp_path / "out", cfg, params)
    with safe_open(tmp_path / "out" / "model.safetensors", framework="numpy") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    _, fp32_as_bf16 = hf_io.load_hf(hf_dirs["llama_tied"], dtype="bfloat16")
    assert fp32_as_bf16["layers"]["w_up"].dtype == jnp.bfloat16


# --------------------------------------------------------------------------------------------------- errors

def test_missing_tensor(hf_dirs, tmp_path):
    d = _copy(hf_dirs["qwen2_untied"], tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        hf_io.load_hf(d)


def test_untied_needs_lm_head(hf_dirs, tmp_path):
    d = _copy(hf_dirs["qwen2_tied"], tmp_path)
    config = json.loads((d / "config.json").read_text()) | {"tie_word_embeddings": False}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lm_head.weight"):
        hf_io.load_hf(d)


def test_bad_shape(hf_dirs, tmp_path):
    d = _copy(hf_dirs["llama_untied"], tmp_path)
    config = json.loads((d / "config.json").read_text()) | {"intermediate_size": 64}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gate_proj\.weight.*\(48, 32\).*\(64, 32\)"):
        hf_io.load_hf(d)


@pytest.mark.parametrize("override,match", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "MistralForCausalLM.*Qwen2ForCausalLM"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling.rope_type='longrope'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 4.0}}, "rope_scaling.rope_type='dynamic'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     r"rope_parameters \(rope_type 'llama3'\): lacks \['low_freq_factor', 'high_freq_factor'\]"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "short_factor": [1.0]}}, r"\['short_factor'\] not supp"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "attention_bias=true is not supported for qwen3"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"intermediate_size": None}, "intermediate_size"),
])
def test_unsupported_configs(override, match):
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 48} | override
    hf = {k: v for k, v in hf.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        hf_io.config_from_hf(hf)


def test_pickled_checkpoint_refused(hf_dirs, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(hf_dirs["qwen2_untied"] / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"not a pickle; must never be opened")
    with pytest.raises(ValueError, match=r"(?s)pytorch_model\.bin.*safe_serialization=True"):
        hf_io.load_hf(d)


def test_missing_dir_and_config(hf_dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        hf_io.load_hf(tmp_path / "nowhere")
    d = _copy(hf_dirs["qwen2_untied"], tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_io.load_hf(d)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(hf_dirs["qwen2_untied"] / "config.json", empty)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf_io.load_hf(empty)
