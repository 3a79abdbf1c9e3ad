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

from sage_jax.plan import cli as plan_cli, memory as plan, roofline
from sage_jax.models import build

ROOT = Path(__file__).resolve().parents[2]
TINY = "configs/tiny_test.py"
FIELDS = ("argument", "output", "alias", "temp", "code")


def _start(args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), SAGE_JAX_PLAN_CACHE="off")  # compile (cache tests: --cache)
    env.pop("XLA_FLAGS", None)  # conftest's flags are for this process; each child sets its own
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout=300) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _plan_cli(*args) -> subprocess.Popen:
    return _start(["-m", "sage_jax.plan", "--config", TINY, "--compiler", "cpu", "--devices", "8", *args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The slow compiles, started together so they share the cores: the plan, its --layers twin, the check."""
    tmp = tmp_path_factory.mktemp("plan")
    procs = {"plan": _plan_cli("--chip", "v4", "--json", str(tmp / "plan.json"), "--cache", str(tmp / "cache")),
             "layers": _plan_cli("--layers", "1", "--memory-gb", "0.000001", "--json", str(tmp / "layers.json")),
             "independent": _start(["-c", INDEPENDENT]),
             "lora": _plan_cli("--chip", "v4", "--config.model.lora.rank=1", "--config.model.lora.alpha=2",
                               "--json", str(tmp / "lora.json"))}
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
from sage_jax.plan.memory import FAST_COMPILE_FLAGS
os.environ["XLA_FLAGS"] = " ".join(["--xla_force_host_platform_device_count=8", *FAST_COMPILE_FLAGS])
os.environ["JAX_PLATFORMS"] = "cpu"
import dataclasses, jax, jax.numpy as jnp, numpy as np
from sage_jax.models import build, decoder as model_lib, sharding
from sage_jax.rewards.countdown import CountdownTokenizer
from sage_jax.rl import objectives
from sage_jax.run import config as config_lib
from sage_jax.training import state as train_state, trainer

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
    cfg, params = build.load_or_init_params(config, mesh, rules, tokenizer)
    shard_sum = sum(int(np.prod(sh.shard_shape(x.shape))) * x.dtype.itemsize for x, sh in zip(
        jax.tree.leaves(params), jax.tree.leaves(model_lib.param_shardings(cfg, mesh, rules))))
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
    assert report["memory_bytes"] == 32 * 2 ** 30 and report["fits"]  # v4: 32 GiB
    assert report["compiler"]["name"] == "XLA:CPU" and report["prediction"] is None
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


def test_lora_plan_trains_only_the_adapters_and_holds_one_copy_of_the_weights(report, runs):
    done, tmp = runs
    proc = done["lora"]
    assert proc.returncode == 0, proc.stderr
    assert "frozen base" in proc.stdout and "no second copy" in proc.stdout
    lora, full = json.loads((tmp / "lora.json").read_text())["analytic"], report["analytic"]
    r = json.loads((tmp / "lora.json").read_text())
    assert r["model"]["lora"]["rank"] == 1 and report["model"]["lora"] is None
    assert lora["params"] + lora["opt_state"] < (full["params"] + full["opt_state"]) / 4  # adapters + moments
    assert lora["ref_params"] == 0 < full["ref_params"]  # the reference is the base itself
    assert lora["base_params"] == full["params"] and full["base_params"] == 0  # tiny_test's params are fp32 either way
    train = r["programs"]["train_step"]
    # the compiled update takes the frozen base and the adapters' state, and is smaller than the full one's inputs
    assert train["argument"] >= lora["base_params"] + lora["params"] + lora["opt_state"]
    assert train["argument"] < report["programs"]["train_step"]["argument"]
    assert r["resident"]["train_step"] == 0 and r["resident"]["sampler"] == lora["opt_state"]


def test_a_second_plan_of_the_same_programs_takes_them_from_the_cache(report, runs):
    """The same config again with the first plan's --cache: nothing compiled, the same figures; a config whose
    train step differs (another loss) compiles that program alone."""
    _, tmp = runs
    assert report["cache"] == {"dir": str(tmp / "cache"), "hits": []}
    again = _finish(_plan_cli("--chip", "v4", "--json", str(tmp / "again.json"), "--cache", str(tmp / "cache")))
    assert again.returncode == 0, again.stderr
    r = json.loads((tmp / "again.json").read_text())
    assert r["programs"] == report["programs"] and "from the plan cache" in again.stdout
    assert sorted(h.split()[0] for h in r["cache"]["hits"]) == sorted(plan.PROGRAMS)
    other = _finish(_plan_cli("--chip", "v4", "--json", str(tmp / "other.json"), "--cache", str(tmp / "cache"),
                              "--config.loss.guide=token"))
    assert other.returncode == 0, other.stderr
    hits = json.loads((tmp / "other.json").read_text())["cache"]["hits"]
    assert sorted(h.split()[0] for h in hits) == ["ref_logprobs", "sampler"]


def test_mesh_that_does_not_fit_the_devices_is_a_clear_error():
    proc = _finish(_plan_cli("--no-compile", "--config.mesh.shape=3,1,1"))
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "mesh" in proc.stderr and "8" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_compile_mode_in_process():
    from sage_jax.run import config as config_lib
    r = plan.run(config_lib.load(TINY), devices=8, memory_gb=16, do_compile=False, config_name=TINY)
    a = r["analytic"]
    assert r["programs"] == {} and r["lower_bound"] and r["fits"]
    assert r["phases"]["sampler"] == a["params"] + a["opt_state"] + a["ref_params"] + a["kv_cache"]
    assert "at least" in plan.format_report(r)


def test_no_compile_with_the_tpu_compiler_still_predicts(monkeypatch):
    """--no-compile --compiler tpu: no memory program is compiled, the prediction's cost variants still are."""
    import jax
    from sage_jax.run import config as config_lib
    cost = {"flops": 1e9, "bytes": 1e6, "optimal_seconds": 0.0, "loops": 0.0, "kernels": 0.0}
    asked = []
    monkeypatch.setattr(plan, "_devices", lambda *a: (jax.devices()[:8], 8, {"name": "XLA:TPU", "libtpu": "x",
                        "jax": jax.__version__, "topology": "v5p:2x2x2", "device_kind": "TPU v5"}))
    monkeypatch.setattr(plan, "compile_programs", lambda *a: pytest.fail("compiled a memory program"))
    monkeypatch.setattr(roofline, "measure_costs", lambda *a, **k: asked.append(a) or {"train_step": dict(cost)})
    r = plan.run(config_lib.load(TINY), do_compile=False, compiler="tpu", topology="2x2x2", config_name=TINY)
    assert r["programs"] == {} and r["lower_bound"] and len(asked) == 1
    assert r["prediction"]["programs"]["train_step"]["flops"] == 1e9


def test_simulate_devices_refuses_more_devices_than_the_process_has():
    with pytest.raises(ValueError, match="fresh process"):
        plan.simulate_devices(4096)


def test_model_from_a_known_checkpoint_name_or_a_local_config_json(tmp_path):
    from sage_jax.models import hf_io, decoder as model
    from sage_jax.run import config as config_lib
    cfg, source = build.resolve_model(config_lib.load("configs/qwen7b_branch.py"))
    assert "qwen2.5-math-7b" in source
    assert (cfg.vocab_size, cfg.num_layers, cfg.tie_embeddings, cfg.remat) == (152064, 28, False, True)
    cfg, _ = build.resolve_model(config_lib.load("configs/r1distill7b_branch.py"))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.tie_embeddings) == (152064, 3584, False)
    (tmp_path / "config.json").write_text(json.dumps(hf_io.config_to_hf(model.preset("small"))))
    cfg, source = build.resolve_model(config_lib.load(TINY, [f"--config.model.path={tmp_path}"]))
    assert source.endswith("config.json") and cfg.hidden_size == model.PRESETS["small"].hidden_size
    with pytest.raises(FileNotFoundError, match="not a known checkpoint name"):
        build.resolve_model(config_lib.load(TINY, ["--config.model.path=/nowhere/MyModel-9B"]))


def test_extrapolate_is_linear_in_layers():
    a, b = {"temp": 10, "argument": 3}, {"temp": 14, "argument": 5}
    assert plan.extrapolate(a, b, 2, 28) == {"temp": 10 + 4 * 26, "argument": 3 + 2 * 26}


# --------------------------------------------------------------------------------------------------- XLA:TPU, roofline

needs_libtpu = pytest.mark.skipif(not roofline.available(), reason="libtpu is not installed: pip install -r "
                                  "requirements-tpu.txt to compile for TPU (requirements-test.txt installs it)")


@pytest.fixture(scope="module")
def tpu_report(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpu") / "plan.json"
    proc = _finish(_start(["-m", "sage_jax.plan", "--config", TINY, "--compiler", "tpu", "--chip", "v5p",
                           "--topology", "2x2x1", "--json", str(path)]), timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "TPU_WORKER_HOSTNAMES" not in proc.stderr  # libtpu kept quiet
    return proc, json.loads(path.read_text())


@needs_libtpu
def test_tiny_config_compiles_with_xla_tpu_and_predicts_its_run(tpu_report):
    proc, r = tpu_report
    assert f"libtpu {roofline.libtpu_version()}" in proc.stdout and "PREDICTION" in proc.stdout
    assert r["compiler"]["name"] == "XLA:TPU" and r["compiler"]["topology"] == "v5p:2x2x1"
    assert r["devices"] == r["chips"] == 4 and r["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert r["fits"] and r["memory_bytes"] == 95 * 2 ** 30
    for p in r["programs"].values():
        assert p["peak"] == p["argument"] + p["output"] - p["alias"] + p["temp"] + p["code"] > 0
    pred = r["prediction"]
    progs = pred["programs"]
    assert set(progs) == {"train_step", "ref_logprobs", "prefill", "decode_step"}
    # XLA:TPU expands the decode slots' per-slot cache write (a scatter) into a loop of one in-place row update per
    # slot: the only loop left, and its body (a [kv_heads, head_dim] copy) is no part of the step's cost
    assert pred["loops_left"] in ([], ["decode_step"]) and pred["kernels_uncounted"] == []
    assert progs["decode_step"]["calls"] == 15 and progs["train_step"]["calls"] == 1  # max_new_tokens 16
    assert pred["step_s"] == pytest.approx(sum(p["time_s"] * p["calls"] for p in progs.values()))
    assert pred["run_s"] == pytest.approx(3 * pred["step_s"])
    # XLA computes at least the model's FLOPs (it adds recompute and masked attention), but not twice as many
    assert pred["model_flops"] <= pred["compiled_flops"] <= 2 * pred["model_flops"]


def tpu_devices_in_process(chip: str, topology: str):
    """(abstract devices of a `chip` slice, its chips), in this process."""
    saved = dict(os.environ)
    roofline.prepare_environment()
    try:
        return roofline.tpu_devices(chip, topology)
    finally:  # libtpu has read them; the TPU host variables must not reach the training subprocesses of later tests
        os.environ.clear()
        os.environ.update(saved)


def _tpu_mesh_in_process(topology="2x2x1"):
    from sage_jax.models import sharding
    devices, chips = tpu_devices_in_process("v5p", topology)
    return sharding.make_mesh((1, -1, 1), devices=devices), chips


@needs_libtpu
def test_roofline_of_a_sharded_matmul_matches_a_hand_count():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    from sage_jax.plan import programs as plan_programs
    mesh, chips = _tpu_mesh_in_process()
    M, K, N = 4096, 8192, 4096
    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("fsdp", None)))
    w = jax.ShapeDtypeStruct((K, N), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
    stats = plan_programs.cost_stats(jax.jit(jnp.matmul).lower(x, w))
    rows = M // chips  # each of the 4 devices multiplies its quarter of the rows by all of w
    flops, least_bytes = 2 * rows * K * N, 2 * (rows * K + K * N + rows * N)
    assert stats["flops"] == flops and stats["loops"] == 0
    # XLA:TPU counts the traffic of its tiling (operands re-read, the output accumulated), never less than one pass
    assert least_bytes <= stats["bytes"] <= 4 * least_bytes
    t = roofline.roofline(stats["flops"], stats["bytes"], roofline.CHIPS["v5p"])
    assert t["compute_s"] == pytest.approx(flops / 459e12) and t["memory_s"] == pytest.approx(stats["bytes"] / 2765e9)
    assert t["time_s"] == t["compute_s"] == pytest.approx(149.7e-6, rel=1e-3) and t["bound"] == "compute"


@needs_libtpu
def test_a_program_too_big_for_hbm_is_reported_not_raised():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    from sage_jax.plan import programs as plan_programs
    mesh, _ = _tpu_mesh_in_process("1x1x1")
    x = jax.ShapeDtypeStruct((60 * 2 ** 30 // 2,), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
    stats = plan_programs.memory_stats(jax.jit(lambda a: (a * 2, a + 1)).lower(x))  # 180 GB > 95 GiB
    assert set(stats) == {"oom"} and "HBM" in stats["oom"]


@needs_libtpu
def test_cost_extrapolation_equals_the_unrolled_program_and_the_scanned_one_undercounts():
    from sage_jax.models import sharding
    from sage_jax.plan import programs as pp
    from sage_jax.run import config as config_lib
    import jax
    config = config_lib.load(TINY, ["--config.model.num_layers=3"])
    mesh, _ = _tpu_mesh_in_process()
    cfg, _ = build.resolve_model(config)
    rules, shapes = dict(config.mesh.rules), pp.plan_shapes(config, mesh)
    rows = roofline.call_rows(config, shapes)["ref_logprobs"]
    predicted = roofline.measure_costs(cfg, config, mesh, rules, shapes, programs=("ref_logprobs",))["ref_logprobs"]
    measured = {}
    for name, c in (("unrolled", pp.cost_variant(cfg, 3)), ("scanned", cfg)):
        with sharding.use_rules(rules):
            _, ref, _, _ = pp.abstract_state(c, config, mesh, rules)
        with jax.set_mesh(mesh), sharding.use_rules(rules):
            lowered = pp.lower_ref_logprobs(c, config, ref, pp.abstract_batch(config, shapes, rows, mesh), shapes)
        measured[name] = pp.cost_stats(lowered)
    # since the projections became 2-D matmuls (model.matmul), XLA's count of the unrolled program is 1.5e-4 above
    # the extrapolation (7.8k of 52.2M FLOPs; where it comes from is not traced)
    assert predicted["flops"] == pytest.approx(measured["unrolled"]["flops"], rel=1e-3)
    assert predicted["bytes"] == pytest.approx(measured["unrolled"]["bytes"], rel=0.1)
    assert measured["scanned"]["loops"] >= 1 and measured["scanned"]["flops"] < 0.7 * predicted["flops"]


@needs_libtpu
def test_pallas_splash_attention_compiles_for_tpu_forward_and_backward():
    """A Pallas TPU kernel lowers through this path (Mosaic inside libtpu), so one that cannot is caught before a pod
    is rented; and the cost analysis does not see into it, which is why the roofline warns about kernels."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import splash_attention as splash
    from jax.sharding import NamedSharding, PartitionSpec
    from sage_jax.plan import programs as plan_programs
    mesh, _ = _tpu_mesh_in_process("1x1x1")
    H, T, D = 4, 512, 128
    blocks = splash.BlockSizes(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, block_q_dq=128,
                               block_kv_dq=128)
    attend = jax.vmap(splash.make_splash_mha_single_device(splash.MultiHeadMask([splash.CausalMask((T, T))] * H),
                                                           block_sizes=blocks))
    qkv = [jax.ShapeDtypeStruct((2, H, T, D), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))] * 3
    grads = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    stats = plan_programs.cost_stats(grads.lower(*qkv))
    assert stats["kernels"] >= 3  # forward, dq and dkv kernels
    assert stats["flops"] < 2 * 2 * H * T * T * D  # far below even the forward's matmuls: kernels are not counted


def test_cost_stats_counts_loops_in_the_lowered_program_when_the_compiled_one_cannot_be_printed():
    """libtpu's HLO printer rejects some 7B programs (a RET_CHECK): the cost still comes back, loops counted from the
    lowered StableHLO."""
    import jax
    import jax.numpy as jnp
    from sage_jax.plan import programs as plan_programs

    class Unprintable:
        def __init__(self, compiled):
            self.compiled = compiled

        def cost_analysis(self):
            return self.compiled.cost_analysis()

        def as_text(self):
            raise jax.errors.JaxRuntimeError("INTERNAL: RET_CHECK failure")

    lowered = jax.jit(lambda x: jax.lax.fori_loop(0, x.shape[0] + x.sum().astype(jnp.int32), lambda i, c: c @ c,
                                                  x)).lower(jnp.ones((8, 8)))
    printable = plan_programs.cost_stats(lowered)

    class Lowered:
        def compile(self):
            return Unprintable(lowered.compile())

        def as_text(self):
            return lowered.as_text()
    fallback = plan_programs.cost_stats(Lowered())
    assert fallback == printable and fallback["loops"] == 1 and fallback["kernels"] == 0


def test_bilinear_extrapolation_is_exact_for_a_bilinear_cost():
    cost = lambda l, r: 5 + 3 * l + 7 * r + 11 * l * r
    points = {(l, r): cost(l, r) for l in (1, 2) for r in (8, 16)}
    assert roofline._bilinear(points, 28, 1024) == cost(28, 1024)


def test_prediction_sums_each_program_times_its_calls():
    from sage_jax.models import sharding
    from sage_jax.plan import programs as plan_programs
    from sage_jax.run import config as config_lib
    config = config_lib.load(TINY, ["--config.train.logprob_rows=8", "--config.train.steps=10"])
    cfg, _ = build.resolve_model(config)
    shapes = plan_programs.plan_shapes(config, sharding.make_mesh((1, -1, 1)))
    costs = {name: {"flops": 1e12, "bytes": 1e9, "optimal_seconds": 0.0, "loops": 0.0, "kernels": 0.0}
             for name in ("train_step", "ref_logprobs", "prefill", "decode_step")}
    costs["decode_step"]["bytes"] = 1e10  # memory-bound: 1e10 / 2765e9 s > 1e12 / 459e12 s
    p = roofline.predict(costs, cfg, config, shapes, "v5p", chips=8, devices=8)
    compute, memory = 1e12 / 459e12, 1e10 / 2765e9
    assert p["programs"]["decode_step"]["bound"] == "memory" and p["programs"]["train_step"]["bound"] == "compute"
    calls = {"train_step": 1, "ref_logprobs": 2, "prefill": 1, "decode_step": 15}  # 16 rows / 8 per pass; 16 - 1
    assert {k: v["calls"] for k, v in p["programs"].items()} == calls
    assert p["step_s"] == pytest.approx(4 * compute + 15 * memory)
    assert p["run_s"] == pytest.approx(10 * p["step_s"])
    assert p["tokens_per_s"] == pytest.approx(16 * (32 + 16) / p["step_s"])
    assert p["mfu"] == pytest.approx(p["model_flops"] / (p["step_s"] * 8 * 459e12))
    assert "PREDICTION" in roofline.format_prediction(p)


def test_tpu_flags_that_cannot_work_are_clear_errors():
    for args, words in ((["--compiler", "tpu", "--chip", "h100", "--topology", "2x2x1"], "not a TPU"),
                        (["--compiler", "cpu"], "--devices"), (["--compiler", "tpu"], "--topology")):
        proc = _finish(_start(["-m", "sage_jax.plan", "--config", TINY, *args]))
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, args


# --------------------------------------------------------------------------------------------------- phase model

def _phase_machine():
    from sage_jax.plan import phase_model
    return phase_model.Machine(flops_per_s=1e12, bytes_per_s=1e11)


def test_decode_is_modelled_at_the_slot_pool_and_every_tail_step_reads_the_weights():
    import numpy as np
    from sage_jax.bench import workloads
    from sage_jax.models import decoder as model
    from sage_jax.plan import phase_model
    cfg = model.preset("small")
    lengths = workloads.longtail_lengths(64, 256)
    from sage_jax.sampling.schedule import decode_batches
    rows, live = decode_batches(lengths)
    assert (rows == 64).all() and len(rows) == lengths.max() - 1  # every slot computes until the longest row ends
    assert (live == np.array([(lengths > j).sum() for j in range(1, lengths.max())])).all()
    half, half_live = decode_batches(lengths, slots=32)
    assert (half == 32).all() and (half_live <= 32).all() and half_live.sum() == live.sum() + 32  # refilled
    assert len(half) >= -(-int(lengths.sum()) // 32) - 1
    m = _phase_machine()
    g = phase_model.generation(cfg, 8, 32, lengths, m)
    weights_s = cfg.num_params * 4 / m.bytes_per_s
    tail_steps = int((live <= 8).sum())
    assert g["tail_s"] >= tail_steps * weights_s  # a few live rows still read every weight
    full = phase_model.generation(cfg, 8, 32, np.full(64, 256), m)
    assert g["decode_s"] <= full["decode_s"]
    assert phase_model.generation(cfg, 8, 32, lengths, m, slots=16)["decode_s"] != g["decode_s"]


def test_placements_add_up_and_hide_the_host_only_off_policy():
    import numpy as np
    from sage_jax.bench import workloads
    from sage_jax.models import decoder as model
    from sage_jax.plan import phase_model
    cfg = model.preset("qwen2.5-7b")
    lengths = workloads.longtail_lengths(512, 3072)
    rows = phase_model.placements(cfg, 64, 512, lengths, _phase_machine(), 32, 4, host_s=5.0, splits=[8, 16])
    on, k1, *split = rows
    assert on["step_s"] == on["generate_s"] + on["train_s"] + 5.0
    assert k1["step_s"] == max(on["generate_s"] + on["train_s"], 5.0) < on["step_s"]
    for r in split:
        assert r["step_s"] == max(r["generate_s"], r["train_s"] + r["sync_s"], 5.0) and r["sync_s"] > 0
    assert [r["n"] for r in split] == [8, 16]
    assert np.isclose(on["vs_on_policy"], 1.0)


def test_plan_chip_cpu_goes_to_the_phase_check():
    assert plan_cli.cpu_check(["--chip", "cpu"]) and plan_cli.cpu_check(["--chip=cpu", "--presets", "tiny"])
    assert not plan_cli.cpu_check(["--chip", "v5p", "--config", "x.py"])


def test_sampler_only_plan_and_its_breakdown_add_up():
    """--programs sampler (in process, XLA:CPU, 8 devices): only the sampler is compiled, no prediction, and the
    breakdown splits its compiled peak into the weights shard, the slot KV cache and the prompt caches (each counted
    by hand from the shapes and the mesh) and the rest, with issue 26's bound."""
    import math
    from sage_jax.plan import report as plan_report
    from sage_jax.run import config as config_lib
    config = config_lib.load(TINY, ["--config.model.compute_dtype=bfloat16"])  # 2-byte caches, as on a TPU
    r = plan.run(config, devices=8, memory_gb=16, config_name=TINY, names=("sampler",))
    assert set(r["programs"]) == {"sampler"} == set(r["phases"]) and r["prediction"] is None
    assert any("only sampler compiled" in w for w in r["warnings"])
    b, a, s, p = r["sampler_breakdown"], r["analytic"], r["shapes"], r["programs"]["sampler"]
    cfg, _ = build.resolve_model(config)
    dp, tp = r["mesh"]["data"] * r["mesh"]["fsdp"], r["mesh"]["tensor"]
    kv_heads = cfg.num_kv_heads // tp if cfg.num_kv_heads % tp == 0 else cfg.num_kv_heads
    per_position = 2 * cfg.num_layers * kv_heads * cfg.head_dim * 2  # k and v, bf16
    assert b["kv_cache"] == a["kv_cache"] == s["sampler_slots"] // dp * s["cache_len"] * per_position
    prompts = s["sampler_prompts"] // dp if s["sampler_prompts"] % dp == 0 else s["sampler_prompts"]
    assert b["prompt_caches"] == prompts * s["prompt_len"] * per_position
    # the sampler takes the float32 weights cast to bf16 (model.compute_params, once per generate); the float32
    # originals stay resident beside it
    assert b["weights"] == a["rollout_params"] == a["params"] // 2 and a["rollout_cast_from"] == a["params"]
    assert r["resident"]["sampler"] == a["opt_state"] + a["ref_params"] + a["params"]
    assert b["peak"] == p["peak"] and b["temp"] == p["temp"]
    assert b["weights"] + b["kv_cache"] + b["prompt_caches"] + b["rest"] == b["peak"]
    assert math.isclose(b["temp_over_kv"], p["temp"] / a["kv_cache"])
    assert b["bound"] == round(a["rollout_params"] + plan_report.SLOT_CACHE_SLACK * a["kv_cache"] + b["prompt_caches"])
    assert b["within_bound"] == (b["peak"] <= b["bound"])
    assert "sampler breakdown per device" in plan.format_report(r)


@needs_libtpu
def test_sigterm_ends_a_plan_at_once_even_while_xla_compiles():
    """A plan saves nothing, and no Python handler runs inside a compile: SIGTERM must end it within seconds (it once
    ran on for 440 s after SIGTERM, then printed a resume hint)."""
    import signal
    import time
    proc = _start(["-m", "sage_jax.plan", "--config", "configs/qwen7b_branch.py", "--compiler", "tpu", "--chip",
                   "v5p", "--topology", "2x4x4", "--no-compile"])
    time.sleep(20)  # the prediction's compiles are under way (minutes for the 7B shapes)
    assert proc.poll() is None, "the plan finished before the signal: this test needs a longer one"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc, timeout=30)
    assert out.returncode == -signal.SIGTERM and time.monotonic() - t0 < 15
    assert "resume" not in out.stderr
