"""python -m sage_jax.patterns runA/samples.jsonl runB/samples.jsonl [--only-correct] [--out table.md]

Compares the reasoning-pattern frequencies (sage_jax/eval/patterns.py's rules) of two sample logs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from sage_jax.eval.patterns import compare


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Compare reasoning-pattern frequencies of two sample logs.")
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--only-correct", action="store_true", help="count only completions with reward 1")
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args(argv)
    for path in (args.run_a, args.run_b):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: no such file; pass two samples.jsonl files (e.g. "
                                    "WORKDIR/eval/after/NAME/samples.jsonl)")
    table = compare(args.run_a, args.run_b, args.only_correct)
    print(table, end="")
    if args.out:
        Path(args.out).write_text(table, encoding="utf-8")


if __name__ == "__main__":
    from sage_jax.run import cli
    cli.main_guard(main)
