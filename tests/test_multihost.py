"""Two local CPU processes (coordinator on 127.0.0.1) vs one process with the same two devices: same params."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGE_")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    return env


def _digest(stdout: str) -> dict:
    line = [x for x in stdout.splitlines() if x.startswith("DIGEST ")]
    assert line, stdout[-3000:]
    return json.loads(line[-1][len("DIGEST "):])


def test_two_processes_match_one_process(tmp_path):
    single = subprocess.run([sys.executable, WORKER, str(tmp_path / "single")], cwd=ROOT, env=_env(2),
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, WORKER, str(tmp_path / "multi"), coordinator, "2", str(i)], cwd=ROOT,
                              env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    a, b = _digest(single.stdout), _digest(outs[0][0])
    assert a["devices"] == b["devices"] == 2 and a["processes"] == 1 and b["processes"] == 2
    np.testing.assert_allclose(a["sums"], b["sums"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a["abs"], b["abs"], rtol=1e-6)
    # process 0 alone writes logs and checkpoint metadata
    assert (tmp_path / "multi" / "metrics.jsonl").exists()
    assert (tmp_path / "multi" / "rl" / "checkpoints" / "2").exists()
