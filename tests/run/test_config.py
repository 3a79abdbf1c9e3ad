import re
from pathlib import Path

import pytest

from sage_jax.run import config as config_lib

ALL_CONFIGS = ["cpu_demo", "tiny_test", "qwen7b_branch", "qwen7b_grpo", "qwen7b_nokl", "qwen7b_fkl", "qwen7b_random",
               "qwen7b_token", "qwen7b_dapo", "qwen7b_dapo_branch", "qwen7b_bnpo", "qwen7b_bnpo_branch",
               "r1distill7b_branch", "qwen1p5b_branch", "qwen3b_branch", "qwen7b_grpo_rkl"]


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_every_config_loads_and_builds_a_loss_config(name):
    from sage_jax.rl import objectives
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


POD_CONFIGS = [n for n in ALL_CONFIGS if n not in ("cpu_demo", "tiny_test")] + ["paper"]


def _literal_settings(path):
    """(parent config module, [(section, key, value)]) for every literal a config file sets on its parent's config."""
    import ast
    tree = ast.parse(open(path).read())
    parent, settings = None, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get_config" \
                and isinstance(node.func.value, ast.Name):
            parent = node.func.value.id
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
            section = node.func.value
            if isinstance(section, ast.Attribute):
                settings += [(section.attr, kw.arg, ast.literal_eval(kw.value)) for kw in node.keywords]
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            target = node.targets[0]
            if isinstance(target.value, ast.Attribute):
                try:
                    settings.append((target.value.attr, target.attr, ast.literal_eval(node.value)))
                except ValueError:
                    pass
    return parent, settings


@pytest.mark.parametrize("name", POD_CONFIGS)
def test_paper_configs_state_only_their_differences(name):
    """paper.py and every arm set only values their parent config does not already have."""
    import importlib
    parent, settings = _literal_settings(f"configs/{name}.py")
    base = importlib.import_module(f"configs.{parent}").get_config()
    restated = [f"{s}.{k}={v!r}" for s, k, v in settings
                if k in base[s] and (tuple(base[s][k]) if isinstance(v, tuple) else base[s][k]) == v]
    assert not restated, f"configs/{name}.py restates its parent's ({parent}) values: {restated}"


def test_branch_arm_differs_from_grpo_only_in_the_guide():
    grpo, branch = (config_lib.load(f"configs/{n}.py").to_dict() for n in ("qwen7b_grpo", "qwen7b_branch"))
    diff = {(s, k) for s in grpo for k in (grpo[s] if isinstance(grpo[s], dict) else [None])
            if (grpo[s][k] if k else grpo[s]) != (branch[s][k] if k else branch[s])}
    assert diff == {("loss", "guide")}


def test_loss_defaults_have_one_source():
    """config.loss is built from the dataclasses, so a field's default is written once."""
    import dataclasses
    from sage_jax.rl import guides, objectives
    c = config_lib.load("configs/base.py")
    loss = objectives.LossConfig.from_config(c.loss)
    assert dataclasses.replace(loss, guide=dataclasses.replace(loss.guide, schedule_steps=1000)) == \
        objectives.LossConfig(guide=guides.GuideConfig(schedule_steps=1000))
    assert set(c.loss) == set(objectives.loss_defaults())


def _parse_cli(tmp_path, *overrides):
    from sage_jax.run import cli
    return cli.parse(["--config", "configs/tiny_test.py", "--workdir", str(tmp_path / "w"), *overrides], "test")[0]


def test_tuple_overrides_parse_unquoted_through_the_cli(tmp_path):
    c = _parse_cli(tmp_path, "--config.model.lora.targets=q_proj,v_proj", "--config.eval.ks=1,2",
                   "--config.mesh.shape=(1, -1, 1)")
    assert c.model.lora.targets == ("q_proj", "v_proj")
    assert c.eval.ks == (1, 2) and c.mesh.shape == (1, -1, 1)
    assert _parse_cli(tmp_path, "--config.model.lora.targets=o_proj").model.lora.targets == ("o_proj",)


@pytest.mark.parametrize("override, message", [
    ("--config.model.lora.targets=q_proj,vproj", r"model\.lora\.targets=\('q_proj', 'vproj'\): must be HF module"),
    ("--config.eval.ks=1,two", r"eval\.ks=1,two: expected int items such as 1,4 \(bad: 'two'\)"),
    ("--config.eval.ks=(1,", r"eval\.ks=\(1,: not a valid tuple"),
])
def test_a_bad_tuple_override_is_one_clear_error(tmp_path, capsys, override, message):
    from sage_jax.run import cli
    with pytest.raises(SystemExit) as exit_info:
        cli.main_guard(lambda: _parse_cli(tmp_path, override) and 0)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS.glob("*.py") if p.stem != "__init__"))
def test_every_config_rejects_an_unknown_argument(name):
    """configs/NAME.py:quik (a typo) must be an error, never the full config run silently."""
    with pytest.raises(config_lib.ConfigError, match="quik"):
        config_lib.load(f"configs/{name}.py:quik")
