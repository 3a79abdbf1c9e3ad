"""A training run that loses its lease stops (issue 50, item 2): run A is frozen with SIGSTOP after a step, another
host's run takes the stale lock over, A is continued: A exits with one line naming the other holder and writes
nothing more (no metrics row, no checkpoint, no deletion of the other's files)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _rows(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.slow
def test_a_paused_run_whose_lock_was_taken_over_stops_without_writing(tmp_path):
    workdir, beat_s = tmp_path / "w", 1.0
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", SAGE_LEASE_BEAT_S=str(beat_s),
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    cmd = [sys.executable, "-m", "sage_jax.train", "--config", str(ROOT / "configs" / "tiny_test.py"), "--workdir",
           str(workdir), "--config.train.steps=200", "--config.train.ckpt_every=1", "--config.train.keep_ckpts=2"]
    a = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stop = threading.Event()
    try:
        deadline = time.time() + 240
        while len(_rows(workdir / "metrics.jsonl")) < 3:
            assert a.poll() is None and time.time() < deadline, a.communicate()[1][-3000:]
            time.sleep(0.2)
        a.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        rows, steps = _rows(workdir / "metrics.jsonl"), sorted(os.listdir(workdir / "rl" / "checkpoints"))
        lock = workdir / "run.lock"

        def run_b():  # the other host's run: took the stale lock and renews it
            while not stop.is_set():
                holder = {"pid": 4321, "host": "host-b", "since": "now", "token": "theirs", "beat": time.time(),
                          "beat_s": beat_s}
                (workdir / "run.lock.b").write_text(json.dumps(holder))
                os.replace(workdir / "run.lock.b", lock)
                stop.wait(0.2)
        time.sleep(3.5 * beat_s)  # A's lease is stale now: B takes it over
        threading.Thread(target=run_b, daemon=True).start()
        time.sleep(0.5)
        a.send_signal(signal.SIGCONT)
        _, err = a.communicate(timeout=120)
    finally:
        stop.set()
        if a.poll() is None:
            a.kill()
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert a.returncode == 2, err[-3000:]
    assert last.startswith("error: this run lost its workdir") and "pid 4321 on host host-b" in last, last
    assert _rows(workdir / "metrics.jsonl") == rows  # no row after the pause
    # none deleted, none begun after the pause (a save the pause caught halfway may complete: the lease is checked
    # before a write, not held through it)
    done = lambda names: {n for n in names if n.isdigit()}
    after = sorted(os.listdir(workdir / "rl" / "checkpoints"))
    assert done(steps) <= done(after) <= {n.split(".")[0] for n in steps}, (steps, after)
    assert json.loads((workdir / "run.lock").read_text())["token"] == "theirs"
