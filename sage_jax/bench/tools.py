"""`python -m sage_jax.bench tools`: generation tokens/s with tool calls against the same workload without them.

    python -m sage_jax.bench tools --batch 64 --group 4 --new-tokens 128 --tool-ms 100

One random-weight model, one set of prompts and one seed. The tool-free arm is one sampler.generate call. In the
tool arm a row pauses at the first time it draws a marker token, chosen from the tool-free run as the token that
about half of the rows draw, so about half the rows call once (rollout.max_turns 1); the call sleeps --tool-ms and
its output is 4 observed tokens; the row resumes through training/tool_rollouts.py as in training. Generation
tokens/s counts sampled tokens only. Each arm's figure is the median of --repeats timed runs after warm-up runs
(until one compiles no new sampler program: which calls a run makes depends on the tools' timing), the arms
interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from sage_jax.models import decoder as model_lib
from sage_jax.sampling import sampler
from sage_jax.tools.base import ToolOutput, ToolPool
from sage_jax.tools.calls import ToolCall
from sage_jax.training import tool_rollouts

OBSERVED = [5, 6, 7, 8]


class _SleepTool:
    name, schema = "sleep", {}

    def __init__(self, seconds: float):
        self.seconds = seconds

    def parse(self, arguments):
        return arguments

    def execute(self, payload) -> ToolOutput:
        time.sleep(self.seconds)
        return ToolOutput("ok", seconds=self.seconds)


class _MarkerFormat:
    """A call wherever a row draws the marker token; its output is OBSERVED."""
    call_format = "hermes"

    def __init__(self, marker: int):
        self.end_ids = (marker,)

    def find(self, turn_ids):
        return ToolCall("sleep", {})

    def turn_text(self, turn_ids):
        return ""

    def observe(self, messages, output, max_tokens):
        return list(OBSERVED), False


def _marker(tokens: np.ndarray, lengths: np.ndarray, eos: int) -> tuple[int, float]:
    """The token drawn by the share of rows nearest one half (not the eos, nor an observed id)."""
    rows = [set(t[:n].tolist()) for t, n in zip(tokens, lengths)]
    share = {v: sum(v in r for r in rows) / len(rows) for v in set().union(*rows) - {eos, *OBSERVED}}
    best = min(share, key=lambda v: abs(share[v] - 0.5))
    return int(best), share[best]


def main(argv: list[str]) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m sage_jax.bench tools", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64, help="rows (prompts x group)")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--tool-ms", type=float, default=100.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=16, help="tool calls at once")
    p.add_argument("--return-share", type=float, default=1.0, help="a sampler call returns once this share of "
                   "its groups is complete (1: when every row has stopped)")
    args = p.parse_args(argv[1:])
    cfg = model_lib.ModelConfig(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                                head_dim=32, intermediate_size=512, rope_theta=10000.0, max_position_embeddings=1024)
    params = model_lib.init_params(cfg, jax.random.key(0))
    B, G, C, eos = args.batch // args.group, args.group, args.new_tokens, 2
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 500, int(rng.integers(8, 24))).tolist() for _ in range(B)]
    key = jax.random.key(1)
    plain = lambda: sampler.generate(cfg, params, prompts, C, temperature=1.0, eos_ids=(eos,), seed=key,
                                     num_samples=G)
    out = jax.device_get(plain())
    marker, share = _marker(np.asarray(out.tokens), np.asarray(out.lengths), eos)

    def generate_fn(prompts_, num_samples, resume, stop, limits, extra_eos):
        return jax.device_get(sampler.generate(cfg, params, prompts_, C, temperature=1.0, eos_ids=(eos, *extra_eos),
                                               seed=key, num_samples=num_samples, resume=resume,
                                               stop_after_groups=stop, row_max_new_tokens=limits,
                                               min_rows=B * G + 1 if resume else 0))

    settings = tool_rollouts.ToolSettings(max_turns=1, return_share=args.return_share)
    with ToolPool({"sleep": _SleepTool(args.tool_ms / 1000)}, num_workers=args.workers) as pool:
        def with_tools():
            return tool_rollouts.generate_with_tools(generate_fn, prompts, G, _MarkerFormat(marker), pool, settings,
                                                     C, key)
        for _ in range(6):  # warm-up until a run compiles nothing new (which calls a run makes depends on timing)
            before = sampler.compile_count()
            with_tools()
            if sampler.compile_count() == before:
                break
        times = {"plain": [], "tools": []}
        counts = {}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = jax.block_until_ready(plain())
            times["plain"].append(time.perf_counter() - t0)
            counts["plain"] = int(np.asarray(out.lengths).sum())
            t0 = time.perf_counter()
            ro = with_tools()
            times["tools"].append(time.perf_counter() - t0)
            counts["tools"] = int(ro["sampled_mask"].sum())
            calls = ro["tool_stats"]["tools/calls_per_row"]
    rows = [{"arm": arm, "rows": B * G, "new_tokens": C, "tool_ms": args.tool_ms, "return_share": args.return_share,
             "sampled_tokens": counts[arm],
             "median_s": statistics.median(times[arm]), "tokens_per_s": counts[arm] / statistics.median(times[arm])}
            for arm in ("plain", "tools")]
    rows[1].update(calls_per_row=calls, marker_share=share, sampler_calls=ro["tool_stats"]["tools/sampler_calls"],
                   ratio=rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
    for r in rows:
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    return rows
