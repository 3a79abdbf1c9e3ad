"""The sandbox against hostile code: each case is contained within the timeout plus one second, the tool pool answers
the next call, no process of the sandbox's user ids is left, and this (the trainer's) process is untouched."""

import os
import socket
import time

import pytest

from sage_jax.tools import sandbox
from sage_jax.tools.base import ToolPool
from sage_jax.tools.python_tool import PythonTool

TIMEOUT_S = 1.5
pytestmark = pytest.mark.skipif(sandbox.available_isolation() is None,
                                reason="namespaces need root with unshare/mount/prlimit/setpriv")


@pytest.fixture(scope="module")
def pool():
    with ToolPool({"python": PythonTool(timeout_s=TIMEOUT_S)}, num_workers=2) as p:
        yield p


def _sandbox_processes() -> list[int]:
    """Processes running as one of this test process's sandbox user ids (sandbox._UserIds: a block of 100 per
    calling process), so sandboxes of other runs on the machine, e.g. a study's tool calls, do not count."""
    pids, first = [], sandbox.USER_IDS.first
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, ValueError, StopIteration):
            continue
        if first < uid <= first + 100:
            pids.append(int(entry))
    return pids


def contained(pool, code: str):
    """Runs hostile `code`; checks the limits held; returns the observation."""
    env_before = dict(os.environ)
    start = time.perf_counter()
    out = pool.submit("python", code).result(timeout=60)
    elapsed = time.perf_counter() - start
    assert elapsed <= TIMEOUT_S + 1.0, f"took {elapsed:.2f} s"
    deadline = time.time() + 1.0
    while _sandbox_processes() and time.time() < deadline:
        time.sleep(0.05)
    assert not _sandbox_processes(), "sandbox processes left running"
    assert pool.submit("python", "print(6 * 7)").result(timeout=60).text == "42\n", "the pool died"
    assert dict(os.environ) == env_before
    return out


def test_infinite_loop(pool):
    out = contained(pool, "while True:\n    pass\n")
    assert out.timed_out and "TimeoutError" in out.text


def test_sleep_past_the_timeout(pool):
    out = contained(pool, "import time\nprint('before', flush=True)\ntime.sleep(60)\nprint('after')\n")
    assert out.timed_out and out.text.startswith("before\n") and "after" not in out.text


def test_fork_bomb(pool):
    out = contained(pool, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert not out.ok


def test_fork_bomb_that_leaves_its_session(pool):
    contained(pool, "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        os.setsid()\n"
                    "        time.sleep(60)\nprint('parent done')\n")


def test_ten_gigabyte_allocation(pool):
    out = contained(pool, "x = bytearray(10 * 1024 ** 3)\nprint('allocated')\n")
    assert out.text == "MemoryError" and not out.ok


def test_hundred_megabytes_of_output(pool):
    out = contained(pool, "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2 ** 20)\n")
    assert len(out.text) < 17_000 and "bytes cut" in out.text


def test_write_outside_the_scratch_directory(pool, tmp_path):
    targets = [tmp_path / "escaped.txt", os.path.join(os.path.dirname(__file__), "escaped.txt"),
               "/var/tmp/sage_tool_escaped.txt", "/dev/shm/sage_tool_escaped.txt"]
    code = "".join(f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError as e:\n    print(type(e).__name__)\n"
                   for t in targets) + "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())\n"
    out = contained(pool, code)
    assert out.text.endswith("ok\n")
    assert not any(os.path.exists(t) for t in targets)


def test_socket(pool):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                "    print('in')\n"
                "except OSError as e:\n    print('refused', type(e).__name__)\n"
                "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    print('out')\n"
                "except OSError as e:\n    print('refused', type(e).__name__)\n")
        out = contained(pool, code)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert out.text.count("refused") == 2, out.text


def test_reading_the_parent_environment(pool, monkeypatch):
    monkeypatch.setenv("SAGE_TOOL_SECRET", "hunter2-secret")
    code = ("import os\nprint(dict(os.environ))\n"
            f"for pid in ({os.getpid()}, os.getppid(), 1):\n    try:\n"
            "        print(open(f'/proc/{pid}/environ').read())\n    except OSError as e:\n        print(e)\n")
    out = contained(pool, code)
    assert "hunter2" not in out.text and "SAGE_TOOL_SECRET" not in out.text


def test_killing_the_parent(pool):
    code = ("import os, signal\n"
            f"for pid in ({os.getpid()}, {os.getppid()}, os.getppid(), -1):\n    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(type(e).__name__)\n")
    contained(pool, code)  # this process still runs the assertions


def test_ctypes(pool):
    out = contained(pool, f"import ctypes\nprint(ctypes.CDLL(None).kill({os.getpid()}, 9), flush=True)\n"
                          "ctypes.string_at(0)\n")
    assert out.text.startswith("-1\n") and "SIGSEGV" in out.text


def test_deep_recursion(pool):
    out = contained(pool, "import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(n):\n    return f(n + 1)\nf(0)\n")
    assert not out.ok
