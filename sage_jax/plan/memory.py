"""Ahead-of-time memory plan: does a config's RL step fit the chips, checked before renting them?

    python -m sage_jax.plan --config configs/qwen7b_branch.py --chip v5p --topology 2x4x4 --compiler tpu
    python -m sage_jax.plan --config configs/qwen7b_branch.py --devices 32 --compiler cpu
    python -m sage_jax.plan --config configs/qwen7b_branch.py --devices 32 --layers 2    # quick, extrapolated
    python -m sage_jax.plan --config configs/qwen7b_branch.py --devices 32 --no-compile  # analytic only
    python -m sage_jax.plan --config configs/qwen7b_branch.py --devices 64 --programs sampler  # + its breakdown

Builds the config's mesh and lowers the trainer's own programs on abstract inputs (ShapeDtypeStructs with
shardings, no weights; sage_jax.plan.programs), at the worst-case shapes a step can reach:
  train_step    one update on prompts_per_step * group_size / mini_batches rows of (prompt bucket + max_new_tokens)
                tokens, scanned over grad_accum micro-batches, state donated;
  sampler       the rollout program: prompts_per_step prompts x group_size samples, KV cache of prompt + new buckets;
  ref_logprobs  the reference model's pass, train.logprob_rows rows at a time.
With LoRA (config.model.lora.rank > 0) the trained state is the adapters and their optimizer moments, and every
program also takes the frozen base, which is the reference itself: no second copy of the weights is counted.
--compiler tpu (the default when libtpu is installed) compiles them with XLA:TPU for an abstract slice of --chip
shaped --topology, and adds sage_jax.plan.roofline's PREDICTION of the run; --compiler cpu compiles them with XLA:CPU for
--devices simulated devices, which only approximates a TPU (fusion, layouts, bf16 handling differ).
A program's per-device peak is argument + output - alias + temp + code bytes (compiled.memory_analysis()); its phase
adds what stays resident outside it (the optimizer state while sampling, ...). Parameter, optimizer, reference and
KV-cache bytes are also computed from the shardings (shard shape x itemsize). Exit code: 0 fits, 1 does not fit
(or XLA:TPU refused a program for HBM), 2 config or mesh error. `--layers N` compiles N and N + 1 layers and
extrapolates linearly to the full depth, a rough estimate (XLA's buffer reuse is not linear in depth; see
docs/PERFORMANCE.md). `--no-compile` still compiles the trainer's tiny state-init program, whose output shardings
are what the trainer keeps; with --compiler tpu it skips the memory programs but still makes the prediction (its
cost variants are compiled at 1 and 2 layers, whatever the depth), the quick way to a prediction of a deep model.
Each compiled program's figures are kept in sage_jax.plan.cache (--cache DIR, 'off' to compile everything), keyed
by its StableHLO text, the compiler and the devices: configs that share a program (the qwen7b_* arms' sampler and
reference pass) compile it once, and the report lists what came from the cache.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from typing import Any, Sequence

from sage_jax.plan import roofline
from sage_jax.plan.report import _fmt, format_report  # noqa: F401  (format_report: public here)

GB = 1e9
CHIPS_GB = {**{k: c.hbm_bytes / GB for k, c in roofline.CHIPS.items()}, "h100": 80.0, "h200": 141.0}
PROGRAMS = ("train_step", "sampler", "ref_logprobs")
# The programs are compiled only to be measured, never run: skip the slow CPU code generation. Buffer assignment,
# and so memory_analysis(), comes out the same to within a few hundred bytes.
FAST_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true")

# --------------------------------------------------------------------------------------------------- devices

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

# --------------------------------------------------------------------------------------------------- compile

def compile_programs(cfg, config, mesh, rules, shapes, cache=None, programs=PROGRAMS) -> dict[str, dict[str, int]]:
    """memory_analysis() of each of `programs`; a program the TPU compiler finds too big for HBM gets {"oom":
    message}. cache: a plan_cache.Cache (the names it answered are added to cache.hits)."""
    import jax
    from sage_jax.models import sharding
    from sage_jax.plan import cache as plan_cache, programs as pp
    with sharding.use_rules(rules):  # outside the mesh: optax builds its state template eagerly
        state, ref, tx, schedule = pp.abstract_state(cfg, config, mesh, rules)
    # the trainer runs no-grad passes train.logprob_rows rows at a time
    ref_rows = min(shapes.step_rows, config.train.logprob_rows or shapes.step_rows)
    lowerers = {
        "train_step": lambda: pp.lower_train_step(cfg, config, state, ref, tx, schedule,
                                                  pp.abstract_batch(config, shapes, shapes.update_rows, mesh)),
        "sampler": lambda: pp.lower_sampler(cfg, config, pp.rollout_params(cfg, pp.policy_params(config, state, ref)),
                                            shapes, mesh),
        "ref_logprobs": lambda: pp.lower_ref_logprobs(cfg, config, ref, pp.abstract_batch(config, shapes, ref_rows,
                                                                                          mesh), shapes),
    }
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        lowered = {k: lowerers[k]() for k in programs}
    t0 = time.perf_counter()
    cache = cache or plan_cache.Cache(None, "")
    out, hits = plan_cache.measure_all(cache, "memory", lowered, pp.memory_stats, pp.compile_in_parallel)
    cache.hits += [f"{k} ({cfg.num_layers} layers)" for k in hits]
    print(f"  compiled {', '.join(k for k in programs if k not in hits) or 'nothing'} ({cfg.num_layers} layers) in "
          f"{time.perf_counter() - t0:.1f} s" + (f"; from the plan cache: {', '.join(hits)}" if hits else ""),
          file=sys.stderr)
    return out


def extrapolate(a: dict[str, int], b: dict[str, int], layers_a: int, layers: int) -> dict[str, int]:
    """Linear in depth from measurements at layers_a and layers_a + 1."""
    return {k: a[k] + (b[k] - a[k]) * (layers - layers_a) for k in a}


# --------------------------------------------------------------------------------------------------- analytic bytes

def kv_cache_bytes(cfg, shapes, mesh, rules, rows: int = 0, length: int = 0) -> tuple[int, bool]:
    """(per-device bytes of all layers' k and v, whether the cache's sharding constraint applies): the slot cache,
    or rows x length positions (the prompt caches: sampler_prompts x prompt_len)."""
    import jax.numpy as jnp
    from sage_jax.models import decoder as model_lib, sharding
    shape = (rows or shapes.sampler_slots, cfg.num_kv_heads, length or shapes.cache_len, cfg.head_dim)
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


def analytic(cfg, config, mesh, rules, shapes) -> tuple[dict[str, int], list[str]]:
    from sage_jax.models import sharding
    import jax
    from sage_jax.plan.programs import abstract_batch, abstract_state, lora_config, policy_params, rollout_params, tree_bytes
    with sharding.use_rules(rules):
        state, ref, _, _ = abstract_state(cfg, config, mesh, rules)
    batch = abstract_batch(config, shapes, shapes.step_rows, mesh)
    kv, kv_sharded = kv_cache_bytes(cfg, shapes, mesh, rules)
    # LoRA: the trained params are the adapters, and the frozen base is the reference (one copy, counted as base)
    lora = lora_config(config) is not None
    out = {"params": tree_bytes(state["params"]), "opt_state": tree_bytes(state["opt_state"]) + tree_bytes(
        state["step"]), "ref_params": 0 if lora else tree_bytes(ref), "base_params": tree_bytes(ref) if lora else 0,
        "kv_cache": kv, "prompt_caches": kv_cache_bytes(cfg, shapes, mesh, rules, shapes.sampler_prompts,
                                                        shapes.prompt_len)[0], "step_batch": tree_bytes(batch),
        "opt_state_if_sharded": opt_bytes_if_sharded_like_params(state["opt_state"], state["params"])}
    # The sampler takes the policy's weights cast to the compute dtype (sampler.generate: model.compute_params);
    # the originals of what it casts stay resident beside them.
    policy = policy_params(config, state, ref)
    rollout = rollout_params(cfg, policy)
    out["rollout_params"] = tree_bytes(rollout)
    cast = [(p, r) for p, r in zip(jax.tree.leaves(policy), jax.tree.leaves(rollout)) if p.dtype != r.dtype]
    out["rollout_cast_from"], out["rollout_copy"] = tree_bytes([p for p, _ in cast]), tree_bytes([r for _, r in cast])
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

def _devices(compiler: str, chip: str, topology: str, devices: int):
    """(devices to build the mesh on, chips they stand for, the compiler's description)."""
    import jax
    if compiler == "cpu":
        simulate_devices(devices)
        return jax.devices("cpu")[:devices], devices, {"name": "XLA:CPU", "jax": jax.__version__}
    from sage_jax.plan import roofline
    topology = topology or roofline.topology_for(chip, devices)
    found, chips = roofline.tpu_devices(chip, topology)
    if devices and devices != len(found):
        raise ValueError(f"--devices {devices} but the {chip}:{topology} slice has {len(found)} devices; drop "
                         "--devices or change --topology")
    return found, chips, {"name": "XLA:TPU", "libtpu": roofline.libtpu_version(), "jax": jax.__version__,
                          "topology": f"{chip}:{topology}", "device_kind": found[0].device_kind}


def _compile_all(cfg, config, mesh, rules, shapes, layers: int, cache, names=PROGRAMS):
    """(programs at full depth, what was compiled at which depth)."""
    full = cfg.num_layers
    if layers and layers < full:
        measured = {n: compile_programs(cfg.replace(num_layers=n), config, mesh, rules, shapes, cache, names)
                    for n in (layers, layers + 1)}
        a, b = measured.values()
        oom = {k: a[k] if "oom" in a[k] else b[k] for k in names if "oom" in a[k] or "oom" in b[k]}
        return {k: oom.get(k) or extrapolate(a[k], b[k], layers, full) for k in names}, measured
    programs = compile_programs(cfg, config, mesh, rules, shapes, cache, names)
    return programs, {full: programs}


def run(config, devices: int = 0, memory_gb: float = CHIPS_GB["v5p"], layers: int = 0, do_compile: bool = True,
        config_name: str = "", compiler: str = "cpu", chip: str = "v5p", topology: str = "",
        predict: bool = True, cache_dir: str = "off", names: Sequence[str] = PROGRAMS,
        decode_rows: Sequence[int] = ()) -> dict[str, Any]:
    """The report: shapes, analytic and compiled per-device bytes, the peak phase and the verdict; with the TPU
    compiler also the roofline PREDICTION of the run (sage_jax.plan.roofline). cache_dir: sage_jax.plan.cache's.
    names: the memory programs to compile (a subset answers for those only, with no prediction). decode_rows: with
    the TPU compiler, the decode shapes plan.decode judges (default: the config's slots)."""
    from sage_jax.models import sharding
    from sage_jax.plan import cache as plan_cache, programs as plan_programs, report as plan_report
    found, chips, compiler_info = _devices(compiler, chip, topology, devices)
    mesh = sharding.make_mesh(tuple(config.mesh.shape), devices=found)
    cache = plan_cache.Cache(cache_dir, plan_cache.compiler_tag(mesh.devices))
    rules = dict(config.mesh.rules)
    from sage_jax.models import build
    cfg, source = build.resolve_model(config)
    shapes = plan_programs.plan_shapes(config, mesh)
    static, warnings = analytic(cfg, config, mesh, rules, shapes)
    programs, measured = _compile_all(cfg, config, mesh, rules, shapes, layers, cache,
                                        tuple(names)) if do_compile else ({}, {})
    state = static["params"] + static["opt_state"]
    # With LoRA every program takes the frozen base as an argument, so only full fine-tuning's reference copy and
    # what the program does not take count as resident beside it.
    resident = {"train_step": static["ref_params"] + (static["step_batch"] if config.optim.mini_batches > 1 else 0),
                "sampler": static["opt_state"] + static["ref_params"] + static["rollout_cast_from"],
                "ref_logprobs": state + static["batch_besides_ref_inputs"]}
    oom = {k: p["oom"] for k, p in programs.items() if "oom" in p}
    if do_compile:
        phases = {k: p["peak"] + resident[k] for k, p in programs.items() if k not in oom}
    else:  # lower bounds: what must be resident, without any activations
        held = state + static["base_params"] + static["ref_params"]
        phases = {"train_step": held + static["step_batch"],
                  "sampler": held + static["kv_cache"] + static["rollout_copy"],
                  "ref_logprobs": held + static["step_batch"]}
    warnings += [f"{k}: XLA:TPU cannot fit it in HBM: {msg}" for k, msg in oom.items()]
    peak_phase = max(phases, key=phases.get) if phases else next(iter(oom))
    memory = round(memory_gb * GB)
    prediction = None
    if do_compile and len(names) < len(PROGRAMS):
        warnings.append(f"only {', '.join(names)} compiled (--programs): the verdict covers no other program")
    if compiler == "tpu" and predict and not oom and len(names) == len(PROGRAMS):
        from sage_jax.plan import roofline
        t0 = time.perf_counter()
        costs = roofline.measure_costs(cfg, config, mesh, rules, shapes, cache=cache)
        print(f"  compiled the cost variants in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        prediction = roofline.predict(costs, cfg, config, shapes, chip, chips, len(found))
    decode = []
    if compiler == "tpu" and do_compile:
        from sage_jax.plan import decode as plan_decode
        t0 = time.perf_counter()
        decode = plan_decode.lines(cfg, config, mesh, rules, shapes, decode_rows or (shapes.sampler_slots,), chip,
                                   chips)
        print(f"  compiled the decode checks in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    peak = phases.get(peak_phase, 0)
    report = {
        "config": config_name, "devices": len(found), "chips": chips, "compiler": compiler_info,
        "mesh": dict(mesh.shape), "memory_bytes": memory,
        "model": {"source": source, "num_layers": cfg.num_layers, "num_params": cfg.num_params,
                  "param_dtype": cfg.param_dtype, "compute_dtype": cfg.compute_dtype,
                  "ref_dtype": config.model.ref_dtype, "remat": cfg.remat, "compiled_layers": list(measured),
                  "lora": plan_programs.lora_summary(cfg, config)},
        "shapes": dataclasses.asdict(shapes) | {"seq_len": shapes.seq_len, "cache_len": shapes.cache_len},
        "analytic": static, "programs": programs, "measured": measured, "resident": resident, "phases": phases,
        "peak_phase": peak_phase, "peak_bytes": peak, "lower_bound": not do_compile,
        "fits": not oom and peak <= memory, "headroom_bytes": memory - peak, "warnings": warnings,
        "prediction": prediction, "cache": {"dir": cache.directory, "hits": cache.hits}, "decode": decode,
    }
    return report | {"sampler_breakdown": plan_report.sampler_breakdown(report)}
