"""Which decode program each platform gets: the one place that says it (kv_cache, decoder and the sampler's pool read
a DecodeForms; nothing else looks at the backend).

XLA:CPU, XLA:TPU and XLA:GPU want different programs for the same decode step:

              scores                 cache, layer loop                  attention                       steps per loop
  cpu     f32 multiply-and-sum   stacked [R, L, K, S, H], one loop   64-slot blocks, rows in 4 position   1
                                 over the layers, weights unstacked  groups, the pool shrinks (a cache of
                                                                     <= 192 positions: one pass)
  tpu     matmul, compute dtype  one [R, K, S, H] pair per layer,    Pallas kernel reading each row's     1
          with f32 accumulation  layers unrolled                     live positions (kernel="auto")
  gpu     as tpu                 as tpu                              as tpu                               4

Why, from measurements and from the compiled programs (docs/PERFORMANCE.md, "Decode per platform"):
- XLA:CPU computes a 16-bit product in float32 and runs a matmul with G = N / K query rows by repacking its operand:
  a multiply-and-sum reads the cache once; blocks skip the unwritten cache; per-layer caches with unrolled layers
  made XLA:CPU gather every layer's weights at once (5.7 GB per device for qwen7b_branch on 64 devices).
- XLA:TPU copied the whole stacked cache into another layout in every layer iteration of every decode step when the
  cache was stacked and read at a loop-variable layer; per-layer caches compile with no cache-sized copy. On the
  matrix units the scores are matmuls.
- XLA:GPU copies each data-dependent loop condition and `cond` predicate to the host and waits, so the decode loop
  runs several steps per iteration and refills slots between them (a freed slot idles at most steps - 1 steps; the
  tokens do not depend on when a row runs).
- A per-row-length kernel reads each row's own positions, so idle slots and short rows cost nothing and the pool
  need not shrink (each width is one more loop body to compile).
- A decode step has one token per row: on TPU and GPU it runs under sharding.decode_rules (stationary_weights), the
  activations split like the weights' embed dim, so no weight is gathered per step (qwen7b_branch, 32 v5p chips,
  64 rows: 11.33x -> 0.93x the ideal bytes). XLA:CPU's meshes are simulated, and its programs stay as measured.
- XLA:CPU scatters 16-bit floats in float32 (a float32 copy of the cache carried through the loop), so there the
  cache holds bf16 bits as uint16; on XLA:TPU the bitcasts around the per-layer writes cost whole-cache passes.

`attention` can be forced ("blocked", "one_pass", "kernel"): rollout.decode_attention in the config,
sampler.generate(decode_attention=...), which also takes a whole DecodeForms (emulated(): a platform's forms on the
CPU, for tests).
"""

from __future__ import annotations

import dataclasses

ATTENTION_FORMS = ("auto", "blocked", "one_pass", "kernel")


@dataclasses.dataclass(frozen=True)
class DecodeForms:
    platform: str  # "cpu", "tpu" or "gpu"
    scores: str  # "multiply_sum": float32 products summed over the head dim; "matmul": compute dtype, f32 accumulation
    stacked_cache: bool  # one (k, v) pair [R, L, K, S, H] read in a loop over the layers; else a pair per layer
    attention: str  # "blocked" (DECODE_BLOCK slots at a time), "one_pass" (the whole cache), "kernel" (Pallas)
    position_groups: int  # blocked attention only: rows sorted by how far they read, run in this many groups
    steps_per_loop: int  # decode steps per iteration of the pool's while loop (slots refill between iterations)
    unstack_layers: bool  # slice the stacked layer weights once per call, before the decode loop
    shrink: bool  # the pool moves its live rows into narrower widths once the queue is empty
    cache_bits: bool  # a 16-bit cache held, copied and scattered as uint16 bits (kv_cache.BITS)
    stationary_weights: bool = False  # decode steps under sharding.decode_rules: no per-step weight gathers
    interpret: bool = False  # run the Pallas kernel in interpret mode (on the CPU: tests, or a forced "kernel")

    @property
    def reads_live_positions_only(self) -> bool:
        return self.attention == "kernel"


def platform_of(backend: str) -> str:
    """A jax backend or device platform name as a DecodeForms platform."""
    return {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend if backend in ("cpu", "tpu", "gpu") else "cpu")


# XLA:CPU reads a cache of at most this many positions in one pass: 64 rows of the small preset (fp32), 128 new tokens
# after 32 prompt positions (160): 5.15 s one pass against 5.68 s in 64-slot blocks; 256 new tokens (288): 13.57 s
# against 12.89 s; the long tail to 512: 16.0 s against 12.1 s (docs/PERFORMANCE.md, "Decode per platform")
CPU_ONE_PASS_MAX_POSITIONS = 192


def for_platform(backend: str, attention: str = "auto", cache_positions: int | None = None) -> DecodeForms:
    """The forms `backend` (a jax backend / device platform: cpu, tpu, gpu, cuda, rocm) decodes with; `attention`
    other than "auto" forces that attention form (the rest of the platform's forms stay). cache_positions: the
    decode cache's positions per row (prompt bucket + new-token bucket), where known: on XLA:CPU a cache of at most
    CPU_ONE_PASS_MAX_POSITIONS is read in one pass, not in blocks."""
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"decode attention {attention!r}: choose one of {', '.join(ATTENTION_FORMS)}")
    platform = platform_of(backend)
    if platform == "cpu":
        short = cache_positions is not None and cache_positions <= CPU_ONE_PASS_MAX_POSITIONS
        forms = DecodeForms("cpu", "multiply_sum", stacked_cache=True, attention="one_pass" if short else "blocked",
                            position_groups=4, steps_per_loop=1, unstack_layers=True, shrink=True, cache_bits=True)
    else:
        forms = DecodeForms(platform, "matmul", stacked_cache=False, attention="kernel", position_groups=1,
                            steps_per_loop=4 if platform == "gpu" else 1, unstack_layers=False, shrink=False,
                            cache_bits=False, stationary_weights=True)
    if attention != "auto" and attention != forms.attention:
        # without the kernel a step reads every row's whole cache: the pool shrinks again so that it reads fewer rows
        forms = dataclasses.replace(forms, attention=attention, shrink=forms.shrink or attention != "kernel",
                                    interpret=platform == "cpu")
    return forms


def emulated(platform: str, attention: str = "auto") -> DecodeForms:
    """`platform`'s forms run on the CPU (its Pallas kernel interpreted): the tests' way to check the TPU and GPU
    programs' results without the chip."""
    return dataclasses.replace(for_platform(platform, attention), interpret=True)
