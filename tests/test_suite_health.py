"""The test process itself: conftest drops compiled programs before XLA:CPU's memory maps reach vm.max_map_count."""

import pytest

import conftest
from sage_jax.sampling import sampler
from tests.sampling.test_sampler import CFG, PROMPTS, _random_params


def test_dropping_compiled_programs_returns_their_memory_maps():
    if not conftest._memory_maps():
        pytest.skip("no /proc/self/maps on this platform")
    params = _random_params(CFG)
    conftest.release_compiled_programs()
    before = conftest._memory_maps()
    for slots in (1, 2, 5):  # the slot-pool programs whose maps ran the suite into the limit
        sampler.generate(CFG, params, PROMPTS[:3], max_new_tokens=12, num_samples=3, seed=5, slots=slots)
    grown = conftest._memory_maps()
    conftest.release_compiled_programs()
    after = conftest._memory_maps()
    assert grown > before + 300, (before, grown)  # the programs did map pages
    assert after - before < 0.25 * (grown - before), (before, grown, after)
