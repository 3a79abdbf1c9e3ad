import gc
import os
import sys
import tempfile

# 8 simulated CPU devices for sharding tests; must be set before JAX is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A persistent compilation cache shared by this process and the training subprocesses the tests start: the same
# tiny programs are compiled once per machine instead of once per process (a 77 s -> 22 s training run here).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "sage_jax_test_jit_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sage_jax  # noqa: E402,F401  sizes XLA:CPU's thread pool for the 8 simulated devices (sage_jax/__init__.py)


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


# XLA:CPU maps each compiled program's code and data into the process (one slot-pool equality test in
# tests/sampling/test_sampler.py: ~5,000 maps), and JAX's caches keep every program alive. The whole suite in one process
# reached Linux's default vm.max_map_count (65,530) in tests/sampling/test_sampler.py, where mmap fails inside XLA and jaxlib
# aborts or segfaults (CI exit 134 in an executable's serialize, 139 in compile or cache load; measured here: 63,804
# maps, then exit 139). Past this many maps every compiled program is dropped after the test: the freed pages go
# back, and the next programs compile again (or load from the persistent cache). Clearing after every test instead
# held the peak at ~7,000 but made tests/sampling/test_sampler.py 1.3x slower.
_CLEAR_ABOVE_MAPS = 16384
_PEAK_MAPS = [0]


def release_compiled_programs():
    for name, attr in (("sage_jax.bench.train_step", "compiled_train_step"), ("sage_jax.models.sharding", "_replicator")):
        module = sys.modules.get(name)  # lru_caches of compiled programs, where the module was imported
        if module is not None:
            getattr(module, attr).cache_clear()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


def pytest_runtest_teardown(item):
    maps = _memory_maps()
    _PEAK_MAPS[0] = max(_PEAK_MAPS[0], maps)
    if maps > _CLEAR_ABOVE_MAPS:
        release_compiled_programs()


def pytest_terminal_summary(terminalreporter):
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = f.read().strip()
    except OSError:
        return
    terminalreporter.write_line(f"memory maps of this process: peak {_PEAK_MAPS[0]} after a test (vm.max_map_count "
                                f"{limit}; compiled programs dropped above {_CLEAR_ABOVE_MAPS})")
