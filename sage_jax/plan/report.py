"""The memory plan's text report (sage_jax.plan.run's dict -> lines): analytic and compiled per-device bytes, the
verdict, the warnings, the prediction."""

from __future__ import annotations

from typing import Any


def _fmt(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


SLOT_CACHE_SLACK = 1.15  # issue 26's bound: the sampler holds its weights, the slot cache (+15%) and prompt caches


def sampler_breakdown(r: dict[str, Any]) -> dict[str, Any] | None:
    """The compiled sampler's per-device peak split into the weights shard it takes, the slot KV cache, the prompt
    caches (analytic, from the shardings) and the rest (activations, logits, gathered copies, code), with issue 26's
    bound weights + 1.15 x KV cache + prompt caches; None when the sampler was not compiled."""
    p, a = r["programs"].get("sampler"), r["analytic"]
    if not p or "oom" in p:
        return None
    weights = a["rollout_params"]  # the policy's weights in the compute dtype (with LoRA the base and the adapters)
    kv, prompts = a["kv_cache"], a["prompt_caches"]
    bound = weights + SLOT_CACHE_SLACK * kv + prompts
    return {"peak": p["peak"], "weights": weights, "kv_cache": kv, "prompt_caches": prompts,
            "rest": p["peak"] - weights - kv - prompts, "temp": p["temp"], "temp_over_kv": p["temp"] / kv if kv else 0,
            "bound": round(bound), "within_bound": p["peak"] <= bound}


def _breakdown_line(b: dict[str, Any]) -> str:
    return (f"sampler breakdown per device: peak {_fmt(b['peak'])} = weights shard {_fmt(b['weights'])} + KV cache "
            f"{_fmt(b['kv_cache'])} + prompt caches {_fmt(b['prompt_caches'])} + the rest {_fmt(b['rest'])}; temp "
            f"{_fmt(b['temp'])} = {b['temp_over_kv']:.2f}x the KV cache; bound weights + {SLOT_CACHE_SLACK} x KV + "
            f"prompt caches = {_fmt(b['bound'])}: {'within' if b['within_bound'] else 'OVER'}")


def format_report(r: dict[str, Any]) -> str:
    m, s, a = r["model"], r["shapes"], r["analytic"]
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    depth = ""
    if len(m["compiled_layers"]) == 2:
        depth = f" (compiled at {m['compiled_layers'][0]} and {m['compiled_layers'][1]} layers, extrapolated: rough)"
    c = r["compiler"]
    where = (f"{r['devices']} simulated CPU devices, compiled by XLA:CPU (jax {c['jax']})" if c["name"] == "XLA:CPU"
             else f"{c['topology']} ({r['devices']} x {c['device_kind']}, abstract), compiled by XLA:TPU (libtpu "
                  f"{c['libtpu']}, jax {c['jax']})")
    lora = m.get("lora")
    trained = (f"LoRA rank {lora['rank']} on {','.join(lora['targets'])}: {lora['adapter_params'] / 1e6:.1f}M "
               "adapter params trained, the frozen base is the reference" if lora else "full fine-tuning")
    lines = [
        f"memory plan: {r['config']} on {where}, mesh {mesh}",
        f"model: {m['source']}: {m['num_params'] / 1e9:.2f}B params, {m['num_layers']} layers{depth}; params "
        f"{m['param_dtype']}, compute {m['compute_dtype']}, reference {m['ref_dtype']}, remat={m['remat']}; {trained}",
        f"train_step: {s['update_rows']} rows per update = {s['grad_accum']} micro-batch(es) of "
        f"{s['update_rows'] // s['grad_accum']} ({s['update_rows'] // s['grad_accum'] / s['dp']:g} per data-parallel "
        f"device), {s['seq_len']} tokens = prompt {s['prompt_len']} + completion {s['completion_len']}",
        f"sampler: {s['sampler_prompts']} prompts x {s['sampler_rows'] // s['sampler_prompts']} samples = "
        f"{s['sampler_rows']} rows ({s['sampler_rows'] // s['dp']} per data-parallel device) in "
        f"{s.get('sampler_slots', s['sampler_rows'])} decode slots, KV cache "
        f"{s['cache_len']} slots; ref_logprobs: {s['step_rows']} rows",
        "",
        "per device (analytic, from shardings)",
        f"  trained params      {_fmt(a['params']):>12}" + ("   (the adapters)" if lora else ""),
        f"  optimizer state     {_fmt(a['opt_state']):>12}   ({_fmt(a['opt_state_if_sharded'])} if sharded like the "
        "params)",
        *([f"  frozen base         {_fmt(a['base_params']):>12}   (also the reference: no second copy)"] if lora
          else [f"  reference params    {_fmt(a['ref_params']):>12}"]),
        f"  KV cache (rollout)  {_fmt(a['kv_cache']):>12}   (inside the sampler's temp; prompt caches "
        f"{_fmt(a.get('prompt_caches', 0))})",
        f"  step batch          {_fmt(a['step_batch']):>12}",
    ]
    if r["programs"]:
        lines += ["", "per device (compiled, memory_analysis)   peak = argument + output - alias + temp + code",
                  f"  {'program':13}" + "".join(f"{h:>11}" for h in
                                              ("argument", "output", "alias", "temp", "code", "peak", "+resident",
                                               "phase"))]
        for name, p in r["programs"].items():
            if "oom" in p:
                lines.append(f"  {name:13} does not compile: out of HBM (see the warning)")
                continue
            cells = [p[k] for k in ("argument", "output", "alias", "temp", "code", "peak")]
            cells += [r["resident"][name], r["phases"][name]]
            lines.append(f"  {name:13}" + "".join(f"{_fmt(c):>11}" for c in cells))
    else:
        lines += ["", "no compile: phases below are lower bounds (resident state, batch and KV cache; no activations)"]
        lines += [f"  {name:13} {_fmt(v):>11}" for name, v in r["phases"].items()]
    if r.get("sampler_breakdown"):
        lines.append(_breakdown_line(r["sampler_breakdown"]))
    verdict = "fits" if r["fits"] else "DOES NOT FIT"
    bound = " at least" if r["lower_bound"] else ""
    oom = [k for k, p in r["programs"].items() if "oom" in p]
    if oom:
        lines += ["", f"DOES NOT FIT: XLA:TPU ran out of HBM compiling {', '.join(oom)} (see the warnings)"]
    else:
        lines += ["", f"peak{bound} {_fmt(r['peak_bytes'])} per device ({r['peak_phase']}) vs "
                      f"{_fmt(r['memory_bytes'])}: {verdict}, headroom {_fmt(r['headroom_bytes'])} "
                      f"({100 * r['headroom_bytes'] / r['memory_bytes']:.0f}%)"]
    lines += [f"warning: {w}" for w in r["warnings"]]
    cache = r.get("cache") or {}
    if cache.get("hits"):
        lines += [f"from the plan cache ({cache['dir']}, the same program text for the same compiler and devices): "
                  + ", ".join(cache["hits"])]
    if r.get("prediction"):
        from sage_jax.plan import roofline
        lines += ["", roofline.format_prediction(r["prediction"])]
    if r.get("decode"):  # plan.decode: copies counted in the compiled loop body; the rate a PREDICTION
        lines += [""] + [d["text"] for d in r["decode"]]
    return "\n".join(lines)
