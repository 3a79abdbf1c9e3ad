"""The trainer's programs on abstract inputs (ShapeDtypeStructs with shardings, no weights), for sage_jax.plan.

Two kinds: the programs as the trainer runs them (layers scanned, grad_accum micro-batches, chunked logits), whose
memory_analysis() is the plan's memory; and cost variants for sage_jax.plan.roofline, which count FLOPs and bytes. XLA's
cost analysis counts a loop body once whatever its trip count, so a cost variant has no loops to miss: layers
unrolled, one logits chunk, one micro-batch, and one decode step (prefill_program / decode_step_program: the
sampler's prefill and the body of its decode loop) instead of the whole while loop.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from sage_jax.models import lora, decode_forms, decoder as model_lib, config as model_config, sharding
from sage_jax.rl import objectives
from sage_jax.sampling import sampler
from sage_jax.training import state as train_state, trainer


@dataclasses.dataclass(frozen=True)
class Shapes:
    dp: int  # data x fsdp: the devices rows are split over
    step_rows: int  # prompts_per_step * group_size: rollouts and the reference pass
    update_rows: int  # one train_step call (a mini-batch)
    grad_accum: int
    prompt_len: int  # the prompt bucket of max_prompt_len
    completion_len: int  # the train batch's completion columns, at most max_new_tokens
    sampler_prompts: int  # prompts per generate call, padded so the rows split over dp
    sampler_rows: int
    new_bucket: int  # the sampler's bucket for max_new_tokens
    sampler_slots: int  # decode slots (rollout.slots; all rows by default), a multiple of dp

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.completion_len

    @property
    def cache_len(self) -> int:
        return self.prompt_len + self.new_bucket


def plan_shapes(config, mesh) -> Shapes:
    ro, optim = config.rollout, config.optim
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    if ro.prompts_per_step % optim.mini_batches:
        raise ValueError(f"optim.mini_batches={optim.mini_batches} must divide rollout.prompts_per_step="
                         f"{ro.prompts_per_step}")
    step_rows = ro.prompts_per_step * ro.group_size
    update_rows = step_rows // optim.mini_batches
    for what, rows in (("prompts_per_step * group_size", step_rows), ("... / optim.mini_batches", update_rows)):
        if rows % dp:
            raise ValueError(f"{what} = {rows} rows do not split over data x fsdp = {dp} devices; change "
                             "rollout.prompts_per_step, optim.mini_batches or config.mesh.shape")
    if update_rows % optim.grad_accum:
        raise ValueError(f"optim.grad_accum={optim.grad_accum} must divide the {update_rows} rows of an update")
    prompts = ro.prompts_per_step
    while (prompts * ro.group_size) % dp:  # as sampler.generate pads its batch
        prompts += 1
    slots = fixed_slots(getattr(ro, "slots", None), prompts * ro.group_size)
    return Shapes(dp=dp, step_rows=step_rows, update_rows=update_rows, grad_accum=optim.grad_accum,
                  prompt_len=sampler.prompt_bucket(config.data.max_prompt_len), completion_len=ro.max_new_tokens,
                  sampler_prompts=prompts, sampler_rows=prompts * ro.group_size,
                  new_bucket=sampler.new_tokens_bucket(ro.max_new_tokens), sampler_slots=-(-slots // dp) * dp)


def fixed_slots(value, rows: int) -> int:
    """rollout.slots as a number: None (one per row) and "auto" (the plan reports the largest that fits) plan the
    static batch of every row."""
    return rows if value in (None, "auto", "all") else int(value)


# --------------------------------------------------------------------------------------------------- abstract inputs

def tree_bytes(tree) -> int:
    """Per-device bytes of a tree of sharded ShapeDtypeStructs: shard shape x itemsize."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _abstract_outputs(fn, *args):
    """The outputs of jitted fn as ShapeDtypeStructs carrying the shardings its compiled program picks."""
    shardings = fn.lower(*args).compile().output_shardings
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        jax.eval_shape(fn, *args), shardings)


def lora_config(config) -> lora.LoraConfig | None:
    return lora.LoraConfig.from_config(config.model.lora)


def lora_summary(cfg, config) -> dict[str, Any] | None:
    lcfg = lora_config(config)
    if lcfg is None:
        return None
    return {"rank": lcfg.rank, "alpha": lcfg.alpha, "targets": list(lcfg.targets),
            "adapter_params": lora.num_params(cfg, lcfg)}


def abstract_state(cfg, config, mesh, rules):
    """(state, reference params, tx, schedule) laid out as trainer.setup_rl lays them out, without any weights.

    With LoRA (config.model.lora.rank > 0) the state trains only the adapters, and the reference is the frozen base
    itself: the one copy of the weights, which the train step and the sampler also take (see policy_params)."""
    shapes = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
    base = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                        model_lib.param_shardings(cfg, mesh, rules))
    lcfg = lora_config(config)
    params, trained_sh = base, None
    if lcfg is not None:
        trained_sh = lora.shardings(cfg, lcfg, mesh, rules)
        params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              jax.eval_shape(lambda: lora.random_adapters(cfg, lcfg, jax.random.key(0))), trained_sh)
    optim = config.optim
    tx, schedule = train_state.make_optimizer(optim, config.train.steps * optim.num_iterations * optim.mini_batches)
    shardings = train_state.state_shardings(params, tx, cfg, mesh, rules, trained_sh)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         jax.eval_shape(lambda p: train_state.init_state(p, tx), params), shardings)
    if lcfg is not None:
        return state, base, tx, schedule
    ref_dtype = config.model.ref_dtype
    ref = _abstract_outputs(jax.jit(lambda p: jax.tree.map(lambda x: x.astype(ref_dtype), p)), state["params"])
    return state, ref, tx, schedule


def policy_params(config, state, ref):
    """The params the sampler and the policy's own passes run with: the trained params, or with LoRA the base with
    the adapters on (lora.apply, which only places the scaled adapters beside the base weights: every leaf keeps an
    input's shape and sharding)."""
    lcfg = lora_config(config)
    if lcfg is None:
        return state["params"]
    adapters = state["params"]
    out = jax.eval_shape(lambda b, a: lora.apply(b, a, lcfg), ref, adapters)
    sources = {jax.tree_util.keystr(p): x for tree in (ref, adapters) for p, x in jax.tree_util.tree_leaves_with_path(
        tree)}

    def attach(path, s):
        key = jax.tree_util.keystr(path)
        src = sources.get(key) or next(x for k, x in sources.items() if key.endswith(k) and x.shape == s.shape)
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=src.sharding)
    return jax.tree_util.tree_map_with_path(attach, out)


def rollout_params(cfg, policy):
    """The weights the sampler takes: policy_params as model.compute_params casts them (float32 -> the compute
    dtype, each leaf keeping its sharding), which sampler.generate does once per call."""
    cdt = jnp.dtype(cfg.compute_dtype)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, cdt, sharding=s.sharding)
                        if model_config.narrows_to_compute(cfg, s) else s, policy)


def abstract_batch(config, shapes: Shapes, rows: int, mesh) -> dict[str, Any]:
    """The loss batch trainer.run_rl puts on the mesh (rows over data x fsdp)."""
    T, C = shapes.seq_len, shapes.completion_len
    specs = {"tokens": ((rows, T), jnp.int32), "mask": ((rows, T), jnp.int32),
             "completion_mask": ((rows, C), jnp.float32), "advantages": ((rows,), jnp.float32),
             "sampler_logp": ((rows, C), jnp.float32), "truncated": ((rows,), jnp.bool_),
             "ref_logp": ((rows, C), jnp.float32)}
    if needs_old_logprobs(config):
        specs["old_logp"] = ((rows, C), jnp.float32)
    if config.loss.kl_estimator in objectives.SEQUENCE_ESTIMATORS:
        specs["seq_kl_coef"] = ((rows,), jnp.float32)
    if tuple(config.rollout.get("tools", ())):  # tool rollouts: the sampled tokens' mask (training/tool_rollouts.py)
        specs["sampled_mask"] = ((rows, C), jnp.float32)
    batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.data_sharding(mesh, len(shape)))
             for k, (shape, dtype) in specs.items()}
    batch["rl_step"] = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(mesh))
    return batch


# --------------------------------------------------------------------------------------------------- programs

def lower_train_step(cfg, config, state, ref, tx, schedule, batch, grad_accum: int | None = None):
    """The update as trainer.setup_rl builds it; with LoRA it also takes the frozen base (ref) as an argument."""
    grad_accum = config.optim.grad_accum if grad_accum is None else grad_accum
    lcfg = lora_config(config)
    base_sh = None if lcfg is None else jax.tree.map(lambda x: x.sharding, ref)
    step = train_state.make_train_step(cfg, trainer.loss_config(config), tx, schedule, config.seed, grad_accum,
                                       jax.tree.map(lambda x: x.sharding, state), lora_cfg=lcfg,
                                       base_shardings=base_sh)
    return step.lower(state, batch) if lcfg is None else step.lower(state, batch, ref)


def needs_old_logprobs(config) -> bool:
    """Whether an RL step also scores its rows under the current policy (trainer.run_rl's old_logp pass)."""
    return (config.optim.num_iterations * config.optim.mini_batches > 1 or config.loss.kl_in_reward
            or config.loss.kl_estimator in objectives.SEQUENCE_ESTIMATORS)


def lower_logprobs(cfg, config, params, batch, shapes: Shapes):
    """train_state.sequence_logprobs_pass: one no-grad pass over a batch's rows."""
    return train_state.sequence_logprobs_pass.lower(cfg, params, batch["tokens"], batch["mask"],
                                                prompt_len=shapes.prompt_len,
                                                temperature=trainer.loss_config(config).temperature)


def lower_ref_logprobs(cfg, config, ref_params, batch, shapes: Shapes):
    return lower_logprobs(cfg.replace(compute_dtype=config.model.ref_dtype), config, ref_params, batch, shapes)


def sampler_plan(cfg, config, shapes: Shapes, mesh, forms=None) -> sampler.SamplerPlan:
    """The static settings sampler.generate picks for a rollout batch on the mesh's devices (decode_forms: the
    TPU's program for the TPU plan)."""
    ro = config.rollout
    greedy = ro.temperature == 0
    forms = forms or decode_forms.for_platform(mesh.devices.flat[0].platform, ro.get("decode_attention", "auto"))
    static = dict(num_samples=ro.group_size, new_bucket=shapes.new_bucket, greedy=greedy,
                  top_k=0 if greedy or ro.top_k >= cfg.vocab_size else ro.top_k, use_top_p=not greedy and ro.top_p < 1,
                  use_min_p=not greedy and ro.min_p > 0, mesh=mesh, unstack_layers=forms.unstack_layers,
                  forms=forms,
                  slots=shapes.sampler_slots, stages=None,  # None: the pool's shrink stages, as generate runs it
                  stop_early=False, carried=0, carrying=0,  # an on-policy call: no carried rows
                  pausing=False)  # generate's one program (tool rows in a pool session run it per width)
    fields = {f.name for f in dataclasses.fields(sampler.SamplerPlan)}
    if fields - static.keys():
        raise RuntimeError(f"sampler.SamplerPlan has fields {sorted(fields - static.keys())} that sage_jax.plan does not "
                           "know: update plan_programs.sampler_plan to match sampler.generate")
    return sampler.SamplerPlan(**{k: v for k, v in static.items() if k in fields})


def rows_arg(shape, dtype, mesh, dp: int):
    """An input as sampler.generate places it: rows over data x fsdp when they split, else replicated."""
    ok = shape and shape[0] % dp == 0
    sh = sharding.data_sharding(mesh, len(shape)) if ok else NamedSharding(mesh, PartitionSpec())
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)


def lower_sampler(cfg, config, params, shapes: Shapes, mesh, num_eos: int = 4, forms=None):
    """sampler.generate_program as sampler.generate calls it for one rollout batch (params: rollout_params)."""
    arg = functools.partial(rows_arg, mesh=mesh, dp=shapes.dp)
    B, P, N, C = shapes.sampler_prompts, shapes.prompt_len, shapes.sampler_rows, shapes.new_bucket
    # stop_groups, temperature, top_p, min_p, pad_id
    scalars = [arg((), d) for d in (jnp.int32, jnp.float32, jnp.float32, jnp.float32, jnp.int32)]
    rows = sampler.rows_lib.Rows(*(arg((N,), jnp.int32) for _ in range(4)),
                                 arg((N,), jax.eval_shape(lambda: jax.random.key(0)).dtype))  # one key per row
    per_row = [arg((N, C), jnp.int32), arg((N, C), jnp.float32), arg((N,), jnp.int32), rows]  # tokens, logp, limits
    return sampler.generate_program.lower(cfg, sampler_plan(cfg, config, shapes, mesh, forms), params,
                                           arg((B, P), jnp.int32), arg((B, P), jnp.bool_), *per_row, *scalars,
                                           arg((num_eos,), jnp.int32))


def compile_in_parallel(lowered: dict[Any, Any], measure) -> dict[Any, Any]:
    """measure(each lowered program), compiled on threads: XLA compiles outside the GIL."""
    workers = max(1, min(len(lowered), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {k: pool.submit(measure, v) for k, v in lowered.items()}
        return {k: f.result() for k, f in futures.items()}


def memory_stats(lowered) -> dict[str, int]:
    try:
        m = lowered.compile().memory_analysis()
    except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses a program that cannot fit in HBM
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return {"oom": str(e).splitlines()[0]}
    out = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes, "alias": m.alias_size_in_bytes,
           "temp": m.temp_size_in_bytes, "code": m.generated_code_size_in_bytes}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["code"]
    return out


# --------------------------------------------------------------------------------------------------- cost variants

def cost_variant(cfg, num_layers: int):
    """cfg with nothing looped that the cost analysis could count once: layers unrolled, the logits in one chunk, and
    attention as one masked product (blockwise attention loops over key blocks; it also skips the blocks above the
    diagonal, so this counts up to 2x the causal attention FLOPs, while the projections and MLP are exact)."""
    return cfg.replace(num_layers=num_layers, scan_layers=False, logits_chunk=1 << 30, attention="naive")


@functools.partial(jax.jit, static_argnames=("cfg", "num_samples", "new_bucket"))
def prefill_program(cfg, params, prompt_BxP, mask_BxP, *, num_samples: int, new_bucket: int):
    """The sampler's prefill as generate_program runs it: each prompt once into its prompt cache, the last
    position's logits for the samples (new_bucket: kept for the callers, the slot cache is not made here)."""
    B, P = prompt_BxP.shape
    mask_BxP = mask_BxP.astype(jnp.bool_)
    h_BxPxD, cache = model_lib.forward_with_cache(cfg, params, prompt_BxP, model_lib.default_positions(mask_BxP),
                                                  model_lib.init_cache(cfg, B, P), 0, mask_BxP, return_hidden=True)
    logits_NxV = jnp.repeat(model_lib.logits_from_hidden(cfg, params, h_BxPxD[:, -1:])[:, 0], num_samples, axis=0)
    return logits_NxV, sampler.constrain_cache(cache)


@functools.partial(jax.jit, static_argnames=("cfg", "plan"), donate_argnames=("cache",))
def decode_step_program(cfg, plan, params, last_N, cache, kv_mask_NxS, index, temperature, top_p, min_p, key):
    """One iteration of the sampler's decode loop: every slot's next token over the whole preallocated cache, each
    slot writing at its own position (here all at `index`)."""
    N = last_N.shape[0]
    index_N = jnp.full((N,), index)
    h_Nx1xD, cache = model_lib.forward_with_cache(cfg, params, last_N[:, None], index_N[:, None], cache,
                                                  index_N, kv_mask_NxS, return_hidden=True, forms=plan.forms)
    logits_NxV = model_lib.logits_from_hidden(cfg, params, h_Nx1xD)[:, 0]
    keys_N = sampler.row_keys(key, index_N, jnp.arange(N, dtype=jnp.int32))
    tok_N, logp_N = sampler.sample_tokens(logits_NxV, keys_N, greedy=plan.greedy,
                                          temperature=temperature, top_k=plan.top_k,
                                          top_p=top_p if plan.use_top_p else None,
                                          min_p=min_p if plan.use_min_p else None)
    return tok_N, logp_N, sampler.constrain_cache(cache)


def decode_step_lowering(cfg, config, mesh, rules, shapes: Shapes, rollout, rows: int):
    """decode_step_program lowered for `rows` slots over the whole cache, one (k, v) pair per layer (the layout
    decode_forms gives TPUs and GPUs; the cost variants' layers are unrolled). Call under jax.set_mesh(mesh) and
    sharding.use_rules(rules)."""
    arg = functools.partial(rows_arg, mesh=mesh, dp=shapes.dp)
    S, dt = shapes.cache_len, jnp.dtype(cfg.compute_dtype)
    spec = sharding.logical_to_spec(model_lib.cache_axes(), rules)
    shape = (rows, cfg.num_kv_heads, S, cfg.head_dim)
    sh = NamedSharding(mesh, spec if sharding.divides(shape, spec, mesh) else PartitionSpec())  # as constrain does
    cache = [(jax.ShapeDtypeStruct(shape, dt, sharding=sh),) * 2 for _ in range(cfg.num_layers)]
    key = arg((), jax.eval_shape(lambda: jax.random.key(0)).dtype)
    f32 = arg((), jnp.float32)
    return decode_step_program.lower(cfg, sampler_plan(cfg, config, shapes, mesh), rollout, arg((rows,), jnp.int32),
                                     cache, arg((rows, S), jnp.bool_), arg((), jnp.int32), f32, f32, f32, key)


def cost_lowerers(cfg, config, mesh, rules, shapes: Shapes, state, ref, tx, schedule) -> dict[str, Any]:
    """name -> (rows -> the lowered cost variant of that program on `rows` rows); cfg is already a cost variant.
    Call under jax.set_mesh(mesh) and sharding.use_rules(rules)."""
    arg = functools.partial(rows_arg, mesh=mesh, dp=shapes.dp)
    P = shapes.prompt_len
    policy = policy_params(config, state, ref)
    rollout = rollout_params(cfg, policy)
    lowerers = {
        "train_step": lambda r: lower_train_step(cfg, config, state, ref, tx, schedule,
                                                 abstract_batch(config, shapes, r, mesh), grad_accum=1),
        "ref_logprobs": lambda r: lower_ref_logprobs(cfg, config, ref, abstract_batch(config, shapes, r, mesh), shapes),
        "prefill": lambda r: prefill_program.lower(cfg, rollout, arg((r, P), jnp.int32),
                                                   arg((r, P), jnp.bool_), num_samples=config.rollout.group_size,
                                                   new_bucket=shapes.new_bucket),
        "decode_step": lambda r: decode_step_lowering(cfg, config, mesh, rules, shapes, rollout, r),
    }
    if needs_old_logprobs(config):
        lowerers["old_logprobs"] = lambda r: lower_logprobs(cfg, config, policy, abstract_batch(config, shapes, r, mesh),
                                                            shapes)
    return lowerers


def cost_stats(lowered) -> dict[str, float]:
    """Per-device FLOPs, bytes accessed and the compiler's own time estimate, and what the cost analysis cannot see
    into: loops left (their bodies are counted once) and Pallas kernels (custom calls, not counted at all)."""
    compiled = lowered.compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0)),
            "optimal_seconds": float(ca.get("optimal_seconds", 0.0)), **_loops_and_kernels(lowered, compiled)}


def _loops_and_kernels(lowered, compiled) -> dict[str, float]:
    """While loops and Pallas TPU kernels without a cost estimate of their own (pl.CostEstimate: the analysis counts
    those through it) in the optimised HLO; in the program as lowered (StableHLO, before XLA may unroll a loop: the
    safe side) when libtpu cannot print its optimised module, as for some 7B programs whose async collectives its HLO
    printer rejects (a RET_CHECK on an async-update's operands)."""
    unestimated = lambda text, call: float(sum(call in line and "cost_estimate" not in line
                                               for line in text.splitlines()))
    try:
        hlo = compiled.as_text()
        return {"loops": float(len(re.findall(r"\bwhile\(", hlo))),
                "kernels": unestimated(hlo, 'custom_call_target="tpu_custom_call"')}
    except jax.errors.JaxRuntimeError:
        mlir = lowered.as_text()
        return {"loops": float(len(re.findall(r"\bstablehlo\.while\b", mlir))),
                "kernels": unestimated(mlir, "custom_call @tpu_custom_call")}
