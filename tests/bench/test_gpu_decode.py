"""bench gpu_decode, the decode path's GPU check: its worker against this code on the CPU, its table, its errors."""

from __future__ import annotations

import pytest

from sage_jax.bench import gpu_decode


def test_worker_times_this_codes_sampler_and_counts_its_loops():
    spec = dict(preset="tiny", compute_dtype="float32", repeats=1,
                shapes=[dict(rows=4, samples=2, prompt_len=8, new_tokens=8, attention="auto"),
                        dict(rows=2, samples=2, prompt_len=8, new_tokens=8, attention="flash")])
    good, bad = gpu_decode.run_worker(gpu_decode.ROOT, spec, timeout=300)
    assert good["tokens"] == 4 * 8 and good["tokens_per_s"] > 0 and good["steps"] == 8 and good["loops"] >= 7
    assert "decode attention 'flash'" in bad["error"]  # a failed shape is a row, the others still run


def test_table_compares_same_run_rates():
    base = [dict(rows=64, tokens_per_s=1000.0)]
    ours = [dict(rows=64, attention="auto", tokens_per_s=2500.0, tokens=64 * 512, steps=512, loops=130),
            dict(rows=64, attention="one_pass", tokens_per_s=2000.0),
            dict(rows=64, attention="blocked", tokens_per_s=500.0),
            dict(rows=64, attention="kernel", workload="longtail", tokens_per_s=1800.0),
            dict(rows=64, attention="one_pass", workload="longtail", tokens_per_s=1000.0)]
    lines = gpu_decode.table(base, ours)
    assert "2.50x" in lines[2] and "0.25" in lines[2]  # auto over the baseline; loops per decode step
    assert lines[-1].endswith("1.80x")


def test_a_baseline_dir_without_the_code_is_named(tmp_path):
    with pytest.raises(SystemExit, match="holds no sage_jax"):
        gpu_decode.main(["gpu_decode", "--quick", "--baseline-dir", str(tmp_path), "--out", str(tmp_path / "o.json")])
