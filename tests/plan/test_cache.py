"""sage_jax.plan.cache: a hit only for the same program text, compiler and devices; a bad entry is a miss."""

import json
import os

import jax
import jax.numpy as jnp

from sage_jax.plan import cache as plan_cache, programs as plan_programs


def _lowered(n: int, fn=jnp.sin):
    return jax.jit(fn).lower(jax.ShapeDtypeStruct((n,), jnp.float32))


def _counting(calls):
    def measure(lowered):
        calls.append(lowered)
        return plan_programs.memory_stats(lowered)
    return measure


def test_only_the_misses_are_compiled_and_a_hit_returns_the_stored_figures(tmp_path):
    cache = plan_cache.Cache(str(tmp_path), plan_cache.compiler_tag(jax.devices()[:1]))
    programs = {"a": _lowered(8), "b": _lowered(16)}
    calls = []
    first, hits = plan_cache.measure_all(cache, "memory", programs, _counting(calls),
                                         plan_programs.compile_in_parallel)
    assert hits == [] and len(calls) == 2 and len(os.listdir(tmp_path)) == 2
    programs["c"] = _lowered(16, jnp.cos)  # another computation at the same shape
    again, hits = plan_cache.measure_all(cache, "memory", programs, _counting(calls),
                                         plan_programs.compile_in_parallel)
    assert hits == ["a", "b"] and len(calls) == 3 and {k: again[k] for k in first} == first
    assert again["c"]["peak"] > 0


def test_another_compiler_kind_or_measure_misses_and_off_stores_nothing(tmp_path):
    lowered = _lowered(8)
    cache = plan_cache.Cache(str(tmp_path), "jax A")
    cache.put("memory", lowered, {"peak": 1})
    assert cache.get("memory", lowered) == {"peak": 1}
    assert cache.get("cost", lowered) is None
    assert plan_cache.Cache(str(tmp_path), "jax B").get("memory", lowered) is None
    off = plan_cache.Cache("off", "jax A")
    off.put("memory", lowered, {"peak": 2})
    assert off.get("memory", lowered) is None and len(os.listdir(tmp_path)) == 1


def test_a_corrupt_entry_is_a_miss_and_is_rewritten(tmp_path):
    lowered = _lowered(8)
    cache = plan_cache.Cache(str(tmp_path), "tag")
    path = tmp_path / (cache.key("memory", lowered) + ".json")
    path.write_text('{"kind": "memory", "figu')  # a plan killed mid-write by an older version
    calls = []
    out, hits = plan_cache.measure_all(cache, "memory", {"p": lowered}, _counting(calls),
                                       plan_programs.compile_in_parallel)
    assert hits == [] and len(calls) == 1
    assert json.loads(path.read_text())["figures"] == out["p"]


def test_the_compiler_tag_names_versions_flags_and_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_flag_a=1")
    devices = jax.devices()[:2]
    tag = plan_cache.compiler_tag(devices)
    assert f"jax {jax.__version__}" in tag and "--xla_flag_a=1" in tag and "ids 0,1" in tag
    assert plan_cache.compiler_tag(devices[::-1]) != tag


def test_the_default_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(plan_cache.ENV, str(tmp_path / "c"))
    assert plan_cache.default_dir() == str(tmp_path / "c")
    monkeypatch.delenv(plan_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert plan_cache.default_dir() == os.path.join(str(tmp_path), "sage_jax", "plan")
