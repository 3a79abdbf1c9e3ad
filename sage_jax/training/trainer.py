"""The RL loop. One step (`rl_step`): rollouts -> rewards -> group advantages -> reference / old log-probs ->
jitted updates -> metrics; `run_rl` is its setup, loop and hooks (checkpoints, evaluation, logging). Reads top to
bottom: mesh -> task -> model/optimizer -> sharded state -> train_step -> restore -> loop. The policy params are
donated to train_step and read by the sampler in place; the reference params are made once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging as pylogging
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax.data import tasks
from sage_jax.eval import passk as evaluation
from sage_jax.models import build, lora, sharding
from sage_jax.rl import guides, objectives, packing
from sage_jax.run import checkpoint, config as config_lib, guard as run_guard, metrics_log as slog, paths
from sage_jax.run import record as run_record
from sage_jax.training import offpolicy, partial as partial_lib, rollouts, supervised
from sage_jax.models import decoder as model_lib
from sage_jax.training import step_timing, state as train_state
from sage_jax.rewards.pool import RewardPool
from sage_jax.training.rollouts import collect_phases, collect_rollouts  # run_rl's collect: collect_phases

log = pylogging.getLogger("sage_jax")

# (policy params, RL step) -> (scored rollouts in rollouts.rollout's layout plus "rewards" and "correct", host stats)
CollectFn = Callable[[Any, int], tuple[dict[str, Any], dict[str, float]]]


# --------------------------------------------------------------------------------------------------- one RL step

@dataclasses.dataclass(frozen=True)
class RLContext:
    """What one RL step reads besides the train state; made once per run (`rl_context`)."""
    cfg: model_lib.ModelConfig          # the policy's
    ref_cfg: model_lib.ModelConfig
    ref_params: Any
    loss_cfg: objectives.LossConfig
    train_step: Callable[[Any, dict[str, Any]], tuple[Any, dict[str, jax.Array]]]
    mesh: Any
    group_size: int
    max_new_tokens: int
    num_iterations: int = 1
    mini_batches: int = 1
    logprob_rows: int = 0                # rows per no-grad log-prob pass (0: all at once)
    seed: int = 0
    packing: bool = False                # passes and updates on packed rows (packing.py)
    grad_accum: int = 1
    lora_cfg: lora.LoraConfig | None = None  # LoRA: the state trains adapters on the frozen `base`
    base: Any = None
    off_policy: bool = False             # train.off_policy_steps > 0 or rollout.partial: tokens of earlier policies
    shapes: set = dataclasses.field(default_factory=set, compare=False)  # packed shapes compiled (build_batch)

    def policy(self, trained) -> Any:
        """The params to sample and score the policy with: the trained params, or with LoRA base + adapters."""
        return lora.policy(self.base, trained, self.lora_cfg)


class StepOutput(NamedTuple):
    state: Any
    metrics: dict[str, jax.Array]        # the last update's, on device (fetch them one step late)
    host: dict[str, float]               # rollout statistics and timings
    rollouts: dict[str, Any]


def rl_step(ctx: RLContext, state, step: int, collect: CollectFn) -> StepOutput:
    """One RL step: `collect` samples and scores rollouts with the current policy (off-policy: hands back a batch an
    earlier policy sampled, offpolicy.py), then every update of the step. Each time/* phase waits for its outputs."""
    clock = step_timing.PhaseClock()
    ro, stats = collect(ctx.policy(state["params"]), step)
    clock.lap("rollout")                 # host arrays: generation and scoring are done
    lc = ctx.loss_cfg
    adv = objectives.group_advantages(jnp.asarray(ro["rewards"]), ctx.group_size, scale=lc.adv_scale,
                                      eps=lc.adv_eps, ddof=lc.std_ddof, estimator=lc.adv_estimator)
    batch = _loss_batch(ctx, ro, np.asarray(adv), step)
    mine = sharding.local_rows(batch["tokens"].shape[0])  # this process feeds its share
    dev = {k: sharding.global_batch(v[mine], ctx.mesh) for k, v in batch.items()}
    packed = packing.is_packed(batch)
    clock.lap("batch", dev)
    dev["ref_logp"], _ = _no_grad_logprobs(ctx, ctx.ref_cfg, ctx.ref_params, dev, ro, packed)
    clock.lap("ref", dev["ref_logp"])
    sequence_kl = lc.kl_in_loss and lc.kl_estimator in objectives.SEQUENCE_ESTIMATORS
    # off-policy, the ratio's denominator is the behaviour policy (the sampler's log-probs), so the pre-update pass
    # is needed only for the terms computed once per step, which read the current policy as on-policy
    if lc.kl_in_reward or sequence_kl or (ctx.num_iterations * ctx.mini_batches > 1 and not ctx.off_policy):
        dev["old_logp"], old_entropy = _no_grad_logprobs(ctx, ctx.cfg, ctx.policy(state["params"]), dev, ro, packed)
        # the KL terms computed once per step need whole groups as rows [N, C], before the batch is split
        keep = lambda a: a
        view = functools.partial(packing.to_rows, row_index=batch["row_index"]) if packed else keep
        back = functools.partial(packing.from_rows, row_index=batch["row_index"]) if packed else keep
        rows = {k: view(dev[k]) for k in ("completion_mask", "sampled_mask", "old_logp", "ref_logp") if k in dev}
        if lc.kl_in_reward:
            dev["advantages"] = back(_advantages_with_kl_penalty(ctx, ro, rows, view(old_entropy), step))
        if sequence_kl:
            dev["seq_kl_coef"] = back(objectives.forward_kl_coefficients(
                rows["old_logp"], rows["ref_logp"], _old_log_q(ctx, rows, view(old_entropy), step),
                objectives.sampled_tokens(rows), ctx.group_size))
        clock.lap("old", dev)
    if ctx.off_policy:
        dev["old_logp"] = dev["sampler_logp"]
    dev["rl_step"] = np.int32(step)
    for _ in range(ctx.num_iterations):
        for mb in _mini_batches(dev, ctx.mini_batches, ctx.group_size, step, packed):
            state, metrics = ctx.train_step(state, mb, *(() if ctx.lora_cfg is None else (ctx.base,)))
    clock.lap("update", state, metrics)
    host = {**stats, "rl/reward": float(ro["rewards"].mean()), "rl/accuracy": float(ro["correct"].mean()),
            "rl/truncated": float((~ro["finished"]).mean()), "rl/gen_len": float(ro["lengths"].mean()),
            **clock.laps, "time/step_s": clock.total(), "time/rl_step": step,
            "perf/tokens_per_s": packing.num_tokens(batch) / clock.total(),
            "perf/padded_frac": packing.padded_fraction(batch)}
    return StepOutput(state, metrics, host, ro)


def _loss_batch(ctx: RLContext, ro, adv_N: np.ndarray, rl_step: int) -> dict[str, np.ndarray]:
    """The step's loss batch on the host: padded rows, or packed slices that split over devices x micro-batches x
    mini-batches (each mini-batch the padded layout's rows)."""
    if not ctx.packing:
        return rollouts.build_batch(ro, adv_N, ctx.cfg.pad_token_id, ctx.max_new_tokens)
    N = len(ro["lengths"])
    slices = packing.slice_options(N, ctx.group_size, _data_parallel(ctx.mesh), ctx.grad_accum, ctx.mini_batches)
    groups = rollouts.mini_batch_rows(N, ctx.mini_batches, ctx.group_size, rl_step) if ctx.mini_batches > 1 else None
    return rollouts.build_batch(ro, adv_N, ctx.cfg.pad_token_id, ctx.max_new_tokens, packed=True, slices=slices,
                                row_groups=groups, shapes=ctx.shapes)


def _data_parallel(mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def _train_steps(make_step: Callable[[int], Callable], grad_accum: int, data_parallel: int) -> Callable:
    """train_step(state, batch, *base) with as many micro-batches as the batch has (packing.micro_batches: a packed
    step may use fewer than optim.grad_accum); one jitted step per count, made when first needed."""
    steps: dict[int, Callable] = {}

    def train_step(state, batch, *base):
        accum = packing.micro_batches(batch, data_parallel, grad_accum)
        if accum not in steps:
            steps[accum] = make_step(accum)
        return steps[accum](state, batch, *base)
    return train_step


def _no_grad_logprobs(ctx: RLContext, cfg, params, dev, ro, packed: bool):
    """(logp, entropy) of the batch's completion tokens under params, in the batch's layout."""
    if packed:
        return packing.sequence_logprobs_in_passes(cfg, params, dev, temperature=ctx.loss_cfg.temperature,
                                                   rows_per_pass=ctx.logprob_rows)
    return train_state.sequence_logprobs(cfg, params, dev["tokens"], dev["mask"],
                                         prompt_len=ro["prompt_tokens"].shape[1],
                                         temperature=ctx.loss_cfg.temperature, rows_per_pass=ctx.logprob_rows)


def _mini_batches(dev, n_mb: int, group_size: int, rl_step: int, packed: bool):
    """The n_mb mini-batches of rollouts.mini_batch_rows; packed, those are the batch's n_mb runs of slices."""
    if n_mb == 1:
        yield dev
        return
    S = dev["tokens"].shape[0]
    if packed:
        runs = [slice(i, i + S // n_mb) for i in range(0, S, S // n_mb)]
    else:
        runs = rollouts.mini_batch_rows(S, n_mb, group_size, rl_step)
    for rows in runs:
        yield {k: (v if v.ndim == 0 else v[rows]) for k, v in dev.items()}


def _old_log_q(ctx: RLContext, dev, entropy, rl_step: int):
    """The guide's log q from the pre-update policy (for terms computed once per RL step, outside the loss)."""
    lc = ctx.loss_cfg
    key = jax.random.fold_in(jax.random.key(ctx.seed + 1), rl_step)
    return guides.compute_log_q(lc.guide.name, dev["old_logp"], entropy, objectives.sampled_tokens(dev), key,
                                lc.guide, rl_step)


def _advantages_with_kl_penalty(ctx: RLContext, ro, dev, entropy, rl_step: int):
    """KL as a k1 penalty in the reward: r - beta * sum_t (logp - ref_logp - log q), then group-normalised."""
    lc = ctx.loss_cfg
    penalty = objectives.kl_reward_penalty(dev["old_logp"], dev["ref_logp"], _old_log_q(ctx, dev, entropy, rl_step),
                                           objectives.sampled_tokens(dev), lc.beta)
    return objectives.group_advantages(jnp.asarray(ro["rewards"]) + penalty, ctx.group_size, scale=lc.adv_scale,
                                       eps=lc.adv_eps, ddof=lc.std_ddof, estimator=lc.adv_estimator)


# --------------------------------------------------------------------------------------------------- setup

def loss_config(config) -> objectives.LossConfig:
    """LossConfig from config.loss; log-probs and entropies are of the sampling (temperature-scaled) policy."""
    loss_cfg = objectives.LossConfig.from_config(config.loss, total_steps=config.train.steps)
    temperature = config.rollout.temperature
    return dataclasses.replace(loss_cfg, temperature=float(temperature) if temperature > 0 else 1.0,
                               norm_len=loss_cfg.norm_len or int(config.rollout.max_new_tokens))


def setup_rl(config, mesh, rules, tokenizer, params_override=None) -> tuple[RLContext, Any]:
    """(the RL context, the train state born sharded) for config on mesh; call under jax.set_mesh(mesh)."""
    optim = config.optim
    cfg, params = build.load_or_init_params(config, mesh, rules, tokenizer)
    if params_override is not None:
        params = jax.device_put(params_override, model_lib.param_shardings(cfg, mesh, rules))
    ref_cfg = cfg.replace(compute_dtype=config.model.ref_dtype)
    # LoRA: the loaded weights stay frozen and are the reference as they are (no second copy); the state holds only
    # the adapters and their optimizer moments
    lora_cfg = lora.LoraConfig.from_config(config.model.lora)
    base, trained_sh, base_sh = None, None, None
    if lora_cfg is None:
        ref_params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(config.model.ref_dtype), p))(params)
    else:
        base = ref_params = params
        trained_sh, base_sh = lora.shardings(cfg, lora_cfg, mesh, rules), model_lib.param_shardings(cfg, mesh, rules)
        params = lora.init_adapters(cfg, lora_cfg, jax.random.key(config.seed), mesh, rules)
    loss_cfg = loss_config(config)
    tx, schedule = train_state.make_optimizer(optim, config.train.steps * optim.num_iterations * optim.mini_batches)
    state, shardings = train_state.create_state(params, tx, cfg, mesh, rules, trained_sh)
    make_step = lambda accum: train_state.make_train_step(
        cfg, loss_cfg, tx, schedule, config.seed, accum, shardings, loss_fn=packing.loss_fn if config.train.packing
        else None, lora_cfg=lora_cfg, base_shardings=base_sh)
    step_fn = _train_steps(make_step, optim.grad_accum, _data_parallel(mesh))
    ctx = RLContext(cfg=cfg, ref_cfg=ref_cfg, ref_params=ref_params, loss_cfg=loss_cfg, train_step=step_fn,
                    mesh=mesh, group_size=config.rollout.group_size, max_new_tokens=config.rollout.max_new_tokens,
                    num_iterations=optim.num_iterations, mini_batches=optim.mini_batches,
                    logprob_rows=config.train.logprob_rows, seed=config.seed, packing=config.train.packing,
                    grad_accum=optim.grad_accum, lora_cfg=lora_cfg, base=base,
                    off_policy=config.train.get("off_policy_steps", 0) > 0 or config.rollout.get("partial", False))
    return ctx, state


# --------------------------------------------------------------------------------------------------- the loop

class RLResult(NamedTuple):
    summary: dict[str, Any]              # what summary.json holds
    cfg: model_lib.ModelConfig
    state: Any                           # the final train state, on the mesh
    policy: Any                          # the params to sample the trained policy with (LoRA: base + adapters)


def run_rl(config, workdir: str, task: tasks.Task | None = None, params_override=None) -> RLResult:
    """Train with RL from config (on `task`, default tasks.build(config)); resumes from workdir's checkpoints."""
    config_lib.validate(config)
    paths.makedirs(workdir)  # a local folder or a gs:// bucket alike (run/paths.py)
    tr, rules = config.train, dict(config.mesh.rules)
    k = tr.get("off_policy_steps", 0)
    mesh, rollout_mesh = sharding.make_meshes(tuple(config.mesh.shape), config.mesh.get("rollout_devices", 0))
    task = task or tasks.build(config)
    with jax.set_mesh(mesh), sharding.use_rules(rules), run_guard.locked(workdir):
        ctx, state = setup_rl(config, mesh, rules, task.tokenizer, params_override)
        ckpt = checkpoint.Checkpointer(os.path.join(workdir, "rl"), keep=tr.keep_ckpts)
        weights = sharding.fingerprint(ctx.base if ctx.lora_cfg else state["params"])  # as loaded (or warm-started)
        model = {**checkpoint.model_meta(ctx.cfg), "weights_fingerprint": weights}  # a resume with other settings
        run_record.check_resume(config, ckpt, workdir, check_model=lambda: ckpt.check_model(model))  # stops here
        state, start = _restore(ckpt, state, workdir)
        logger = slog.MetricsLogger(workdir, None if start else config.to_dict(), use_tensorboard=tr.use_tensorboard,
                                    use_wandb=tr.use_wandb, resume_step=start)  # a resume keeps config.json
        summary = Summary(os.path.join(workdir, "summary.json"))
        carry = partial_lib.Carry(workdir, k) if config.rollout.get("partial", False) else None
        if carry is None and start:
            partial_lib.report_dropped(workdir, start)  # partial rollouts turned off at resume: rows in flight go
        collect_fn = collect_phases if carry is None else functools.partial(partial_lib.collect_phases, carry=carry)
        with RewardPool(tr.reward or task.reward, num_workers=tr.reward_workers, timeout_s=tr.reward_timeout,
                        memory_mb=tr.reward_memory_mb) as pool, offpolicy.Pipeline(
                functools.partial(collect_fn, task, ctx.cfg, config, offpolicy.TimedPool(pool)), k, tr.steps,
                mesh=rollout_mesh or mesh, rules=rules, place=offpolicy.placement(ctx, rollout_mesh, rules, k > 0),
                workdir=workdir) as collect:
            evaluate = lambda params, tag: run_eval(task, ctx.cfg, params, config,
                                                    os.path.join(workdir, "eval", tag), pool, tag)
            if config.eval.at_start and task.evals and "before" not in summary.data:
                summary.update(before=evaluate(ctx.policy(state["params"]), "before"))
            late, watch = slog.LateMetrics(), checkpoint.FiniteWatch(ckpt, start if start else None)
            progress = slog.Progress(total=tr.steps, initial=start, enabled=tr.progress and jax.process_index() == 0)
            report = lambda m: _report(m, logger, progress, watch)
            record = run_record.as_record(config)
            meta = lambda done: {"rl_step": done, "seed": config.seed, "model": model, "config": record}
            save = lambda done: ckpt.save(done, state, meta(done))  # the state first: a preemption notice is short
            pending = lambda done: [x.save(done, keep=ckpt.all_steps()) for x in (collect, carry) if x]  # in flight
            stop = run_guard.StepStop("RL step", ckpt, save, lambda: report(late.flush()), (progress, logger), pending)
            for step in stop.steps(start, tr.steps):
                state, metrics, host, ro = rl_step(ctx, state, step, collect)
                report(late.push(step, metrics))
                logger.log(step, host)
                progress.update(step + 1, host)
                if tr.sample_every and step % tr.sample_every == 0:
                    logger.log_samples(step, rollouts.samples(ro, 4))
                done = step + 1
                if done % tr.ckpt_every == 0 or done == tr.steps:
                    report(late.flush())
                    save(done)
                    pending(done)
                    watch.saved(done)
                if tr.eval_every and done % tr.eval_every == 0 and done != tr.steps:
                    collect.drain()  # the reward pool is the evaluation's now
                    res = evaluate(ctx.policy(state["params"]), f"step{done}")
                    logger.log(step, {f"eval/{d}/{k}": v for d, r in res["datasets"].items() for k, v in r.items()})
            report(late.flush())
            collect.drain()
            progress.close()
            ckpt.wait()
            if config.eval.at_end and task.evals and summary.data.get("after_step") != tr.steps:
                summary.update(after=evaluate(ctx.policy(state["params"]), "after"), after_step=tr.steps)
        if tr.export_hf:
            _export(workdir, ctx, state["params"], task.tokenizer)
        ckpt.close()
        logger.close()
    return RLResult(summary.data, ctx.cfg, state, ctx.policy(state["params"]))


def _export(workdir: str, ctx: RLContext, trained, tokenizer) -> None:
    """WORKDIR/hf_export (with LoRA the merged model) and, with LoRA, the adapter as PEFT writes it."""
    if ctx.lora_cfg is None:
        checkpoint.export_hf(workdir, ctx.cfg, trained, tokenizer)
        return
    merged = jax.jit(lambda b, a: lora.merge(ctx.cfg, ctx.lora_cfg, b, a))(ctx.base, trained)
    checkpoint.export_hf(workdir, ctx.cfg, merged, tokenizer)
    paths.write_dir(os.path.join(workdir, "peft_adapter"), lambda d: lora.save_peft(d, ctx.cfg, ctx.lora_cfg, trained))


def _restore(ckpt: checkpoint.Checkpointer, state, workdir: str) -> tuple[Any, int]:
    """(state, first RL step to run): the newest good checkpoint's, or the fresh state and 0."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = ckpt.restore(abstract)
    if restored is None:
        return state, 0
    _, state, meta = restored
    log.info("resumed from %s at RL step %d", os.path.join(workdir, "rl"), int(meta["rl_step"]))
    return state, int(meta["rl_step"])


def _report(metrics, logger, progress, watch: checkpoint.FiniteWatch):
    if metrics is None:
        return
    step, values = metrics
    watch.check(step, values)
    logger.log(step, values)
    progress.update(step + 1, values)


# --------------------------------------------------------------------------------------------------- evaluation

def run_eval(task: tasks.Task, cfg, params, config, out_dir: str, pool: RewardPool, tag: str) -> dict[str, Any]:
    """pass@k on every eval set of the task; returns {dataset: {"pass@k": value}}."""
    ev = config.eval
    sampling = dict(max_new_tokens=ev.max_new_tokens or config.rollout.max_new_tokens, temperature=ev.temperature,
                    top_p=ev.top_p, min_p=ev.min_p)
    batch_problems = max(1, 256 // ev.n)
    generate_fn = evaluation.make_generate_fn(cfg, params, task.tokenizer.decode, sampling, config.seed,
                                              max_rows=batch_problems * ev.n)
    results = {}
    for name, examples in task.evals.items():
        examples = examples[:ev.problems] if ev.problems else examples
        reward = lambda text, ex: float(pool.score([text], [task.gold(ex)])[0])
        res = evaluation.evaluate(task.tokenizer, examples, reward, n=ev.n, ks=list(ev.ks),
                                  out_dir=os.path.join(out_dir, name), template=task.template, run_name=tag,
                                  generate_fn=generate_fn, batch_problems=batch_problems,
                                  progress=config.train.progress)
        results[name] = {f"pass@{k}": v for k, v in res["pass_at_k"].items()}
    # summary.json layout: the first eval set's pass@k at the top, every set under "datasets"
    first = next(iter(results.values()), {})
    return {**first, "datasets": results}


class Summary:
    """summary.json (read at start, rewritten on each update) and next to it pass_at_k.png: one curve per
    (phase, eval set) that has been evaluated. Only the first process writes."""

    def __init__(self, path: str):
        self.path = path
        self.data: dict[str, Any] = {}
        text = paths.read_agreed(path)  # process 0's file, on every process: they all evaluate or skip alike
        if text is None:
            return
        try:
            self.data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e}); delete it to recompute the before/after evaluations"
                             ) from None
        if not isinstance(self.data, dict):
            raise ValueError(f"{path} holds a {type(self.data).__name__}, not a JSON object; delete it to recompute "
                             "the before/after evaluations")

    def update(self, **entries: Any) -> None:
        self.data.update(entries)
        if jax.process_index() != 0:
            return
        evaluation.write_json(self.path, self.data)
        curves = {f"{phase}: {name}": {int(k.split("@")[1]): v for k, v in table.items()}
                  for phase in ("before", "after") if phase in self.data
                  for name, table in self.data[phase].get("datasets", {}).items()}
        if curves:
            evaluation.plot_pass_at_k(curves, os.path.join(os.path.dirname(self.path), "pass_at_k.png"),
                                      title="pass@k before and after RL")


def run(config, workdir: str, prepared=None) -> dict[str, Any]:
    """The whole job: optional SFT warm-start, RL, evaluations; prints the final table (prepared: preflight's)."""
    params, task, sft_data = None, *(prepared or (None, None))
    if config.sft.steps > 0:
        _, params = supervised.run_sft(config, os.path.join(workdir, "sft"), task, sft_data)
    summary = run_rl(config, workdir, task, params_override=params).summary
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
