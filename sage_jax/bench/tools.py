"""`python -m sage_jax.bench tools`: generation tokens/s with tool calls against the same workload without them.

    python -m sage_jax.bench tools --batch 64 --group 4 --new-tokens 128 --tool-ms 100

One random-weight model, one set of prompts and one seed. The tool-free arm is one sampler.generate call. In the
tool arm a row pauses the first time it draws a marker token, chosen from the tool-free run as the tokens that about
half of the rows draw (_markers), so about half the rows call (once: rollout.max_turns 1, a row that draws a second
marker ends there, truncated, as a row past its turns does in training); the call sleeps --tool-ms and
its output is 4 observed tokens; the row resumes through eval/tool_loop.py as in training: in the pool, which stays
on the device and keeps decoding the other rows while the tool runs (arm "tools", sampling/session.py), and by
returning from the sampler and coming back in a new call (arm "tools_calls", --return-share). Generation tokens/s
counts sampled tokens only. Each arm's figure is the median of --repeats timed runs after warm-up runs (until one
compiles no new sampler program: which calls a run makes depends on the tools' timing), the arms interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from sage_jax.models import decoder as model_lib
from sage_jax.sampling import sampler
from sage_jax.sampling.session import PoolSession
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
    """A call wherever a row draws a marker token; its output is OBSERVED."""
    call_format = "hermes"

    def __init__(self, markers: tuple[int, ...]):
        self.end_ids = markers

    def find(self, turn_ids):
        return ToolCall("sleep", {})

    def turn_text(self, turn_ids):
        return ""

    def observe(self, messages, output, max_tokens):
        return list(OBSERVED), False


def _markers(tokens: np.ndarray, lengths: np.ndarray, eos: int) -> tuple[tuple[int, ...], float]:
    """Marker tokens (not the eos, nor an observed id) such that the share of rows that draw at least one of them is
    nearest one half: one token at a time, each the one that brings the share nearest, while it gets nearer (with a
    small random model's flat distribution no single token is drawn by half the rows) -> (markers, share)."""
    rows = [set(t[:n].tolist()) for t, n in zip(tokens, lengths)]
    ids = sorted(set().union(*rows) - {eos, *OBSERVED})
    share = lambda ms: sum(bool(r & ms) for r in rows) / len(rows)
    chosen: set[int] = set()
    while True:
        best = min(ids, key=lambda v: (abs(share(chosen | {v}) - 0.5), v))
        if chosen and abs(share(chosen | {best}) - 0.5) >= abs(share(chosen) - 0.5):
            return tuple(sorted(chosen)), share(chosen)
        chosen.add(best)


def main(argv: list[str]) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m sage_jax.bench tools", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64, help="rows (prompts x group)")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--tool-ms", type=float, default=100.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=16, help="tool calls at once")
    p.add_argument("--return-share", type=float, default=1.0, help="tools_calls: a sampler call returns once "
                   "this share of its groups is complete (1: when every row has stopped)")
    p.add_argument("--steps-per-call", default="16", help="tools: decode steps between two looks at the rows (several, "
                   "comma-separated: one in-pool arm each, e.g. 4,8,16)")
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
    markers, share = _markers(np.asarray(out.tokens), np.asarray(out.lengths), eos)

    def generate_fn(prompts_, num_samples, resume, stop, limits, extra_eos):
        return jax.device_get(sampler.generate(cfg, params, prompts_, C, temperature=1.0, eos_ids=(eos, *extra_eos),
                                               seed=key, num_samples=num_samples, resume=resume,
                                               stop_after_groups=stop, row_max_new_tokens=limits,
                                               min_rows=B * G + 1 if resume else 0))

    def session(prompts_, num_samples, pause_ids, steps_per_call):  # the in-pool path (tool_loop.bind_sampler's)
        return PoolSession(cfg, params, prompts_, C, temperature=1.0, eos_ids=(eos,), seed=key,
                           num_samples=num_samples, pause_ids=pause_ids, steps_per_call=steps_per_call)
    generate_fn.session = session
    ks = [int(k) for k in str(args.steps_per_call).split(",")]
    settings = {**{"tools" if len(ks) == 1 else f"tools_k{k}":
                   tool_rollouts.ToolSettings(max_turns=1, steps_per_call=k) for k in ks},
                "tools_calls": tool_rollouts.ToolSettings(max_turns=1, return_share=args.return_share, in_pool=False)}
    arms = ("plain", *settings)
    with ToolPool({"sleep": _SleepTool(args.tool_ms / 1000)}, num_workers=args.workers) as pool:
        def run(arm):
            if arm == "plain":
                return int(np.asarray(jax.block_until_ready(plain()).lengths).sum()), None
            ro = tool_rollouts.generate_with_tools(generate_fn, prompts, G, _MarkerFormat(markers), pool,
                                                   settings[arm], C, key)
            return int(ro["sampled_mask"].sum()), ro["tool_stats"]
        for arm in settings:
            for _ in range(6):  # warm-up until a run compiles nothing new (the calls made depend on the tools' timing)
                before = sampler.compile_count()
                run(arm)
                if sampler.compile_count() == before:
                    break
        times, counts, stats = {arm: [] for arm in arms}, {}, {}
        for _ in range(args.repeats):
            for arm in arms:
                t0 = time.perf_counter()
                counts[arm], stats[arm] = run(arm)
                times[arm].append(time.perf_counter() - t0)
    rows = [{"arm": arm, "rows": B * G, "new_tokens": C, "tool_ms": args.tool_ms, "sampled_tokens": counts[arm],
             "median_s": statistics.median(times[arm]), "tokens_per_s": counts[arm] / statistics.median(times[arm])}
            for arm in arms]
    for r in rows[1:]:
        st = stats[r["arm"]]
        r.update(calls_per_row=st["tools/calls_per_row"], marker_share=share, markers=len(markers),
                 sampler_calls=st["tools/sampler_calls"], ratio=r["tokens_per_s"] / rows[0]["tokens_per_s"])
    for r, k in zip(rows[1:], ks):
        r["steps_per_call"] = k
    rows[-1]["return_share"] = args.return_share
    for r in rows:
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    return rows
