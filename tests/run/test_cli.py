"""Every face ends a failure with one line and a non-zero exit (sage_jax.run.cli.main_guard): a checkpoint write
refused by the disk (issue 50, item 1: it exited 1 without a word), any other error (exit 1, the traceback in the
run's log.txt), and nothing leaves a hook behind that swallows an error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SAVE_REFUSED = """
import errno, sys
import jax.numpy as jnp
from sage_jax.run import checkpoint, cli

def main():
    ckpt = checkpoint.Checkpointer(sys.argv[1])
    def refuse(*args, **kwargs):  # what orbax raises for a read-only checkpoint folder (errno 30), or EACCES (13)
        raise OSError(int(sys.argv[2]), "refused", sys.argv[1] + "/checkpoints/1.orbax-checkpoint-tmp")
    ckpt._manager.save = refuse
    ckpt.save(1, {"w": jnp.ones(3)})

if __name__ == "__main__":
    cli.main_guard(main)
"""

_FAILS = """
import logging, sys
from sage_jax.run import cli, metrics_log

def main():
    metrics_log.setup_python_logging(sys.argv[1], "INFO")
    logging.getLogger("sage_jax").info("started")
    {body}

if __name__ == "__main__":
    cli.main_guard(main)
"""


def _run(tmp_path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / "face.py"
    path.write_text(script)
    environ = {k: v for k, v in os.environ.items() if k != "SAGE_DEBUG"}
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=120,
                          env=dict(environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **env))


def test_a_checkpoint_save_refused_by_the_disk_is_one_line_not_a_silent_exit(tmp_path):
    for code, words in ((30, "read-only"), (13, "permission denied"), (5, "I/O error")):
        proc = _run(tmp_path, _SAVE_REFUSED, str(tmp_path / f"w{code}"), str(code))
        lines = [l for l in proc.stderr.splitlines() if l.strip()]
        assert proc.returncode == 2, proc.stderr
        assert lines and lines[-1].startswith("error: cannot write checkpoint step 1 in "), proc.stderr
        assert words in lines[-1] and "--workdir" in lines[-1], lines[-1]
        assert "Traceback" not in proc.stderr


def test_any_other_error_is_one_line_exit_1_with_the_traceback_in_log_txt(tmp_path):
    proc = _run(tmp_path, _FAILS.format(body="open(sys.argv[1], 'w')"), str(tmp_path / "w"))  # a folder
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert f"Is a directory ({tmp_path / 'w'})" in lines[0] and "traceback in" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    log = (tmp_path / "w" / "log.txt").read_text()
    assert "the run failed: IsADirectoryError" in log and "Traceback" in log and "open(sys.argv[1], 'w')" in log

    proc = _run(tmp_path, _FAILS.format(body="raise RuntimeError('boom')"), str(tmp_path / "w"), SAGE_DEBUG="1")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "error: RuntimeError: boom" in proc.stderr


def test_a_failed_save_leaves_no_hook_that_swallows_errors():
    import threading

    from sage_jax.run import save_errors
    before = sys.excepthook, threading.excepthook, sys.unraisablehook
    try:
        with save_errors.quiet_failures():
            raise OSError(30, "Read-only file system")
    except OSError:
        pass
    assert sys.excepthook is before[0]
    seen = []
    sys.unraisablehook, threading.excepthook = before[2], before[1]
    original_thread = threading.excepthook
    threading.excepthook = lambda args: seen.append(args.exc_value)
    try:
        with save_errors.quiet_failures():
            raise OSError(30, "Read-only file system")
    except OSError:
        pass
    try:
        thread = threading.Thread(target=lambda: 1 / 0)  # not a checkpoint writer: its error reaches the old hook
        thread.start()
        thread.join()
        assert len(seen) == 1 and isinstance(seen[0], ZeroDivisionError)
    finally:
        sys.excepthook, threading.excepthook, sys.unraisablehook = before[0], original_thread, before[2]
        threading.excepthook = before[1]


def test_a_background_thread_error_is_one_line_with_the_traceback_in_log_txt(tmp_path):
    body = ("import threading; t = threading.Thread(target=lambda: 1 / 0, name='writer'); t.start(); t.join()")
    proc = _run(tmp_path, _FAILS.format(body=body), str(tmp_path / "w"))
    assert proc.returncode == 0, proc.stderr
    assert "warning: background thread writer failed: ZeroDivisionError: division by zero" in proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" in (tmp_path / "w" / "log.txt").read_text()


_SAVE_ON_A_READ_ONLY_DISK = """
import logging, sys
import jax
from sage_jax.run import checkpoint, cli, metrics_log

def main():
    metrics_log.setup_python_logging(sys.argv[1], logging.INFO)
    checkpoint.Checkpointer(sys.argv[1] + "/rl").save(1, {"w": jax.numpy.zeros(4)})

cli.main_guard(main)
"""


def test_a_save_into_a_really_read_only_checkpoint_folder_prints_one_line(tmp_path):
    """The item-1 run as it was found: a read-only checkpoint folder (a read-only tmpfs in a private mount namespace;
    needs root, skipped elsewhere) made the run exit 1 with no message."""
    from tests.helpers_system import private_tmpfs_or_skip
    folder = tmp_path / "wd" / "rl" / "checkpoints"
    folder.mkdir(parents=True)
    private_tmpfs_or_skip(folder, "size=1m,ro")
    script = tmp_path / "save.py"
    script.write_text(_SAVE_ON_A_READ_ONLY_DISK)
    shell = f"mount -t tmpfs -o size=1m,ro tmpfs {folder} && exec {sys.executable} {script} {tmp_path / 'wd'}"
    r = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: cannot write checkpoint step 1 in ") and "read-only" in lines[0], lines[0]
