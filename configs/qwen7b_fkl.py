"""GRPO with a forward-KL anchor over whole completions, KL(m~ || pi) with m~ = pi_ref normalised, on Qwen2.5-Math-7B.

    python -m sage_jax.train --config configs/qwen7b_fkl.py --workdir gs://BUCKET/qwen7b_fkl

Each group's 8 completions are weighted by pi_ref(y) / pi_old(y), self-normalised within the group (see
objectives.forward_kl_coefficients). The per-token "forward" estimator would not do: it has k3's expected gradient.
Hardware: TPU v5p-64. Paper: pass@256 slightly above GRPO, pass@1 below SAGE.
"""

from configs import paper

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.kl_estimator = "forward-seq"
    return c
