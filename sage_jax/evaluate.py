"""python -m sage_jax.evaluate --model DIR --datasets aime24,aime25,amc23,math500 --n 256 --k 1,4,16,64,256

Samples n completions per problem from a Hugging Face model directory or a training workdir, scores them in a reward
process pool and writes the unbiased pass@k per dataset (OUT/<dataset>/{results.json, results.md, pass_at_k.png,
samples.jsonl}) and over all of them (OUT/summary.json, OUT/summary.md, OUT/pass_at_k.png; "average" is the mean of
the per-dataset values). Rerunning the same command resumes: problems already in a samples.jsonl are not sampled
again, and a finished run only rewrites the tables without loading the model. OUT/eval_settings.json records what
drew the samples; resuming with other sampling settings (or another model / checkpoint step) is refused.

--model: an HF directory (config.json + *.safetensors + tokenizer files), or a training workdir: its hf_export/ if
present (--step S: that RL checkpoint instead), else the newest checkpoint under WORKDIR/rl, rebuilt from the run's
WORKDIR/config.json.
--tools python (or a workdir whose rollout.tools is set): samples pause at their tool calls, the tools run, the
samples resume with the output as tokens the model reads; the reward reads the model's own text only. samples.jsonl
then holds each sample's turns and tool counts, results.json the tool metrics (calls per row, errors, timeouts).
Datasets: registered names (math500, aime24, aime25, amc23, gsm8k, kk, kk:people5, ...), local .jsonl/.parquet files
or folders, countdown and countdown_ood (regenerated as the training run made them; loaders' defaults without a
run config).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from sage_jax.run import cli


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="pass@k of a model on evaluation sets (resumable).")
    p.add_argument("--model", required=True, help="HF model directory or training workdir")
    p.add_argument("--datasets", default=None, help="comma-separated names or paths (default: a training workdir's "
                   "own evaluation sets, its data.eval; else aime24,aime25,amc23,math500)")
    p.add_argument("--n", type=int, default=256, help="samples per problem")
    p.add_argument("--k", default="", help="comma-separated k values (default 1, 2, 4, ..., n)")
    p.add_argument("--out", default="", help="output folder (default WORKDIR/eval/<source> or ./eval/<model name>)")
    p.add_argument("--data-dir", default="", help="folder holding math500/, aime24/, ... (default: loaders')")
    # sampling: a training workdir's own evaluation settings (its eval.*) unless given; else these defaults
    p.add_argument("--temperature", type=float, default=None, help="default: the run's eval.temperature, else 1.0")
    p.add_argument("--top-p", type=float, default=None, help="default: the run's eval.top_p, else 1.0")
    p.add_argument("--top-k", type=int, default=None, help="default: the run's rollout.top_k, else 0")
    p.add_argument("--min-p", type=float, default=None, help="default: the run's eval.min_p, else 0.0")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the run's eval.max_new_tokens (or rollout.max_new_tokens), else 3072")
    p.add_argument("--template", default="", help="prompt template (default: the run's data.template, else "
                   "qwen_math_boxed; plain for countdown; chat: the model's own chat template)")
    p.add_argument("--limit", type=int, default=0, help="only the first N problems of each dataset (0 = all)")
    p.add_argument("--batch-problems", type=int, default=0, help="problems per sampler call (default max-rows // n)")
    p.add_argument("--max-rows", type=int, default=256, help="decode rows per sampler call (bounds the KV cache)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--data-seed", type=int, default=None, help="countdown generator seed (default: the run's seed)")
    p.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor mesh shape (one may be -1)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="params and compute dtype (default: the run's compute dtype, else bfloat16)")
    p.add_argument("--task", choices=("math", "kk", "countdown"), default=None,
                   help="tokenizer and reward family (default: the run's task, else from the dataset names)")
    p.add_argument("--tokenizer", default="", help="tokenizer directory when the model directory has none")
    p.add_argument("--step", type=int, default=None, help="workdir: evaluate this RL checkpoint step")
    p.add_argument("--reward-workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="reward worker processes (0 = score in this process)")
    p.add_argument("--reward-timeout", type=float, default=10.0, help="seconds per scored completion")
    # tools: the model calls them mid-answer (eval/tool_loop.py); default: a training workdir's own rollout.tools
    p.add_argument("--tools", default=None, help="comma-separated tools the model may call: python, calculator "
                   "('none': no tools; default: the run's rollout.tools, else none)")
    p.add_argument("--tool-format", choices=("markdown", "hermes"), default=None,
                   help="call format: ```python blocks or the chat template's <tool_call> (default: the run's, "
                   "else markdown)")
    p.add_argument("--max-turns", type=int, default=None, help="tool calls per sample (default: the run's, else 4)")
    p.add_argument("--tool-timeout", type=float, default=None, help="seconds per call (default: the run's, else 5)")
    p.add_argument("--max-tool-tokens", type=int, default=None,
                   help="tokens of a tool's output kept, head and tail (default: the run's, else 512)")
    p.add_argument("--tool-workers", type=int, default=None, help="calls run at once (default: the run's, else 8)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from sage_jax.models import sharding
    sharding.initialize_distributed()
    from sage_jax.eval import offline
    summary = offline.run(args)
    from sage_jax.run import paths
    out = paths.path(summary["out"])
    print(paths.read_text(out / "summary.md"), end="")
    print(f"wrote {out / 'summary.json'}, {out / 'summary.md'}, {out / 'pass_at_k.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    cli.main_guard(main)
