"""A study's regime, chosen on GRPO alone before any guided arm runs (`study.py --regime`; the verdicts and
regime.md / regime.json: report.py's regime_*), and the countdown study's old command as an alias.

Rule. Paired by seed (GRPO seed s against the base evaluated with seed s's key, or the one base evaluation when the
base has one), a candidate is kept when GRPO's pass@1 on the rule's split rises by at least min_gain with a 95%
t-interval above 0, and one of the `fall` metrics (pass@n: n = the largest k evaluated; distinct) falls below the
base's: its mean, or with fall_interval its whole interval. The selected candidate is the cheapest kept one (fewest
rollouts; the larger gain on a tie); if none is kept, the closest to the rule (the smallest shortfall: how far
pass@1's interval reaches below 0 plus how far the fall interval reaches above 0), the cheaper on a tie. Freeze it by
copying its settings into the settings file's REGIME (one commit) before any guided arm runs.

    python -m sage_jax.experiments.regime --out docs/results/study_countdown/regime.md --records RUNS   # the alias
"""

from __future__ import annotations

import os
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The countdown study's old regime command: --out FILE.md, --records DIR, --budget/--tiny."""
    from sage_jax.experiments import reproduce, study
    shown = list(sys.argv[1:] if argv is None else argv)
    argv = reproduce.translated(shown)
    out = argv.index("--out") + 1
    argv[out] = os.path.dirname(os.path.abspath(argv[out]))
    return study.main(["--regime", "--regime-all", *argv], "python -m sage_jax.experiments.regime", shown)


if __name__ == "__main__":
    from sage_jax.run import cli
    cli.main_guard(main)
