"""Two local CPU processes (coordinator on 127.0.0.1) vs one process with the same two devices: same params."""

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

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


# --------------------------------------------------------------------------- the real trainer on 2 processes x 4 CPUs
# Each process is `python -m sage_jax.train` with SAGE_COORDINATOR / SAGE_NUM_PROCESSES / SAGE_PROCESS_ID, the path
# launch/ uses (cli.setup_runtime -> sharding.initialize_distributed -> jax.distributed.initialize); CPU collectives
# are jax 0.10's default, gloo. About 1-2 min per 2-process run on 2 cores (the compile), hence `slow`.

TRAIN = [sys.executable, "-m", "sage_jax.train", "--config", "configs/tiny_test.py"]


def _start_pair(workdir, *args: str) -> list[subprocess.Popen]:
    coordinator = f"localhost:{_free_port()}"
    procs = []
    for i in range(2):
        env = dict(_env(4), SAGE_COORDINATOR=coordinator, SAGE_NUM_PROCESSES="2", SAGE_PROCESS_ID=str(i))
        procs.append(subprocess.Popen([*TRAIN, "--workdir", str(workdir), *args], cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def _finish_pair(procs, timeout: float = 600) -> list[str]:
    """Each process's stderr; kills both if either hangs (a lone process waits in its collectives forever)."""
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=timeout)[1])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("a process did not finish: " + " || ".join(p.communicate()[1][-2000:] for p in procs))
    return errs


def _run_pair(workdir, *args: str) -> list[str]:
    procs = _start_pair(workdir, *args)
    errs = _finish_pair(procs)
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]
    return errs


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_one_shared_checkpoint_and_both_resume(tmp_path):
    """A preemption notice reaching one host only: the flag is agreed at the step boundary, both processes finish
    the step, save one checkpoint together, print the stop line and exit 143; both resume at the named step."""
    import re
    import time
    workdir = tmp_path / "wd"
    procs = _start_pair(workdir, "--config.train.steps=100000", "--config.train.ckpt_every=100000")
    deadline = time.time() + 600
    metrics = workdir / "metrics.jsonl"
    while not (metrics.exists() and metrics.stat().st_size):  # step 0 done on both (process 0 logs)
        assert all(p.poll() is None for p in procs) and time.time() < deadline, "a process ended before step 1"
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGTERM)  # the non-primary one: process 0 learns of it only through the agreement
    errs = _finish_pair(procs)
    steps = []
    for p, err in zip(procs, errs):
        assert p.returncode == 143 and "Traceback" not in err, err[-3000:]
        stops = [line for line in err.splitlines() if line.startswith("stopped by SIGTERM after RL step ")]
        assert len(stops) == 1 and "resume with: python -m sage_jax.train" in stops[0], err[-3000:]
        steps.append(int(re.search(r"after RL step (\d+):", stops[0]).group(1)))
    assert steps[0] == steps[1] >= 1, steps
    step = steps[0]
    assert sorted(int(s) for s in os.listdir(workdir / "rl" / "checkpoints")) == [step]
    assert not (workdir / "run.lock").exists()
    _run_pair(workdir, f"--config.train.steps={step + 1}", "--config.train.ckpt_every=100000")
    assert f"at RL step {step}" in (workdir / "log.txt").read_text()
    assert (workdir / "rl" / "checkpoints" / str(step + 1)).is_dir()
    rows = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert sorted(set(rows)) == list(range(step + 1)), rows


def _metrics(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_split_placement_across_processes_is_refused_with_one_line(tmp_path):
    """mesh.rollout_devices = one process's 4 devices: refused up front on every process (see the xfail below)."""
    errs = _finish_pair(_start_pair(tmp_path / "wd", "--config.train.steps=2", "--config.train.off_policy_steps=1",
                                    "--config.mesh.rollout_devices=4"))
    for err in errs:
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[Gloo]")]
        assert "Traceback" not in err and lines[-1].startswith("error: mesh.rollout_devices=4 across 2 processes"), \
            err[-3000:]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="split placement across hosts is not supported (make_meshes refuses it). Measured without the "
                          "refusal, jax 0.10.2, 2 CPU processes: the weight copy fails first (offpolicy.to_rollout_mesh: "
                          "process 0 'device_put's second argument must be a Device or a Sharding which represents "
                          "addressable devices', process 1 'The backend ... does not support cross-host device "
                          "transfers'); a probe showed the prompts' put and the sampled rows' allgather fail the same way "
                          "on a process with no device in the sampler's mesh")
def test_split_placement_across_hosts_matches_colocated(tmp_path):
    """Issue 28's target across hosts: the sampler on process 1's 4 devices, training on process 0's, k = 1 for 2
    steps, the same metrics as colocated k = 1 within float tolerance (the single-process test is in
    tests/test_offpolicy.py)."""
    args = ["--config.train.steps=2", "--config.train.ckpt_every=100000", "--config.train.off_policy_steps=1"]
    _run_pair(tmp_path / "split", *args, "--config.mesh.rollout_devices=4")
    _run_pair(tmp_path / "colocated", *args)
    split, colocated = _metrics(tmp_path / "split"), _metrics(tmp_path / "colocated")
    assert len(split) == len(colocated) == 2
    for a, b in zip(split, colocated):
        keys = [k for k in b if not k.startswith("time/") and isinstance(b[k], (int, float))]
        np.testing.assert_allclose([a[k] for k in keys], [b[k] for k in keys], rtol=1e-5, atol=1e-6)
