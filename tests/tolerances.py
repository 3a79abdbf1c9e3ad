"""Tolerances for comparing float32 results that are the same sums reduced in different orders.

Sharded against one device, blockwise against naive attention, packed against padded rows, a batch of one width
against another, a KV-cache step against the full forward, JAX against torch: the two sides add the same terms in
another order (other tiles, other vector widths: XLA:CPU picks both by the machine's CPU), so they differ by rounding
alone. A sum of n float32 terms in another order differs by at most about n * eps * sum|terms| and typically by
sqrt(n) * eps * its magnitude (independent roundings add in quadrature), eps = 2**-23 = 1.19e-7. Errors of the
reductions chained along a computation add the same way, so n is the total length of the reductions one output goes
through (decoder_terms). The tolerance is relative: f32_sum_rtol(n) = safety * sqrt(n) * eps, the safety factor (8)
covering the amplification by normalisations, softmax and residual sums, and a CPU that vectorises differently.
Where values can be near zero (logits, gradients, attention outputs: sums that cancel) the rounding error still
scales with the magnitude of the terms, so the absolute floor is rtol times that magnitude (f32_tols(n, floor)),
never a fixed number. Comparisons that are meant to be bit-exact (tokens, the same program twice) stay
assert_array_equal; a comparison against an independent reference keeps its tolerance 100x below the smallest real
defect it guards against (measured in these tests: a position off by one moves log-probs and logits by 0.1 and more,
a token that sees another packed sequence by up to 0.8, a wrong temperature by 0.35).

Example: tests/sampling/test_sampler.py's log-probs (2 layers, hidden 32, vocab 64, up to 144 cache positions) go
through 720 terms: rtol = 8 * sqrt(720) * 1.19e-7 = 2.6e-5, 1.3e-4 at -4. Sharded against one device they differed
by 1.48e-5 at -4 on the AMD EPYC of issue 40 (over the old atol=1e-5), by 1.14e-5 on another; XLA:CPU limited to
SSE4.2 (--xla_cpu_max_isa=SSE4_2: other vector widths, other orders) used at most 15% of any tolerance set here.
Not covered: results that went through an Adam step (it divides a near-zero gradient by its own size), which no
reduction length bounds.
"""

from __future__ import annotations

import math

EPS32 = 2.0 ** -23  # float32 machine epsilon, 1.19e-7
MIN_TERMS = 16  # the floor: even a short sum (or an elementwise op after one) may round differently by a few ulps


def f32_sum_rtol(n_terms: int, safety: float = 8.0) -> float:
    """Relative tolerance for two float32 results that reduce the same n_terms terms in different orders:
    safety * sqrt(n_terms) * eps (typical rounding growth times a margin), at least that of MIN_TERMS terms."""
    return safety * math.sqrt(max(int(n_terms), MIN_TERMS)) * EPS32


def f32_tols(n_terms: int, floor: float = 0.0, safety: float = 8.0, rounded_at: float = 0.0) -> dict[str, float]:
    """{rtol, atol} for np.testing.assert_allclose: rtol = f32_sum_rtol(n_terms, safety) and an absolute floor of rtol
    times `floor`, the magnitude of the terms behind values that can be near zero (0: no floor, values are not).
    rounded_at: the size of a value the results were rounded at on their way (an SGD update read back as
    (p - g) - p rounds at |p|, not at |g|); adds 2 ulps of it to the floor."""
    rtol = f32_sum_rtol(n_terms, safety)
    return {"rtol": rtol, "atol": rtol * float(floor) + 2 * EPS32 * float(rounded_at)}


def decoder_terms(cfg, seq_len: int) -> int:
    """The float32 terms one output of the decoder (a logit, log-prob or entropy) is reduced over, along its depth:
    per layer the q/k/v projections (hidden size), the q.k scores (head_dim), the attention's weighted sum (seq_len
    positions), the output projection (heads x head_dim) and the MLP (hidden size in, intermediate size out); then the
    unembedding (hidden size) and the log-softmax's normaliser (vocab size)."""
    per_layer = (cfg.hidden_size + cfg.head_dim + seq_len + cfg.num_heads * cfg.head_dim + cfg.hidden_size
                 + cfg.intermediate_size)
    return cfg.num_layers * per_layer + cfg.hidden_size + cfg.vocab_size
