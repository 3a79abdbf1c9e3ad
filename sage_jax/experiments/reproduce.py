"""The countdown study's old command, kept as an alias of `python -m sage_jax.experiments.study --settings
configs/countdown_arms.py` (study.py): --budget B is --preset B, --tiny is --preset tiny, --records R keeps the
result files in R/B, --arms STUDY is the settings' SEEDS_PER_ARM arms.

    python -m sage_jax.experiments.reproduce --budget study --arms STUDY --sweep --out OUT --records RUNS --report-only
"""

from __future__ import annotations

import sys
from typing import Sequence

from sage_jax.experiments.runs import ROOT


def translated(argv: list[str]) -> list[str]:
    """The old flags as study.py's."""
    budget = argv[argv.index("--budget") + 1] if "--budget" in argv else "tiny" if "--tiny" in argv else None
    out, i = ["--settings", str(ROOT / "configs" / "countdown_arms.py")], 0
    while i < len(argv):
        flag = argv[i]
        if flag in ("--budget", "--records", "--arms") and i + 1 < len(argv):
            value = argv[i + 1]
            out += {"--budget": ["--preset", value], "--arms": [] if value == "STUDY" else ["--arms", value],
                    "--records": ["--results", f"{value}/{budget or 'full'}"]}[flag]
            i += 2
            continue
        out += ["--preset", "tiny"] if flag == "--tiny" else [flag]
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from sage_jax.experiments import study
    argv = list(sys.argv[1:] if argv is None else argv)
    return study.main(translated(argv), "python -m sage_jax.experiments.reproduce", argv)


if __name__ == "__main__":
    from sage_jax.run import cli
    cli.main_guard(main)
