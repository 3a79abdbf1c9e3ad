"""The RL loop: rollouts -> rewards -> group advantages -> reference log-probs -> jitted updates.

Reads top to bottom: mesh -> task -> model/optimizer -> sharded state -> train_step -> restore -> loop.
The policy params are donated to train_step and read by the sampler in place; the reference params are made once.
"""

from __future__ import annotations

import functools
import json
import logging as pylogging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sage_jax import model as model_lib
from sage_jax import checkpoint, evaluation, objectives, packing, rollouts, sampler, sharding, tasks
from sage_jax import logging as slog
from sage_jax.rewards.pool import RewardPool

log = pylogging.getLogger("sage_jax")


# --------------------------------------------------------------------------------------------------- model

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
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model path {path!r} does not exist: set --config.model.path to a local Hugging "
                                    "Face directory (config.json + *.safetensors)")
        base, params = model_lib.load_hf(path, dtype=jnp.dtype(config.model.param_dtype), mesh=mesh, rules=rules)
        cfg = model_config(config, base=base)
    else:
        cfg = model_config(config, vocab_size=getattr(tokenizer, "vocab_size", None))
        shardings = sharding.param_shardings(cfg, mesh, rules)
        init = jax.jit(functools.partial(model_lib.init_params, cfg), out_shardings=shardings)
        params = init(jax.random.key(config.seed))
    if tokenizer is not None:
        cfg = cfg.replace(eos_token_ids=tuple(tokenizer.eos_ids), pad_token_id=int(tokenizer.pad_id))
    return cfg, params


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


def state_shardings(params, tx, cfg, mesh, rules):
    """Shardings of the train state: optimizer moments take their param's sharding (never replicated)."""
    param_sh = sharding.param_shardings(cfg, mesh, rules)
    abstract = jax.eval_shape(lambda p: init_state(p, tx), params)
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, abstract["opt_state"], param_sh,
                                   transform_non_params=lambda _: sharding.replicated(mesh))
    return {"step": sharding.replicated(mesh), "params": param_sh, "opt_state": opt_sh}


def create_state(params, tx, cfg, mesh, rules):
    """The train state, born sharded (params donated into it)."""
    shardings = state_shardings(params, tx, cfg, mesh, rules)
    state = jax.jit(lambda p: init_state(p, tx), out_shardings=shardings, donate_argnums=0)(params)
    return state, shardings


# --------------------------------------------------------------------------------------------------- step

def make_train_step(cfg, loss_cfg: objectives.LossConfig, tx, schedule, seed: int, grad_accum: int = 1,
                    shardings=None, loss_fn=None):
    """jitted train_step(state, batch) -> (state, metrics); state is donated.

    batch holds [N, ...] arrays (see objectives.loss_fn) and a scalar `rl_step` that keys the guides' randomness
    and schedules. With grad_accum > 1 the rows are split into micro-batches whose gradients are averaged.
    """
    loss_fn = loss_fn or objectives.loss_fn

    def grads_of(params, arrays, rl_step, key):
        return jax.value_and_grad(loss_fn, has_aux=True)(params, arrays, cfg, loss_cfg, rl_step, key)

    def train_step(state, batch):
        rl_step = batch["rl_step"]
        arrays = {k: v for k, v in batch.items() if k != "rl_step"}
        key = jax.random.fold_in(jax.random.key(seed), rl_step)
        if grad_accum == 1:
            (_, metrics), grads = grads_of(state["params"], arrays, rl_step, key)
        else:
            # strided split: micro-batch m holds rows m, m+A, ..., so each device keeps its own rows
            micro = jax.tree.map(lambda a: a.reshape(a.shape[0] // grad_accum, grad_accum, *a.shape[1:]).swapaxes(0, 1),
                                 arrays)

            def body(acc, mb):
                (_, m), g = grads_of(state["params"], mb, rl_step, key)
                return jax.tree.map(jnp.add, acc, (g, m)), None
            (_, m0), g0 = jax.eval_shape(grads_of, state["params"], jax.tree.map(lambda a: a[0], micro), rl_step, key)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (g0, m0))
            (grads, metrics), _ = jax.lax.scan(body, zeros, micro)
            grads, metrics = jax.tree.map(lambda x: x / grad_accum, (grads, metrics))
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = dict(metrics, **{"opt/grad_norm": optax.tree.norm(grads), "opt/lr": schedule(state["step"])})
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    if shardings is None:
        return jax.jit(train_step, donate_argnums=0)
    return jax.jit(train_step, donate_argnums=0, in_shardings=(shardings, None), out_shardings=(shardings, None))


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




# --------------------------------------------------------------------------------------------------- evaluation

def make_generate_fn(task: tasks.Task, cfg, params, eval_cfg, rollout_cfg, seed: int):
    """generate_fn(prompt_token_lists, n) -> texts, for evaluation.evaluate."""
    max_new = eval_cfg.max_new_tokens or rollout_cfg.max_new_tokens
    calls = [0]

    def generate_fn(prompts, n):
        calls[0] += 1
        out = sampler.generate(cfg, params, prompts, max_new_tokens=max_new, temperature=eval_cfg.temperature,
                               top_p=eval_cfg.top_p, min_p=eval_cfg.min_p, eos_ids=cfg.eos_token_ids,
                               seed=jax.random.fold_in(jax.random.key(seed), calls[0]), num_samples=n,
                               pad_id=cfg.pad_token_id)
        tokens, lengths = sharding.to_host((out.tokens, out.lengths))
        texts = [task.tokenizer.decode(t[:l]) for t, l in zip(tokens, lengths)]
        return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]
    return generate_fn


def run_eval(task: tasks.Task, cfg, params, config, out_dir: str, pool: RewardPool, tag: str) -> dict[str, Any]:
    """pass@k on every eval set of the task; returns {dataset: {"pass@k": value}}."""
    ev = config.eval
    results = {}
    for name, examples in task.evals.items():
        examples = examples[:ev.problems] if ev.problems else examples
        reward = lambda text, ex: float(pool.score([text], [task.gold(ex)])[0])
        res = evaluation.evaluate(cfg, params, task.tokenizer, examples, reward, n=ev.n, ks=list(ev.ks),
                                  out_dir=os.path.join(out_dir, name), template=task.template, run_name=tag,
                                  generate_fn=make_generate_fn(task, cfg, params, ev, config.rollout, config.seed),
                                  batch_problems=max(1, 256 // ev.n), progress=config.train.progress)
        results[name] = {f"pass@{k}": v for k, v in res["pass_at_k"].items()}
    # summary.json layout: the first eval set's pass@k at the top, every set under "datasets"
    first = next(iter(results.values()), {})
    return {**first, "datasets": results}


# --------------------------------------------------------------------------------------------------- the loop

def _rl_step_data(task, cfg, params, config, rl_step, pool, loss_cfg):
    """Rollouts + rewards (+ DAPO dynamic sampling) for one RL step; host arrays."""
    ro_cfg, tr = config.rollout, config.train
    G, B = ro_cfg.group_size, ro_cfg.prompts_per_step
    parts, kept = [], 0
    for attempt in range(1 + (tr.max_resample if tr.dynamic_sampling else 0)):
        examples = task.train_batch(rl_step * (1 + tr.max_resample) + attempt if tr.dynamic_sampling else rl_step,
                                    B, config.seed)
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), rl_step), attempt)
        ro = rollouts.rollout(task, cfg, params, examples, ro_cfg, key, config.data.max_prompt_len)
        # each process scores its own share of the rows; everyone gets all rewards back
        mine = sharding.local_rows(len(ro["texts"]))
        ro["rewards"] = sharding.allgather_rows(pool.score(ro["texts"][mine], ro["golds"][mine]).astype(np.float32))
        ro["correct"] = (ro["rewards"] >= 1.0).astype(np.float32)
        ro["rewards"] = ro["rewards"] + rollouts.overlong_penalty(ro["lengths"], ro_cfg.max_new_tokens, tr.overlong_buffer,
                                                   tr.overlong_penalty)
        parts.append(ro)
        if not tr.dynamic_sampling:
            break
        kept += int((~np.asarray(objectives.zero_variance_groups(ro["rewards"], G))).sum())
        if kept >= B:
            break
    ro = rollouts.concat_rollouts(parts, cfg.pad_token_id)
    zero_var = np.asarray(objectives.zero_variance_groups(ro["rewards"], G))
    stats = {"rl/zero_var_groups": float(zero_var[:B].mean()) if not tr.dynamic_sampling else float(zero_var.mean())}
    if tr.dynamic_sampling:
        # informative groups first; degenerate ones only fill up what resampling could not
        order = np.concatenate([np.flatnonzero(~zero_var), np.flatnonzero(zero_var)])[:B]
        ro = rollouts.take_rows(ro, (order[:, None] * G + np.arange(G)).reshape(-1))
        stats["rl/resample_rounds"] = float(len(parts) - 1)
    return ro, stats


def run_rl(config, workdir: str, params_override=None) -> dict[str, Any]:
    """Train with RL from config; resumes from workdir's checkpoints. Returns the summary dict."""
    os.makedirs(workdir, exist_ok=True)
    primary = jax.process_index() == 0
    tr, ro_cfg, optim = config.train, config.rollout, config.optim
    rules = dict(config.mesh.rules)

    # mesh -> task -> model/optimizer
    mesh = sharding.make_mesh(tuple(config.mesh.shape))
    task = tasks.build(config)
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        cfg, params = load_or_init_params(config, mesh, rules, task.tokenizer)
        if params_override is not None:
            params = jax.device_put(params_override, sharding.param_shardings(cfg, mesh, rules))
        ref_cfg = cfg.replace(compute_dtype=config.model.ref_dtype)
        ref_params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(config.model.ref_dtype), p))(params)
        loss_cfg = loss_config(config)
        updates_per_step = optim.num_iterations * optim.mini_batches
        tx, schedule = make_optimizer(optim, tr.steps * updates_per_step)
        state, shardings = create_state(params, tx, cfg, mesh, rules)
        del params
        train_step = make_train_step(cfg, loss_cfg, tx, schedule, config.seed, optim.grad_accum, shardings,
                                     loss_fn=packing.loss_fn if tr.packing else None)

        # restore
        ckpt = checkpoint.Checkpointer(os.path.join(workdir, "rl"), keep=tr.keep_ckpts)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        restored = ckpt.restore(abstract)
        start = 0
        if restored is not None:
            _, state, meta = restored
            start = int(meta["rl_step"])
            log.info("resumed from %s at RL step %d", os.path.join(workdir, "rl"), start)

        logger = slog.MetricsLogger(workdir, config.to_dict(), use_tensorboard=tr.use_tensorboard,
                                    use_wandb=tr.use_wandb)
        late = slog.LateMetrics()
        summary_path = os.path.join(workdir, "summary.json")
        summary = _read_summary(summary_path)
        with RewardPool(tr.reward if tr.reward else task.reward, num_workers=tr.reward_workers,
                        timeout_s=tr.reward_timeout) as pool:
            if config.eval.at_start and "before" not in summary and task.evals:
                summary["before"] = run_eval(task, cfg, state["params"], config,
                                             os.path.join(workdir, "eval", "before"), pool, "before")
                _write_summary(summary_path, summary, primary)
            progress = slog.Progress(total=tr.steps, initial=start, enabled=tr.progress and primary)
            last_good = start if restored is not None else None
            for rl_step in range(start, tr.steps):
                t0 = time.perf_counter()
                ro, stats = _rl_step_data(task, cfg, state["params"], config, rl_step, pool, loss_cfg)
                t_rollout = time.perf_counter() - t0
                adv = objectives.group_advantages(jnp.asarray(ro["rewards"]), ro_cfg.group_size,
                                                  scale=loss_cfg.adv_scale, eps=loss_cfg.adv_eps,
                                                  ddof=loss_cfg.std_ddof, estimator=loss_cfg.adv_estimator)
                slices = packing.slice_count(len(ro["lengths"]), ro_cfg.group_size,
                                             mesh.shape["data"] * mesh.shape["fsdp"], optim.grad_accum,
                                             optim.mini_batches) if tr.packing else 1
                batch = rollouts.build_batch(ro, np.asarray(adv), cfg.pad_token_id, ro_cfg.max_new_tokens,
                                             packed=tr.packing, slices=slices)
                P = ro["prompt_tokens"].shape[1]
                mine = sharding.local_rows(batch["tokens"].shape[0])  # this process feeds its share
                dev = {k: sharding.global_batch(v[mine], mesh) for k, v in batch.items()}
                no_grad = dict(prompt_len=P, temperature=loss_cfg.temperature, rows_per_pass=tr.logprob_rows)
                packed = packing.is_packed(batch)
                logprobs = ((lambda c, p: packing.sequence_logprobs_in_passes(
                                c, p, dev, temperature=loss_cfg.temperature, rows_per_pass=tr.logprob_rows))
                            if packed else
                            (lambda c, p: sequence_logprobs(c, p, dev["tokens"], dev["mask"], **no_grad)))
                dev["ref_logp"], _ = logprobs(ref_cfg, ref_params)
                if updates_per_step > 1 or loss_cfg.kl_in_reward:
                    dev["old_logp"], old_ent = logprobs(cfg, state["params"])
                if loss_cfg.kl_in_reward:
                    view = packing.row_view if packed else (lambda a: a)  # the penalty needs rows [N, C]
                    rows = {k: view(dev[k]) for k in ("completion_mask", "old_logp", "ref_logp")}
                    adv = _advantages_with_kl_penalty(ro, rows, view(old_ent), loss_cfg, rl_step, config)
                    dev["advantages"] = adv.reshape(dev["advantages"].shape)
                dev["rl_step"] = np.int32(rl_step)
                t1 = time.perf_counter()
                for _ in range(optim.num_iterations):
                    # packed: the rows are slices of whole groups
                    for mb in _mini_batches(dev, optim.mini_batches, 1 if packed else ro_cfg.group_size, rl_step):
                        state, metrics = train_step(state, mb)
                host = {**stats, "rl/reward": float(ro["rewards"].mean()), "rl/accuracy": float(ro["correct"].mean()),
                        "rl/truncated": float((~ro["finished"]).mean()),
                        "rl/gen_len": float(ro["lengths"].mean()),
                        "time/rollout_s": t_rollout, "time/rl_step": rl_step}
                previous = late.push(rl_step, metrics)
                step_time = time.perf_counter() - t0
                host.update({"time/update_s": time.perf_counter() - t1, "time/step_s": step_time,
                             "perf/tokens_per_s": packing.num_tokens(batch) / step_time,
                             "perf/padded_frac": packing.padded_fraction(batch)})
                if previous is not None:
                    _report(previous, logger, progress, last_good, workdir)
                logger.log(rl_step, host)
                progress.update(rl_step + 1, host)
                if tr.sample_every and rl_step % tr.sample_every == 0:
                    logger.log_samples(rl_step, [{"prompt": p, "completion": c, "reward": float(r)} for p, c, r in
                                                 zip(ro["prompts"][:4], ro["texts"][:4], ro["rewards"][:4])])
                done = rl_step + 1
                if done % tr.ckpt_every == 0 or done == tr.steps:
                    _report(late.flush(), logger, progress, last_good, workdir)
                    ckpt.save(done, state, {"rl_step": done, "seed": config.seed})
                    last_good = done
                if tr.eval_every and done % tr.eval_every == 0 and done != tr.steps:
                    res = run_eval(task, cfg, state["params"], config, os.path.join(workdir, "eval", f"step{done}"),
                                   pool, f"step{done}")
                    logger.log(rl_step, {f"eval/{d}/{k}": v for d, r in res["datasets"].items()
                                         for k, v in r.items()})
            _report(late.flush(), logger, progress, last_good, workdir)
            progress.close()
            ckpt.wait()
            if config.eval.at_end and task.evals and ("after" not in summary or summary.get("after_step") != tr.steps):
                summary["after"] = run_eval(task, cfg, state["params"], config,
                                            os.path.join(workdir, "eval", "after"), pool, "after")
                summary["after_step"] = tr.steps
                _write_summary(summary_path, summary, primary)
        if tr.export_hf:
            model_lib.save_hf(os.path.join(workdir, "hf_export"), cfg, state["params"])
        ckpt.close()
        logger.close()
    summary["state"] = state
    summary["model_cfg"] = cfg
    return summary


def loss_config(config) -> objectives.LossConfig:
    """LossConfig from config.loss; log-probs and entropies are of the sampling (temperature-scaled) policy."""
    import dataclasses
    loss_cfg = objectives.LossConfig.from_config(config.loss, total_steps=config.train.steps)
    temperature = config.rollout.temperature
    return dataclasses.replace(loss_cfg, temperature=float(temperature) if temperature > 0 else 1.0)


def _mini_batches(dev, n_mb: int, group_size: int, rl_step: int):
    """Split rows into n_mb mini-batches of whole groups (order shuffled per step)."""
    if n_mb == 1:
        yield dev
        return
    N = dev["tokens"].shape[0]
    if (N // group_size) % n_mb:
        raise ValueError(f"optim.mini_batches={n_mb} must divide the {N // group_size} prompt groups per step")
    groups = np.random.default_rng(rl_step).permutation(N // group_size).reshape(n_mb, -1)
    for g in groups:
        rows = (g[:, None] * group_size + np.arange(group_size)).reshape(-1)
        yield {k: (v if v.ndim == 0 else v[rows]) for k, v in dev.items()}


def _advantages_with_kl_penalty(ro, dev, entropy, loss_cfg, rl_step, config):
    """KL as a k1 penalty in the reward: r - beta * sum_t (logp - ref_logp - log q), then group-normalised."""
    from sage_jax import guides
    mask = dev["completion_mask"]
    key = jax.random.fold_in(jax.random.key(config.seed + 1), rl_step)
    log_q = guides.compute_log_q(loss_cfg.guide.name, dev["old_logp"], entropy, mask, key, loss_cfg.guide, rl_step)
    penalty = objectives.kl_reward_penalty(dev["old_logp"], dev["ref_logp"], log_q, mask, loss_cfg.beta)
    rewards = jnp.asarray(ro["rewards"]) + penalty
    return objectives.group_advantages(rewards, config.rollout.group_size, scale=loss_cfg.adv_scale,
                                       eps=loss_cfg.adv_eps, ddof=loss_cfg.std_ddof, estimator=loss_cfg.adv_estimator)


def _report(metrics, logger, progress, last_good, workdir):
    if metrics is None:
        return
    step, values = metrics
    slog.check_finite(step, values, last_good, workdir=os.path.join(workdir, "rl"))
    logger.log(step, values)
    progress.update(step + 1, values)


def _read_summary(path):
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _write_summary(path, summary, primary):
    """summary.json, and next to it pass_at_k.png: one curve per (phase, eval set) that has been evaluated."""
    if not primary:
        return
    evaluation.write_json(path, {k: v for k, v in summary.items() if k not in ("state", "model_cfg")})
    curves = {f"{phase}: {name}": {int(k.split("@")[1]): v for k, v in table.items()}
              for phase in ("before", "after") if phase in summary
              for name, table in summary[phase].get("datasets", {}).items()}
    if curves:
        evaluation.plot_pass_at_k(curves, os.path.join(os.path.dirname(path), "pass_at_k.png"),
                                  title="pass@k before and after RL")


def run(config, workdir: str) -> dict[str, Any]:
    """The whole job: optional SFT warm-start, RL, before/after evaluation; prints the final table."""
    params = None
    if config.sft.steps > 0:
        from sage_jax import supervised
        _, params = supervised.run_sft(config, os.path.join(workdir, "sft"))
    summary = run_rl(config, workdir, params_override=params)
    if jax.process_index() == 0 and "after" in summary:
        print(format_summary(summary))
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    rows = []
    for phase in ("before", "after"):
        for dataset, values in summary.get(phase, {}).get("datasets", {}).items():
            rows.append((phase, dataset, values))
    if not rows:
        return ""
    keys = sorted({k for _, _, v in rows for k in v}, key=lambda k: int(k.split("@")[1]))
    lines = ["| phase | dataset | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    lines += [f"| {p} | {d} | " + " | ".join(f"{v[k]:.3f}" for k in keys) + " |" for p, d, v in rows]
    return "\n".join(lines)
