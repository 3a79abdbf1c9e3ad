"""Ahead-of-time memory plan: does a config's RL step fit the chips, checked before renting them?

    python -m sage_jax.plan --config configs/qwen7b_branch.py --devices 32 --chip v5p
    python -m sage_jax.plan --config configs/qwen7b_branch.py --devices 32 --layers 2    # quick, extrapolated
    python -m sage_jax.plan --config configs/qwen7b_branch.py --devices 32 --no-compile  # analytic only

Simulates `--devices` CPU devices, builds the config's mesh and lowers the trainer's own programs on abstract inputs
(ShapeDtypeStructs with shardings, no weights), at the worst-case shapes a step can reach:
  train_step    one update on prompts_per_step * group_size / mini_batches rows of (prompt bucket + max_new_tokens)
                tokens, scanned over grad_accum micro-batches, state donated;
  sampler       the rollout program: prompts_per_step prompts x group_size samples, KV cache of prompt + new buckets;
  ref_logprobs  the reference model's pass over all prompts_per_step * group_size rows at once.
A program's per-device peak is argument + output - alias + temp + code bytes (compiled.memory_analysis()); its phase
adds what stays resident outside it (the optimizer state while sampling, ...). Parameter, optimizer, reference and
KV-cache bytes are also computed from the shardings (shard shape x itemsize). Exit code: 0 fits, 1 does not fit,
2 config or mesh error. A full 7B plan compiles in about a minute; `--layers N` compiles N and N + 1 layers and
extrapolates linearly to the full depth, a rough estimate (XLA's buffer reuse is not linear in depth: for
qwen7b_branch it was within 2% for the sampler but 16% low for the train step). `--no-compile` still compiles the
trainer's tiny state-init program, whose output shardings are what the trainer keeps.
CPU compiles only approximate TPU / GPU ones (fusion, layouts, bf16 handling differ): keep ~10% headroom.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Any, Sequence

GB = 1e9
CHIPS_GB = {"v5p": 95.0, "v4": 32.0, "v5e": 16.0, "h100": 80.0, "h200": 141.0}
PROGRAMS = ("train_step", "sampler", "ref_logprobs")
# The programs are compiled only to be measured, never run: skip the slow CPU code generation. Buffer assignment,
# and so memory_analysis(), comes out the same to within a few hundred bytes.
FAST_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true")

# HF checkpoint directory names -> (model preset, overrides), to plan without the checkpoint on this machine.
KNOWN_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": ("qwen2.5-0.5b", {}),
    "qwen2.5-1.5b": ("qwen2.5-1.5b", {}),
    "qwen2.5-3b": ("qwen2.5-3b", {}),
    "qwen2.5-7b": ("qwen2.5-7b", {}),
    "qwen2.5-math-1.5b": ("qwen2.5-1.5b", dict(rope_theta=1e4, max_position_embeddings=4096)),
    "qwen2.5-math-7b": ("qwen2.5-math-7b", dict(max_position_embeddings=4096)),
    "deepseek-r1-distill-qwen-1.5b": ("qwen2.5-1.5b", dict(tie_embeddings=False, rope_theta=1e4,
                                                           max_position_embeddings=131072)),
    "deepseek-r1-distill-qwen-7b": ("qwen2.5-7b", dict(rope_theta=1e4, max_position_embeddings=131072)),
    "qwen3-4b-base": ("qwen3-4b", dict(max_position_embeddings=32768)),
}


# --------------------------------------------------------------------------------------------------- flags, devices

def parse_flags(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our flags and the --config.key=value overrides; imports nothing heavy (JAX must not be loaded yet)."""
    overrides = [a for a in argv if a.startswith("--config.")]
    parser = argparse.ArgumentParser(prog="python -m sage_jax.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="configs/NAME.py[:arg]")
    parser.add_argument("--devices", type=int, required=True, help="number of simulated devices (chips)")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--memory-gb", type=float, help="memory per device in GB (1e9 bytes); default: v5p's 95")
    memory.add_argument("--chip", choices=sorted(CHIPS_GB), help="memory per device from a chip: "
                        + ", ".join(f"{k} {v:g} GB" for k, v in CHIPS_GB.items()))
    parser.add_argument("--layers", type=int, default=0, help="compile N and N+1 layers, extrapolate to full depth")
    parser.add_argument("--no-compile", action="store_true", help="analytic bytes only (no activations)")
    parser.add_argument("--json", default="", help="write the report as one JSON line to this file ('-': stdout)")
    args = parser.parse_args([a for a in argv if not a.startswith("--config.")])
    if args.devices < 1:
        parser.error("--devices must be >= 1")
    return args, overrides


def simulate_devices(n: int) -> None:
    """Ask for n CPU devices: XLA_FLAGS before JAX's import, else check the process already has enough."""
    if "jax" not in sys.modules:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
        flags = " ".join([flags, f"--xla_force_host_platform_device_count={n}", *FAST_COMPILE_FLAGS])
        os.environ["XLA_FLAGS"] = flags.strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
        return
    import jax
    have = len(jax.devices("cpu"))
    if have < n:
        raise ValueError(f"JAX was imported before sage_jax.plan could ask for {n} simulated CPU devices and has only "
                         f"{have}; run `python -m sage_jax.plan --devices {n} ...` in a fresh process (or set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax)")


# --------------------------------------------------------------------------------------------------- model, shapes

def resolve_model(config):
    """(ModelConfig, where it came from): a local config.json, a known checkpoint name, or config.model.preset."""
    from sage_jax import model as model_lib, train_state
    path = config.model.path
    if not path:
        vocab = None
        if config.data.task == "countdown":
            from sage_jax.rewards.countdown import CountdownTokenizer
            vocab = CountdownTokenizer().vocab_size
        return train_state.model_config(config, vocab_size=vocab), f"preset {config.model.preset or 'tiny'!r}"
    config_json = os.path.join(path, "config.json")
    if os.path.isfile(config_json):
        from sage_jax import hf_io
        with open(config_json) as f:
            return train_state.model_config(config, base=hf_io.config_from_hf(json.load(f))), config_json
    name = os.path.basename(os.path.normpath(path)).lower()
    if name not in KNOWN_MODELS:
        raise FileNotFoundError(
            f"model path {path!r} has no config.json on this machine and {name!r} is not a known checkpoint name "
            f"({', '.join(sorted(KNOWN_MODELS))}); copy its config.json there, or plan a preset with "
            "--config.model.path= --config.model.preset=NAME")
    preset, overrides = KNOWN_MODELS[name]
    return (train_state.model_config(config, base=model_lib.preset(preset, **overrides)),
            f"preset {preset!r} (by name: {path} is not on this machine)")


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

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.completion_len

    @property
    def cache_len(self) -> int:
        return self.prompt_len + self.new_bucket


def plan_shapes(config, mesh) -> Shapes:
    from sage_jax import sampler
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
    return Shapes(dp=dp, step_rows=step_rows, update_rows=update_rows, grad_accum=optim.grad_accum,
                  prompt_len=sampler.prompt_bucket(config.data.max_prompt_len), completion_len=ro.max_new_tokens,
                  sampler_prompts=prompts, sampler_rows=prompts * ro.group_size,
                  new_bucket=sampler.new_tokens_bucket(ro.max_new_tokens))


# --------------------------------------------------------------------------------------------------- abstract inputs

def tree_bytes(tree) -> int:
    """Per-device bytes of a tree of sharded ShapeDtypeStructs: shard shape x itemsize."""
    import jax
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _abstract_outputs(fn, *args):
    """The outputs of jitted fn as ShapeDtypeStructs carrying the shardings its compiled program picks."""
    import jax
    shardings = fn.lower(*args).compile().output_shardings
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        jax.eval_shape(fn, *args), shardings)


def abstract_state(cfg, config, mesh, rules):
    """(state, reference params, tx, schedule) laid out as trainer.run_rl lays them out, without any weights."""
    import jax
    from sage_jax import model as model_lib, sharding, train_state
    shapes = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                          sharding.param_shardings(cfg, mesh, rules))
    optim = config.optim
    tx, schedule = train_state.make_optimizer(optim, config.train.steps * optim.num_iterations * optim.mini_batches)
    shardings = train_state.state_shardings(params, tx, cfg, mesh, rules)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         jax.eval_shape(lambda p: train_state.init_state(p, tx), params), shardings)
    ref_dtype = config.model.ref_dtype
    ref = _abstract_outputs(jax.jit(lambda p: jax.tree.map(lambda x: x.astype(ref_dtype), p)), state["params"])
    return state, ref, tx, schedule


def abstract_batch(config, shapes: Shapes, rows: int, mesh) -> dict[str, Any]:
    """The loss batch trainer.run_rl puts on the mesh (rows over data x fsdp)."""
    import jax
    import jax.numpy as jnp
    from sage_jax import objectives, sharding
    T, C = shapes.seq_len, shapes.completion_len
    specs = {"tokens": ((rows, T), jnp.int32), "mask": ((rows, T), jnp.int32),
             "completion_mask": ((rows, C), jnp.float32), "advantages": ((rows,), jnp.float32),
             "sampler_logp": ((rows, C), jnp.float32), "truncated": ((rows,), jnp.bool_),
             "ref_logp": ((rows, C), jnp.float32)}
    sequence_kl = config.loss.kl_estimator in objectives.SEQUENCE_ESTIMATORS
    if config.optim.num_iterations * config.optim.mini_batches > 1 or config.loss.kl_in_reward or sequence_kl:
        specs["old_logp"] = ((rows, C), jnp.float32)
    if sequence_kl:
        specs["seq_kl_coef"] = ((rows,), jnp.float32)
    batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.data_sharding(mesh, len(shape)))
             for k, (shape, dtype) in specs.items()}
    batch["rl_step"] = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(mesh))
    return batch


# --------------------------------------------------------------------------------------------------- programs

def lower_train_step(cfg, config, state, tx, schedule, batch):
    import jax
    from sage_jax import train_state, trainer
    step = train_state.make_train_step(cfg, trainer.loss_config(config), tx, schedule, config.seed, config.optim.grad_accum,
                                   jax.tree.map(lambda x: x.sharding, state))
    return step.lower(state, batch)


def lower_ref_logprobs(cfg, config, ref_params, batch, shapes: Shapes):
    from sage_jax import train_state, trainer
    ref_cfg = cfg.replace(compute_dtype=config.model.ref_dtype)
    return train_state.sequence_logprobs_pass.lower(ref_cfg, ref_params, batch["tokens"], batch["mask"],
                                           prompt_len=shapes.prompt_len, temperature=trainer.loss_config(config).temperature)


def lower_sampler(cfg, config, params, shapes: Shapes, mesh, num_eos: int = 4):
    """sampler._generate_program as sampler.generate calls it for one rollout batch."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    from sage_jax import sampler, sharding
    ro = config.rollout
    greedy = ro.temperature == 0
    # As generate() on an accelerator (unstack_layers is its CPU-only default).
    static = dict(num_samples=ro.group_size, new_bucket=shapes.new_bucket, greedy=greedy,
                  top_k=0 if greedy or ro.top_k >= cfg.vocab_size else ro.top_k, use_top_p=not greedy and ro.top_p < 1,
                  use_min_p=not greedy and ro.min_p > 0, mesh=mesh, unstack_layers=False, compact=True)
    fields = {f.name for f in dataclasses.fields(sampler._Plan)}
    if fields - static.keys():
        raise RuntimeError(f"sampler._Plan has fields {sorted(fields - static.keys())} that sage_jax.plan does not "
                           "know: update plan.lower_sampler to match sampler.generate")
    plan = sampler._Plan(**{k: v for k, v in static.items() if k in fields})

    def arg(shape, dtype):
        ok = shape and shape[0] % shapes.dp == 0
        sh = sharding.data_sharding(mesh, len(shape)) if ok else NamedSharding(mesh, PartitionSpec())
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    B, P, N, C = shapes.sampler_prompts, shapes.prompt_len, shapes.sampler_rows, shapes.new_bucket
    scalars = [arg((), d) for d in (jnp.int32, jnp.float32, jnp.float32, jnp.float32, jnp.int32)]
    key = arg((), jax.eval_shape(lambda: jax.random.key(0)).dtype)
    per_row = [arg((N, C), jnp.int32), arg((N, C), jnp.float32), arg((N,), jnp.int32)]  # tokens, logp, limits
    return sampler._generate_program.lower(cfg, plan, params, arg((B, P), jnp.int32), arg((B, P), jnp.bool_),
                                           *per_row, *scalars, arg((num_eos,), jnp.int32), key)


def memory_stats(lowered) -> dict[str, int]:
    m = lowered.compile().memory_analysis()
    out = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes, "alias": m.alias_size_in_bytes,
           "temp": m.temp_size_in_bytes, "code": m.generated_code_size_in_bytes}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["code"]
    return out


def compile_programs(cfg, config, mesh, rules, shapes: Shapes) -> dict[str, dict[str, int]]:
    import jax
    from sage_jax import sharding
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        state, ref, tx, schedule = abstract_state(cfg, config, mesh, rules)
        lowerers = {
            "train_step": lambda: lower_train_step(cfg, config, state, tx, schedule,
                                                   abstract_batch(config, shapes, shapes.update_rows, mesh)),
            "sampler": lambda: lower_sampler(cfg, config, state["params"], shapes, mesh),
            # the trainer runs no-grad passes train.logprob_rows rows at a time
            "ref_logprobs": lambda: lower_ref_logprobs(cfg, config, ref, abstract_batch(
                config, shapes, min(shapes.step_rows, config.train.logprob_rows or shapes.step_rows), mesh), shapes),
        }
        out = {}
        for name in PROGRAMS:
            t0 = time.perf_counter()
            out[name] = memory_stats(lowerers[name]())
            print(f"  compiled {name} ({cfg.num_layers} layers) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def extrapolate(a: dict[str, int], b: dict[str, int], layers_a: int, layers: int) -> dict[str, int]:
    """Linear in depth from measurements at layers_a and layers_a + 1."""
    return {k: a[k] + (b[k] - a[k]) * (layers - layers_a) for k in a}


# --------------------------------------------------------------------------------------------------- analytic bytes

def kv_cache_bytes(cfg, shapes: Shapes, mesh, rules) -> tuple[int, bool]:
    """(per-device bytes of all layers' k and v, whether the cache's sharding constraint applies)."""
    import jax.numpy as jnp
    from sage_jax import model as model_lib, sharding
    shape = (shapes.sampler_rows, cfg.num_kv_heads, shapes.cache_len, cfg.head_dim)  # model.cache_axes() order
    spec = sharding.logical_to_spec(model_lib.cache_axes(), rules)
    split = [math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e)) if e else 1 for e in spec]
    split += [1] * (len(shape) - len(split))
    applies = all(s % n == 0 for s, n in zip(shape, split))  # sharding.constrain skips constraints that don't divide
    per_device = math.prod(s // n for s, n in zip(shape, split)) if applies else math.prod(shape)
    return 2 * cfg.num_layers * per_device * jnp.dtype(cfg.compute_dtype).itemsize, applies


def opt_bytes_if_sharded_like_params(opt_state, params) -> int:
    """What the optimizer state would take if each param-shaped leaf were sharded like its parameter."""
    import jax
    by_path = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        key = jax.tree_util.keystr(path)
        match = next((p for k, p in by_path.items() if key.endswith(k) and p.shape == leaf.shape), None)
        sh = (match or leaf).sharding
        total += math.prod(sh.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


def analytic(cfg, config, mesh, rules, shapes: Shapes) -> tuple[dict[str, int], list[str]]:
    import jax
    from sage_jax import sharding
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        state, ref, _, _ = abstract_state(cfg, config, mesh, rules)
    batch = abstract_batch(config, shapes, shapes.step_rows, mesh)
    kv, kv_sharded = kv_cache_bytes(cfg, shapes, mesh, rules)
    out = {"params": tree_bytes(state["params"]), "opt_state": tree_bytes(state["opt_state"]) + tree_bytes(
        state["step"]), "ref_params": tree_bytes(ref), "kv_cache": kv, "step_batch": tree_bytes(batch),
        "opt_state_if_sharded": opt_bytes_if_sharded_like_params(state["opt_state"], state["params"])}
    # Parts of the step's batch that stay on device while the reference pass runs (tokens / mask are its inputs).
    out["batch_besides_ref_inputs"] = tree_bytes({k: v for k, v in batch.items() if k not in (
        "tokens", "mask", "ref_logp", "old_logp")})
    warnings = []
    if out["opt_state"] > 1.05 * out["opt_state_if_sharded"]:
        warnings.append(f"the optimizer state is not sharded like the parameters: {_fmt(out['opt_state'])} per device "
                        f"instead of {_fmt(out['opt_state_if_sharded'])} (train_state.init_state's jit has no "
                        "out_shardings, so XLA picks them); fix that in the trainer")
    if not kv_sharded:
        warnings.append("the KV cache's sharding constraint does not divide its shape and is skipped: counted "
                        "unsharded")
    if shapes.cache_len > cfg.max_position_embeddings:
        warnings.append(f"prompt bucket + new-token bucket = {shapes.cache_len} exceeds the model's "
                        f"max_position_embeddings={cfg.max_position_embeddings}")
    return out, warnings


# --------------------------------------------------------------------------------------------------- the plan

def run(config, devices: int, memory_gb: float = CHIPS_GB["v5p"], layers: int = 0, do_compile: bool = True,
        config_name: str = "") -> dict[str, Any]:
    """The report: shapes, analytic and compiled per-device bytes, the peak phase and the verdict."""
    simulate_devices(devices)
    import jax
    from sage_jax import sharding
    mesh = sharding.make_mesh(tuple(config.mesh.shape), devices=jax.devices("cpu")[:devices])
    rules = dict(config.mesh.rules)
    cfg, source = resolve_model(config)
    shapes = plan_shapes(config, mesh)
    static, warnings = analytic(cfg, config, mesh, rules, shapes)
    full_layers = cfg.num_layers
    compiled_layers: list[int] = []
    programs: dict[str, dict[str, int]] = {}
    measured: dict[int, dict[str, dict[str, int]]] = {}
    if do_compile:
        if layers and layers < full_layers:
            compiled_layers = [layers, layers + 1]
            measured = {n: compile_programs(cfg.replace(num_layers=n), config, mesh, rules, shapes)
                        for n in compiled_layers}
            a, b = measured.values()
            programs = {k: extrapolate(a[k], b[k], layers, full_layers) for k in PROGRAMS}
        else:
            compiled_layers = [full_layers]
            programs = compile_programs(cfg, config, mesh, rules, shapes)
            measured = {full_layers: programs}
    state = static["params"] + static["opt_state"]
    resident = {"train_step": static["ref_params"] + (static["step_batch"] if config.optim.mini_batches > 1 else 0),
                "sampler": static["opt_state"] + static["ref_params"],
                "ref_logprobs": state + static["batch_besides_ref_inputs"]}
    if do_compile:
        phases = {k: programs[k]["peak"] + resident[k] for k in PROGRAMS}
    else:  # lower bounds: what must be resident, without any activations
        phases = {"train_step": state + static["ref_params"] + static["step_batch"],
                  "sampler": state + static["ref_params"] + static["kv_cache"],
                  "ref_logprobs": state + static["ref_params"] + static["step_batch"]}
    peak_phase = max(phases, key=phases.get)
    memory = int(memory_gb * GB)
    return {
        "config": config_name, "devices": devices, "mesh": dict(mesh.shape), "memory_bytes": memory,
        "model": {"source": source, "num_layers": full_layers, "num_params": cfg.num_params,
                  "param_dtype": cfg.param_dtype, "compute_dtype": cfg.compute_dtype,
                  "ref_dtype": config.model.ref_dtype, "remat": cfg.remat, "compiled_layers": compiled_layers},
        "shapes": dataclasses.asdict(shapes) | {"seq_len": shapes.seq_len, "cache_len": shapes.cache_len},
        "analytic": static, "programs": programs, "measured": measured, "resident": resident, "phases": phases,
        "peak_phase": peak_phase, "peak_bytes": phases[peak_phase], "lower_bound": not do_compile,
        "fits": phases[peak_phase] <= memory, "headroom_bytes": memory - phases[peak_phase], "warnings": warnings,
    }


def _fmt(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_report(r: dict[str, Any]) -> str:
    m, s, a = r["model"], r["shapes"], r["analytic"]
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    depth = ""
    if len(m["compiled_layers"]) == 2:
        depth = f" (compiled at {m['compiled_layers'][0]} and {m['compiled_layers'][1]} layers, extrapolated: rough)"
    lines = [
        f"memory plan: {r['config']} on {r['devices']} simulated devices, mesh {mesh}",
        f"model: {m['source']}: {m['num_params'] / 1e9:.2f}B params, {m['num_layers']} layers{depth}; params "
        f"{m['param_dtype']}, compute {m['compute_dtype']}, reference {m['ref_dtype']}, remat={m['remat']}",
        f"train_step: {s['update_rows']} rows per update = {s['grad_accum']} micro-batch(es) of "
        f"{s['update_rows'] // s['grad_accum']} ({s['update_rows'] // s['grad_accum'] / s['dp']:g} per data-parallel "
        f"device), {s['seq_len']} tokens = prompt {s['prompt_len']} + completion {s['completion_len']}",
        f"sampler: {s['sampler_prompts']} prompts x {s['sampler_rows'] // s['sampler_prompts']} samples = "
        f"{s['sampler_rows']} rows ({s['sampler_rows'] // s['dp']} per data-parallel device), KV cache "
        f"{s['cache_len']} slots; ref_logprobs: {s['step_rows']} rows",
        "",
        "per device (analytic, from shardings)",
        f"  parameters          {_fmt(a['params']):>12}",
        f"  optimizer state     {_fmt(a['opt_state']):>12}   ({_fmt(a['opt_state_if_sharded'])} if sharded like the "
        "params)",
        f"  reference params    {_fmt(a['ref_params']):>12}",
        f"  KV cache (rollout)  {_fmt(a['kv_cache']):>12}   (inside the sampler's temp)",
        f"  step batch          {_fmt(a['step_batch']):>12}",
    ]
    if r["programs"]:
        lines += ["", "per device (compiled, memory_analysis)   peak = argument + output - alias + temp + code",
                  f"  {'program':13}" + "".join(f"{h:>11}" for h in
                                              ("argument", "output", "alias", "temp", "code", "peak", "+resident",
                                               "phase"))]
        for name, p in r["programs"].items():
            cells = [p[k] for k in ("argument", "output", "alias", "temp", "code", "peak")]
            cells += [r["resident"][name], r["phases"][name]]
            lines.append(f"  {name:13}" + "".join(f"{_fmt(c):>11}" for c in cells))
    else:
        lines += ["", "no compile: phases below are lower bounds (resident state, batch and KV cache; no activations)"]
        lines += [f"  {name:13} {_fmt(v):>11}" for name, v in r["phases"].items()]
    verdict = "fits" if r["fits"] else "DOES NOT FIT"
    bound = " at least" if r["lower_bound"] else ""
    lines += ["", f"peak{bound} {_fmt(r['peak_bytes'])} per device ({r['peak_phase']}) vs "
                  f"{_fmt(r['memory_bytes'])}: {verdict}, headroom {_fmt(r['headroom_bytes'])} "
                  f"({100 * r['headroom_bytes'] / r['memory_bytes']:.0f}%)"]
    lines += [f"warning: {w}" for w in r["warnings"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = parse_flags(list(sys.argv[1:] if argv is None else argv))
    simulate_devices(args.devices)
    from sage_jax import config as config_lib
    config = config_lib.load(args.config, overrides)
    memory_gb = CHIPS_GB[args.chip] if args.chip else (args.memory_gb or CHIPS_GB["v5p"])
    report = run(config, args.devices, memory_gb, layers=args.layers, do_compile=not args.no_compile,
                 config_name=args.config)
    print(format_report(report))
    if args.json:
        line = json.dumps(report)
        if args.json == "-":
            print(line)
        else:
            with open(args.json, "w") as f:
                f.write(line + "\n")
    return 0 if report["fits"] else 1


if __name__ == "__main__":
    simulate_devices(parse_flags(sys.argv[1:])[0].devices)  # before cli imports anything that imports JAX
    from sage_jax import cli
    cli.main_guard(main)
