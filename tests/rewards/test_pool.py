import os
import sys
import threading
import time

import numpy as np
import pytest

from sage_jax.rewards.pool import RewardPool, resolve


def echo_or_hang(completion, gold):
    """Test-only reward: hangs on "HANG", raises on "RAISE", dies on "EXIT", else 1.0 iff completion == gold."""
    if completion == "HANG":
        while True:
            pass
    if completion == "RAISE":
        raise RuntimeError("checker bug")
    if completion == "EXIT":
        os._exit(3)
    if completion == "MEM":
        hog = []
        while True:
            hog.append(bytearray(64 << 20))
    if completion == "JAX?":
        return float("jax" in sys.modules)
    return float(completion == gold)


def test_resolve():
    assert resolve("math") == "sage_jax.rewards.math:score"
    assert resolve("countdown") == "sage_jax.rewards.countdown:score"
    assert resolve(echo_or_hang).endswith(":echo_or_hang")
    with pytest.raises(ValueError, match="unknown reward"):
        resolve("nope")
    with pytest.raises(ValueError, match="module-level"):
        resolve(lambda c, g: 0.0)
    with pytest.raises(ValueError, match="cannot load"):
        RewardPool("no.such.module:fn", num_workers=0)


def test_hang_is_killed_and_others_score():
    limit = 1.0
    with RewardPool(echo_or_hang, num_workers=2, timeout_s=limit) as pool:
        pool.score(["a"], ["a"])  # wait for start-up so the timing below measures scoring only
        completions = ["a", "HANG", "b", "x", "RAISE", "c", "EXIT", "d", "JAX?"]
        golds = ["a", "", "b", "y", "", "c", "", "d", ""]
        start = time.monotonic()
        rewards = pool.score(completions, golds)
        elapsed = time.monotonic() - start
        assert rewards.dtype == np.float32
        np.testing.assert_array_equal(rewards, [1, 0, 1, 0, 0, 1, 0, 1, 0])
        assert elapsed < limit + 8.0  # one hang costs one limit; restarts happen alongside the other worker
        assert pool.stats["timeouts"] == 1 and pool.stats["errors"] == 2 and pool.stats["restarts"] == 2
        # The replaced workers serve the next batch.
        np.testing.assert_array_equal(pool.score(["p", "q"], ["p", "z"]), [1, 0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_hanging_memory_hungry_and_crashing_items_score_zero_within_the_bound(num_workers):
    limit = 4.0  # well above the time "MEM" takes to reach the cap on a loaded machine
    with RewardPool(echo_or_hang, num_workers=num_workers, timeout_s=limit, memory_mb=512) as pool:
        pool.score(["a"], ["a"])  # start-up done, so the timing below measures scoring only
        assert pool.take_counts() == {"rl/reward_timeouts": 0.0, "rl/reward_errors": 0.0}
        start = time.monotonic()
        rewards = pool.score(["a", "HANG", "MEM", "RAISE", "EXIT", "b"], ["a", "", "", "", "", "b"])
        elapsed = time.monotonic() - start
        np.testing.assert_array_equal(rewards, [1, 0, 0, 0, 0, 1])
        # one hang costs one limit; each replaced worker costs one start-up (a few seconds on a loaded machine)
        assert elapsed < limit + 3 * 10.0
        assert pool.take_counts() == {"rl/reward_timeouts": 1.0, "rl/reward_errors": 3.0}
        np.testing.assert_array_equal(pool.score(["p", "q"], ["p", "z"]), [1, 0])  # the pool goes on
        assert pool.take_counts() == {"rl/reward_timeouts": 0.0, "rl/reward_errors": 0.0}


def test_many_failures_warn(caplog):
    with RewardPool(echo_or_hang, num_workers=1, timeout_s=5.0) as pool:
        with caplog.at_level("WARNING", logger="sage_jax"):
            pool.score(["RAISE", "RAISE", "a"], ["", "", "a"])
            pool.take_counts()
    assert any("2 of 3 items" in r.getMessage() for r in caplog.records)


def test_math_and_kk_by_name():
    from sage_jax.rewards import kk

    puzzle = kk.generate_puzzle(3, 0)
    good = "<answer>" + puzzle["solution_text_format"] + "</answer>"
    with RewardPool("math", num_workers=2, timeout_s=10.0) as pool:
        rewards = pool.score(["\\boxed{\\dfrac12}", "\\boxed{3}", "\\boxed{10^{10^{10^{10}}}}", "nothing"],
                             ["0.5", "4", "1", "1"])
        np.testing.assert_array_equal(rewards, [1, 0, 0, 0])
    with RewardPool("kk", num_workers=1, timeout_s=10.0) as pool:
        rewards = pool.score([good, "<answer></answer>"], [kk.parse_row(puzzle)] * 2)
        np.testing.assert_array_equal(rewards, [1, 0])


def test_score_from_threads_and_errors():
    with RewardPool(echo_or_hang, num_workers=1, timeout_s=5.0) as pool:
        with pytest.raises(ValueError, match="golds"):
            pool.score(["a"], [])
        results = {}

        def work(k):
            results[k] = pool.score([str(k), "z"], [str(k), "y"])

        threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for k in range(3):
            np.testing.assert_array_equal(results[k], [1, 0])
    with pytest.raises(ValueError, match="closed"):
        pool.score(["a"], ["a"])


def hang_once_or_raise(completion, gold):
    """Test-only reward for a whole run: the first item ever scored hangs, odd-length completions raise. The marker
    is created atomically: two workers that checked for it at once both hung (2 timeouts where 1 was expected)."""
    try:
        os.close(os.open(os.environ["SAGE_TEST_HANG_MARKER"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        pass
    else:
        while True:
            pass
    if len(completion) % 2:
        raise ValueError("odd")
    return 0.0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_run_goes_on_past_hanging_and_failing_rewards(tmp_path, monkeypatch, num_workers):
    import json
    from sage_jax.run import config as config_lib
    from sage_jax.training import trainer
    monkeypatch.setenv("SAGE_TEST_HANG_MARKER", str(tmp_path / "hung"))
    config = config_lib.load("configs/tiny_test.py", [
        "--config.train.steps=1", f"--config.train.reward_workers={num_workers}", "--config.train.reward_timeout=2",
        f"--config.train.reward={__name__}:hang_once_or_raise"])
    trainer.run_rl(config, str(tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    host = next(r for r in rows if "rl/reward_timeouts" in r)
    assert host["rl/reward_timeouts"] == 1.0 and host["rl/reward_errors"] >= 1.0
    assert (tmp_path / "run" / "rl" / "checkpoints" / "1").is_dir()
