"""bench/compiles.py: compilations counted per step, and the steps that count as timings."""

import jax
import jax.numpy as jnp
import pytest

from sage_jax.bench import common, compiles


def test_counter_sees_each_new_program_once_and_names_it():
    @jax.jit
    def train_step(x):
        return x * 2 + 1

    three, five = jnp.ones(3), jnp.ones(5)  # made outside: making them compiles too
    with compiles.CompileCounter() as first:
        train_step(three).block_until_ready()
    with compiles.CompileCounter() as again:
        train_step(three).block_until_ready()  # cached: no compilation
    with compiles.CompileCounter() as new_shape:
        train_step(five).block_until_ready()
    assert first.count == 1 and "train_step" in first.names[0] and first.seconds > 0
    assert again.count == 0 and new_shape.count == 1
    assert first.split() == dict(compiles=1.0, sampler_compiles=0.0, train_compiles=1.0, compile_s=first.seconds)


def test_counter_stops_listening_when_closed():
    with compiles.CompileCounter() as closed:
        pass
    jax.jit(lambda x: x - 7)(jnp.ones(2)).block_until_ready()
    assert closed.count == 0


def test_split_sorts_sampler_and_train_programs():
    c = compiles.CompileCounter()
    c.names = ["jit(generate_program)", "jit(_decode_fn)", "jit(_prefill_fn)", "jit(_train_step)", "jit(equal)"]
    assert c.split() == dict(compiles=5.0, sampler_compiles=3.0, train_compiles=1.0, compile_s=0.0)


def test_timed_steps_leave_out_the_warmup_and_any_step_that_compiled():
    steps = [dict(seconds=30.0, compiles=9), dict(seconds=1.5, compiles=1), dict(seconds=1.0, compiles=0),
             dict(seconds=1.2, compiles=0)]
    kept, counts = compiles.timed_steps(steps)
    assert [s["seconds"] for s in kept] == [1.0, 1.2] and counts == dict(timed_steps=2, compiled_steps=1)
    # every measured step compiled: they are all that is left, and the counts say so
    kept, counts = compiles.timed_steps([dict(seconds=9.0, compiles=3), dict(seconds=2.0, compiles=1)])
    assert [s["seconds"] for s in kept] == [2.0] and counts == dict(timed_steps=0, compiled_steps=1)
    assert compiles.median_row(kept[:1] + [dict(seconds=4.0, compiles=0)]) == dict(seconds=3.0, compiles=0.5)


def test_interleaved_seconds_reports_the_calls_that_compiled():
    inputs = iter([jnp.ones(3), jnp.ones(3), jnp.ones(4), jnp.ones(3)])  # warm-up, rounds 1-3 (2: a new shape)
    fn = jax.jit(lambda x: x * 3)
    per_call: dict = {}
    times = common.interleaved_seconds({"f": lambda: fn(next(inputs))}, 3, per_call)
    assert per_call == {"f": [0, 1, 0]} and len(times["f"]) == 3
    assert common.uncompiled_median([1.0, 50.0, 3.0], per_call["f"]) == 2.0
    assert common.uncompiled_median([5.0, 7.0], [1, 1]) == 6.0


@pytest.mark.parametrize("text, minimum, error", [("0", 1, "0 is below 1"), ("-3", 1, "-3 is below 1"),
                                                  ("x", 0, "'x' is not an integer")])
def test_count_type_rejects_what_a_count_cannot_be(text, minimum, error):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match=error):
        common.count(minimum)(text)
    assert common.count(0)("0") == 0 and common.count(1)("12") == 12
