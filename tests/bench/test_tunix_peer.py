"""bench/tunix_peer.py and `--peer`: the harness without tunix (what CI runs), and tunix's side where installed."""

import importlib.util

import numpy as np
import pytest

from sage_jax.bench import cli, tunix_peer

HAS_TUNIX = importlib.util.find_spec("tunix") is not None
needs_tunix = pytest.mark.skipif(not HAS_TUNIX, reason="tunix not installed (pip install -r requirements-bench.txt)")


@pytest.fixture
def no_tunix(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tunix" else real(name, *a))


@pytest.mark.parametrize("argv", [["rl_step", "--peer", "tunix"], ["sampler", "--peer", "tunix", "--preset", "tiny"]])
def test_missing_tunix_is_one_line_with_the_install_command(no_tunix, argv):
    """Before any model is built: a ValueError, which the bench's guard prints as one line and exits 2."""
    with pytest.raises(ValueError, match=r"--peer tunix needs tunix.*pip install -r requirements-bench\.txt"):
        cli.main(argv)


@pytest.mark.parametrize("argv", [["rl_step", "--peer", "tunix", "--steady", "2"], ["train_step", "--peer", "tunix"],
                                  ["rl_step", "--peer", "jax"], ["sampler", "--peer", "trl"]])
def test_peer_flag_refuses_what_it_cannot_time(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2 and "--peer" in capsys.readouterr().err


@pytest.mark.parametrize("flags, peer", [([], "trl"), (["--peer", "tunix"], "tunix"), (["--peer", "none"], None),
                                         (["--no-trl"], None), (["--no-trl", "--peer", "tunix"], None)])
def test_peer_flag_reaches_the_mode(monkeypatch, flags, peer):
    seen = []
    monkeypatch.setitem(cli.TRAINING_MODES, "rl_step", lambda args: seen.append(args.peer) or [])
    cli.main(["rl_step", *flags])
    assert seen == [peer]


def test_bench_rl_step_refuses_an_unknown_peer():
    from sage_jax.bench import rl_step
    with pytest.raises(ValueError, match="unknown peer 'jax'"):
        rl_step.bench_rl_step("tiny", peer="jax")


@needs_tunix
def test_tunix_model_computes_our_logits():
    """Our weights through tunix's own safetensors loader: the same function (its random init would not be)."""
    import jax
    import jax.numpy as jnp
    from sage_jax.bench import common
    from sage_jax.models import decoder as model
    cfg = common.preset_config("tiny", "fp32")
    params = common.init_params(cfg, 0)
    ids_BxT = jnp.asarray(np.random.default_rng(0).integers(2, cfg.vocab_size, (2, 12)))
    mesh = tunix_peer.auto_mesh()
    net = tunix_peer.tunix_model(cfg, params, mesh)
    with jax.set_mesh(mesh):
        theirs, _ = net(ids_BxT, jnp.broadcast_to(jnp.arange(12), (2, 12)), None,
                        jnp.broadcast_to(jnp.tril(jnp.ones((12, 12), bool)), (2, 12, 12)))
    np.testing.assert_allclose(np.asarray(theirs), np.asarray(model.forward(cfg, params, ids_BxT)), atol=1e-4)


@needs_tunix
def test_tunix_sampler_stops_each_row_at_its_forced_length():
    from sage_jax.bench import common
    cfg = common.preset_config("tiny", "fp32")
    prompts = np.random.default_rng(1).integers(2, cfg.vocab_size, (4, 8))
    lengths = np.array([3, 24, 1, 10])  # 24: the limit, a row that never stops
    run, realised = tunix_peer.sampler_fn(cfg, common.init_params(cfg, 0), prompts, 24, lengths)
    run()
    np.testing.assert_array_equal(realised["lengths"], lengths)


@needs_tunix
@pytest.mark.slow
def test_tunix_grpo_step_phases_and_compiles():
    from sage_jax.bench import common, rl_step
    cfg = common.preset_config("tiny", "fp32")
    prompts = np.random.default_rng(0).integers(2, cfg.vocab_size, (2, 16))
    run = tunix_peer.grpo_runner(cfg, common.init_params(cfg, 0), prompts, 2, np.array([8, 3, 5, 8]), 0.05,
                                 rl_step.ids_reward, rl_step.EOS_ID, micro=1)  # 2 micro-batches, one update
    first, later = run(), [run() for _ in range(3)]
    assert first["sampler_compiles"] >= 2 and first["train_compiles"] >= 1  # its prefill, decode and train step
    assert later[-1]["compiles"] == 0  # steady state: nothing new to compile
    for r in (first, *later):
        parts = r["generate_s"] + r["ref_s"] + r["reward_s"] + r["update_s"]
        assert parts == pytest.approx(r["seconds"], rel=1e-6) and min(r["generate_s"], r["update_s"]) > 0


def test_micro_prompts_fit_the_budget_and_divide_the_prompts():
    assert tunix_peer.micro_prompts(8, 8, 160) == 8  # the fixed 128-token step: one micro-batch
    assert tunix_peer.micro_prompts(8, 8, 544) == 2  # 512 new tokens: 2 prompts x 8 rows per micro-batch
    assert tunix_peer.micro_prompts(6, 8, 544) == 2 and tunix_peer.micro_prompts(5, 8, 544) == 1
    assert tunix_peer.micro_prompts(1, 64, 10_000) == 1  # never below one prompt
