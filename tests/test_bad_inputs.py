"""Bad inputs through the real command lines: each exits 2 with one `error:` line naming the key or file, and no
traceback, and writes nothing (no log line, no checkpoint: the workdir is as it was). Most cases fail in the
up-front config check, before JAX starts; the rest in the checks before the model loads (training/preflight.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = "configs/tiny_test.py"


def _prepare_file(tmp: Path) -> dict:
    (tmp / "a_file").write_text("not a directory")
    return {"workdir": str(tmp / "a_file")}


def _prepare_summary(tmp: Path) -> dict:
    (tmp / "wd").mkdir()
    (tmp / "wd" / "summary.json").write_text('{"before": {"pass@1": 0.5')
    return {}


def _prepare_other_model(tmp: Path) -> dict:
    """A checkpoint whose meta says it was made with another model width."""
    import jax.numpy as jnp
    from sage_jax.run import checkpoint
    ck = checkpoint.Checkpointer(tmp / "wd" / "rl")
    ck.save(1, {"w": jnp.zeros(2)}, {"rl_step": 1, "model": {"hidden_size": 32, "num_layers": 2}})
    ck.close()
    return {}


def _prepare_seed0_checkpoint(tmp: Path) -> dict:
    """A checkpoint made with the tiny config as it is (seed 0, k3)."""
    import jax.numpy as jnp
    from sage_jax.run import checkpoint, config, record as run_record
    ck = checkpoint.Checkpointer(tmp / "wd" / "rl")
    ck.save(2, {"w": jnp.zeros(2)}, {"rl_step": 2, "config": run_record.as_record(config.load(str(ROOT / TINY)))})
    ck.close()
    return {}


def _prepare_live_lock(tmp: Path) -> dict:
    """The workdir locked by a live process (this test's)."""
    import socket
    (tmp / "wd").mkdir()
    (tmp / "wd" / "run.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    return {}


def _prepare_samples(tmp: Path) -> dict:
    (tmp / "good.jsonl").write_text(json.dumps({"completion": "x", "reward": 1.0}) + "\n")
    (tmp / "bad.jsonl").write_text('{"completion": "x"}\n{"completion": "y",}\n')
    (tmp / "empty.jsonl").write_text("")
    return {}


def _prepare_demos(tmp: Path) -> dict:
    """SFT demonstration files, each wrong in one way (the tiny config's length limit is 32 + 16 tokens)."""
    row = lambda prompt, completion: json.dumps({"prompt": prompt, "completion": completion}) + "\n"
    (tmp / "long.jsonl").write_text(row("1 " * 30 + ">2:", "1+1=2") + row("3 " * 40 + ">6:", "3+3=6"))
    (tmp / "empty.jsonl").write_text("\n")
    (tmp / "null_completion.jsonl").write_text(row("1 1>2:", "1+1=2") + row("2 2>4:", None))
    (tmp / "numeric_prompt.jsonl").write_text(row(12, "1+1=2"))
    return {}


def _prepare_math_data(tmp: Path) -> dict:
    """A tokenizer for the math task, and an empty training file."""
    from tests.helpers_hf import tiny_tokenizer
    tiny_tokenizer(tmp / "tok")
    (tmp / "empty.jsonl").write_text("")
    return {}


def _prepare_bad_configs(tmp: Path) -> dict:
    (tmp / "bad_syntax.py").write_text("def get_config(arg=None):\n    return (\n")
    (tmp / "bad_import.py").write_text('"""A config whose import fails."""\n\nimport no_such_module_xyz\n')
    return {}


def _prepare_non_utf8_demos(tmp: Path) -> dict:
    (tmp / "demos.jsonl").write_bytes(b'{"prompt": "1+1", "completion": "2"}\n'
                                      b'{"prompt": "caf\xe9", "completion": "x"}\n')
    return {}


# (case id, command after `python -m`, what the error line must name, prepare the tmp dir, fails before JAX starts)
CASES = [
    ("unknown key", ["sage_jax.train", "--config.loss.betta=1"], "loss.betta", None, True),
    ("override without value", ["sage_jax.train", "--config.loss.beta"], "--config.key=value", None, True),
    ("bad type", ["sage_jax.train", "--config.train.steps=abc"], "train.steps", None, True),
    ("missing config file", ["sage_jax.train", "--config", "configs/nonexistent.py"], "configs/nonexistent.py",
     None, True),
    ("missing model path", ["sage_jax.train", "--config.model.path=/nonexistent/model"], "/nonexistent/model",
     None, False),
    ("mesh does not divide", ["sage_jax.train", "--config.mesh.shape=3,1,1"], "mesh shape", None, False),
    ("group of one", ["sage_jax.train", "--config.rollout.group_size=1"], "rollout.group_size", None, True),
    ("group of zero", ["sage_jax.train", "--config.rollout.group_size=0"], "rollout.group_size", None, True),
    ("ckpt_every zero", ["sage_jax.train", "--config.train.ckpt_every=0"], "train.ckpt_every", None, True),
    ("eval.n zero", ["sage_jax.train", "--config.eval.n=0"], "eval.n", None, True),
    ("eval.ks above eval.n", ["sage_jax.train", "--config.eval.ks=1,8"], "eval.ks", None, True),
    ("negative sft steps", ["sage_jax.train", "--config.sft.steps=-3"], "sft.steps", None, True),
    ("negative sft steps (sft)", ["sage_jax.sft", "--config.sft.steps=-3"], "sft.steps", None, True),
    ("sft ckpt_every zero", ["sage_jax.sft", "--config.sft.ckpt_every=0"], "sft.ckpt_every", None, True),
    ("negative gamma", ["sage_jax.train", "--config.loss.gamma=-5"], "loss.gamma", None, True),
    ("negative beta", ["sage_jax.train", "--config.loss.beta=-1"], "loss.beta", None, True),
    ("zero steps", ["sage_jax.train", "--config.train.steps=0"], "train.steps", None, True),
    ("unknown task", ["sage_jax.train", "--config.data.task=bogus"], "data.task", None, True),
    ("top_p zero", ["sage_jax.train", "--config.rollout.top_p=0"], "rollout.top_p", None, True),
    ("zero lr", ["sage_jax.train", "--config.optim.lr=0"], "optim.lr", None, True),
    ("reward timeout zero", ["sage_jax.train", "--config.train.reward_timeout=0"], "train.reward_timeout", None,
     True),
    ("workdir is a file", ["sage_jax.train"], "a_file", _prepare_file, True),
    ("corrupt summary.json", ["sage_jax.train"], "summary.json", _prepare_summary, False),
    ("other model in workdir", ["sage_jax.train"], "hidden_size: checkpoint 32, config 64", _prepare_other_model,
     False),
    ("resume with other settings", ["sage_jax.train", "--config.seed=7", "--config.loss.kl_estimator=k2"],
     "loss.kl_estimator: checkpoint 'k3', now 'k2'; seed: checkpoint 0, now 7", _prepare_seed0_checkpoint, False),
    ("workdir in use", ["sage_jax.train"], f"in use by another run (pid {os.getpid()} on host", _prepare_live_lock,
     False),
    ("workdir in use (sft)", ["sage_jax.sft"], f"in use by another run (pid {os.getpid()} on host", _prepare_live_lock,
     False),
    ("config syntax error", ["sage_jax.train", "--config", "{tmp}/bad_syntax.py"], "bad_syntax.py:2: syntax error",
     _prepare_bad_configs, True),
    ("config import fails", ["sage_jax.train", "--config", "{tmp}/bad_import.py"],
     "bad_import.py:3: the config file fails to load (ModuleNotFoundError", _prepare_bad_configs, True),
    ("config argument typo", ["sage_jax.train", "--config", "configs/cpu_demo.py:quikc"],
     "unknown config argument 'quikc'; cpu_demo.py accepts 'quick'", None, True),
    ("config argument to a config without any", ["sage_jax.train", "--config", "configs/tiny_test.py:fast"],
     "tiny_test.py accepts no argument", None, True),
    ("non-UTF-8 data file", ["sage_jax.sft", "--config.sft.data={tmp}/demos.jsonl", "--config.sft.steps=1"],
     "demos.jsonl:2: not UTF-8 text", _prepare_non_utf8_demos, False),
    ("patterns: missing file", ["sage_jax.patterns", "{tmp}/good.jsonl", "{tmp}/missing.jsonl"], "missing.jsonl",
     _prepare_samples, False),
    ("patterns: bad JSON", ["sage_jax.patterns", "{tmp}/good.jsonl", "{tmp}/bad.jsonl"],
     "bad.jsonl:2: invalid JSON (Expecting property name enclosed in double quotes at column 20)", _prepare_samples,
     False),
    # issue 50, items 4, 5, 7, 8, 14
    ("patterns: empty file", ["sage_jax.patterns", "{tmp}/good.jsonl", "{tmp}/empty.jsonl"],
     "empty.jsonl: no completions in it", _prepare_samples, False),
    ("sft: no completion token left", ["sage_jax.sft", "--config.sft.data={tmp}/long.jsonl", "--config.sft.steps=1"],
     "long.jsonl: every one of its 2 demonstrations has a prompt of at least 48 tokens", _prepare_demos, False),
    ("sft: empty file", ["sage_jax.sft", "--config.sft.data={tmp}/empty.jsonl", "--config.sft.steps=1"],
     "empty.jsonl: no demonstrations in it", _prepare_demos, False),
    ("sft: null completion", ["sage_jax.sft", "--config.sft.data={tmp}/null_completion.jsonl",
                              "--config.sft.steps=1"],
     "null_completion.jsonl:2: field 'completion' is null", _prepare_demos, False),
    ("sft: numeric prompt", ["sage_jax.sft", "--config.sft.data={tmp}/numeric_prompt.jsonl", "--config.sft.steps=1"],
     "numeric_prompt.jsonl:1: field 'prompt' should be text, got int", _prepare_demos, False),
    ("sft data checked by train", ["sage_jax.train", "--config.sft.data={tmp}/empty.jsonl", "--config.sft.steps=1"],
     "empty.jsonl: no demonstrations in it", _prepare_demos, False),
    ("other model in workdir, SFT first", ["sage_jax.train", "--config.sft.steps=2", "--config.sft.batch_size=4",
                                           "--config.sft.num_demos=8"],
     "hidden_size: checkpoint 32, config 64", _prepare_other_model, False),
    ("empty data.train", ["sage_jax.train", "--config.data.task=math", "--config.tokenizer_path={tmp}/tok",
                          "--config.data.train={tmp}/empty.jsonl", "--config.train.reward=math"],
     "empty.jsonl': no training examples", _prepare_math_data, False),
]


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """{path: (size, mtime)} of every file under root (bytecode caches aside)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
                PYTHONPATH=str(ROOT))


@pytest.mark.parametrize("module_and_args,names,prepare,early", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(tmp_path, module_and_args, names, prepare, early):
    options = prepare(tmp_path) if prepare else {}
    before = _files(tmp_path)
    module, *args = [a.format(tmp=tmp_path) for a in module_and_args]
    cmd = [sys.executable, "-m", module, *args]
    if module != "sage_jax.patterns":
        if "--config" not in args:
            cmd += ["--config", TINY]
        cmd += ["--workdir", options.get("workdir", str(tmp_path / "wd"))]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and errors[0] == lines[-1] and names in errors[0], r.stderr[-3000:]
    if early:  # rejected before any work: the error is all that is printed
        assert lines == errors, r.stderr
    assert _files(tmp_path) == before, r.stderr[-3000:]  # and nothing was written: no log line, no checkpoint


def test_ctrl_c_exits_130_with_a_resume_hint(tmp_path):
    """Ctrl-C in a terminal sends SIGINT to the whole process group, the reward workers included: they ignore it
    (no KeyboardInterrupt tracebacks, no lost rewards) while the trainer finishes its step, saves and stops."""
    workdir = tmp_path / "wd"
    # python -m sage_jax.train, with faulthandler dumping every thread's stack on SIGUSR1 (used if it hangs)
    launch = ("import faulthandler, runpy, signal; faulthandler.register(signal.SIGUSR1, all_threads=True); "
              "runpy.run_module('sage_jax.train', run_name='__main__', alter_sys=True)")
    cmd = [sys.executable, "-c", launch, "--config", TINY, "--workdir", str(workdir),
           "--config.train.steps=100000"]  # never finishes before the interrupt, however fast the machine
    # a shell's background job inherits SIGINT ignored, and Python then never installs its Ctrl-C handler
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint, process_group=0)  # its own group, as a terminal's job
    deadline = time.time() + 300
    while not (workdir / "rl" / "checkpoints" / "1").exists():  # interrupt mid-training, threads running
        assert proc.poll() is None and time.time() < deadline, "run ended before its first checkpoint"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C: the trainer and its reward workers
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # show where it hangs: every thread's stack, then stop it
        proc.send_signal(signal.SIGUSR1)
        time.sleep(5)
        proc.kill()
        _, err = proc.communicate()
        pytest.fail("the run did not exit within 120 s of its SIGINT; its threads' stacks:\n" + err[-8000:])
    assert proc.returncode == 130, err[-3000:]
    # inside the step loop a Ctrl-C stops at the step boundary, after a checkpoint of the last completed step
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    stops = [line for line in err.splitlines() if line.startswith("stopped by SIGINT after RL step ")]
    assert len(stops) == 1 and "python -m" in stops[0].split("resume with: ")[1], err[-3000:]
    assert stops[0] == err.strip().splitlines()[-1], err[-3000:]  # nothing from the workers after the stop line
    step = int(stops[0].split("after RL step ")[1].split(":")[0])
    assert (workdir / "rl" / "checkpoints" / str(step)).is_dir()
    rewards = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert all(r.get("rl/reward_errors", 0) == 0 for r in rewards), rewards  # no worker died under the step


def _start(cmd, workdir: Path):
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)


def _wait_for(proc, path: Path, what: str):
    deadline = time.time() + 300
    while not (path.exists() and path.stat().st_size):  # the logger creates its files empty before the loop
        assert proc.poll() is None and time.time() < deadline, f"run ended before {what}: {proc.stderr.read()[-3000:]}"
        time.sleep(0.2)


def _stopped_at(err: str, what: str) -> int:
    import re
    stops = [line for line in err.splitlines() if line.startswith(f"stopped by SIGTERM after {what} ")]
    assert len(stops) == 1 and "python -m sage_jax." in stops[0].split("resume with: ")[1], err[-3000:]
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=1" in stops[0]  # the devices the run was built on
    return int(re.search(rf"after {what} (\d+):", stops[0]).group(1))


def test_sigterm_saves_the_last_step_and_a_second_run_on_the_workdir_exits_2(tmp_path):
    """kill -TERM mid-run: a checkpoint of the last completed step (not on the ckpt_every cadence), exit 143, one
    line naming the step; a second run on the live workdir exits 2 at once naming the holder; the rerun resumes."""
    workdir = tmp_path / "wd"
    train = [sys.executable, "-m", "sage_jax.train", "--config", TINY, "--workdir", str(workdir)]
    first = _start(train + ["--config.train.steps=100000", "--config.train.ckpt_every=100000"], workdir)
    _wait_for(first, workdir / "samples.jsonl", "its first step")  # written at the end of step 0
    second = subprocess.run(train, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert second.stderr.strip().splitlines()[-1].startswith("error: the workdir ")
    assert f"pid {first.pid} on host " in second.stderr
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 143 and "Traceback" not in err, err[-3000:]
    step = _stopped_at(err, "RL step")
    assert step >= 1 and (workdir / "rl" / "checkpoints" / str(step)).is_dir(), err[-3000:]
    rows = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(rows)) == list(range(step)), rows  # the first run's steps only, each logged
    assert not (workdir / "run.lock").exists()
    rerun = subprocess.run(train + [f"--config.train.steps={step + 1}", "--config.train.ckpt_every=100000"],
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"at RL step {step}" in (workdir / "log.txt").read_text()
    assert (workdir / "rl" / "checkpoints" / str(step + 1)).is_dir()


def test_sigterm_during_sft_saves_and_resumes(tmp_path):
    workdir = tmp_path / "wd"
    sft = [sys.executable, "-m", "sage_jax.sft", "--config", TINY, "--workdir", str(workdir),
           "--config.sft.batch_size=4", "--config.sft.num_demos=16"]
    proc = _start(sft + ["--config.sft.steps=100000", "--config.sft.ckpt_every=100000"], workdir)
    _wait_for(proc, workdir / "sft" / "metrics.jsonl", "its first step")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    step = _stopped_at(err, "SFT step")
    assert (workdir / "sft" / "checkpoints" / str(step)).is_dir()
    rerun = subprocess.run(sft + [f"--config.sft.steps={step + 1}"], cwd=ROOT, env=_env(), capture_output=True,
                           text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"SFT resumed at step {step}" in (workdir / "log.txt").read_text()


@pytest.mark.parametrize("args,names", [
    (["--topology", "2xx4"], "--topology '2xx4' is not a slice shape"),
    (["--memory-gb", "-5"], "--memory-gb -5: must be > 0"),
    (["--compiler", "tpu", "--chip", "v5e", "--topology", "2x4x4"], "a v5e slice is shaped AxB"),
    (["--compiler", "tpu", "--chip", "v5p", "--topology", "4x4"], "a v5p slice is shaped AxBxC"),
    (["--devices", "100000"], "XLA:CPU cannot simulate more than"),
], ids=["malformed topology", "negative memory", "v5e in 3D", "v5p in 2D", "too many CPU devices"])
def test_plan_rejects_bad_shapes_and_sizes(args, names):
    cmd = [sys.executable, "-m", "sage_jax.plan", "--config", TINY, "--devices", "1", "--compiler", "cpu", *args]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert names in r.stderr.strip().splitlines()[-1], r.stderr


def test_evaluate_names_an_unknown_dataset():
    from sage_jax.eval import offline as evaluate
    with pytest.raises(ValueError, match="unknown dataset 'bogusset'"):
        evaluate.reward_for("bogusset", "countdown")
    assert evaluate.reward_for("countdown", "countdown") == "countdown"
    with pytest.raises(ValueError, match="does not suit a countdown model"):
        evaluate.reward_for("math500", "countdown")


def test_a_truncated_safetensors_file_is_named_as_incomplete(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file
    from sage_jax.models import hf_io
    save_file({"w": np.zeros((64, 64), np.float32)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:40])  # a download cut short
    with pytest.raises(ValueError, match=r"model.safetensors is incomplete or not a safetensors file"):
        hf_io._checkpoint_files(tmp_path)


def test_a_full_disk_is_one_error_line(tmp_path, monkeypatch):
    """orbax failing with ENOSPC mid-save: a CheckpointError naming the step and the fix (cli prints it alone)."""
    import jax.numpy as jnp
    from sage_jax.run import checkpoint
    ck = checkpoint.Checkpointer(tmp_path)
    ck.save(1, {"w": jnp.zeros(2)})

    def full(*args, **kwargs):
        raise ValueError('RESOURCE_EXHAUSTED: Failed writing "x": No space left on device [os_error_code=\'28\']')
    monkeypatch.setattr(ck._manager, "save", full)
    with pytest.raises(checkpoint.CheckpointError, match="cannot write checkpoint step 2 .* no space left on device"
                       ".* newest complete checkpoint is step 1"):
        ck.save(2, {"w": jnp.zeros(2)})
    monkeypatch.undo()
    ck.close()


# A save of many arrays through the real orbax / tensorstore writer threads, in a process whose writes fail: printed
# through cli.main_guard as the entry points do, with the trainer's logging set up.
_FAILING_SAVE = """
import logging, resource, sys
import jax
from sage_jax.run import checkpoint, cli, metrics_log

def main():
    workdir, limit = sys.argv[1], int(sys.argv[2])
    metrics_log.setup_python_logging(workdir, logging.INFO)
    ck = checkpoint.Checkpointer(workdir + "/rl")
    ck.save(1, {"w": jax.numpy.zeros(4)})
    state = {f"w{i}": jax.random.normal(jax.random.key(i), (64, 1024)) for i in range(64)}
    if limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    ck.save(2, state)
    ck.wait()

cli.main_guard(main)
"""


def _assert_only_the_error_line(r, cause: str):
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr[-5000:]  # no traceback, no "Event loop is closed", no orbax ERROR lines
    assert lines[0].startswith("error: cannot write checkpoint step 2 in ") and cause in lines[0], lines[0]
    assert "the newest complete checkpoint is step 1" in lines[0], lines[0]


def test_a_write_over_the_file_size_limit_prints_only_the_error_line(tmp_path):
    """RLIMIT_FSIZE makes tensorstore's writes fail inside orbax's writer threads (EFBIG), as a full disk does: the
    other writers are shut down before the error is printed, and it is printed alone."""
    cmd = [sys.executable, "-c", _FAILING_SAVE, str(tmp_path / "wd"), "100000"]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    _assert_only_the_error_line(r, "a file exceeds the file-size limit (ulimit -f)")


def test_a_real_full_disk_prints_only_the_error_line(tmp_path):
    """A 1 MiB tmpfs in a private mount namespace (needs root; skipped elsewhere): ENOSPC from the kernel."""
    from tests.helpers_system import private_tmpfs_or_skip
    mnt = tmp_path / "small"
    mnt.mkdir()
    private_tmpfs_or_skip(mnt, "size=1m")
    script = tmp_path / "save.py"
    script.write_text(_FAILING_SAVE)
    shell = f"mount -t tmpfs -o size=1m tmpfs {mnt} && exec {sys.executable} {script} {mnt}/wd 0"
    r = subprocess.run(["unshare", "-m", "sh", "-c", shell], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    _assert_only_the_error_line(r, "no space left on device")


def test_a_workdir_that_cannot_be_written_is_one_error_line():
    """A read-only filesystem (here /sys) at start: one line naming the workdir, no traceback, no lock left."""
    r = subprocess.run([sys.executable, "-m", "sage_jax.train", "--config", TINY, "--workdir", "/sys/sage_jax_ro"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "workdir /sys/sage_jax_ro: cannot write there" in r.stderr.strip().splitlines()[-1]


def test_a_lock_whose_write_fails_leaves_no_empty_file(tmp_path, monkeypatch):
    """A full disk while the run lock is written: the half-made file is removed (it would read as someone's lock)."""
    from sage_jax.run import paths

    def full(fd, mode):
        os.close(fd)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(paths.os, "fdopen", full)
    with pytest.raises(OSError, match="No space"):
        paths.create_text(str(tmp_path / "run.lock"), "{}")
    assert not (tmp_path / "run.lock").exists()


def _fake_workdir(workdir: Path) -> None:
    """A training workdir as evaluate finds one (its config.json and a finished RL checkpoint's folder): the
    results' folder is checked before any checkpoint is read."""
    from sage_jax.run import config, record as run_record
    (workdir / "rl" / "checkpoints" / "3" / "state").mkdir(parents=True)
    (workdir / "config.json").write_text(json.dumps(run_record.as_record(config.load(str(ROOT / TINY)))))


@pytest.mark.parametrize("how", ["read-only mount", "eval is a file"])
def test_evaluate_on_a_workdir_it_cannot_write_names_it_and_suggests_out(tmp_path, how):
    """Issue 50, item 11: the default results folder WORKDIR/eval/... cannot be made: one line, a hint to pass --out."""
    import shutil
    workdir = tmp_path / "wd"
    _fake_workdir(workdir)
    cmd = [sys.executable, "-m", "sage_jax.evaluate", "--model", str(workdir), "--n", "2", "--limit", "2",
           "--reward-workers", "0", "--no-progress"]
    if how == "eval is a file":
        (workdir / "eval").write_text("")
    else:  # a private read-only bind mount of the workdir (needs root; skipped elsewhere)
        ro = f"mount --bind {workdir} {workdir} && mount -o remount,bind,ro {workdir}"
        probe = subprocess.run(["unshare", "-m", "sh", "-c", ro], capture_output=True, text=True) \
            if shutil.which("unshare") else None
        if probe is None or probe.returncode != 0:
            pytest.skip(f"no private read-only mount here: {probe.stderr.strip() if probe else 'no unshare'}")
        cmd = ["unshare", "-m", "sh", "-c", f"{ro} && exec " + " ".join(cmd)]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot write the evaluation's results to {workdir}/eval/step3 (") and \
        last.endswith("pass --out with a folder you can write to"), r.stderr


@pytest.mark.parametrize("args,names", [
    (["--config", "configs/nonexistent.py", "--compiler", "tpu"], "config file 'configs/nonexistent.py' not found"),
    (["--config", TINY, "--compiler", "tpu", "--devices", "0"], "--devices 0: must be >= 1"),
    (["--config", TINY, "--compiler", "cpu", "--devices", "1", "--config.rollout.prompts_per_step=0"],
     "--config.rollout.prompts_per_step=0: must be >= 1"),
    (["--config", TINY, "--compiler", "cpu", "--devices", "1", "--config.rollout.group_size=1"],
     "--config.rollout.group_size=1: must be >= 2"),
], ids=["missing config file", "devices 0", "prompts_per_step 0", "group of one"])
def test_plan_checks_its_flags_and_the_config_as_train_does(args, names):
    """Issue 50, item 9: each gets its own message, before anything is compiled."""
    r = subprocess.run([sys.executable, "-m", "sage_jax.plan", *args], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert names in r.stderr.strip().splitlines()[-1], r.stderr
