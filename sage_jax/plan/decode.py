"""The sampler's decode program judged by the compiler that will run it (XLA:TPU through libtpu, no TPU needed).

For each decode shape (rows decoding at once, over the config's prompt and new-token buckets) one line:

    decode: rows R, copies C, bytes X.XXx ideal, predicted T tokens/s/chip

- copies: copy and transpose ops inside the decode loop's body (the compiled sampler program, sampler.generate's
  whole program as generate runs it) whose output is at least one layer's cache slice on a device: a cache-sized
  copy or relayout per layer per step. An asynchronous copy into on-chip memory (XLA:TPU's memory-space prefetch,
  `S(1)`, same layout) moves the slice its reader would read anyway and is counted apart, as prefetches.
- bytes: one decode step's bytes accessed, as XLA's cost analysis counts them inside the sampler program itself: the
  program compiled again with one more decode step per loop iteration (DecodeForms.steps_per_loop), the difference
  of the two programs' counts (the analysis counts a loop body once). Over the ideal: the rollout weights once plus
  every row's cache once, at the last step, where each row's cache is full (P + C positions; the plan's worst case,
  roofline.ASSUMPTIONS). A Pallas kernel is seen by the cost analysis through its own estimate (decode_attention:
  the whole cache). With the pool's shrinking widths (forced non-kernel attention) each width's loop adds a step.
- T: that step at the chip's HBM bandwidth or its bf16 peak, whichever is slower: a PREDICTION.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import tempfile
from typing import Any, Sequence

_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "u16": 2, "s16": 2, "s8": 1, "u8": 1, "pred": 1,
          "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^(?:ROOT )?%?[\w.\-]+ = (.*?) ([a-z][\w\-]*)\(")
_CALLS = re.compile(r"\b(?:calls|body|condition|to_apply|branch_computations|true_computation|false_computation)="
                    r"\{?((?:%?[\w.\-]+(?:, )?)+)\}?")


def _computations(hlo: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        m = _HEADER.match(line)
        if m and not line.startswith(" "):
            current = comps.setdefault(m.group(1), [])
        elif current is not None and line.strip().startswith(("%", "ROOT")):
            current.append(line.strip())
    return comps


def _array_bytes(shape_text: str) -> int:
    """Bytes of the first array of an instruction's result (of a tuple: its first element, the copy's target)."""
    m = _ARRAY.search(shape_text)
    return _BYTES[m.group(1)] * math.prod(int(d) for d in m.group(2).split(",") if d) if m else 0


def loop_copies(hlo: str, min_bytes: int) -> dict[str, list[str]]:
    """{"copies": [...], "prefetches": [...]}: copy / transpose / copy-start instructions of at least min_bytes in
    the computations reachable from any while loop's body of an optimised HLO module's text."""
    comps = _computations(hlo)
    bodies = {b for lines in comps.values() for line in lines for b in re.findall(r"\bbody=%?([\w.\-]+)", line)}
    seen, stack = set(), list(bodies)
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for group in _CALLS.findall(line):
                stack += [n.strip().lstrip("%") for n in group.split(",")]
    found: dict[str, list[str]] = {"copies": [], "prefetches": []}
    for name in seen:
        for line in comps[name]:
            m = _INSTRUCTION.match(line)
            if not m or m.group(2) not in ("copy", "transpose", "copy-start") or _array_bytes(m.group(1)) < min_bytes:
                continue
            shapes = re.findall(r"\{[^}]*\}", m.group(1))
            prefetch = m.group(2) == "copy-start" and len(shapes) >= 2 and shapes[0].replace("S(1)", "") == \
                shapes[1].replace("S(1)", "") and "S(1)" in m.group(1)
            found["prefetches" if prefetch else "copies"].append(f"{m.group(2)} {m.group(1)[:90]}")
    return found


@dataclasses.dataclass(frozen=True)
class DecodeLine:
    rows: int
    copies: int
    prefetches: int
    step_bytes: float
    ideal_bytes: float
    step_flops: float
    tokens_per_s_per_chip: float  # a PREDICTION
    copy_ops: tuple[str, ...] = ()

    def text(self) -> str:
        return (f"decode: rows {self.rows}, copies {self.copies}, bytes {self.step_bytes / self.ideal_bytes:.2f}x "
                f"ideal, predicted {self.tokens_per_s_per_chip:,.0f} tokens/s/chip")


def _shapes_with_rows(shapes, rows: int):
    prompts = max(1, rows // max(1, shapes.sampler_rows // max(1, shapes.sampler_prompts)))
    return dataclasses.replace(shapes, sampler_slots=rows, sampler_rows=rows, sampler_prompts=prompts)


def check(cfg, config, mesh, rules, shapes, rows: int, chip_name: str, chips: int, forms=None,
          count_bytes: bool = True) -> DecodeLine:
    """One decode shape of `rows` rows, compiled for the mesh's devices (abstract TPU devices for the TPU plan), in
    the decode forms the sampler picks for them (or `forms`); count_bytes=False: the copies only (one compile, the
    bytes and the rate left 0)."""
    import jax
    import jax.numpy as jnp
    from sage_jax.models import sharding
    from sage_jax.plan import programs as pp, roofline
    shapes = _shapes_with_rows(shapes, rows)
    with sharding.use_rules(rules):
        state, ref, _, _ = pp.abstract_state(cfg, config, mesh, rules)
    rollout = pp.rollout_params(cfg, pp.policy_params(config, state, ref))
    forms = forms or pp.sampler_plan(cfg, config, shapes, mesh).forms
    longer = dataclasses.replace(forms, steps_per_loop=forms.steps_per_loop + 1)
    with jax.set_mesh(mesh), sharding.use_rules(rules):
        hlo, program = _compile_with_text(pp.lower_sampler(cfg, config, rollout, shapes, mesh, forms=forms))
        longer_program = pp.lower_sampler(cfg, config, rollout, shapes, mesh, forms=longer).compile() \
            if count_bytes else program
    cost = {k: _cost(longer_program, k) - _cost(program, k) for k in ("bytes accessed", "flops")}
    devices = mesh.devices.size
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    tp = mesh.shape["tensor"] if cfg.num_kv_heads % mesh.shape["tensor"] == 0 else 1
    rows_per_device = rows / shapes.dp
    layer_slice = rows_per_device * (cfg.num_kv_heads // tp) * shapes.cache_len * cfg.head_dim * itemsize
    found = loop_copies(hlo, int(layer_slice))
    ideal = pp.tree_bytes(rollout) + 2 * cfg.num_layers * layer_slice
    step_bytes, step_flops = cost["bytes accessed"], cost["flops"]
    chip = roofline.CHIPS[chip_name]
    seconds = roofline.roofline(step_flops, step_bytes, chip, chips / devices)["time_s"]
    return DecodeLine(rows, len(found["copies"]), len(found["prefetches"]), step_bytes, ideal, step_flops,
                      rows / chips / seconds if seconds else 0.0, tuple(found["copies"][:4]))



def _compile_with_text(lowered):
    """(the optimised HLO module's text, the compiled program): the text from XLA's own dump, since libtpu cannot
    print some programs back through compiled.as_text() (a RET_CHECK on the async collectives of sharded ones)."""
    with tempfile.TemporaryDirectory() as folder:
        compiled = lowered.compile(compiler_options={"xla_dump_to": folder, "xla_dump_hlo_as_text": True,
                                                     "xla_dump_hlo_pass_re": "^$"})
        dumps = sorted(glob.glob(os.path.join(folder, "*after_optimizations.txt")), key=os.path.getsize)
        if not dumps:
            return compiled.as_text(), compiled
        with open(dumps[-1]) as f:
            return f.read(), compiled


def _cost(compiled, key: str) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost).get(key, 0.0))


def lines(cfg, config, mesh, rules, shapes, rows_list: Sequence[int], chip_name: str,
          chips: int) -> list[dict[str, Any]]:
    out = []
    for rows in rows_list:
        line = check(cfg, config, mesh, rules, shapes, rows, chip_name, chips)
        out.append(dataclasses.asdict(line) | {"text": line.text()})
    return out
