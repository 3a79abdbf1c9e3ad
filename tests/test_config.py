import pytest

from sage_jax import config as config_lib

ALL_CONFIGS = ["cpu_demo", "tiny_test", "qwen7b_branch", "qwen7b_grpo", "qwen7b_nokl", "qwen7b_fkl", "qwen7b_random",
               "qwen7b_token", "qwen7b_dapo", "qwen7b_dapo_branch", "qwen7b_bnpo", "qwen7b_bnpo_branch",
               "r1distill7b_branch", "qwen1p5b_branch", "qwen3b_branch"]


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_every_config_loads_and_builds_a_loss_config(name):
    from sage_jax import objectives
    c = config_lib.load(f"configs/{name}.py")
    assert c.is_locked
    config_lib.validate(c)  # every shipped config passes the up-front checks
    objectives.LossConfig.from_config(c.loss, total_steps=c.train.steps)


def test_overrides_are_typed():
    c = config_lib.load("configs/tiny_test.py", ["--config.loss.beta=0.1", "--config.train.steps=7",
                                                 "--config.loss.guide=token", "--config.train.export_hf=true",
                                                 "--config.eval.ks=1,2"])
    assert c.loss.beta == 0.1 and c.train.steps == 7 and c.loss.guide == "token" and c.train.export_hf is True
    assert c.eval.ks == (1, 2)


def test_unknown_key_names_the_key():
    with pytest.raises(config_lib.ConfigError, match="unknown config key 'loss.betta'.*no field 'betta'"):
        config_lib.load("configs/tiny_test.py", ["--config.loss.betta=0.1"])
    with pytest.raises(config_lib.ConfigError, match="expected an integer"):
        config_lib.load("configs/tiny_test.py", ["--config.train.steps=many"])
    with pytest.raises(config_lib.ConfigError, match="not found"):
        config_lib.load("configs/nope.py")


def test_paper_main_setting():
    c = config_lib.load("configs/qwen7b_branch.py")
    assert (c.loss.guide, c.loss.gamma, c.loss.tau, c.loss.q_min, c.loss.q_max) == ("branch", 0.3, 1.2, 0.6, 1.4)
    assert c.rollout.group_size == 8 and c.rollout.temperature == 1.0 and c.loss.kl_estimator == "k3"
    assert c.data.template == "qwen_math_boxed" and c.data.train == "math_train_l3to5"
