"""sage_jax.plan: its numbers are the compiled programs' own, its verdict flips with the memory, errors are clear.

The CLI runs in subprocesses (it sets XLA_FLAGS before importing JAX); the independent check builds the trainer's
programs on real tiny arrays, the way trainer.run_rl does, and reads their memory_analysis() itself.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sage_jax import plan

ROOT = Path(__file__).resolve().parents[1]
TINY = "configs/tiny_test.py"
FIELDS = ("argument", "output", "alias", "temp", "code")


def _start(args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)  # conftest's flags are for this process; each child sets its own
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout=300) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _plan_cli(*args) -> subprocess.Popen:
    return _start(["-m", "sage_jax.plan", "--config", TINY, "--devices", "8", *args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The slow compiles, started together so they share the cores: the plan, its --layers twin, the check."""
    tmp = tmp_path_factory.mktemp("plan")
    procs = {"plan": _plan_cli("--chip", "v4", "--json", str(tmp / "plan.json")),
             "layers": _plan_cli("--layers", "1", "--memory-gb", "0.000001", "--json", str(tmp / "layers.json")),
             "independent": _start(["-c", INDEPENDENT])}
    done = {name: _finish(p) for name, p in procs.items()}
    return done, tmp


@pytest.fixture(scope="module")
def report(runs):
    done, tmp = runs
    proc = done["plan"]
    assert proc.returncode == 0, proc.stderr
    assert "fits" in proc.stdout and "train_step" in proc.stdout and "Traceback" not in proc.stderr
    return json.loads((tmp / "plan.json").read_text())


# Independent of plan.py: real params and state made as trainer.run_rl makes them, real batch arrays.
INDEPENDENT = r"""
import json, os, sys, types
from sage_jax.plan import FAST_COMPILE_FLAGS
os.environ["XLA_FLAGS"] = " ".join(["--xla_force_host_platform_device_count=8", *FAST_COMPILE_FLAGS])
os.environ["JAX_PLATFORMS"] = "cpu"
import dataclasses, jax, jax.numpy as jnp, numpy as np
from sage_jax import config as config_lib, objectives, sharding, train_state, trainer
from sage_jax.rewards.countdown import CountdownTokenizer

config = config_lib.load("configs/tiny_test.py")
mesh, rules = sharding.make_mesh(tuple(config.mesh.shape)), dict(config.mesh.rules)
tok = CountdownTokenizer()
tokenizer = types.SimpleNamespace(vocab_size=tok.vocab_size, eos_ids=(tok.eos_id,), pad_id=tok.pad_id)
N, P, C = 16, 32, 16  # 4 prompts x 4 samples; prompt bucket of max_prompt_len 32; max_new_tokens 16
on_device0 = lambda tree: sum(next(s.data.nbytes for s in x.addressable_shards if s.device == jax.devices()[0])
                              for x in jax.tree.leaves(tree))
stats = lambda c: {k: getattr(c.memory_analysis(), f"{k}_size_in_bytes") for k in
                   ("argument", "output", "alias", "temp")} | {"code": c.memory_analysis().generated_code_size_in_bytes}
with jax.set_mesh(mesh), sharding.use_rules(rules):
    cfg, params = train_state.load_or_init_params(config, mesh, rules, tokenizer)
    shard_sum = sum(int(np.prod(sh.shard_shape(x.shape))) * x.dtype.itemsize for x, sh in zip(
        jax.tree.leaves(params), jax.tree.leaves(sharding.param_shardings(cfg, mesh, rules))))
    tx, schedule = train_state.make_optimizer(config.optim, config.train.steps)
    state, shardings = train_state.create_state(jax.tree.map(jnp.copy, params), tx, cfg, mesh, rules)
    loss_cfg = dataclasses.replace(objectives.LossConfig.from_config(config.loss, config.train.steps), temperature=1.0)
    step = train_state.make_train_step(cfg, loss_cfg, tx, schedule, config.seed, config.optim.grad_accum, shardings)
    put = lambda a: jax.device_put(a, sharding.data_sharding(mesh, a.ndim))
    batch = {"tokens": put(np.zeros((N, P + C), np.int32)), "mask": put(np.ones((N, P + C), np.int32)),
             "completion_mask": put(np.ones((N, C), np.float32)), "advantages": put(np.zeros(N, np.float32)),
             "sampler_logp": put(np.zeros((N, C), np.float32)), "truncated": put(np.zeros(N, bool)),
             "ref_logp": put(np.zeros((N, C), np.float32)),
             "rl_step": jax.device_put(np.int32(0), sharding.replicated(mesh))}
    train = stats(step.lower(state, batch).compile())
    ref_cfg = cfg.replace(compute_dtype=config.model.ref_dtype)
    ref_params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(config.model.ref_dtype), p))(params)
    ref = stats(train_state.sequence_logprobs_pass.lower(ref_cfg, ref_params, batch["tokens"], batch["mask"], prompt_len=P,
                                                temperature=1.0).compile())
print(json.dumps({"params_device0": on_device0(params), "params_shard_sum": shard_sum,
                  "opt_device0": on_device0(state["opt_state"]) + on_device0(state["step"]),
                  "ref_device0": on_device0(ref_params), "train_step": train, "ref_logprobs": ref}))
"""


def test_report_matches_independently_compiled_programs(report, runs):
    proc = runs[0]["independent"]
    assert proc.returncode == 0, proc.stderr
    truth = json.loads(proc.stdout.strip().splitlines()[-1])
    a = report["analytic"]
    assert a["params"] == truth["params_device0"] == truth["params_shard_sum"]
    assert a["opt_state"] == truth["opt_device0"]
    assert a["ref_params"] == truth["ref_device0"]
    for name in ("train_step", "ref_logprobs"):
        got = report["programs"][name]
        assert {k: got[k] for k in FIELDS} == truth[name], name
    # the train step's inputs are the state plus the batch (jit drops the batch fields the loss does not read)
    state = a["params"] + a["opt_state"]
    assert state < report["programs"]["train_step"]["argument"] <= state + a["step_batch"]


def test_report_arithmetic_and_shapes(report):
    s = report["shapes"]
    assert (s["step_rows"], s["update_rows"], s["seq_len"], s["cache_len"], s["dp"]) == (16, 16, 48, 64, 8)
    for name, p in report["programs"].items():
        assert p["peak"] == p["argument"] + p["output"] - p["alias"] + p["temp"] + p["code"]
        assert report["phases"][name] == p["peak"] + report["resident"][name]
    assert report["peak_bytes"] == max(report["phases"].values())
    assert report["memory_bytes"] == 32e9 and report["fits"]
    assert report["headroom_bytes"] == report["memory_bytes"] - report["peak_bytes"]
    # the sampler's inputs: params, prompts + mask, output buffers, scalars, eos ids, key
    assert report["programs"]["sampler"]["argument"] >= report["analytic"]["params"]
    assert report["programs"]["sampler"]["temp"] >= report["analytic"]["kv_cache"]


def test_layers_extrapolation_and_verdict_flip(report, runs):
    done, tmp = runs
    proc = done["layers"]
    assert proc.returncode == 1, proc.stderr
    assert "DOES NOT FIT" in proc.stdout
    small = json.loads((tmp / "layers.json").read_text())
    assert not small["fits"] and small["headroom_bytes"] < 0
    assert small["model"]["compiled_layers"] == [1, 2]
    assert small["programs"] == report["programs"]  # 1 and 2 layers extrapolated to the full 2 are exact


def test_mesh_that_does_not_fit_the_devices_is_a_clear_error():
    proc = _finish(_plan_cli("--no-compile", "--config.mesh.shape=3,1,1"))
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "mesh" in proc.stderr and "8" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_compile_mode_in_process():
    from sage_jax import config as config_lib
    r = plan.run(config_lib.load(TINY), devices=8, memory_gb=16, do_compile=False, config_name=TINY)
    a = r["analytic"]
    assert r["programs"] == {} and r["lower_bound"] and r["fits"]
    assert r["phases"]["sampler"] == a["params"] + a["opt_state"] + a["ref_params"] + a["kv_cache"]
    assert "at least" in plan.format_report(r)


def test_simulate_devices_refuses_more_devices_than_the_process_has():
    with pytest.raises(ValueError, match="fresh process"):
        plan.simulate_devices(4096)


def test_model_from_a_known_checkpoint_name_or_a_local_config_json(tmp_path):
    from sage_jax import config as config_lib, hf_io, model
    cfg, source = plan.resolve_model(config_lib.load("configs/qwen7b_branch.py"))
    assert "qwen2.5-math-7b" in source
    assert (cfg.vocab_size, cfg.num_layers, cfg.tie_embeddings, cfg.remat) == (152064, 28, False, True)
    cfg, _ = plan.resolve_model(config_lib.load("configs/r1distill7b_branch.py"))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.tie_embeddings) == (152064, 3584, False)
    (tmp_path / "config.json").write_text(json.dumps(hf_io.config_to_hf(model.preset("small"))))
    cfg, source = plan.resolve_model(config_lib.load(TINY, [f"--config.model.path={tmp_path}"]))
    assert source.endswith("config.json") and cfg.hidden_size == model.PRESETS["small"].hidden_size
    with pytest.raises(FileNotFoundError, match="not a known checkpoint name"):
        plan.resolve_model(config_lib.load(TINY, ["--config.model.path=/nowhere/MyModel-9B"]))


def test_extrapolate_is_linear_in_layers():
    a, b = {"temp": 10, "argument": 3}, {"temp": 14, "argument": 5}
    assert plan.extrapolate(a, b, 2, 28) == {"temp": 10 + 4 * 26, "argument": 3 + 2 * 26}
