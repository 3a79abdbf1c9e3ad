"""The JAX peer of the rl_step and sampler modes: tunix (`google-tunix`, an optional benchmark requirement).

  python -m sage_jax.bench rl_step --preset small --peer tunix
  python -m sage_jax.bench sampler --preset small --workload longtail --peer tunix

tunix's GRPO step (`GRPOLearner` on an `RLCluster` with its vanilla sampler) and its `Sampler`, on its Qwen2 model
(flax nnx) loaded with our weights (saved as safetensors; its random init would zero the MLP weights), the same
prompts, group, forced completion lengths, optimizer (configs/base.py's AdamW with the gradient clip), k3 KL and
clip. What a peer harness has to set that a plain tunix run does not:
- the mesh's axes Auto (`jax.make_mesh` makes them Explicit; tunix's sharding needs Auto);
- the completion lengths: its sampler has no ignore-EOS and no logits processor, so `force_lengths` wraps its
  per-token sampling: EOS (and the pad id, which its masks treat as padding) is never drawn, except where the row's
  forced length puts it (as our side and the other peers place it), and a row with no EOS runs to the limit;
- a sampling key per step (its rollout reuses one key unless seeded).
One step = `GRPOLearner._generate_and_compute_advantage` (generation, reference log-probs, rewards, advantages) then
`RLCluster.update_actor` on its micro-batches (micro_prompts: long completions need them to fit in memory): the body
of its `train` loop without the thread that feeds it batches (on one mesh tunix runs them in turn anyway), so that our
steps run between its steps.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax.bench import common, compiles, trl_peer
from sage_jax.models import decoder as model

INSTALL = "pip install -r requirements-bench.txt (or pip install 'google-tunix>=0.1.7,<0.2')"
PAD_ID = 0  # trl_peer.word_level_tokenizer's "<pad>"


def require_tunix() -> None:
    """A clear error (exit 2 from the bench) when tunix is not installed: it is a benchmark requirement only."""
    if importlib.util.find_spec("tunix") is None or importlib.util.find_spec("flax") is None:
        raise ValueError(f"--peer tunix needs tunix, an optional benchmark requirement that is not installed: "
                         f"{INSTALL}")


def auto_mesh() -> jax.sharding.Mesh:
    """One device, tunix's axis names, Auto axis types."""
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(auto, auto), devices=jax.devices()[:1])


def tunix_model(cfg: model.ModelConfig, params, mesh, model_dir: str | None = None):
    """tunix's Qwen2 (nnx) with our weights: saved as HF safetensors, loaded by tunix's own loader."""
    from tunix.models.qwen2 import model as qwen2, params as qwen2_params
    if cfg.architecture != "qwen2" or cfg.qk_norm:
        raise ValueError(f"--peer tunix runs Qwen2 models only (this one is {cfg.architecture})")
    tcfg = qwen2.ModelConfig(num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.hidden_size,
                             hidden_dim=cfg.intermediate_size, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                             num_kv_heads=cfg.num_kv_heads, rope_theta=int(cfg.rope_theta), norm_eps=cfg.rms_norm_eps,
                             use_tied_embedding=cfg.tie_embeddings, dtype=jnp.dtype(cfg.compute_dtype),
                             param_dtype=jnp.dtype(cfg.param_dtype))
    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            model.save_hf(tmp, cfg, params)
        return qwen2_params.create_model_from_safe_tensors(model_dir or tmp, tcfg, mesh)


def force_lengths(sampler, eos_index_N: np.ndarray, eos_id: int) -> None:
    """Make tunix's Sampler draw eos_id as row n's completion token eos_index[n] (-1: never; the row runs to the
    limit) and never draw eos_id or PAD_ID elsewhere. Rows in the order of its prompts."""
    draw = sampler._sample  # its per-token step: logits [B, T, V] -> next token into token_buffer[:, step + 1]
    eos_index_B = jnp.asarray(eos_index_N, jnp.int32)

    def forced(logits, eos, cache, sampler_state):
        last_BxV = logits[:, -1].astype(jnp.float32)
        vocab_V = jnp.arange(last_BxV.shape[-1])
        j = sampler_state.decoding_step + 1 - sampler_state.num_input_tokens  # the completion index drawn now
        last_BxV = jnp.where((vocab_V == eos_id) | (vocab_V == PAD_ID), -jnp.inf, last_BxV)
        only_eos_V = jnp.where(vocab_V == eos_id, 0.0, -jnp.inf)
        last_BxV = jnp.where((j == eos_index_B)[:, None], only_eos_V, last_BxV)
        return draw(last_BxV[:, None].astype(logits.dtype), eos, cache, sampler_state)
    sampler._sample = forced  # looked up when its prefill and decode programs are traced (the first call)


def words(prompts_BxP: np.ndarray) -> list[str]:
    """Prompts as the word-level tokenizer's text ("t5 t17 ..."): exactly the same ids."""
    return [" ".join(f"t{i}" for i in row) for row in prompts_BxP]


def sampler_fn(cfg: model.ModelConfig, params, prompts_NxP: np.ndarray, new_tokens: int,
               lengths_N: np.ndarray | None, eos_id: int = 1) -> tuple[Callable[[], None], dict]:
    """(run, realised) as bench/sampler.py's sides: tunix's Sampler, greedy, each row of prompts_NxP (a prompt per
    row) forced to lengths_N (None: all to new_tokens); realised["lengths"]: the tokens before EOS per row."""
    from tunix.generate import sampler as tunix_sampler
    mesh = auto_mesh()
    net = tunix_model(cfg, params, mesh)
    P = prompts_NxP.shape[1]
    cache = tunix_sampler.CacheConfig(cache_size=P + new_tokens, num_layers=cfg.num_layers,
                                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    sampler = tunix_sampler.Sampler(net, trl_peer.word_level_tokenizer(cfg.vocab_size), cache)
    lengths = np.full(len(prompts_NxP), new_tokens) if lengths_N is None else np.asarray(lengths_N)
    force_lengths(sampler, np.where(lengths < new_tokens, lengths, -1), eos_id)  # EOS after lengths[n] tokens
    texts, realised = words(prompts_NxP), {}

    def run():
        with jax.set_mesh(mesh):
            out = sampler(texts, max_generation_steps=new_tokens, max_prompt_length=P, temperature=0.0,
                          eos_tokens=[eos_id])
        realised["lengths"] = np.array([len(t) for t in out.tokens])
    return run, realised


def grpo_runner(cfg: model.ModelConfig, params, prompts_BxP: np.ndarray, group: int, lengths_N: np.ndarray,
                beta: float, reward: Callable, eos_id: int, seed: int = 0, micro: int | None = None
                ) -> Callable[[], dict[str, float]]:
    """run() does one tunix GRPO step and returns its seconds per phase (each waits for its outputs) and the
    compilations it made (compiles.CompileCounter). reward(completion ids) scores a completion, as on our side.
    micro: prompts per micro-batch (default micro_prompts)."""
    import optax
    from flax import nnx
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
    mesh = auto_mesh()
    B, P, new_tokens = prompts_BxP.shape[0], prompts_BxP.shape[1], int(lengths_N.max())
    micro = micro or micro_prompts(B, group, P + new_tokens)
    optim = common.OPTIM
    optimizer = optax.chain(optax.clip_by_global_norm(optim.grad_clip),
                            optax.adamw(optim.lr, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                                        weight_decay=optim.weight_decay))
    rollout = base_rollout.RolloutConfig(max_tokens_to_generate=new_tokens, temperature=1.0, top_p=1.0,
                                         max_prompt_length=P, kv_cache_size=P + new_tokens, eos_tokens=[eos_id])
    training = rl.RLTrainingConfig(actor_optimizer=optimizer, eval_every_n_steps=10 ** 9, max_steps=10 ** 9,
                                   mini_batch_size=B, train_micro_batch_size=micro, rollout_micro_batch_size=B,
                                   compute_logps_micro_batch_size=micro)
    cluster = rl.RLCluster(
        actor=tunix_model(cfg, params, mesh), reference=tunix_model(cfg, params, mesh),
        tokenizer=trl_peer.word_level_tokenizer(cfg.vocab_size),
        cluster_config=rl.ClusterConfig(role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh,
                                                      rl.Role.ROLLOUT: mesh},
                                        rollout_engine="vanilla", training_config=training, rollout_config=rollout))
    # k3 ("low_var_kl"), clip 0.2, one iteration, token mean within a sequence then mean over sequences (its default)
    algo = grpo_learner.GRPOConfig(num_generations=group, num_iterations=1, beta=beta, kl_loss_mode="low_var_kl",
                                   epsilon=0.2)
    tokenizer = trl_peer.word_level_tokenizer(cfg.vocab_size)
    score = lambda prompts, completions, **_: [reward(tokenizer(c)["input_ids"]) for c in completions]
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=score)
    # as rl_step.forced_rollout: a row that stops before the limit has EOS as its token lengths[n] - 1
    force_lengths(cluster.rollout._sampler, np.where(lengths_N < new_tokens, lengths_N - 1, -1), eos_id)
    parts: dict[str, float] = {}
    cluster.generate = _timed(cluster.generate, "generate_s", parts)
    cluster.get_ref_per_token_logps = _timed(cluster.get_ref_per_token_logps, "ref_s", parts)
    prompts = list(np.repeat(words(prompts_BxP), group))  # what its data loop feeds a step: each prompt G times

    def run() -> dict[str, float]:
        parts.update(generate_s=0.0, ref_s=0.0)
        rollout.seed = jax.random.PRNGKey(seed + cluster.global_steps)
        with compiles.CompileCounter() as counted:
            start = time.perf_counter()
            example = learner._generate_and_compute_advantage({"prompts": prompts})
            scored = time.perf_counter()
            rows = micro * group  # its micro-batches, as its data loop would feed them: one optimizer step in all
            cluster.update_actor([jax.tree.map(lambda x, i=i: x[i:i + rows], example)
                                  for i in range(0, B * group, rows)], None, False)
            jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
            end = time.perf_counter()
        cluster.global_steps += 1
        return dict(seconds=end - start, generate_s=parts["generate_s"], ref_s=parts["ref_s"],
                    reward_s=scored - start - parts["generate_s"] - parts["ref_s"], update_s=end - scored,
                    **counted.split())
    return run


def micro_prompts(prompts: int, group: int, seq_len: int, budget: int = 64 * 160) -> int:
    """Prompts per tunix micro-batch (its gradient accumulation, and its reference pass's chunk): the most that
    divide `prompts` with at most `budget` row positions (64 rows of 32 + 128 fit this 24 GB machine; its update
    on 64 rows of 32 + 512 asked for a 34 GB buffer), at least one prompt."""
    fits = [m for m in range(1, prompts + 1) if prompts % m == 0 and m * group * seq_len <= budget]
    return max(fits, default=1)


def _timed(fn: Callable, key: str, parts: dict[str, float]) -> Callable:
    def wrapper(*a, **kw):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*a, **kw))
        parts[key] += time.perf_counter() - start
        return out
    return wrapper
