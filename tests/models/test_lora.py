import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.models import hf_io, lora, decoder as model, sharding
from sage_jax.models import build
from tests.helpers_hf import tiny_hf_model, torch_logits
from tests.tolerances import decoder_terms, f32_tols

CFG = model.preset("tiny", vocab_size=128, num_layers=2, hidden_size=32, num_heads=4, head_dim=8, num_kv_heads=2,
                   intermediate_size=48)
LCFG = lora.LoraConfig(rank=4, alpha=8.0)
# Logits (of order 1 here: the floor) of an adapted model against the merged weights, a KV cache, PEFT or torch: the
# same sums in other orders (tests/tolerances.py); rtol 2.1e-5, 6e-5 at 2: the adapters move the logits by more than
# 1e-2 (checked below), 160x that; half of their effect (alpha / rank = 2 lost) is still 80x.
TOLS = f32_tols(decoder_terms(CFG, 8), floor=1.0)
TOKENS = np.array([[5, 17, 3, 60, 94, 1, 22, 8], [9, 9, 40, 2, 71, 33, 12, 0]], np.int32)
MASK = np.array([[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1]], np.int32)


def _trained_like(adapters, seed=1, std=0.3):
    """Adapters whose B is no longer zero, as after some training."""
    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(adapters)))
    return {w: {"a": ad["a"], "b": std * jax.random.normal(next(keys), ad["b"].shape)} for w, ad in adapters.items()}


@pytest.fixture(scope="module")
def base():
    return model.init_params(CFG, jax.random.key(0), std=0.1)


def test_fresh_adapters_leave_the_model_unchanged(base):
    adapters = lora.init_adapters(CFG, LCFG, jax.random.key(1))
    assert all(float(jnp.abs(ad["a"]).max()) > 0 and not ad["b"].any() for ad in adapters.values())
    bound = 1 / np.sqrt(CFG.hidden_size)  # PEFT's lora_A init: uniform in +-1/sqrt(fan_in)
    assert float(jnp.abs(adapters["wq"]["a"]).max()) <= bound
    np.testing.assert_array_equal(model.forward(CFG, lora.apply(base, adapters, LCFG), TOKENS, mask_BxT=MASK),
                                  model.forward(CFG, base, TOKENS, mask_BxT=MASK))


def test_adapted_forward_equals_merged_weights(base):
    adapters = _trained_like(lora.init_adapters(CFG, LCFG, jax.random.key(1)))
    viewed = model.forward(CFG, lora.apply(base, adapters, LCFG), TOKENS, mask_BxT=MASK)
    merged = model.forward(CFG, lora.merge(CFG, LCFG, base, adapters), TOKENS, mask_BxT=MASK)
    np.testing.assert_allclose(viewed, merged, **TOLS)
    assert float(jnp.abs(viewed - model.forward(CFG, base, TOKENS, mask_BxT=MASK)).max()) > 1e-2
    # the KV-cache path (the sampler's) runs the same adapted layers
    cache = model.init_cache(CFG, 2, 8)
    step, _ = model.forward_with_cache(CFG, lora.apply(base, adapters, LCFG), jnp.asarray(TOKENS),
                                       model.default_positions(jnp.asarray(MASK)), cache, 0, jnp.asarray(MASK))
    np.testing.assert_allclose(np.asarray(step)[MASK.astype(bool)], np.asarray(merged)[MASK.astype(bool)], **TOLS)


def test_gradients_reach_every_adapter(base):
    adapters = _trained_like(lora.init_adapters(CFG, LCFG, jax.random.key(1)))
    targets = jnp.roll(TOKENS, -1, axis=1)

    def loss(ad):
        return model.logprobs_and_entropy(CFG, lora.apply(base, ad, LCFG), TOKENS, targets, mask_BxT=MASK)[0].sum()
    grads = jax.grad(loss)(adapters)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_train_step_updates_only_the_adapters(base, grad_accum):
    """The trainer's step with lora_cfg: the state is the adapters and their Adam moments; the base is an input it
    reads and leaves as it was."""
    from sage_jax.rl import objectives
    from sage_jax.training import state as train_state
    from sage_jax.run import config as config_lib
    config = config_lib.load("configs/tiny_test.py")
    rng = np.random.RandomState(0)
    N, P, C = 4, 5, 3
    tokens = jnp.asarray(rng.randint(3, CFG.vocab_size, (N, P + C)).astype(np.int32))
    batch = {"tokens": tokens, "mask": jnp.ones((N, P + C), jnp.int32), "completion_mask": jnp.ones((N, C)),
             "advantages": jnp.asarray(rng.randn(N).astype(np.float32)), "ref_logp": jnp.full((N, C), -3.0),
             "sampler_logp": jnp.zeros((N, C)), "truncated": jnp.zeros((N,), bool), "rl_step": jnp.int32(0)}
    tx, schedule = train_state.make_optimizer(config.optim, 10)
    adapters = lora.init_adapters(CFG, LCFG, jax.random.key(1))
    state = train_state.init_state(adapters, tx)
    loss_cfg = objectives.LossConfig.from_config(config.loss, total_steps=10)
    step = train_state.make_train_step(CFG, loss_cfg, tx, schedule, seed=0, grad_accum=grad_accum, lora_cfg=LCFG)
    base_before = jax.tree.map(np.asarray, base)
    state, metrics = step(state, batch, base)
    assert np.isfinite(float(metrics["loss/total"])) and float(metrics["opt/grad_norm"]) > 0
    assert jax.tree.structure(state["params"]) == jax.tree.structure(adapters)
    assert all(float(jnp.abs(ad["b"]).max()) > 0 for ad in state["params"].values())  # B moved off zero
    assert jax.tree.structure(state["opt_state"][1][0].mu) == jax.tree.structure(adapters)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), base, base_before)


def test_dropout_is_keyed_and_off_without_a_key(base):
    lcfg = lora.LoraConfig(rank=4, alpha=8.0, dropout=0.5)
    adapters = _trained_like(lora.init_adapters(CFG, lcfg, jax.random.key(1)))
    plain = model.forward(CFG, lora.apply(base, adapters, lcfg), TOKENS)
    a = model.forward(CFG, lora.apply(base, adapters, lcfg, jax.random.key(3)), TOKENS)
    b = model.forward(CFG, lora.apply(base, adapters, lcfg, jax.random.key(3)), TOKENS)
    c = model.forward(CFG, lora.apply(base, adapters, lcfg, jax.random.key(4)), TOKENS)
    np.testing.assert_array_equal(a, b)
    assert float(jnp.abs(a - plain).max()) > 1e-3 and float(jnp.abs(a - c).max()) > 1e-3


def test_targets_and_config_errors():
    attn_only = lora.LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj"))
    assert attn_only.weights == ("wq", "wv") and set(lora.init_adapters(CFG, attn_only, jax.random.key(0))) == {
        "wq", "wv"}
    assert lora.num_params(CFG, attn_only) == 2 * 2 * ((32 + 32) + (32 + 16))  # layers * rank * (in + out)
    with pytest.raises(ValueError, match="unknown.*'qkv'"):
        lora.LoraConfig(rank=2, alpha=4.0, targets=("qkv",))
    with pytest.raises(ValueError, match="rank=0"):
        lora.LoraConfig(rank=0, alpha=4.0)


def test_sharded_adapters_follow_their_weights():
    mesh = sharding.make_mesh((1, 2, 4))
    cfg = CFG.replace(num_kv_heads=4)
    adapters = lora.init_adapters(cfg, LCFG, jax.random.key(0), mesh=mesh)
    P = jax.sharding.PartitionSpec
    assert adapters["wq"]["a"].sharding.spec == P(None, "fsdp", None)
    assert adapters["wq"]["b"].sharding.spec == P(None, None, "tensor", None)
    assert adapters["w_down"]["a"].sharding.spec == P(None, "tensor", None)


# --------------------------------------------------------------------------------------------------- PEFT

@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen3", True), ("llama", True)])
def test_peft_export_gives_the_same_logits_in_peft(tmp_path, arch, tied):
    import peft
    import torch
    import transformers

    src = tiny_hf_model(tmp_path / "base", arch=arch, tied=tied, head_dim=8)
    cfg, base = hf_io.load_hf(src)
    lcfg = lora.LoraConfig(rank=4, alpha=16.0)
    adapters = _trained_like(lora.init_adapters(cfg, lcfg, jax.random.key(2)), std=0.5)
    ours = np.asarray(model.forward(cfg, lora.apply(base, adapters, lcfg), TOKENS, mask_BxT=MASK))

    lora.export(tmp_path / "out" / "merged", tmp_path / "out" / "adapter", cfg, lcfg, base, adapters)
    written = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], len(written["target_modules"])) == (4, 16.0, 7)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "out" / "adapter").eval()
    mask_t = torch.as_tensor(MASK, dtype=torch.long)
    with torch.no_grad():
        theirs = peft_model(torch.as_tensor(TOKENS, dtype=torch.long), attention_mask=mask_t,
                            position_ids=(mask_t.cumsum(-1) - 1).clamp(min=0)).logits.numpy()
    real = MASK.astype(bool)
    tols = f32_tols(decoder_terms(cfg, TOKENS.shape[1]), floor=1.0)  # as TOLS, for this cfg
    np.testing.assert_allclose(ours[real], theirs[real], **tols)
    assert np.abs(ours - np.asarray(model.forward(cfg, base, TOKENS, mask_BxT=MASK)))[real].max() > 1e-2

    # the merged export is a plain HF model with the same logits
    merged = torch_logits(tmp_path / "out" / "merged", TOKENS, MASK)
    np.testing.assert_allclose(ours[real], merged[real], **tols)

    # and the PEFT directory loads back to continue training
    lcfg2, adapters2 = lora.load_peft(tmp_path / "out" / "adapter", cfg)
    assert lcfg2 == lcfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), adapters, adapters2)
    started = lora.init_adapters(cfg, dataclasses_replace(lcfg, init_from=str(tmp_path / "out" / "adapter")),
                                 jax.random.key(9))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), adapters, started)


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


def test_adapter_written_by_peft_loads(tmp_path):
    """An adapter peft itself trained-and-saved (attention only) loads into the same logits."""
    import peft
    import torch
    import transformers

    src = tiny_hf_model(tmp_path / "base", arch="qwen2", head_dim=8)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    pm = peft.get_peft_model(hf_model, peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "o_proj"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    pm.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        theirs = pm.eval()(torch.as_tensor(TOKENS, dtype=torch.long)).logits.numpy()
    cfg, base = hf_io.load_hf(src)
    lcfg, adapters = lora.load_peft(tmp_path / "peft", cfg)
    assert (lcfg.rank, lcfg.alpha, lcfg.weights) == (2, 6.0, ("wq", "wo"))
    np.testing.assert_allclose(np.asarray(model.forward(cfg, lora.apply(base, adapters, lcfg), TOKENS)), theirs,
                               **f32_tols(decoder_terms(cfg, TOKENS.shape[1]), floor=1.0))  # as TOLS, for this cfg


def test_unsupported_peft_config_is_one_clear_error(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                              "target_modules": ["q_proj"], "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True not supported"):
        lora.load_peft(tmp_path, CFG)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        lora.load_peft(tmp_path / "nowhere", CFG)


# --------------------------------------------------------------------------------------------------- training

def _lora_run_config(steps, **overrides):
    from sage_jax.run import config as config_lib
    flags = {"model.lora.rank": 4, "model.lora.alpha": 8.0, "train.steps": steps, "train.ckpt_every": 1,
             "optim.lr": 1e-2, **overrides}
    return config_lib.load("configs/tiny_test.py", [f"--config.{k}={v}" for k, v in flags.items()])


def _metrics(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "rl/kl_ref" in r}


def test_rl_with_lora_trains_only_adapters_against_the_base(tmp_path):
    from sage_jax.data import tasks
    from sage_jax.run import checkpoint
    from sage_jax.training import trainer
    config = _lora_run_config(3, **{"train.export_hf": True})
    result = trainer.run_rl(config, str(tmp_path))
    cfg, policy = result.cfg, result.policy
    _, init_base = build.load_or_init_params(config, sharding.make_mesh((1, -1, 1)), None,
                                               tasks.build(config).tokenizer)
    # the state is the adapters and their Adam moments; the base the policy runs on is the untouched initial weights
    assert set(result.state["params"]) == set(lora.MODULES)
    assert jax.tree.structure(result.state["opt_state"][1][0].mu) == jax.tree.structure(
        result.state["params"])
    frozen = {k: v for k, v in policy.items() if k != "layers"} | {
        "layers": {k: v for k, v in policy["layers"].items() if k != "lora"}}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), frozen, init_base)
    assert any(float(jnp.abs(ad["b"]).max()) > 0 for ad in result.state["params"].values())
    # the reference is the base with adapters off: KL to it is 0 while B = 0 (step 0), then grows
    kl_ref = {s: m["rl/kl_ref"] for s, m in _metrics(tmp_path).items()}
    assert abs(kl_ref[0]) < 1e-6 and kl_ref[2] > 1e-5, kl_ref
    # checkpoints hold only the adapters' state
    _, saved, _ = checkpoint.Checkpointer(str(tmp_path / "rl")).restore_raw(3)
    assert set(saved["params"]) == set(lora.MODULES)
    # the exports: a merged HF model and a PEFT adapter, both giving the adapted policy's logits
    tokens = np.array([[3, 4, 5, 6, 7, 8]], np.int32)
    adapted = np.asarray(model.forward(cfg, policy, tokens))
    _, merged = hf_io.load_hf(tmp_path / "hf_export")
    np.testing.assert_allclose(np.asarray(model.forward(cfg, merged, tokens)), adapted,
                               **f32_tols(decoder_terms(cfg, tokens.shape[1]), floor=1.0))  # as TOLS, for this cfg
    _, adapters = lora.load_peft(tmp_path / "peft_adapter", cfg)
    np.testing.assert_allclose(np.asarray(model.forward(cfg, lora.apply(init_base, adapters, lora.LoraConfig(
        rank=4, alpha=8.0)), tokens)), adapted, atol=1e-5)
    # a new run starts from the PEFT adapter (model.lora.init_from) instead of B = 0
    again = _lora_run_config(1, **{"model.lora.init_from": str(tmp_path / "peft_adapter")})
    mesh = sharding.make_mesh(tuple(again.mesh.shape))
    with jax.set_mesh(mesh), sharding.use_rules(dict(again.mesh.rules)):
        _, state = trainer.setup_rl(again, mesh, dict(again.mesh.rules), tasks.build(again).tokenizer)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state["params"], adapters)


def test_rl_with_lora_resumes_to_the_same_adapters(tmp_path):
    """Stopped after 2 of 4 steps and restarted from its checkpoint, a LoRA run ends with the same adapters."""
    from sage_jax.training import trainer
    full = trainer.run_rl(_lora_run_config(4), str(tmp_path / "full")).state
    trainer.run_rl(_lora_run_config(2), str(tmp_path / "resumed"))
    resumed = trainer.run_rl(_lora_run_config(4), str(tmp_path / "resumed")).state
    logged = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
              if "rl/kl_ref" in line]
    assert logged == [0, 1, 2, 3]  # the restart continued at step 2 (from the checkpoint), it did not start over
    assert int(resumed["step"]) == int(full["step"]) == 4
    for a, b in zip(jax.tree.leaves((full["params"], full["opt_state"])),
                    jax.tree.leaves((resumed["params"], resumed["opt_state"]))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_init_from_a_mismatched_adapter_is_one_clear_error(tmp_path):
    adapters = lora.init_adapters(CFG, LCFG, jax.random.key(0))
    lora.save_peft(tmp_path, CFG, LCFG, adapters)
    other = lora.LoraConfig(rank=8, alpha=8.0, init_from=str(tmp_path))
    with pytest.raises(ValueError, match="adapter has rank 4, alpha 8.0.*asks for rank 8"):
        lora.init_adapters(CFG, other, jax.random.key(0))
