"""The train state both RL and SFT use: optimizer, state born sharded, the jitted train step, and the no-grad
log-prob pass over completions. The model config and params come from sage_jax.models.build."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from sage_jax.models import lora, sharding
from sage_jax.rl import objectives
from sage_jax.models import decoder as model_lib


# --------------------------------------------------------------------------------------------------- optimizer

def learning_rate_schedule(optim, total_updates: int) -> optax.Schedule:
    warmup = min(optim.warmup_steps, max(total_updates - 1, 0))
    if optim.schedule == "constant":
        after = optax.constant_schedule(optim.lr)
    elif optim.schedule == "cosine":
        after = optax.cosine_decay_schedule(optim.lr, max(total_updates - warmup, 1), alpha=0.1)
    else:
        raise ValueError(f"optim.schedule={optim.schedule!r}: choose 'constant' or 'cosine'")
    if not warmup:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, optim.lr, warmup), after], [warmup])


def make_optimizer(optim, total_updates: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(optim, total_updates)
    tx = optax.chain(optax.clip_by_global_norm(optim.grad_clip) if optim.grad_clip > 0 else optax.identity(),
                     optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay))
    return tx, schedule


def init_state(params, tx) -> dict[str, Any]:
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}


def state_shardings(params, tx, cfg, mesh, rules, param_sh=None):
    """Shardings of the train state: optimizer moments take their param's sharding (never replicated).

    param_sh: the trained params' shardings when they are not the model's (LoRA: lora.shardings)."""
    param_sh = model_lib.param_shardings(cfg, mesh, rules) if param_sh is None else param_sh
    abstract = jax.eval_shape(lambda p: init_state(p, tx), params)
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, abstract["opt_state"], param_sh,
                                   transform_non_params=lambda _: sharding.replicated(mesh))
    return {"step": sharding.replicated(mesh), "params": param_sh, "opt_state": opt_sh}


def create_state(params, tx, cfg, mesh, rules, param_sh=None):
    """The train state, born sharded (params donated into it)."""
    shardings = state_shardings(params, tx, cfg, mesh, rules, param_sh)
    state = jax.jit(lambda p: init_state(p, tx), out_shardings=shardings, donate_argnums=0)(params)
    return state, shardings


# --------------------------------------------------------------------------------------------------- step

def make_train_step(cfg, loss_cfg: objectives.LossConfig, tx, schedule, seed: int, grad_accum: int = 1,
                    shardings=None, loss_fn=None, lora_cfg=None, base_shardings=None):
    """jitted train_step(state, batch) -> (state, metrics); state is donated.

    batch holds [N, ...] arrays (see objectives.loss_fn) and a scalar `rl_step` that keys the guides' randomness
    and schedules. With grad_accum > 1 the rows are split into micro-batches whose gradients are averaged; token-mean
    losses keep the whole batch's token count as their normaliser.
    With lora_cfg, state["params"] are the adapters and the step is train_step(state, batch, base): the loss sees
    the frozen base with the adapters on, and only the adapters get gradients.
    """
    loss_fn = loss_fn or objectives.loss_fn

    def grads_of(params, arrays, rl_step, key, base):
        f = loss_fn if lora_cfg is None else lambda p, *rest: loss_fn(lora.apply(base, p, lora_cfg, key), *rest)
        return jax.value_and_grad(f, has_aux=True)(params, arrays, cfg, loss_cfg, rl_step, key)

    def train_step(state, batch, base=None):
        rl_step = batch["rl_step"]
        arrays = {k: v for k, v in batch.items() if k != "rl_step"}
        if loss_cfg is not None:
            arrays = objectives.with_batch_normaliser(arrays, loss_cfg)
        # state["step"] counts updates, so every mini-batch and iteration of an RL step draws its own guide noise
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), rl_step), state["step"])
        if grad_accum == 1:
            (_, metrics), grads = grads_of(state["params"], arrays, rl_step, key, base)
        else:
            # strided split: micro-batch m holds rows m, m+A, ..., so each device keeps its own rows
            micro = jax.tree.map(lambda a: a.reshape(a.shape[0] // grad_accum, grad_accum, *a.shape[1:]).swapaxes(0, 1),
                                 arrays)

            def body(acc, mb_index):
                mb, index = mb_index
                (_, m), g = grads_of(state["params"], mb, rl_step, jax.random.fold_in(key, index), base)
                return jax.tree.map(jnp.add, acc, (g, m)), None
            (_, m0), g0 = jax.eval_shape(grads_of, state["params"], jax.tree.map(lambda a: a[0], micro), rl_step, key,
                                         base)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (g0, m0))
            (grads, metrics), _ = jax.lax.scan(body, zeros, (micro, jnp.arange(grad_accum)))
            grads, metrics = jax.tree.map(lambda x: x / grad_accum, (grads, metrics))
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = dict(metrics, **{"opt/grad_norm": optax.tree.norm(grads), "opt/lr": schedule(state["step"])})
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        return keep_if_finite(state, new_state, grads, metrics)

    if shardings is None:
        return jax.jit(train_step, donate_argnums=0)
    in_shardings = (shardings, None) if lora_cfg is None else (shardings, None, base_shardings)
    return jax.jit(train_step, donate_argnums=0, in_shardings=in_shardings, out_shardings=(shardings, None))


def keep_if_finite(state, new_state, grads, metrics):
    """(new_state, metrics), or the old state if the gradients or the updated state hold a NaN/Inf: a non-finite
    update is never kept (nor saved); metrics["opt/nonfinite_update"] = 1 tells the host loop to stop."""
    floats = [x for x in jax.tree.leaves((grads, new_state)) if jnp.issubdtype(x.dtype, jnp.inexact)]
    finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in floats]))
    # a cond, not a leaf-wise where: XLA:CPU aborted on the where over a donated, restored LoRA state
    kept = jax.lax.cond(finite, lambda: new_state, lambda: state)
    return kept, dict(metrics, **{"opt/nonfinite_update": 1.0 - finite.astype(jnp.float32)})


def sequence_logprobs(cfg, params, tokens_NxT, mask_NxT, *, prompt_len: int, temperature: float,
                      rows_per_pass: int = 0):
    """(logp, entropy) [N, C] of the completion tokens (positions prompt_len..T-1) under `params`.

    With rows_per_pass, rows go through the model that many at a time (bounds the activations of a no-grad pass).
    """
    N = tokens_NxT.shape[0]
    if not rows_per_pass or rows_per_pass >= N:
        return sequence_logprobs_pass(cfg, params, tokens_NxT, mask_NxT, prompt_len=prompt_len, temperature=temperature)
    outs = [sequence_logprobs_pass(cfg, params, tokens_NxT[i:i + rows_per_pass], mask_NxT[i:i + rows_per_pass],
                               prompt_len=prompt_len, temperature=temperature) for i in range(0, N, rows_per_pass)]
    return tuple(jnp.concatenate(parts) for parts in zip(*outs))


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("prompt_len", "temperature"))
def sequence_logprobs_pass(cfg, params, tokens_NxT, mask_NxT, *, prompt_len: int, temperature: float):
    targets = jnp.concatenate([tokens_NxT[:, 1:], jnp.full_like(tokens_NxT[:, :1], cfg.pad_token_id)], axis=1)
    return model_lib.logprobs_and_entropy(cfg, params, tokens_NxT, targets, mask_BxT=mask_NxT,
                                          temperature=temperature, start=prompt_len - 1,
                                          length=tokens_NxT.shape[1] - prompt_len)
