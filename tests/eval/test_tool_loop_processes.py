"""The tool loop on two processes (a multi-host slice in small): process 0 alone runs the tools and tells the other
which calls have answered, so both carry the same rows into the same sampler calls in the same order, whatever the
tools' timing, and both end with the rows one process makes."""

import json
import subprocess
import sys

from tests.training.test_multihost import ROOT, _digest, _env, _free_port

WORKERS = f"{ROOT}/tests/eval"


def _one_and_two_processes(worker: str, single_devices: int) -> tuple[dict, dict, dict]:
    """The worker's digest from one process (with single_devices CPU devices), and from each of two processes (one
    device each) -> (one, process 0, process 1)."""
    worker = f"{WORKERS}/{worker}"
    single = subprocess.run([sys.executable, worker], cwd=ROOT, env=_env(single_devices), capture_output=True,
                            text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, worker, coordinator, "2", str(i)], cwd=ROOT, env=_env(1),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    one, lead, other = _digest(single.stdout), _digest(outs[0][0]), _digest(outs[1][0])
    assert (lead["processes"], other["processes"], lead["process"], other["process"]) == (2, 2, 0, 1)
    return one, lead, other


def test_two_processes_decode_the_same_rows_and_only_process_0_runs_tools():
    one, lead, other = _one_and_two_processes("tool_loop_worker.py", 1)
    assert lead["carried"] == other["carried"] and len(lead["carried"]) >= 2  # the same calls, the same rows
    assert lead["tokens"] == other["tokens"] == one["tokens"] and lead["mask"] == other["mask"] == one["mask"]
    assert lead["calls_per_row"] == other["calls_per_row"] == 2.0
    assert (lead["tool_calls_run"], other["tool_calls_run"], one["tool_calls_run"]) == (16, 0, 16)
    assert json.dumps(lead["tokens"]).count("50, 51, 52, 53") == 16  # every call's output observed in its row


def test_two_processes_pause_rows_in_one_pool_over_both_and_only_process_0_runs_tools():
    """The in-pool path (a session on a mesh over both processes' devices): both processes make the same pool calls
    and end with the rows one process with the same two devices makes."""
    one, lead, other = _one_and_two_processes("tool_pool_worker.py", 2)
    assert lead["tokens"] == other["tokens"] == one["tokens"] and lead["mask"] == other["mask"] == one["mask"]
    assert lead["calls_per_row"] == other["calls_per_row"] == one["calls_per_row"] > 0.2
    assert lead["tool_calls_run"] == one["tool_calls_run"] > 0 and other["tool_calls_run"] == 0
    # the same calls of the pool on both processes (calls of 3 steps: the in-pool path, not a few sampler calls)
    assert lead["pool_calls"] == other["pool_calls"] >= 48 // 3
