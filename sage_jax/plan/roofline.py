"""A PREDICTION of a config's run on a TPU slice, from the TPU compiler's own cost analysis; no TPU is used.

    python -m sage_jax.plan --config configs/qwen7b_branch.py --chip v5p --topology 2x4x4 --compiler tpu

libtpu's XLA:TPU compiles the trainer's programs for an abstract slice (jax.experimental.topologies). For the time,
each program's cost variant (plan_programs: nothing looped) is compiled at 1 and 2 layers and at two row counts;
FLOPs and bytes are linear in depth and in rows, so the full program's per-device counts follow (exactly for FLOPs).
Each program then takes max(FLOPs / bf16 peak, bytes accessed / HBM bandwidth) per device, and an RL step is the sum
of its programs run one after another: one generate call (the prefill, then max_new_tokens - 1 decode steps), the
reference pass (and the policy's, when the step needs old log-probs) and the updates. ASSUMPTIONS lists the rest.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import math
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class Chip:
    bf16_flops: float  # dense bf16 peak per chip, FLOP/s
    hbm_bytes_per_s: float
    hbm_bytes: float  # what a program may use per chip
    source: str


GiB = 2 ** 30
# Published per-chip figures; docs/PERFORMANCE.md tabulates them with their pages.
CHIPS = {
    "v4": Chip(275e12, 1200e9, 32 * GiB, "https://cloud.google.com/tpu/docs/v4"),
    "v5e": Chip(197e12, 819e9, 16e9, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip(459e12, 2765e9, 95 * GiB, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip(918e12, 1638e9, 32e9, "https://cloud.google.com/tpu/docs/v6e"),
}
# A slice's usual shape for a number of chips (the cloud's AcceleratorType tables), when --topology is not given.
_CUBE = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8"}
_PLANE = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
DEFAULT_TOPOLOGY = {"v4": _CUBE, "v5p": _CUBE, "v5e": _PLANE, "v6e": _PLANE}

ASSUMPTIONS = (
    "every row runs to max_new_tokens: the decode loop takes max_new_tokens - 1 steps after the prefill and the "
    "train / reference batches are max_new_tokens wide (the worst case, and the usual one: with hundreds of rows "
    "at temperature 1 some row reaches the limit, and the loop and the batch width follow the longest row)",
    "each program runs at its roofline, max(FLOPs / peak, bytes / HBM bandwidth), from XLA:TPU's per-device cost "
    "analysis; fp32 work counted at the bf16 peak; programs do not overlap one another",
    "not counted: ICI collectives (assumed hidden under compute), host work (rewards, tokenising, host-device "
    "copies), dynamic sampling's extra rollout rounds, evaluation and checkpoints",
)


def available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def libtpu_version() -> str:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def prepare_environment() -> None:
    """Before JAX loads: compile for TPU without one. JAX itself stays on the CPU; libtpu is told it is a one-host
    worker (it would otherwise warn about the missing TPU VM metadata) and may be loaded by several processes."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    for key, value in (("TPU_ACCELERATOR_TYPE", "v5p-8"), ("TPU_WORKER_ID", "0"),
                       ("TPU_WORKER_HOSTNAMES", "localhost"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(key, value)


def topology_for(chip: str, chips: int) -> str:
    shapes = DEFAULT_TOPOLOGY[chip]
    if chips not in shapes:
        raise ValueError(f"no default {chip} topology for {chips} chips; pass --topology (e.g. "
                         f"{', '.join(f'{n}: {t}' for n, t in list(shapes.items())[:4])})")
    return shapes[chips]


def tpu_devices(chip: str, topology: str) -> tuple[list, int]:
    """(abstract compile-only devices of a `chip` slice shaped `topology`, the slice's chip count)."""
    if not available():
        raise ValueError("--compiler tpu needs libtpu: pip install -r requirements-tpu.txt (or .[tpu-plan]), or "
                         "pass --compiler cpu")
    import jax
    from jax.experimental import topologies
    # Executables compiled for devices that are not there cannot be loaded back from JAX's persistent cache.
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=f"{chip}:{topology}")
    except Exception as e:  # the runtime's own error types; its first line says what it could not parse
        raise ValueError(f"--chip {chip} --topology {topology}: libtpu cannot build this slice "
                         f"({str(e).splitlines()[0]}); use AxBxC for v4/v5p, AxB for v5e/v6e") from None
    return list(topo.devices), math.prod(int(d) for d in topology.split("x"))


# --------------------------------------------------------------------------------------------------- costs

def _bilinear(c: dict[tuple[int, int], float], layers: int, rows: int) -> float:
    """Value at (layers, rows) of the function bilinear in both that takes c's four values (keys (l, r))."""
    (l1, r1), (_, r2), (l2, _), _ = sorted(c)
    at = lambda l: c[l, r1] + (c[l, r2] - c[l, r1]) * (rows - r1) / (r2 - r1)
    return at(l1) + (at(l2) - at(l1)) * (layers - l1) / (l2 - l1)


def call_rows(config, shapes) -> dict[str, int]:
    """Rows per call of each program in one RL step."""
    ref_rows = min(shapes.step_rows, config.train.logprob_rows or shapes.step_rows)
    return {"prefill": shapes.sampler_prompts, "decode_step": shapes.sampler_slots, "ref_logprobs": ref_rows,
            "old_logprobs": ref_rows, "train_step": shapes.update_rows}


def measure_costs(cfg, config, mesh, rules, shapes, programs=None, cache=None) -> dict[str, dict[str, float]]:
    """Per-device cost of one call of each program (or of `programs`) at full depth and its real rows (see the
    module docstring); cache: a plan_cache.Cache for the cost variants."""
    import jax
    from sage_jax.models import sharding
    from sage_jax.plan import cache as plan_cache, programs as pp
    rows = call_rows(config, shapes)
    probes = {name: (shapes.dp, 2 * shapes.dp) if r % shapes.dp == 0 else (1, 2) for name, r in rows.items()}
    if rows["decode_step"] % (2 * shapes.dp) == 0:
        # one token per row: even all the rows make a small program, and a probe at a row or two per device is
        # dominated by the weight reads, whose slope in rows extrapolated 100-fold is noise (it went negative at 7B)
        probes["decode_step"] = (rows["decode_step"] // 2, rows["decode_step"])
    lowered = {}
    for layers in (1, 2):
        vcfg = pp.cost_variant(cfg, layers)
        with sharding.use_rules(rules):
            state, ref, tx, schedule = pp.abstract_state(vcfg, config, mesh, rules)
        with jax.set_mesh(mesh), sharding.use_rules(rules):
            for name, lower in pp.cost_lowerers(vcfg, config, mesh, rules, shapes, state, ref, tx, schedule).items():
                if programs is None or name in programs:
                    lowered.update({(name, layers, r): lower(r) for r in probes[name]})
    measured: dict[str, dict[tuple[int, int], dict[str, float]]] = {}
    cache = cache or plan_cache.Cache(None, "")
    costs, hits = plan_cache.measure_all(cache, "cost", lowered, pp.cost_stats, pp.compile_in_parallel)
    cache.hits += [f"{name} cost variant ({layers} layers, {r} rows)" for name, layers, r in hits]
    for (name, layers, r), stats in costs.items():
        measured.setdefault(name, {})[layers, r] = stats
    out = {}
    for name, points in measured.items():
        out[name] = {k: max(0.0, _bilinear({p: v[k] for p, v in points.items()}, cfg.num_layers, rows[name]))
                     for k in ("flops", "bytes", "optimal_seconds")}
        out[name].update({k: max(v[k] for v in points.values()) for k in ("loops", "kernels")})
    return out


# --------------------------------------------------------------------------------------------------- prediction

def roofline(flops: float, bytes_accessed: float, chip: Chip, chips_per_device: float = 1.0) -> dict[str, Any]:
    """Time of one program on one device: compute-bound or memory-bound, whichever is slower."""
    compute_s = flops / (chip.bf16_flops * chips_per_device)
    memory_s = bytes_accessed / (chip.hbm_bytes_per_s * chips_per_device)
    return {"compute_s": compute_s, "memory_s": memory_s, "time_s": max(compute_s, memory_s),
            "bound": "compute" if compute_s >= memory_s else "memory"}


def predict(costs: dict[str, dict[str, float]], cfg, config, shapes, chip_name: str, chips: int,
            devices: int) -> dict[str, Any]:
    """The RL step as the sum of its programs' rooflines, its throughput and the whole run's wall time."""
    from sage_jax.bench import flops as bench_flops
    chip, ro, optim = CHIPS[chip_name], config.rollout, config.optim
    rows = call_rows(config, shapes)
    passes = math.ceil(shapes.step_rows / rows["ref_logprobs"])
    calls = {"prefill": 1, "decode_step": ro.max_new_tokens - 1, "ref_logprobs": passes, "old_logprobs": passes,
             "train_step": optim.num_iterations * optim.mini_batches}
    programs = {}
    for name, c in costs.items():
        programs[name] = {"calls": calls[name], "rows": rows[name], **c,
                          **roofline(c["flops"], c["bytes"], chip, chips / devices)}
        programs[name]["step_s"] = programs[name]["time_s"] * calls[name]
    step_s = sum(p["step_s"] for p in programs.values())
    P, C = shapes.prompt_len, shapes.completion_len
    no_grad_passes = passes * sum(name in costs for name in ("ref_logprobs", "old_logprobs"))
    model_flops = (calls["train_step"] * bench_flops.train_flops(cfg, rows["train_step"], P, C)
                   + no_grad_passes * bench_flops.train_flops(cfg, rows["ref_logprobs"], P, C) / 3  # forward only
                   + bench_flops.decode_flops(cfg, ro.prompts_per_step, ro.group_size, config.data.max_prompt_len,
                                              ro.max_new_tokens))
    compiled_flops = devices * sum(p["flops"] * p["calls"] for p in programs.values())
    peak = chips * chip.bf16_flops
    return {
        "chip": chip_name, "chips": chips, "devices": devices, "programs": programs, "step_s": step_s,
        "tokens_per_s": shapes.step_rows * (P + ro.max_new_tokens) / step_s,
        "generated_tokens_per_s": shapes.step_rows * ro.max_new_tokens / step_s,
        "model_flops": model_flops, "mfu": model_flops / (step_s * peak),
        "compiled_flops": compiled_flops, "flop_utilisation": compiled_flops / (step_s * peak),
        "compiler_estimate_step_s": sum(p["optimal_seconds"] * p["calls"] for p in programs.values()),
        "steps": config.train.steps, "run_s": config.train.steps * step_s, "assumptions": list(ASSUMPTIONS),
        "loops_left": sorted(name for name, p in programs.items() if p["loops"]),
        "kernels_uncounted": sorted(name for name, p in programs.items() if p.get("kernels")),
    }


def _duration(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.2f} s"


def format_prediction(p: dict[str, Any]) -> str:
    chip = CHIPS[p["chip"]]
    lines = [f"PREDICTION (not a measurement): roofline of the XLA:TPU-compiled programs on {p['chips']} {p['chip']} "
             f"chips ({chip.bf16_flops / 1e12:g} TFLOP/s bf16, {chip.hbm_bytes_per_s / 1e9:g} GB/s HBM per chip)",
             f"  {'program':13}{'calls':>7}{'rows':>7}{'GFLOP':>10}{'GB':>9}{'compute':>11}{'memory':>11}"
             f"{'bound':>9}{'per step':>11}"]
    for name, q in p["programs"].items():
        lines.append(f"  {name:13}{q['calls']:>7}{q['rows']:>7}{q['flops'] / 1e9:>10.1f}{q['bytes'] / 1e9:>9.2f}"
                     f"{q['compute_s'] * 1e3:>9.2f}ms{q['memory_s'] * 1e3:>9.2f}ms{q['bound']:>9}"
                     f"{_duration(q['step_s']):>11}")
    lines += [f"  (GFLOP and GB per call per device; XLA:TPU's own estimate of the same calls: "
              f"{_duration(p['compiler_estimate_step_s'])} per step)",
              f"RL step {_duration(p['step_s'])}: {p['tokens_per_s']:,.0f} tokens/s ({p['generated_tokens_per_s']:,.0f} "
              f"generated), MFU {100 * p['mfu']:.1f}% (model FLOPs), compiled-FLOP utilisation "
              f"{100 * p['flop_utilisation']:.1f}%",
              f"whole run: {p['steps']} steps = {_duration(p['run_s'])} on {p['chips']} chips "
              f"({p['run_s'] * p['chips'] / 3600:,.0f} chip-hours)",
              "assumptions:"]
    lines += [f"  - {a}" for a in p["assumptions"]]
    if p["loops_left"]:
        lines.append(f"warning: the cost variants of {', '.join(p['loops_left'])} still contain loops, whose bodies "
                     "XLA counts once: their FLOPs and bytes are low")
    if p["kernels_uncounted"]:
        lines.append(f"warning: {', '.join(p['kernels_uncounted'])} call Pallas kernels, whose FLOPs and bytes XLA's "
                     "cost analysis does not count: their times are low")
    return "\n".join(lines)
