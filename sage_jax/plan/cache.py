"""The plan's compile cache: a program compiled by the same compiler for the same devices has the same figures.

A 7B program takes XLA:TPU 5-20 minutes on a small machine, and configs share programs: the qwen7b_* arms differ
only in the loss, so their sampler and reference pass lower to the same text as qwen7b_branch's. The cache keeps
each measured program's figures (memory_analysis, or the cost variants' FLOPs and bytes) in one JSON file named by
a hash of

    what was measured, the lowered program's StableHLO text (shapes, shardings, the whole computation),
    the compiler (jax, jaxlib and libtpu versions, XLA_FLAGS, LIBTPU_INIT_ARGS) and the devices (platform, kind,
    the mesh's device ids in order),

so a hit is the same compile by construction, and anything that could change the figures misses. The report lists
the programs that came from the cache. Where: --cache DIR, else $SAGE_JAX_PLAN_CACHE, else
$XDG_CACHE_HOME/sage_jax/plan (~/.cache/sage_jax/plan); "off" turns it off. An unreadable entry is a miss.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from typing import Any, Callable

ENV = "SAGE_JAX_PLAN_CACHE"
OFF = ("", "off", "none", "0")


def default_dir() -> str:
    if ENV in os.environ:
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sage_jax", "plan")


def compiler_tag(devices) -> str:
    """What besides the program text decides its compile: versions, flags, and the devices in mesh order."""
    import jax
    import jaxlib
    flat = list(getattr(devices, "flat", devices))
    parts = [f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}", flat[0].platform, flat[0].device_kind,
             "ids " + ",".join(str(d.id) for d in flat), "XLA_FLAGS " + os.environ.get("XLA_FLAGS", ""),
             "LIBTPU_INIT_ARGS " + os.environ.get("LIBTPU_INIT_ARGS", "")]
    if flat[0].platform == "tpu":
        try:
            parts.append(f"libtpu {importlib.metadata.version('libtpu')}")
        except importlib.metadata.PackageNotFoundError:
            parts.append("libtpu not installed")
    return "\n".join(parts)


class Cache:
    """get/put measured figures by (kind, lowered program); directory None or "off": never hits, stores nothing."""

    def __init__(self, directory: str | None, tag: str):
        self.directory = None if directory is None or directory.lower() in OFF else directory
        self.tag = tag
        self.hits: list[str] = []  # what the callers took from the cache, for the report

    def key(self, kind: str, lowered) -> str:
        text = lowered.as_text()
        return hashlib.sha256("\n".join([kind, self.tag, text]).encode()).hexdigest()[:40]

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + ".json")

    def get(self, kind: str, lowered) -> dict[str, Any] | None:
        if self.directory is None:
            return None
        try:
            with open(self._path(self.key(kind, lowered))) as f:
                entry = json.load(f)
            return entry["figures"] if entry.get("kind") == kind else None
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent, truncated or not ours: compile again

    def put(self, kind: str, lowered, figures: dict[str, Any]) -> None:
        if self.directory is None:
            return
        os.makedirs(self.directory, exist_ok=True)
        path = self._path(self.key(kind, lowered))
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"kind": kind, "compiler": self.tag, "figures": figures}, f)
        os.replace(tmp, path)  # a reader never sees half an entry


def measure_all(cache: Cache, kind: str, lowered: dict[Any, Any], measure: Callable,
                compile_in_parallel: Callable) -> tuple[dict[Any, Any], list[Any]]:
    """(figures of each lowered program, the names that came from the cache): the misses are measured
    (compile_in_parallel(misses, measure)) and stored."""
    found = {k: cache.get(kind, v) for k, v in lowered.items()}
    misses = {k: v for k, v in lowered.items() if found[k] is None}
    measured = compile_in_parallel(misses, measure) if misses else {}
    for k, figures in measured.items():
        cache.put(kind, lowered[k], figures)
    hits = [k for k in lowered if k not in misses]
    return {k: found[k] if k in hits else measured[k] for k in lowered}, hits
