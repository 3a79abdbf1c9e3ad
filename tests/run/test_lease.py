"""The run lock is a lease (sage_jax.run.guard): its holder renews a beat, another host's lock is taken over only once
its beat went stale, and a live one is never shared. The same on a bucket: tests/run/test_gcs_workdir.py."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time

import pytest

from sage_jax.run import guard as run_guard, lease


def _lock(tmp_path, **fields):
    holder = {"pid": 12345, "host": "another-host", "since": "2026-01-01T00:00:00", **fields}
    (tmp_path / "run.lock.new").write_text(json.dumps(holder))
    os.replace(tmp_path / "run.lock.new", tmp_path / "run.lock")  # whole, as the holder's renewals are


def test_a_lease_of_another_host_whose_beat_went_stale_is_taken_over(tmp_path, caplog):
    _lock(tmp_path, beat=time.time() - 4 * 30, beat_s=30)  # four beats missed: that run is gone
    with caplog.at_level(logging.WARNING), run_guard.locked(str(tmp_path)):
        holder = json.loads((tmp_path / "run.lock").read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and "token" in holder
    assert not (tmp_path / "run.lock").exists()
    assert any("took over the stale lock of pid 12345 on host another-host" in r.getMessage() for r in caplog.records)


@contextlib.contextmanager
def _renewing(tmp_path, beat_s: float):
    """Another host's live run: its lock's beat renewed every beat_s / 4 seconds until the block ends."""
    stop = threading.Event()

    def renew():
        while not stop.wait(beat_s / 4):
            _lock(tmp_path, token="theirs", beat=time.time(), beat_s=beat_s)
    _lock(tmp_path, token="theirs", beat=time.time(), beat_s=beat_s)
    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_a_live_lease_of_another_host_is_never_taken(tmp_path, caplog):
    """A recent beat is watched: renewed, the run refuses with the usual line, and the lock stays the other's."""
    with _renewing(tmp_path, beat_s=0.4), caplog.at_level(logging.WARNING):
        with pytest.raises(run_guard.WorkdirBusy, match="in use by another run \\(pid 12345 on host another-host"):
            run_guard.acquire(str(tmp_path))
    assert json.loads((tmp_path / "run.lock").read_text())["token"] == "theirs"
    assert any("waiting up to" in r.getMessage() for r in caplog.records)


def test_a_recent_beat_that_is_not_renewed_is_waited_out_and_taken_over(tmp_path, caplog):
    """A run requeued right after a SIGKILL on another node: the dead run's lease is young but never renewed."""
    _lock(tmp_path, token="theirs", beat=time.time(), beat_s=0.2)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING), run_guard.locked(str(tmp_path)):
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    assert 0.3 < time.monotonic() - t0 < 30
    assert any("took over the stale lock of pid 12345" in r.getMessage() for r in caplog.records)


def test_a_lock_of_another_host_without_a_lease_is_never_taken(tmp_path):
    """Written by an older version (no beat): that host's pid cannot be checked, so it stays."""
    _lock(tmp_path)
    with pytest.raises(run_guard.WorkdirBusy, match="in use by another run \\(pid 12345 on host another-host"):
        run_guard.acquire(str(tmp_path))
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == 12345


def test_the_holder_renews_its_beat_and_a_lost_lease_is_not_removed(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(lease, "BEAT_S", 0.1)
    lock = tmp_path / "run.lock"
    with run_guard.locked(str(tmp_path)):
        first = json.loads(lock.read_text())
        assert first["beat_s"] == 0.1
        deadline = time.time() + 30
        while json.loads(lock.read_text())["beat"] == first["beat"]:
            assert time.time() < deadline, "the beat was never renewed"
            time.sleep(0.05)
        # another run took the lock (e.g. this one was frozen for longer than the stale limit): this one stops
        # renewing and leaves the other's lock in place when it ends
        with caplog.at_level(logging.ERROR):
            lock.write_text(json.dumps({"pid": 999, "host": "another-host", "token": "theirs", "beat": time.time()}))
            time.sleep(0.5)
        assert json.loads(lock.read_text())["token"] == "theirs"
    assert json.loads(lock.read_text())["token"] == "theirs"
    assert any("lost its workdir" in r.getMessage() and "another-host" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------- fencing (issue 50, item 2)

def _taken(tmp_path, beat_s: float = 30.0) -> None:
    """Another host's run took this workdir's lock over (as after this run was paused past its lease)."""
    _lock(tmp_path, pid=4321, host="host-b", token="theirs", beat=time.time(), beat_s=beat_s)


def test_a_run_whose_lock_was_taken_writes_nothing_more_and_names_the_holder(tmp_path, monkeypatch):
    from sage_jax.run import paths
    monkeypatch.setattr(lease, "BEAT_S", 0.1)
    with run_guard.locked(str(tmp_path)):
        paths.append_text(str(tmp_path / "metrics.jsonl"), "step 0\n")
        _taken(tmp_path)
        time.sleep(0.5)  # the lease thread finds out at its next renewal
        for write in (lambda: paths.append_text(str(tmp_path / "metrics.jsonl"), "step 1\n"),
                      lambda: paths.write_text(str(tmp_path / "summary.json"), "{}"),
                      lambda: paths.remove(str(tmp_path / "metrics.jsonl"))):
            with pytest.raises(run_guard.LeaseLost, match="is now held by pid 4321 on host host-b"):
                write()
        with pytest.raises(run_guard.LeaseLost, match="wrote nothing more"):
            run_guard.fence(str(tmp_path / "checkpoints"))  # what a checkpoint save asks first
    assert (tmp_path / "metrics.jsonl").read_text() == "step 0\n" and not (tmp_path / "summary.json").exists()
    assert json.loads((tmp_path / "run.lock").read_text())["token"] == "theirs"  # theirs stays


def test_a_paused_run_checks_its_lease_before_its_next_write(tmp_path, monkeypatch):
    """A run frozen (SIGSTOP) past its lease: its lease thread has not run yet when the main thread writes again;
    the write renews first, finds the other run's lock, and is refused."""
    from sage_jax.run import paths
    monkeypatch.setattr(lease, "BEAT_S", 30.0)  # the lease thread does not wake during the test
    with run_guard.locked(str(tmp_path)):
        held = lease._leases[str(tmp_path / "run.lock")]
        held.beat -= 4 * 30.0  # as if this process had been stopped for four beats
        _taken(tmp_path)
        with pytest.raises(run_guard.LeaseLost, match="host-b"):
            paths.append_text(str(tmp_path / "metrics.jsonl"), "a late row\n")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_paused_run_whose_lock_is_still_its_own_goes_on(tmp_path, monkeypatch):
    from sage_jax.run import paths
    monkeypatch.setattr(lease, "BEAT_S", 30.0)
    monkeypatch.setattr(lease, "SETTLE_S", 0.05)
    with run_guard.locked(str(tmp_path)):
        held = lease._leases[str(tmp_path / "run.lock")]
        held.beat -= 2.5 * 30.0  # late, but nobody took the lock: renewed (and read back) before the write
        paths.append_text(str(tmp_path / "metrics.jsonl"), "row\n")
        assert time.time() - held.beat < 5 and held.lost is None
    assert (tmp_path / "metrics.jsonl").read_text() == "row\n"


def test_a_lease_that_cannot_be_renewed_in_time_is_lost(tmp_path, monkeypatch):
    from sage_jax.run import paths
    monkeypatch.setattr(lease, "BEAT_S", 0.1)
    with run_guard.locked(str(tmp_path)):
        def unreachable(path, text):
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(paths, "write_text", unreachable)
        time.sleep(0.6)  # several renewals fail: past FRESH_BEATS intervals the lease is given up
        with pytest.raises(run_guard.LeaseLost, match="could not renew the lock .* Input/output error"):
            paths.append_text(str(tmp_path / "metrics.jsonl"), "row\n")


def test_the_step_loop_stops_at_the_boundary_once_the_lease_is_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "BEAT_S", 0.1)

    class Ckpt:
        directory, saved = str(tmp_path), []

        def latest_step(self):
            return None

    done = []
    with run_guard.locked(str(tmp_path)):
        stop = run_guard.StepStop("RL step", Ckpt(), lambda step: Ckpt.saved.append(step))
        with pytest.raises(run_guard.LeaseLost, match="host-b"):
            for step in stop.steps(0, 10):
                done.append(step)
                if step == 1:
                    _taken(tmp_path)
                    time.sleep(0.5)
    assert done == [0, 1] and Ckpt.saved == []


def test_a_lock_deleted_under_its_holder_is_made_again_unless_another_run_has_it(tmp_path, monkeypatch):
    from sage_jax.run import paths
    monkeypatch.setattr(lease, "BEAT_S", 0.1)
    monkeypatch.setattr(lease, "SETTLE_S", 0.05)
    with run_guard.locked(str(tmp_path)):
        mine = json.loads((tmp_path / "run.lock").read_text())["token"]
        (tmp_path / "run.lock").unlink()  # by hand
        time.sleep(0.6)
        assert json.loads((tmp_path / "run.lock").read_text())["token"] == mine
        paths.append_text(str(tmp_path / "metrics.jsonl"), "row\n")  # still this run's workdir
    assert not (tmp_path / "run.lock").exists()
