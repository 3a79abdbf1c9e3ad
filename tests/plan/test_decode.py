"""The plan's decode check (sage_jax.plan.decode): the sampler's program compiled by XLA:TPU, its copies of a layer's
cache inside the decode loop and its bytes per step against the ideal."""

from __future__ import annotations

import dataclasses

import pytest

from sage_jax.plan import decode as plan_decode, roofline

HLO = """HloModule m

%body (p: (s32[], bf16[64,2,544,64])) -> (s32[], bf16[64,2,544,64]) {
  %p = (s32[], bf16[64,2,544,64]{3,2,1,0}) parameter(0)
  %c = bf16[64,2,544,64]{3,2,1,0} get-tuple-element(%p), index=1
  %t = bf16[64,2,64,544]{3,2,1,0} transpose(%c), dimensions={0,1,3,2}
  %f = bf16[64,2,544,64]{3,2,1,0} fusion(%c), kind=kLoop, calls=%fused
  %cs = (bf16[64,2,544,64]{3,2,1,0:T(8,128)(2,1)S(1)}, bf16[64,2,544,64]{3,2,1,0:T(8,128)(2,1)}, u32[]) copy-start(%c)
  %small = bf16[4,4]{1,0} copy(%x)
  ROOT %r = (s32[], bf16[64,2,544,64]) tuple(%i, %f)
}

%fused (a: bf16[64,2,544,64]) -> bf16[64,2,544,64] {
  %a = bf16[64,2,544,64]{3,2,1,0} parameter(0)
  ROOT %k = bf16[64,2,544,64]{2,3,1,0} copy(%a)
}

ENTRY %main (x: bf16[64,2,544,64]) -> bf16[64,2,544,64] {
  %x = bf16[64,2,544,64]{3,2,1,0} parameter(0)
  %outside = bf16[64,2,544,64]{2,3,1,0} copy(%x)
  ROOT %w = (s32[], bf16[64,2,544,64]) while(%init), condition=%cond, body=%body
}
"""


def test_loop_copies_counts_cache_sized_copies_inside_loop_bodies_only():
    found = plan_decode.loop_copies(HLO, min_bytes=64 * 2 * 544 * 64 * 2)
    # the transpose in the body and the relayout inside its fusion; not the copy outside the loop, not the small one;
    # the async copy into on-chip memory (same layout, S(1)) is a prefetch
    assert len(found["copies"]) == 2 and len(found["prefetches"]) == 1
    assert sorted(c.split()[0] for c in found["copies"]) == ["copy", "transpose"]


needs_libtpu = pytest.mark.skipif(not roofline.available(), reason="libtpu is not installed: pip install -r "
                                  "requirements-tpu.txt (requirements-test.txt installs it)")


def _tpu_small(layers: int, topology: str = "1x1"):
    """The bench's small preset (configs/bench_small.py) with `layers` layers on an abstract v5e slice."""
    from sage_jax.models import build, sharding
    from sage_jax.plan import programs as pp
    from sage_jax.run import config as config_lib
    from tests.plan.test_memory import tpu_devices_in_process
    devices, chips = tpu_devices_in_process("v5e", topology)
    config = config_lib.load("configs/bench_small.py", [f"--config.model.num_layers={layers}"])
    mesh = sharding.make_mesh(tuple(config.mesh.shape), devices=devices)
    cfg, _ = build.resolve_model(config)
    return cfg, config, mesh, dict(config.mesh.rules), pp.plan_shapes(config, mesh), chips


@needs_libtpu
def test_tpu_decode_program_copies_no_cache_and_reads_near_the_ideal():
    """The bench's small preset as it is (8 layers): the per-step bytes outside the layers (logits, sampling) weigh
    as they do in the benchmark."""
    cfg, config, mesh, rules, shapes, chips = _tpu_small(8)
    line = plan_decode.check(cfg, config, mesh, rules, shapes, 64, "v5e", chips)
    assert line.copies == 0, line.copy_ops
    assert line.step_bytes <= 1.3 * line.ideal_bytes
    assert line.text().startswith("decode: rows 64, copies 0, bytes ") and "tokens/s/chip" in line.text()


@needs_libtpu
def test_the_check_sees_the_stacked_caches_relayouts():
    """The layout the sampler had before (a stacked cache read at a loop-variable layer): XLA:TPU copies the whole
    stacked cache into another layout in the layer loop, and the check counts it (2 layers: copies are per layer)."""
    from sage_jax.models import decode_forms
    cfg, config, mesh, rules, shapes, chips = _tpu_small(2)
    stacked = dataclasses.replace(decode_forms.for_platform("tpu"), stacked_cache=True, attention="one_pass",
                                  scores="multiply_sum", cache_bits=True)
    line = plan_decode.check(cfg, config, mesh, rules, shapes, 64, "v5e", chips, forms=stacked, count_bytes=False)
    assert line.copies > 0


@needs_libtpu
def test_the_kernel_runs_on_each_devices_rows_of_a_sharded_cache():
    """On 4 chips (rows over fsdp) the Pallas kernel runs per device (XLA cannot partition a Mosaic kernel: without
    shard_map it refuses to compile), and still no layer's cache is copied."""
    cfg, config, mesh, rules, shapes, chips = _tpu_small(2, "2x2")
    line = plan_decode.check(cfg, config, mesh, rules, shapes, 64, "v5e", chips, count_bytes=False)
    assert chips == 4 and line.copies == 0, line.copy_ops


@needs_libtpu
def test_an_fsdp_mesh_decodes_on_the_weights_where_they_lie():
    """Rows over fsdp on 4 chips: a decode step that split its rows like training's would gather each chip's
    weight shards every step (5.67x the ideal bytes at 64 rows for the small preset); under sharding.decode_rules
    the matmuls run on the local shards and reduce partial sums (1.53x, with the decode copies of the MLP and the
    head split over every axis: decoder.decode_params)."""
    from sage_jax.models import decode_forms
    cfg, config, mesh, rules, shapes, chips = _tpu_small(2, "2x2")
    assert dict(mesh.shape)["fsdp"] == 4
    tpu = decode_forms.for_platform("tpu")
    assert tpu.stationary_weights
    lines = {on: plan_decode.check(cfg, config, mesh, rules, shapes, 64, "v5e", chips,
                                   forms=dataclasses.replace(tpu, stationary_weights=on)) for on in (True, False)}
    assert lines[True].copies == 0, lines[True].copy_ops
    assert lines[True].step_bytes < 0.5 * lines[False].step_bytes, (lines[True], lines[False])


@needs_libtpu
def test_decode_copies_read_less_than_the_weights_where_they_lie(monkeypatch):
    """Rows over fsdp on 4 chips: with decode_params' copies (the MLP and the head split over every axis, the
    attention weights merged) a step reads less than with every weight where it lies (the MLP's partial sums of
    every row's whole hidden reduced across the chips in each layer, the head's float32 partial logits)."""
    from sage_jax.models import decoder, sharding
    from sage_jax.sampling import sampler
    cfg, config, mesh, rules, shapes, chips = _tpu_small(2, "2x2")
    with_copies = plan_decode.check(cfg, config, mesh, rules, shapes, 64, "v5e", chips)
    monkeypatch.setattr(decoder, "decode_step_rules", lambda cfg, on: sharding.decode_rules(on))
    sampler.generate_program.clear_cache()  # traced with the copies above
    without = plan_decode.check(cfg, config, mesh, rules, shapes, 64, "v5e", chips)
    sampler.generate_program.clear_cache()
    assert with_copies.copies == without.copies == 0, with_copies.copy_ops
    assert with_copies.step_bytes < 0.95 * without.step_bytes, (with_copies, without)
