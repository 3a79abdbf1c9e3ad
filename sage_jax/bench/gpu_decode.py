"""The decode path's GPU check, one command (issue 46): this code's sampler at 1 / 64 / 256 rows against the
2026-11-30 code's (commit 8fc7f94) in the same run, the decode attention forms against each other, the long-tailed
workload through the kernel and in one pass, and a profiler trace.

    python -m sage_jax.bench gpu_decode --baseline-dir DIR --out docs/results/gpu/decode_DATE.json --trace DIR
    python -m sage_jax.bench gpu_decode --quick --out /tmp/gpu_decode.json      # tiny shapes: any machine

DIR holds the 2026-11-30 code: `git archive 8fc7f94 | tar -x -C DIR` (or `--baseline-commit 8fc7f94`, which does
that from this checkout's git). The 0.5B shape in bf16, prompts of 128 tokens, 512 new tokens, 8 samples per prompt
(1 for the single row), EOS ignored. Each code runs in a process of its own (bench/decode_worker.py, which the old
code's sampler also answers), one after the other, so each has the accelerator to itself; every figure is the median
of --repeats calls after a first, compiling one. The table's ratios are of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sage_jax.bench import workloads

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("decode_worker.py")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sage_jax.bench gpu_decode", description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["gpu_decode"])
    p.add_argument("--baseline-dir", default="", help="a checkout of the code to compare with (commit 8fc7f94)")
    p.add_argument("--baseline-commit", default="", help="make --baseline-dir from this checkout's git")
    p.add_argument("--out", default="gpu_decode.json")
    p.add_argument("--trace", default="", help="write a profiler trace of one 64-row call (kernel) here")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run on any machine)")
    p.add_argument("--timeout", type=float, default=180, help="seconds for the baseline's process before it is stopped "
                   "(this code's gets twice as long: it times more forms); the shapes done by then are kept")
    return p


def shapes(quick: bool, trace: str) -> tuple[list[dict], list[dict], dict]:
    """(the baseline's shapes, this code's, the spec's fixed part)."""
    if quick:
        sizes, prompt_len, new_tokens = (1, 4, 8), 8, 16
    else:
        sizes, prompt_len, new_tokens = (1, 64, 256), 128, 512
    fixed = [dict(rows=r, samples=1 if r == 1 else min(8, r), prompt_len=prompt_len, new_tokens=new_tokens)
             for r in sizes]
    ours = [dict(s, attention=a) for s in fixed for a in ("auto", "one_pass")]
    ours += [dict(fixed[1], attention="blocked")]
    tail = workloads.longtail_lengths(sizes[1], new_tokens, seed=0).tolist()
    ours += [dict(fixed[1], lengths=tail, attention=a, workload="longtail") for a in ("kernel", "one_pass")]
    if trace:
        ours.append(dict(fixed[1], attention="kernel", trace=trace))
    spec = dict(preset="tiny" if quick else "qwen2.5-0.5b", compute_dtype="bfloat16", repeats=1)
    return fixed, ours, spec


def run_worker(code_dir: Path, spec: dict, timeout: float) -> list[dict]:
    """The worker's rows, run against the sage_jax in code_dir (a stopped or failed process: an error row)."""
    env = dict(os.environ, PYTHONPATH=str(code_dir))
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    parse = lambda out: [json.loads(line) for line in (out or "").splitlines() if line.startswith("{")]
    try:
        proc = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], cwd=code_dir, env=env, text=True,
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # the shapes done so far are kept
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout
        return parse(out) + [{"error": f"stopped after {timeout:.0f} s", "code": str(code_dir)}]
    rows = parse(proc.stdout)
    if proc.returncode:
        rows.append({"error": proc.stderr.strip().splitlines()[-1][:400] if proc.stderr.strip() else
                     f"exit {proc.returncode}", "code": str(code_dir)})
    return rows


def table(baseline: list[dict], ours: list[dict]) -> list[str]:
    rate = lambda found, **k: next((r.get("tokens_per_s") for r in found
                                   if all(r.get(a) == b for a, b in k.items())), None)
    lines = ["rows  baseline tok/s     auto tok/s   one pass   blocked     auto / baseline   loops per step",
             "(auto: the platform's decode forms, the Pallas kernel on a GPU; loops: data-dependent iterations)"]
    for r in baseline:
        n = r["rows"]
        base, kern = r.get("tokens_per_s"), rate(ours, rows=n, attention="auto", workload=None)
        one, blk = rate(ours, rows=n, attention="one_pass", workload=None), rate(ours, rows=n, attention="blocked")
        auto = next((o for o in ours if o.get("rows") == n and o.get("attention") == "auto" and "tokens" in o), {})
        fmt = lambda x: f"{x:>12,.0f}" if x else f"{'-':>12}"
        ratio = f"{kern / base:.2f}x" if kern and base else "-"
        loops = f"{auto['loops'] / auto['steps']:.2f}" if auto.get("loops") else "-"
        lines.append(f"{n:>4}  {fmt(base)}   {fmt(kern)} {fmt(one)} {fmt(blk)}   {ratio:>17}   {loops:>15}")
    kern, one = rate(ours, workload="longtail", attention="kernel"), rate(ours, workload="longtail",
                                                                           attention="one_pass")
    if kern and one:
        lines.append(f"long tail: kernel {kern:,.0f} tok/s, one pass {one:,.0f} tok/s: {kern / one:.2f}x")
    return lines


def main(argv: list[str]) -> list[dict]:
    args = parser().parse_args(argv)
    if args.repeats < 1 or args.timeout <= 0:
        raise SystemExit("error: --repeats and --timeout must be positive")
    fixed, ours, spec = shapes(args.quick, args.trace)
    spec["repeats"] = args.repeats
    baseline_dir = Path(args.baseline_dir) if args.baseline_dir else None
    if args.baseline_commit:
        baseline_dir = Path(tempfile.mkdtemp(prefix="sage_jax_baseline_"))
        archive = subprocess.run(["git", "archive", args.baseline_commit], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(baseline_dir)], input=archive.stdout, check=True)
    if baseline_dir is not None and not (baseline_dir / "sage_jax").is_dir():
        raise SystemExit(f"error: --baseline-dir {baseline_dir} holds no sage_jax/: extract commit 8fc7f94 there "
                         "(git archive 8fc7f94 | tar -x -C DIR), or pass --baseline-commit 8fc7f94")
    t0 = time.perf_counter()
    base_rows = run_worker(baseline_dir, dict(spec, shapes=fixed), args.timeout) if baseline_dir else []
    our_rows = run_worker(ROOT, dict(spec, shapes=ours), 2 * args.timeout)
    result = {"spec": spec, "baseline": base_rows, "ours": our_rows, "seconds": time.perf_counter() - t0,
              "table": table(base_rows or [dict(r) for r in fixed], our_rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(result["table"]))
    return our_rows + base_rows
