"""sage_jax sizes XLA:CPU's thread pool for simulated host devices (sage_jax/__init__.py): without it, 8 simulated
devices on a 2-core machine deadlocked in their collectives (tests/training/test_partial.py, 2 of 2 runs)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nproc_after_import(xla_flags: str | None, nproc: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    env |= {"PYTHONPATH": ROOT} | ({"XLA_FLAGS": xla_flags} if xla_flags is not None else {}) | \
        ({"NPROC": nproc} if nproc is not None else {})
    out = subprocess.run([sys.executable, "-c", "import os, sage_jax; print(os.environ.get('NPROC', '-'))"],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("flags, nproc, expected", [
    ("--xla_force_host_platform_device_count=8", None, str(max(os.cpu_count() or 1, 32))),
    ("--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=3", None,
     str(max(os.cpu_count() or 1, 12))),
    ("--xla_force_host_platform_device_count=8", "5", "5"),  # the user's NPROC stays
    ("--xla_force_host_platform_device_count=1", None, "-"),  # one device: nothing to deadlock
    (None, None, "-"),
])
def test_the_pool_gets_four_threads_per_simulated_device(flags, nproc, expected):
    assert _nproc_after_import(flags, nproc) == expected


def test_this_process_has_them():
    import jax
    assert len(jax.devices()) == 8 and int(os.environ["NPROC"]) >= 32
