"""phase_model: the decode pool's shrink stages priced, and the training passes' layout."""

import numpy as np

from sage_jax.bench import workloads
from sage_jax.models import decoder as model
from sage_jax.plan import phase_model


def test_stages_cut_the_long_tail_not_equal_lengths():
    cfg, m = model.preset("small"), phase_model.Machine(flops_per_s=1e12, bytes_per_s=1e11)
    tail, fixed = workloads.longtail_lengths(64, 256), np.full(64, 256)
    decode = lambda lengths, dp: phase_model.generation(cfg, 8, 32, lengths, m, stage_dp=dp)["decode_s"]
    assert decode(tail, 1) < 0.8 * decode(tail, 0)
    assert decode(fixed, 1) == decode(fixed, 0)


def test_loss_layout_follows_the_trainers_batch():
    fixed = phase_model.loss_layout(32, np.full(64, 128), packed=True, dense_attention_max=256)
    assert fixed == {"positions": 64 * 160.0, "tokens": 64 * 160.0, "logit_positions": 64 * 128.0, "keys": 160.0,
                     "row_len": 160.0}  # equal lengths: pack_if_smaller keeps the padded batch
    lengths = workloads.longtail_lengths(64, 128)
    packed = phase_model.loss_layout(32, lengths, packed=True, dense_attention_max=256)
    tokens = 64 * 32 + lengths.sum()
    assert packed["tokens"] == tokens <= packed["positions"] < 64 * 160
    assert packed["logit_positions"] == packed["positions"]  # packed rows take logits at every position
    assert packed["keys"] == packed["row_len"]  # dense attention over the whole packed row
    within = phase_model.loss_layout(32, lengths, packed=True, dense_attention_max=0)
    assert within["keys"] == ((32 + lengths) ** 2).sum() / tokens < packed["keys"]
    padded = phase_model.loss_layout(32, lengths, packed=False)
    assert padded["positions"] == 64 * 160 and padded["logit_positions"] == 64 * 128


def test_update_counts_what_the_backward_recomputes():
    cfg = model.preset("small")
    m = phase_model.Machine(flops_per_s=1e12, bytes_per_s=1e30)  # compute only
    lengths = workloads.longtail_lengths(64, 128)
    lay = phase_model.loss_layout(32, lengths, packed=True)
    f = phase_model.forward_flops(cfg, lay["positions"], lay["logit_positions"], lay["keys"])
    t = phase_model.training(cfg, 32, lengths, m)
    assert np.isclose(t["ref_s"], sum(f.values()) / 1e12)
    # 3x forward, plus the attention and the logits chunks again (only the batch-free matmuls are kept)
    assert np.isclose(t["update_s"], (3 * sum(f.values()) + f["attention"] + f["unembed"]) / 1e12)
    remat = phase_model.training(cfg.replace(remat=True), 32, lengths, m)
    assert np.isclose(remat["update_s"], 4 * sum(f.values()) / 1e12)
    rates = {"dense": 5e11, "dense_update": 2.5e11}
    slow = phase_model.training(cfg, 32, lengths, m, rates=rates)
    assert np.isclose(slow["update_s"] - t["update_s"], 3 * f["dense"] * (1 / 2.5e11 - 1 / 1e12))


def test_a_cpu_adds_memory_to_compute():
    cfg, lengths = model.preset("small"), np.full(64, 64)
    tpu = phase_model.Machine(flops_per_s=1e11, bytes_per_s=1e10)
    cpu = phase_model.Machine(flops_per_s=1e11, bytes_per_s=1e10, overlap=False)
    flops_only = phase_model.Machine(flops_per_s=1e11, bytes_per_s=1e30)
    bytes_only = phase_model.Machine(flops_per_s=1e30, bytes_per_s=1e10)
    g = lambda m: phase_model.generation(cfg, 8, 32, lengths, m)["decode_s"]
    assert np.isclose(g(cpu), g(flops_only) + g(bytes_only))
    assert max(g(flops_only), g(bytes_only)) <= g(tpu) < g(cpu)


def test_the_non_matmul_work_adds_on_a_cpu_and_hides_under_a_tpus_matmuls():
    """phase_model.pointwise_elements: the norms, residuals, RoPE, gated product and the loss head; at a measured
    rate (elements/s) on a CPU it adds to the pass (the update: forward + backward, and the recompute's forward);
    on a TPU (the roofline's max) its bytes hide under compute-bound matmuls."""
    cfg, lengths = model.preset("tiny", qkv_bias=False), workloads.longtail_lengths(64, 128)
    lay = phase_model.loss_layout(32, lengths, packed=True)
    D, I, H, N, K = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    pw = phase_model.pointwise_elements(cfg, lay["positions"], lay["logit_positions"])
    assert pw == lay["positions"] * cfg.num_layers * (10 * D + 2 * (N + K) * H + 3 * I) \
        + lay["logit_positions"] * 4 * cfg.vocab_size
    cpu = phase_model.Machine(flops_per_s=1e11, bytes_per_s=1e30, overlap=False)
    base = phase_model.training(cfg, 32, lengths, cpu, rates={"dense": 1e11})
    slow = phase_model.training(cfg, 32, lengths, cpu, rates={"dense": 1e11, "pointwise": 1e9,
                                                            "pointwise_update": 1.5e9})
    assert np.isclose(slow["ref_s"] - base["ref_s"], pw / 1e9)
    assert np.isclose(slow["update_s"] - base["update_s"], 3 * pw / 1.5e9 + pw / 1e9)
    tpu = phase_model.Machine(flops_per_s=1e11, bytes_per_s=1e13)
    flops_only = phase_model.Machine(flops_per_s=1e11, bytes_per_s=1e30)
    assert phase_model.training(cfg, 32, lengths, tpu) == phase_model.training(cfg, 32, lengths, flops_only)


def test_shaped_rates_measure_every_kind_the_model_prices():
    """plan --chip cpu's micro-benchmarks (plan_phases.shaped_rates) run for a tiny model and give a positive rate
    for each kind phase_model.training reads, the non-matmul work among them."""
    from sage_jax.plan import phase_check as plan_phases
    cfg = model.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                            intermediate_size=64)
    rates = plan_phases.shaped_rates(cfg, rows=64, logit_rows=32, attn_rows=2, attn_len=16, repeats=1)
    kinds = ("dense", "attention", "unembed", "pointwise")
    assert all(rates[k] > 0 and rates[f"{k}_update"] > 0 for k in kinds), rates


def test_partial_schedule_trains_whole_groups_and_keeps_its_books():
    """Every step trains B groups (each of G rows, whole lengths), groups come in once and leave once (trained,
    dropped or still in flight), and no trained token is older than max_lag; on long tails a call stops before its
    longest row (fewer decode steps than the longest completion)."""
    B, G, new = 8, 4, 256
    stream = np.concatenate([workloads.longtail_lengths(B * G, new, seed=c) for c in range(30)])
    sched = phase_model.partial_schedule(stream, B, G, 1.5, 2, 12, 32)
    assert all(len(s["trained"]) == B * G for s in sched)
    trained = np.concatenate([s["trained"] for s in sched])
    assert trained.sum() <= stream[:len(trained) + 12 * G * B].sum()
    assert all(s["lag_mean"] <= 2 for s in sched)
    assert max(len(s["rows_J"]) for s in sched[4:]) < new - 1
    assert any(s["carried"] for s in sched)


def test_partial_rollouts_priced_next_to_the_on_policy_step():
    cfg, m = model.preset("small"), phase_model.Machine(flops_per_s=1e12, bytes_per_s=1e11)
    lengths = workloads.longtail_lengths(64, 512)
    stream = np.concatenate([workloads.longtail_lengths(64, 512, seed=c) for c in range(40)])
    rows = phase_model.placements(cfg, 8, 32, lengths, m, 1, 1, 0.0, [], partial=(1.5, 4, stream), group=8)
    names = [r["placement"] for r in rows]
    assert names == ["on-policy colocated", "k=1 colocated", "partial k=0 colocated", "partial k=1 colocated"]
    part = rows[2]
    assert part["tail_s"] == 0.0 and part["prefill_s"] > 0 and 0 < part["token_lag"] <= 4
    assert rows[0]["vs_on_policy"] == 1.0 and part["vs_on_policy"] > 0
