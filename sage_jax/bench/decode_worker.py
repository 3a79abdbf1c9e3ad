"""One process's sampler timings for bench gpu_decode, run as a script against whichever sage_jax is on its path:
this checkout's, or an older commit's (it uses only `sage_jax.model` and `sage_jax.sampler`, public since the first
release, and passes newer generate arguments only where the code has them).

    python sage_jax/bench/decode_worker.py SPEC_JSON     (cwd and PYTHONPATH: the code to measure)

SPEC: {"preset", "compute_dtype", "repeats", "shapes": [{"rows", "samples", "prompt_len", "new_tokens",
"lengths" (optional, one per row), "attention" (optional), "trace" (optional directory)}]}. Prints one JSON line
per shape: seconds (median of the timed calls after a first, compiling call), tokens/s, decode steps, loop
iterations (where the code counts them), or the error.
"""

from __future__ import annotations

import inspect
import json
import statistics
import sys
import time


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure(spec: dict) -> None:
    import jax
    import numpy as np
    from sage_jax import model, sampler
    cfg = model.preset(spec["preset"], param_dtype="float32", compute_dtype=spec["compute_dtype"], eos_token_ids=())
    params = jax.jit(model.init_params, static_argnums=0)(cfg, jax.random.key(0))
    accepts = set(inspect.signature(sampler.generate).parameters)
    for shape in spec["shapes"]:
        row = dict(shape, lengths=None)
        try:
            rows, g = shape["rows"], shape["samples"]
            prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows // g, shape["prompt_len"])).tolist()
            kw = dict(max_new_tokens=shape["new_tokens"], temperature=1.0, eos_ids=(), num_samples=g, seed=0)
            for name in ("lengths", "attention"):
                if shape.get(name) is not None:
                    arg = {"lengths": "row_max_new_tokens", "attention": "decode_attention"}[name]
                    if arg not in accepts:
                        raise ValueError(f"this code's sampler.generate has no {arg}")
                    kw[arg] = shape[name]
            box = {}

            def call():
                box["out"] = sampler.generate(cfg, params, prompts, **kw)
                box["out"].tokens.block_until_ready()
            compile_s = _time(call, 1)[0]
            seconds = statistics.median(_time(call, spec["repeats"]))
            out = box["out"]
            tokens = int(np.asarray(out.lengths).sum())
            row.update(seconds=seconds, first_call_s=compile_s, tokens=tokens, tokens_per_s=tokens / seconds,
                       steps=int(out.steps), loops=int(out.loops) if getattr(out, "loops", None) is not None else None)
            if shape.get("trace"):
                with jax.profiler.trace(shape["trace"]):
                    call()
        except Exception as e:  # noqa: BLE001 - a shape that fails (memory, an old API) must not lose the others
            row["error"] = repr(e)[:400]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    measure(json.loads(sys.argv[1]))
