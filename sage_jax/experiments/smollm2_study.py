"""The SmolLM2 study's old command, kept as an alias of `python -m sage_jax.experiments.study --settings
configs/smollm2_arms.py` (study.py), every flag as it is.

    python -m sage_jax.experiments.smollm2_study --out docs/results/smollm2_study --report-only
"""

from __future__ import annotations

import sys
from typing import Sequence

from sage_jax.experiments.runs import ROOT


def main(argv: Sequence[str] | None = None) -> int:
    from sage_jax.experiments import study
    argv = list(sys.argv[1:] if argv is None else argv)
    return study.main(["--settings", str(ROOT / "configs" / "smollm2_arms.py"), *argv],
                      "python -m sage_jax.experiments.smollm2_study", argv)


if __name__ == "__main__":
    from sage_jax.run import cli
    cli.main_guard(main)
