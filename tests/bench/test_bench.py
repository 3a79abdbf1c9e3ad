"""Smoke tests: every `python -m sage_jax.bench` mode on the tiny preset with tiny shapes (seconds each)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from sage_jax.bench import workloads
from sage_jax.models import decoder as model
from sage_jax.training import trainer
from sage_jax.bench import cli, common, flops, memory, rl_step, scaling, train_step, trl_peer

ROOT = Path(__file__).resolve().parents[2]
# One set of shapes (2 rows, prompt bucket 16, 8 completion tokens) for every mode, so they share compilations.
TINY = dict(prompt_len=16, completion_len=8, repeats=1)


def _finite_positive(rows, key):
    return all(math.isfinite(r[key]) and r[key] > 0 for r in rows)


def test_train_step_rows_and_flops():
    # "chunk_512" equals the tiny preset's default config: the variant machinery without a second compilation
    rows = train_step.bench_train_step("tiny", "fp32", rows=2, peak_size=256, **TINY,
                                       variants={"default": {}, "chunk_512": {"logits_chunk": 512}})
    assert [(r["variant"], r["rows"], r["seq"]) for r in rows] == [("default", 2, 24), ("chunk_512", 2, 24)]
    for key in ("tokens_per_s", "gflops_per_s", "peak_gflops_per_s", "frac_of_peak"):
        assert _finite_positive(rows, key), key
    assert rows[0]["tokens_per_s"] == pytest.approx(2 * 24 / rows[0]["seconds"])


def test_train_flops_close_to_xla_count_without_scan():
    # Unrolled layers and one log-prob chunk: XLA's count covers every matmul once, plus element-wise work.
    cfg = model.preset("small", num_layers=2, vocab_size=4096, scan_layers=False, logits_chunk=64)
    _, lowered = train_step.lowered_train_step(cfg, common.SAGE_LOSS, 2, 16, 64)
    cost = lowered.cost_analysis()
    xla = (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
    assert 0.8 < flops.train_flops(cfg, 2, 16, 64) / xla < 1.05


def test_random_loss_batch_layout():
    cfg = model.preset("tiny")
    b = train_step.random_loss_batch(cfg, 3, 4, 5)
    assert b["tokens"].shape == (3, 9) and b["completion_mask"].shape == (3, 5) and b["advantages"].shape == (3,)
    assert b["tokens"].min() >= 1 and b["tokens"].max() < cfg.vocab_size


def test_rl_step_ours():
    rows = rl_step.bench_rl_step("tiny", prompts=1, group=2, prompt_len=16, new_tokens=8, repeats=1, peer=None)
    (row,) = rows
    assert row["impl"] == "sage_jax" and _finite_positive(rows, "tokens_per_s")
    parts = row["generate_s"] + row["reward_s"] + row["ref_s"] + row["update_s"]
    assert parts == pytest.approx(row["seconds"], rel=1e-6)
    assert row["model_gflops"] * 1e9 == flops.rl_step_flops(model.preset("tiny"), 1, 2, 16, 8)
    assert row["at_peak_s"] == pytest.approx(row["model_gflops"] / row["peak_gflops_per_s"])
    assert row["frac_of_peak"] == pytest.approx(row["at_peak_s"] / row["seconds"])


@pytest.mark.skipif(importlib.util.find_spec("trl") is None or not os.environ.get("SAGE_BENCH_TRL"),
                    reason="trl not installed, or SAGE_BENCH_TRL unset (importing torch + trl alone takes ~15 s)")
def test_rl_step_against_trl():
    start = time.perf_counter()
    rows = rl_step.bench_rl_step("tiny", prompts=1, group=2, prompt_len=16, new_tokens=8, repeats=1)
    assert [r["impl"] for r in rows] == ["sage_jax", "trl"]
    assert _finite_positive(rows, "tokens_per_s") and rows[0]["vs_trl"] > 0
    assert rows[1]["generate_s"] <= rows[1]["seconds"]
    assert time.perf_counter() - start < 60


def test_word_level_tokenizer_ids_match_model_ids():
    tok = trl_peer.word_level_tokenizer(64)
    ids = np.array([5, 17, 63, 2])
    assert tok(" ".join(f"t{i}" for i in ids))["input_ids"] == ids.tolist()
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1


def test_memory_chunked_below_naive():
    rows = memory.bench_memory(vocab=2048, seq=256, hidden_sizes=(32,), batches=(1, 2), chunks=(32,))
    by = {(r["batch"], r["impl"]): r["temp_gib"] for r in rows}
    for b in (1, 2):
        assert by[(b, "chunked_32")] < by[(b, "naive")]
    assert by[(2, "naive")] > by[(1, "naive")]


def test_scaling_rows_and_plot(tmp_path):
    path = tmp_path / "scaling.png"
    rows = scaling.bench_scaling(batches=(2,), lengths=(8,), fixed_batch=2, fixed_len=8, prompt_len=16,
                                 repeats=1, plot=str(path))
    assert {(r["kind"], r["sweep"]) for r in rows} == {(k, s) for k in ("sampler", "train_step")
                                                       for s in ("batch", "length")}
    assert len(rows) == 4 and _finite_positive(rows, "tokens_per_s")
    assert path.stat().st_size > 1000


def test_flags_runs_each_set_in_a_process():
    rows = train_step.bench_flags({"default": "", "fast_math": "--xla_cpu_enable_fast_math=true"}, "matmul",
                                  ("--sizes", "64", "--repeats", "1"), "gflops_per_s", rounds=1)
    assert [(r["flags"], r["dtype"]) for r in rows] == [("default", "fp32"), ("default", "bf16"),
                                                        ("fast_math", "fp32"), ("fast_math", "bf16")]
    assert rows[0]["speedup"] == 1.0 and _finite_positive(rows, "gflops_per_s")


def test_main_json(capsys):
    (rows,) = cli.main(["train_step", "--batch", "2", "--prompt-len", "16", "--new-tokens", "8", "--repeats",
                             "1", "--json"]).values()
    assert rows[0]["preset"] == "tiny"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["modes"]["train_step"][0]["preset"] == "tiny"


def test_rl_step_mode_rejects_bad_group():
    with pytest.raises(ValueError, match="multiple of --group"):
        cli.main(["rl_step", "--batch", "6", "--group", "4", "--no-trl"])


def test_bench_all_forwards_the_shared_flags(monkeypatch):
    """`bench all` runs the sampler modes and every training-side mode with the same shape flags; sampler-only flags
    (--hf-threads N) stay with the sampler."""
    calls = []
    monkeypatch.setattr(cli, "SAMPLER_MODES", {"sampler": lambda args: calls.append(("sampler", args.hf_threads))})
    monkeypatch.setattr(cli, "run_training_mode", lambda argv: calls.append(tuple(argv)))
    cli.main(["all", "--preset", "tiny", "--batch", "8", "--hf-threads", "1"])
    assert calls[0] == ("sampler", 1)
    assert [c[0] for c in calls[1:]] == ["matmul", "train_step", "rl_step", "memory", "scaling"]
    assert all(len(c) % 2 == 1 and all(flag.startswith("--") for flag in c[1::2]) for c in calls[1:])  # flag, value
    assert all(c[c.index("--preset") + 1] == "tiny" and c[c.index("--batch") + 1] == "8" for c in calls[1:])
    assert not any("--hf-threads" in c for c in calls[1:])


def test_main_json_to_a_path(tmp_path):
    path = tmp_path / "out" / "matmul.json"
    rows = cli.main(["matmul", "--sizes", "64", "--repeats", "1", "--json", str(path)])["matmul"]
    saved = json.loads(path.read_text())
    assert saved["modes"]["matmul"] == rows and saved["cores"] >= 1 and saved["load_avg_1min"] >= 0


def test_bench_sampler_longtail_smoke(tmp_path):
    """Both sides generate the same forced long-tailed lengths (transformers stopped by a forced EOS)."""
    pytest.importorskip("torch")
    path = tmp_path / "sampler.json"
    cli.main(["sampler", "--workload", "longtail", "--preset", "tiny", "--batch", "8", "--group", "4",
                "--prompt-len", "8", "--new-tokens", "40", "--repeats", "1", "--slots", "4", "--schedule-ceiling",
                "--json", str(path)])
    rows = json.loads(path.read_text())["modes"]["sampler"]
    assert [r["impl"] for r in rows] == ["sage_jax", "transformers", "sage_jax_slots4", "schedule_ceiling"]
    lengths = workloads.longtail_lengths(8, 40)
    for r in rows:
        assert r["workload"] == "longtail" and r["tokens"] == lengths.sum() and r["len_max"] == 40
        assert r["len_p50"] == np.median(lengths) and _finite_positive([r], "tokens_per_s")
    assert rows[0]["vs_transformers"] == pytest.approx(rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"])
    assert 1 <= rows[0]["loops_per_step"] <= 3  # the loop's iteration, the refill's predicate, some prompt copies


def test_bench_sampler_on_an_hf_model_directory(tmp_path):
    """--model DIR: both sides load that directory's weights (here a tiny model saved as HF), not a preset."""
    pytest.importorskip("torch")
    cfg = model.preset("tiny", eos_token_ids=())
    model.save_hf(tmp_path / "m", cfg, common.init_params(cfg, 3))
    rows = cli.main(["sampler", "--model", str(tmp_path / "m"), "--workload", "longtail", "--batch", "4",
                     "--group", "2", "--prompt-len", "8", "--new-tokens", "16", "--repeats", "1"])["sampler"]
    assert [r["impl"] for r in rows] == ["sage_jax", "transformers"] and rows[0]["preset"] == "m"
    assert rows[0]["tokens"] == rows[1]["tokens"] == workloads.longtail_lengths(4, 16).sum()


def test_rl_step_longtail_packed_and_padded(tmp_path, monkeypatch):
    """Smoke run of `rl_step --workload longtail --layout both`: both layouts, less padding when packed, JSON out.
    Each layout's steps are trainer.rl_step calls (the warm-up step included) on rollouts with the workload's
    lengths, every row that stops early ending with EOS."""
    calls = []

    def spy(ctx, state, step, collect):
        out = real(ctx, state, step, collect)
        calls.append((step, out.rollouts))
        return out
    real = trainer.rl_step
    monkeypatch.setattr(trainer, "rl_step", spy)
    path = tmp_path / "rl.json"
    rows = cli.main(["rl_step", "--batch", "8", "--group", "4", "--prompt-len", "8", "--new-tokens", "40",
                     "--repeats", "1", "--no-trl", "--workload", "longtail", "--layout", "both",
                     "--json", str(path)])["rl_step"]
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"sage_jax", "sage_jax_padded"} and _finite_positive(rows, "tokens_per_s")
    assert by["sage_jax"]["padded_frac"] < by["sage_jax_padded"]["padded_frac"]
    assert by["sage_jax"]["len_max"] == 40 and by["sage_jax"]["vs_padded"] > 0
    assert json.loads(path.read_text())["modes"]["rl_step"][0]["workload"] == "longtail"
    assert [step for step, _ in calls] == [0, 0, 1, 1]  # packed, padded, after each (absent) TRL step
    lengths = workloads.workload_lengths("longtail", 8, 40, 0)
    finished = np.flatnonzero(lengths < 40)
    for _, ro in calls:
        np.testing.assert_array_equal(ro["lengths"], lengths)
        assert (ro["tokens"][finished, lengths[finished] - 1] == rl_step.EOS_ID).all()
        assert ro["rewards"].shape == (8,) and np.isfinite(ro["rewards"]).all()
    assert by["sage_jax"]["len_p50"] == np.percentile(lengths, 50)


def test_forced_rollout_cuts_rows_and_marks_truncation():
    out = types.SimpleNamespace(tokens=np.full((2, 4), 7), logprobs=np.full((2, 4), -1.0),
                                prompt_tokens=np.ones((2, 3), np.int32), prompt_mask=np.ones((2, 3), bool))
    ro = rl_step.forced_rollout(out, np.array([2, 4]), eos_id=1)
    np.testing.assert_array_equal(ro["tokens"], [[7, 1, 0, 0], [7, 7, 7, 7]])
    np.testing.assert_array_equal(ro["finished"], [True, False])
    np.testing.assert_array_equal(ro["sampler_logp"], [[-1, -1, 0, 0], [-1, -1, -1, -1]])


def test_gpu_mode_quick(tmp_path):
    """`python -m sage_jax.bench gpu`, as a GPU host runs it; --quick gives tiny shapes that run on the CPU too."""
    proc = subprocess.run([sys.executable, "-m", "sage_jax.bench", "gpu", "--quick", "--repeats", "1", "--out",
                           str(tmp_path / "gpu_bench.json"), "--decode-blocks", "8"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    saved = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert [r["bench"] for r in saved["rows"]] == ["train_step", "sampler", "sampler"]
    assert all("error" not in r and 0 < r["mfu"] and r["tokens_per_s"] > 0 for r in saved["rows"])
    assert saved["rows"][-1]["decode_block"] == 8 and saved["matmul_peak_tflops"] > 0


def test_score_time_mode_scores_math_solutions():
    rows = cli.main(["score_time", "--items", "16", "--workers", "1", "--rounds", "1"])["score_time"]
    assert rows[0]["items"] == 16 and rows[0]["mean_reward"] > 0.5 and rows[0]["best_s"] > 0


def test_offpolicy_mode_summarises_the_steps_after_the_compiles(tmp_path):
    from sage_jax.bench import offpolicy
    lines = [{"step": s, "time": 10.0 * s, "time/step_s": float(s), "rl/staleness": 1.0} for s in range(8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + "\n")
    row = offpolicy.summary(str(tmp_path / "metrics.jsonl"), 8)
    assert row["steps"] == 6 and row["wall_s"] == 60.0 and row["time/step_s"] == 4.5 and row["rl/staleness"] == 1.0
    with pytest.raises(SystemExit):
        cli.main(["offpolicy", "--tokenizer", str(tmp_path), "--steps", "2"])


def test_lora_memory_mode(capsys):
    rows = cli.main(["lora", "memory", "--devices", "32"])["lora"]
    assert [r["config"] for r in rows] == ["qwen7b_branch", "r1distill7b_branch", "qwen3_4b_branch"]
    assert all(r["lora_bytes"] < r["full_bytes"] and 0 < r["lora_params"] < r["params"] for r in rows)
    assert capsys.readouterr().out.count("| qwen") == 2


def test_lora_sampler_mode():
    rows = cli.main(["lora", "sampler", "--preset", "tiny", "--repeats", "1", "--prompts", "1", "--group", "2",
                     "--new-tokens", "4"])
    assert [r["impl"] for r in rows["lora"]] == ["base", "lora_unmerged", "lora_merge_then_sample"]
    assert all(r["wall_s"] > 0 and r["cpu_s"] >= 0 for r in rows["lora"])


def test_user_error_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "sage_jax.bench", "rl_step", "--batch", "6", "--group", "4",
                           "--no-trl"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --batch 6 rows must be a multiple of --group 4")


def test_schedule_ceiling_prices_each_step_at_its_live_rows(monkeypatch):
    """bench sampler --schedule-ceiling: from MEASURED static-batch step costs (here replaced by a known cost per
    width), every step at its live rows (ideal_s) and at the pool's widths (pool_s, never below it)."""
    from sage_jax.sampling import decode_pool
    from sage_jax.bench import sampler as bench_sampler
    # t(n steps at w rows) = n (1 + w) ms + w n^2 / 2 us: a step at position j costs 1 + w + w j / 1000 ms (about)
    monkeypatch.setattr(bench_sampler.common, "interleaved_seconds", lambda fns, repeats: {
        n: [(n * (1 + len(fns[n]().tolist())) + len(fns[n]().tolist()) * n * n / 2e3) * 1e-3] for n in fns})
    monkeypatch.setattr(bench_sampler.sampler_lib, "generate",
                        lambda cfg, params, prompts, **kw: type("Out", (), {"lengths": np.zeros(len(prompts))})())
    lengths = workloads.longtail_lengths(64, 128)
    sc = bench_sampler.schedule_ceiling(model.preset("tiny"), None, 8, 128, lengths)
    assert set(sc["step_ms"]) == {1, *decode_pool.stage_widths(64, 1)}
    assert all(np.isclose(ms, 1 + w + w * 32 / 1e3, rtol=0.01) for w, ms in sc["step_ms"].items())  # at j = 32
    from sage_jax.sampling.schedule import decode_batches
    rows_J, live_J = decode_batches(lengths, None, stage_dp=1)
    step = lambda r, j: 1 + r + r * j / 1e3
    assert np.isclose(sc["ideal_s"], sum(step(max(1, r), j) for j, r in enumerate(live_J, 1)) * 1e-3, rtol=0.01)
    assert np.isclose(sc["pool_s"], sum(step(r, j) for j, r in enumerate(rows_J, 1)) * 1e-3, rtol=0.01)
    assert sc["pool_s"] >= sc["ideal_s"]


def test_rl_step_steady_runs_on_policy_and_partial_rollouts_side_by_side():
    from sage_jax.bench import rl_steady
    rows = rl_steady.bench_rl_steady("tiny", prompts=2, group=2, prompt_len=8, new_tokens=16, steps=2, trl_steps=0,
                                   oversample=(1.5,), warmup=1)
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"sage_jax", "sage_jax_partial_1.5"}
    on, part = by["sage_jax"], by["sage_jax_partial_1.5"]
    assert on["gen_vs_on_policy"] == 1.0 and on["carried_rows"] == 0 and on["token_lag"] == 0
    assert part["gen_tokens_per_s"] > 0 and part["trained_tokens_per_s"] > 0 and part["steps"] == 2
    assert part["prefill_carry_s"] >= 0 and 0 <= part["reprefill_frac"]
    assert on["gen_ceiling_vs_on_policy"] > 0 and on["trained_ceiling_vs_on_policy"] > 0
    # every measured step counted its compilations; a step that compiled is out of the times
    for r in (on, part):
        assert r["timed_steps"] + r["compiled_steps"] == 2 and r["train_compiles"] >= 0 <= r["sampler_compiles"]
        assert r["train_ms_per_token"] > 0
    assert on["train_cost_vs_on_policy"] == 1.0 and part["train_cost_vs_on_policy"] > 0
    # the ceiling's static batch: twice the mean position of a generated token (1, 2, 3: positions 0; 0, 1; 0, 1, 2)
    assert rl_steady.ceiling_length(np.array([1, 2, 3])) == round(2 * 4 / 6) == 1
    assert rl_steady.ceiling_length(np.array([512] * 4)) == 511


@pytest.mark.parametrize("argv, flag", [
    (["rl_step", "--new-tokens", "0", "--no-trl"], "--new-tokens"),  # was a ZeroDivisionError traceback
    (["rl_step", "--repeats", "0", "--no-trl"], "--repeats"),  # ran, then "no median for empty data"
    (["train_step", "--batch", "-3"], "--batch"),  # exited 0 with "rows 1"
    (["sampler", "--new-tokens", "0", "--preset", "tiny"], "--new-tokens"),  # ran past 60 s
    (["sampler", "--batch", "-3", "--preset", "tiny"], "--batch"),
    (["rl_step", "--group", "0"], "--group"),
    (["lora", "sampler", "--new-tokens", "0"], "--new-tokens"),
])
def test_counts_below_their_minimum_are_a_usage_error_before_any_work(argv, flag, capsys):
    start = time.perf_counter()
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"argument {flag}" in err and "Traceback" not in err
    assert time.perf_counter() - start < 5


def test_sigterm_line_of_a_bench_speaks_of_no_checkpoint(monkeypatch, capsys):
    """A benchmark has nothing to resume: its stop line says to rerun, not "resume from the last checkpoint"."""
    from sage_jax.bench import __main__ as bench_main
    from sage_jax.run import cli as run_cli, guard as run_guard

    def terminated():
        raise run_guard.Terminated()
    monkeypatch.setattr(bench_main.bench_cli, "main", terminated)
    with pytest.raises(SystemExit) as stop:
        run_cli.main_guard(bench_main._run)
    err = capsys.readouterr().err
    assert stop.value.code == 143 and "terminated (SIGTERM)" in err
    assert "checkpoint" not in err and "rerun the command" in err
