import numpy as np
import pytest

from sage_jax.rl import packing
from sage_jax.training import rollouts


def _ro(lengths, P=3, C=40, pad=0, finished=None, start=10):
    N = len(lengths)
    lengths = np.asarray(lengths, np.int32)
    tokens = (start + np.arange(N * C).reshape(N, C)).astype(np.int32)
    return {"prompt_tokens": np.full((N, P), 7, np.int32), "prompt_mask": np.ones((N, P), bool),
            "tokens": tokens, "lengths": lengths,
            "finished": np.ones(N, bool) if finished is None else np.asarray(finished),
            "sampler_logp": -np.ones((N, C), np.float32), "texts": [f"t{i}" for i in range(N)],
            "golds": [i for i in range(N)]}


def test_build_batch_trims_to_a_bucket_and_masks_past_each_length():
    ro = _ro([3, 33, 1, 5], C=100, finished=[True, False, True, True])
    batch = rollouts.build_batch(ro, np.arange(4, dtype=np.float32), pad_id=0, max_new_tokens=100)
    assert batch["tokens"].shape == (4, 3 + 64)  # longest row 33 -> the 64 bucket
    np.testing.assert_array_equal(batch["completion_mask"].sum(1), [3, 33, 1, 5])
    comp = batch["tokens"][:, 3:]
    assert (comp[batch["completion_mask"] == 0] == 0).all()  # pad past the length
    np.testing.assert_array_equal(comp[1, :33], ro["tokens"][1, :33])
    np.testing.assert_array_equal(batch["mask"][:, :3], 1)
    assert (batch["sampler_logp"][batch["completion_mask"] == 0] == 0).all()
    np.testing.assert_array_equal(batch["truncated"], [False, True, False, False])
    assert batch["tokens"].dtype == np.int32 and batch["advantages"].dtype == np.float32


def test_build_batch_multi_turn_rows_attend_to_observed_tokens_and_train_on_sampled_ones():
    ro = _ro([6, 4], C=8)
    ro["sampled_mask"] = np.array([[1, 1, 0, 0, 1, 1, 0, 0], [1, 0, 0, 1, 0, 0, 0, 0]], np.int32)
    ro["sampler_logp"][ro["sampled_mask"] == 0] = np.nan  # observed tokens carry NaN behaviour log-probs
    batch = rollouts.build_batch(ro, np.zeros(2, np.float32), pad_id=0, max_new_tokens=8)
    np.testing.assert_array_equal(batch["completion_mask"].sum(1), [6, 4])  # real tokens, attention and packing
    np.testing.assert_array_equal(batch["sampled_mask"], ro["sampled_mask"][:, :8] * batch["completion_mask"])
    ro["sampled_mask"][0, 2] = 1
    with pytest.raises(ValueError, match="row 0, completion token 2: a sampled token has a NaN"):
        rollouts.build_batch(ro, np.zeros(2, np.float32), pad_id=0, max_new_tokens=8)


def test_build_batch_never_exceeds_max_new_tokens():
    batch = rollouts.build_batch(_ro([40, 2], C=40), np.zeros(2, np.float32), pad_id=0, max_new_tokens=40)
    assert batch["tokens"].shape[1] == 3 + 40


def test_concat_rollouts_left_pads_prompts_to_the_widest():
    a, b = _ro([1, 2], P=2), _ro([3], P=4, start=500)
    joined = rollouts.concat_rollouts([a, b], pad_id=0)
    assert joined["prompt_tokens"].shape == (3, 4)
    np.testing.assert_array_equal(joined["prompt_tokens"][0], [0, 0, 7, 7])
    np.testing.assert_array_equal(joined["prompt_mask"][0], [False, False, True, True])
    np.testing.assert_array_equal(joined["lengths"], [1, 2, 3])
    assert joined["texts"] == ["t0", "t1", "t0"]
    assert rollouts.concat_rollouts([a], pad_id=0) is a


def test_take_rows_keeps_arrays_and_lists_aligned():
    ro = rollouts.take_rows(_ro([1, 2, 3]), np.array([2, 0]))
    np.testing.assert_array_equal(ro["lengths"], [3, 1])
    assert ro["texts"] == ["t2", "t0"] and ro["golds"] == [2, 0]


def test_overlong_penalty_is_linear_over_the_buffer():
    lengths = np.array([10, 80, 90, 100])
    np.testing.assert_allclose(rollouts.overlong_penalty(lengths, max_len=100, buffer=20, penalty=1.0),
                               [0.0, 0.0, -0.5, -1.0])
    np.testing.assert_array_equal(rollouts.overlong_penalty(lengths, 100, 0, 1.0), 0.0)


def test_a_long_prompt_is_cut_to_its_last_tokens_keeping_its_bos():
    from types import SimpleNamespace
    from sage_jax.training.rollouts import cut_prompt
    tok = SimpleNamespace(added_bos_id=1)
    assert cut_prompt([1, 5, 6, 7, 8], 3, tok) == [1, 7, 8]
    assert cut_prompt([5, 6, 7, 8], 3, tok) == [6, 7, 8]  # no BOS to keep
    assert cut_prompt([1, 5, 6], 3, tok) == [1, 5, 6] and cut_prompt([9, 5, 6, 7], 2, None) == [6, 7]


def test_cut_prompts_are_counted_and_warned_about_once(caplog, monkeypatch):
    import logging
    import numpy as np
    from types import SimpleNamespace
    from sage_jax.training import rollouts
    monkeypatch.setattr(rollouts, "_WARNED_CUT", [])
    seen = {}

    def generate(cfg, params, prompts, **kw):
        seen["prompts"] = prompts
        n = len(prompts) * kw["num_samples"]
        return rollouts.sampler.SampleOutput(
            tokens=np.zeros((n, 2), np.int32), lengths=np.ones(n, np.int32), finished=np.ones(n, bool),
            logprobs=np.zeros((n, 2), np.float32), prompt_tokens=np.zeros((n, 4), np.int32),
            prompt_mask=np.ones((n, 4), bool), steps=np.int32(1))
    monkeypatch.setattr(rollouts.sampler, "generate", generate)
    task = SimpleNamespace(encode_prompt=lambda ex: [1] + list(range(10, 10 + ex)), prompt_text=str,
                           gold=lambda ex: ex, tokenizer=SimpleNamespace(added_bos_id=1, decode=lambda ids: "x"))
    cfg = SimpleNamespace(eos_token_ids=(2,), pad_token_id=0)
    ro_cfg = SimpleNamespace(max_new_tokens=2, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, group_size=1)
    with caplog.at_level(logging.WARNING, logger="sage_jax"):
        for _ in range(2):
            ro = rollouts.rollout(task, cfg, None, [2, 6, 9], ro_cfg, None, max_prompt_len=5)
    assert ro["prompts_cut"] == 2 and seen["prompts"][0] == [1, 10, 11]
    assert all(len(p) <= 5 and p[0] == 1 for p in seen["prompts"])
    assert sum("longer than data.max_prompt_len=5" in r.message for r in caplog.records) == 1


def test_a_packed_batch_is_the_budget_wide_and_remembers_its_shape():
    """Packed, the per-row arrays are max_new_tokens wide whatever the longest row (no model compute), so steps
    whose longest rows differ share one compiled shape; the padded fallback (equal lengths) keeps the bucket."""
    shapes: set = set()
    adv = np.zeros(8, np.float32)
    # longest rows 90 and 60: completion buckets 128 and 64, both packed 256 wide, into the same rows
    a = rollouts.build_batch(_ro([90, 40, 30, 5, 6, 7, 8, 9], C=256), adv, 0, 256, packed=True, shapes=shapes)
    b = rollouts.build_batch(_ro([60, 40, 30, 5, 6, 7, 8, 9], C=256), adv, 0, 256, packed=True, shapes=shapes)
    assert a["gather"].shape[2] == b["gather"].shape[2] == 256 and a["tokens"].shape == b["tokens"].shape
    assert shapes == {packing.shape_key(a)}
    equal = rollouts.build_batch(_ro([20] * 8, C=256), adv, 0, 256, packed=True, shapes=shapes)
    assert not packing.is_packed(equal) and equal["tokens"].shape == (8, 3 + 32) and len(shapes) == 1
