"""Offline evaluation with tools (`python -m sage_jax.evaluate --tools python`): the tools and limits a run asks for
(tool_options: flags, else a training run's rollout.*), what they need of the machine and the tokenizer, checked
before the model loads (make_tooling), and generate_fn over tool_loop.generate_with_tools (make_eval_generate_fn):
the texts the reward reads are the model's own tokens only, each sample's turns and tool counts go to samples.jsonl.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, NamedTuple

from sage_jax.eval import tool_loop
from sage_jax.eval.passk import Completions, sampling_chunks
from sage_jax.tools.base import ToolPool

TOOL_DEFAULTS = {"tool_format": "markdown", "max_turns": 4, "tool_timeout": 5.0, "max_tool_tokens": 512,
                 "tool_workers": 8}
TOOL_SETTINGS = {"tools", "tool_format", "max_turns", "tool_timeout", "max_tool_tokens"}  # in eval_settings.json


def tool_options(args: argparse.Namespace, run_config: Any) -> dict[str, Any]:
    """The tools to sample with and their limits ({}: none): --tools, else a training run's rollout.tools; the flags
    left unset take the run's rollout.* values, else TOOL_DEFAULTS."""
    ro = run_config.rollout if run_config is not None else {}
    names = tuple(ro.get("tools", ())) if args.tools is None else tuple(
        t.strip() for t in args.tools.split(",") if t.strip() and t.strip().lower() != "none")
    if not names:
        return {}
    from sage_jax.tools.registry import NAMES
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"--tools {','.join(unknown)}: unknown tool; choose from {', '.join(NAMES)} (or none)")
    opts: dict[str, Any] = {"tools": list(dict.fromkeys(names))}
    for key, default in TOOL_DEFAULTS.items():
        flag = getattr(args, key, None)
        opts[key] = type(default)(flag if flag is not None else ro.get(key, default))
    if opts["tool_format"] not in ("markdown", "hermes"):
        raise ValueError(f"tool format {opts['tool_format']!r}: choose markdown or hermes (--tool-format)")
    if min(opts["max_turns"], opts["max_tool_tokens"], opts["tool_workers"]) < 1 or not opts["tool_timeout"] > 0:
        raise ValueError(f"--max-turns, --max-tool-tokens and --tool-workers must be >= 1 and --tool-timeout > 0; "
                         f"got {opts['max_turns']}, {opts['max_tool_tokens']}, {opts['tool_workers']}, "
                         f"{opts['tool_timeout']}")
    return opts


class Tooling(NamedTuple):
    tools: dict[str, Any]  # by name
    fmt: tool_loop.ToolFormat
    settings: tool_loop.ToolSettings
    schemas: list[dict] | None  # for the chat template's tools= (the hermes format), else None


def make_tooling(opts: dict[str, Any], tokenizer: Any) -> Tooling | None:
    """The tools, their call format over this tokenizer and the loop's limits (None without tools). A tool this
    machine cannot run, or a format the tokenizer cannot express, is refused here in one line."""
    if not opts:
        return None
    from sage_jax.tools.registry import SCHEMAS, make_tools
    if getattr(tokenizer, "hf", None) is None:
        raise ValueError("--tools needs a Hugging Face tokenizer to find the model's calls; this model's own "
                         "tokenizer has none (evaluate it with --tools none)")
    try:
        tools = make_tools(opts["tools"], timeout_s=opts["tool_timeout"])
    except RuntimeError as e:  # the python tool's sandbox cannot be built on this machine
        raise ValueError(f"--tools {','.join(opts['tools'])}: {e}") from None
    try:
        fmt = tool_loop.format_for(tokenizer.hf, opts["tool_format"], tools)
    except ValueError as e:
        raise ValueError(f"--tool-format {opts['tool_format']}: {e}") from None
    hermes = opts["tool_format"] == "hermes"
    return Tooling(tools, fmt, tool_loop.ToolSettings(max_turns=opts["max_turns"],
                                                      max_tool_tokens=opts["max_tool_tokens"]),
                   [SCHEMAS[n] for n in opts["tools"]] if hermes else None)


def make_eval_generate_fn(cfg, params, decode: Callable, sampling: dict[str, Any], seed: int, max_rows: int,
                          fmt: tool_loop.ToolFormat, pool: ToolPool, settings: tool_loop.ToolSettings) -> Callable:
    """passk.make_generate_fn with tools: generate_fn(prompts, n, pad_to=0) -> passk.Completions: the texts a reward
    reads (each row's sampled tokens only), and per prompt each sample's turns (the model's text and each tool's
    output, as training's samples.jsonl) and tool counts. Keys and chunks as make_generate_fn's; the prompts are not
    padded (a padding prompt's rows would call tools too), the calls that carry rows back are, to one size."""
    import jax

    def generate_fn(prompts: list[list[int]], n: int, pad_to: int = 0) -> Completions:
        B, per_call, key = sampling_chunks(prompts, n, pad_to, max_rows, seed)
        texts: list[list[str]] = [[] for _ in prompts]
        extra: list[dict[str, list]] = [{"turns": [], "tools": []} for _ in prompts]
        for chunk in range(n // per_call):
            chunk_key = jax.random.fold_in(key, chunk)
            fn = tool_loop.bind_sampler(cfg, params, sampling, chunk_key, min_rows=B * per_call + 1)
            ro = tool_loop.generate_with_tools(fn, prompts, per_call, fmt, pool, settings,
                                               sampling["max_new_tokens"], chunk_key)
            for r, text in enumerate(tool_loop.sampled_texts(ro, decode)):
                texts[r // per_call].append(text)
                extra[r // per_call]["turns"].append(ro["messages"][r][1:])
                extra[r // per_call]["tools"].append(ro["row_tools"][r])
        return Completions(texts, extra)
    return generate_fn
