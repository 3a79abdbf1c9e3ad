#!/usr/bin/env bash
# Bootstrap one TPU VM worker: a venv with this project's requirements, jax[tpu] and the project itself.
# Idempotent: a marker in the venv records a fingerprint of what was installed; when requirements.txt,
# pyproject.toml and JAX_VERSION are unchanged a re-run returns at once (the project is installed editable,
# so new code needs no reinstall). tpu_vm_pod.sh setup runs this on every worker.
set -euo pipefail

PROJECT_DIR=${PROJECT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
VENV_DIR=${VENV_DIR:-}
PYTHON=${PYTHON:-}
JAX_VERSION=${JAX_VERSION:-}
FORCE=${FORCE:-0}
MIN_PYTHON=3.11
SETUP_FORMAT=1  # bump to make every worker reinstall after a change to the steps below

usage() {
  cat <<EOF
Usage: launch/tpu_worker_setup.sh [--force] [--project-dir DIR]

Creates VENV_DIR (default PROJECT_DIR/.venv) with Python >= $MIN_PYTHON, then pip installs
-r requirements.txt, jax[tpu] (JAX_VERSION, else the jax version requirements.txt brought in) and the project
(pip install -e, or a .pth file when the project has no pyproject.toml). Re-running is cheap: a marker file
records what was installed. Environment: PROJECT_DIR, VENV_DIR, PYTHON (interpreter for the venv), JAX_VERSION,
FORCE=1 (same as --force).
EOF
}

die() {
  echo "tpu_worker_setup.sh (${HOSTNAME:-worker}): error: $*" >&2
  exit 1
}

log() {
  echo "tpu_worker_setup.sh (${HOSTNAME:-worker}): $*"
}

while (($#)); do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --force) FORCE=1 ;;
    --project-dir)
      (($# >= 2)) || die "--project-dir needs a value"
      PROJECT_DIR=$2
      shift
      ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done

[[ -d $PROJECT_DIR/sage_jax ]] || die "PROJECT_DIR '$PROJECT_DIR' has no sage_jax/ package; pass --project-dir"
PROJECT_DIR=$(cd "$PROJECT_DIR" && pwd)
VENV_DIR=${VENV_DIR:-$PROJECT_DIR/.venv}
MARKER="$VENV_DIR/.sage_setup_done"

fingerprint() {
  local f
  {
    echo "format=$SETUP_FORMAT jax=$JAX_VERSION python=$PYTHON"
    for f in requirements.txt pyproject.toml setup.py; do
      if [[ -f $PROJECT_DIR/$f ]]; then
        echo "== $f"
        cat "$PROJECT_DIR/$f"
      fi
    done
  } | sha256sum | cut -d' ' -f1
}

python_ok() {
  command -v "$1" >/dev/null 2>&1 &&
    "$1" -c "import sys; sys.exit(sys.version_info < tuple(map(int, '$MIN_PYTHON'.split('.'))))" 2>/dev/null
}

find_python() {
  local candidate
  if [[ -n $PYTHON ]]; then
    python_ok "$PYTHON" || die "PYTHON='$PYTHON' is not a Python >= $MIN_PYTHON on PATH"
    echo "$PYTHON"
    return
  fi
  for candidate in python3.13 python3.12 python3.11 python3; do
    if python_ok "$candidate"; then
      echo "$candidate"
      return
    fi
  done
  # TPU VM images are Ubuntu 22.04, whose python3 is 3.10; its universe repository has 3.11.
  if command -v apt-get >/dev/null 2>&1; then
    log "no Python >= $MIN_PYTHON found; installing python3.11 with apt-get" >&2
    sudo apt-get update -qq >&2 && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11 python3.11-venv >&2
    if python_ok python3.11; then
      echo python3.11
      return
    fi
  fi
  die "no Python >= $MIN_PYTHON found: install one (e.g. sudo apt-get install python3.11 python3.11-venv) or set PYTHON"
}

make_venv() {  # make_venv PYTHON
  if [[ -x $VENV_DIR/bin/python ]]; then
    return
  fi
  log "creating $VENV_DIR with $1"
  if ! "$1" -m venv "$VENV_DIR"; then
    # Debian/Ubuntu ship venv support separately (pythonX.Y-venv).
    local version
    version=$("$1" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    command -v apt-get >/dev/null 2>&1 || die "'$1 -m venv' failed; install venv support for Python $version"
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "python$version-venv"
    rm -rf "$VENV_DIR"
    "$1" -m venv "$VENV_DIR" || die "'$1 -m venv $VENV_DIR' failed even after installing python$version-venv"
  fi
}

install_all() {
  local vpy="$VENV_DIR/bin/python"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  "$vpy" -m pip install --quiet --upgrade pip
  if [[ -f $PROJECT_DIR/requirements.txt ]]; then
    log "installing requirements.txt"
    "$vpy" -m pip install --quiet -r "$PROJECT_DIR/requirements.txt"
  fi
  # jax[tpu] after the requirements, pinned to the jax they chose, so libtpu matches jax.
  local version=$JAX_VERSION
  if [[ -z $version ]]; then
    version=$("$vpy" -c 'import importlib.metadata as m; print(m.version("jax"))' 2>/dev/null || true)
  fi
  local jax_spec="jax[tpu]${version:+==$version}"
  log "installing $jax_spec"
  "$vpy" -m pip install --quiet "$jax_spec"
  if [[ -f $PROJECT_DIR/pyproject.toml || -f $PROJECT_DIR/setup.py ]]; then
    log "installing the project (editable)"
    "$vpy" -m pip install --quiet -e "$PROJECT_DIR"
  else
    local site
    site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$PROJECT_DIR" >"$site/sage_jax_project.pth"
  fi
  # Import only: touching the devices here would hold the TPU and could collide with a running job.
  "$vpy" -c 'import jax, sage_jax; print("jax", jax.__version__, "sage_jax from", sage_jax.__path__[0])'
}

main() {
  local python want
  want=$(fingerprint)
  if [[ $FORCE != 1 && -f $MARKER && $(cat "$MARKER") == "$want" && -x $VENV_DIR/bin/python ]]; then
    log "already set up ($VENV_DIR); --force to reinstall"
    return
  fi
  python=$(find_python)
  mkdir -p "$(dirname "$VENV_DIR")"
  # One setup at a time per venv (a second `setup` started while the first still runs would race pip).
  exec 9>"$VENV_DIR.lock"
  if command -v flock >/dev/null 2>&1; then
    flock -n 9 || die "another tpu_worker_setup.sh is running for $VENV_DIR; wait for it to finish"
  fi
  rm -f "$MARKER"
  make_venv "$python"
  install_all
  echo "$want" >"$MARKER"
  log "done: $VENV_DIR"
}

main
