"""Tool-integrated RL rollouts (rollout.tools): rollouts.rollout_phases' rows, drawn by the tool loop of
eval/tool_loop.py (rows pause at their tool calls, the calls run in the tool pool while the other rows decode, the
rows resume with the tools' outputs as observed tokens) with the run's sampler bound in.

The loop's names stay importable from here (ToolSettings, ToolFormat, generate_with_tools, settings_from).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sage_jax.eval.tool_loop import (ToolFormat, ToolSettings, _closes_fence, bind_sampler, format_for,  # noqa: F401
                                     generate_with_tools, sampled_texts, settings_from)
from sage_jax.tools.base import ToolPool


def rollout_tool_rows(task, cfg, params, prompts: list[list[int]], rollout_cfg, key) -> dict[str, Any]:
    """rollouts.rollout_phases' rows with rollout.tools: the run's sampler bound into generate_fn, the tools in a
    pool for the call. On several processes, process 0 runs the tools and tells the others which calls answered
    (tool_loop._Answers), so every process decodes the same rows."""
    from sage_jax.sampling import sampler
    from sage_jax.tools.registry import make_tools
    if getattr(task.tokenizer, "hf", None) is None:
        raise ValueError(f"rollout.tools needs a Hugging Face tokenizer (--config.model.path or tokenizer_path); the "
                         f"{task.name!r} task's own tokenizer cannot find calls")
    G = rollout_cfg.group_size
    tools = make_tools(tuple(rollout_cfg.tools), timeout_s=float(getattr(rollout_cfg, "tool_timeout", 5.0)))
    fmt = format_for(task.tokenizer.hf, getattr(rollout_cfg, "tool_format", "markdown"), tools)
    sampling = dict(max_new_tokens=rollout_cfg.max_new_tokens, temperature=rollout_cfg.temperature,
                    top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k, min_p=rollout_cfg.min_p)
    generate_fn = bind_sampler(cfg, params, sampling, key, min_rows=len(prompts) * G + 1,
                               slots=getattr(rollout_cfg, "slots", None))
    with ToolPool(tools, num_workers=int(getattr(rollout_cfg, "tool_workers", 8))) as pool:
        ro = generate_with_tools(generate_fn, prompts, G, fmt, pool, settings_from(rollout_cfg),
                                 rollout_cfg.max_new_tokens, key)
        ro["tool_stats"]["tools/seconds"] = pool.take_counts()["tools/seconds"]  # time in tools, hidden or waited
    P = sampler.prompt_bucket(max(map(len, prompts)))
    ro["prompt_tokens"] = np.full((len(prompts) * G, P), cfg.pad_token_id, np.int32)
    ro["prompt_mask"] = np.zeros((len(prompts) * G, P), bool)
    for n in range(len(prompts) * G):
        p = prompts[n // G]
        ro["prompt_tokens"][n, P - len(p):], ro["prompt_mask"][n, P - len(p):] = p, True
    ro["texts"] = sampled_texts(ro, task.tokenizer.decode)  # the reward reads the model's own text only
    return ro
