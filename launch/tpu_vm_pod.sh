#!/usr/bin/env bash
# Drive a Cloud TPU VM slice for sage_jax: create it, put the project on every worker, start training on all
# workers at once, follow the log, stop, delete. `--dry-run` prints the gcloud commands instead of running them.
# Written for bash 3.2 too (macOS laptops): no mapfile, no ${x@Q}, empty arrays expanded with ${a[@]+...}.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

TPU_NAME=${TPU_NAME:-sage-jax}
ZONE=${ZONE:-}
PROJECT=${PROJECT:-}
ACCEL_TYPE=${ACCEL_TYPE:-}
RUNTIME_VERSION=${RUNTIME_VERSION:-}
BUCKET=${BUCKET:-}
CONFIG=${CONFIG:-}
WORKDIR=${WORKDIR:-}
RUN_NAME=${RUN_NAME:-}
REMOTE_DIR=${REMOTE_DIR:-sage_jax}
SOURCE_DIR=${SOURCE_DIR:-$(dirname "$SCRIPT_DIR")}
GIT_URL=${GIT_URL:-}
GIT_REF=${GIT_REF:-HEAD}
WORKER=${WORKER:-0}
LOG_LINES=${LOG_LINES:-100}
SPOT=${SPOT:-0}
DRY_RUN=${DRY_RUN:-0}
FOLLOW=1
ASSUME_YES=0
subcommand=""
train_args=()
train_env=()

usage() {
  cat <<'EOF'
Usage: launch/tpu_vm_pod.sh [options] COMMAND [-- TRAIN_FLAGS...]

Commands:
  create   create the TPU VM slice (gcloud compute tpus tpu-vm create)
  setup    copy this project to every worker (or git clone it there) and run launch/tpu_worker_setup.sh on each
  run      start `python -m sage_jax.train` on all workers at once, in the background (nohup), logging to
           REMOTE_DIR/logs/RUN_NAME.log; flags after `--` (and any --config.key=value) go to the trainer
  logs     tail the log of the latest run on worker 0 (--worker N for another, --run-name for an older run)
  status   show the slice state and whether training is running on each worker
  stop     stop the training process on every worker
  delete   delete the slice (gcloud asks to confirm unless --yes)

Options (environment variable in brackets; a flag wins over the variable):
  --name NAME              TPU VM name [TPU_NAME, default sage-jax]
  --zone ZONE              e.g. us-central2-b (v4), us-east5-a (v5p) [ZONE, required]
  --project ID             Google Cloud project; default: gcloud's configured project [PROJECT]
  --accelerator-type TYPE  e.g. v4-64, v5p-64, v5litepod-16, v6e-8 [ACCEL_TYPE, required by create]
  --version RUNTIME        TPU software version; default from the accelerator: tpu-ubuntu2204-base (v2-v4),
                           v2-alpha-tpuv5 (v5p), v2-alpha-tpuv5-lite (v5e), v2-alpha-tpuv6e (v6e) [RUNTIME_VERSION]
  --spot                   create a Spot (preemptible) slice [SPOT=1]
  --bucket BUCKET          gs:// bucket for run workdirs; the workdir is gs://BUCKET/RUN_NAME [BUCKET]
  --config FILE            training config, relative to the project root, e.g. configs/qwen7b_branch.py [CONFIG]
  --workdir gs://...       workdir for the run instead of gs://BUCKET/RUN_NAME [WORKDIR]
  --run-name NAME          run (log and workdir) name; default CONFIGNAME-YYYYmmdd-HHMMSS; reuse one to resume [RUN_NAME]
  --env KEY=VALUE          environment variable for the training processes (repeatable)
  --remote-dir DIR         project folder on the workers, relative to the home folder [REMOTE_DIR, default sage_jax]
  --source DIR             local project to copy (git-tracked and untracked, not ignored, files) [SOURCE_DIR]
  --git-url URL            setup clones URL on the workers instead of copying --source [GIT_URL]
  --git-ref REF            branch, tag or commit to check out with --git-url [GIT_REF, default HEAD]
  --worker N|all           worker for logs [WORKER, default 0]
  --lines N                lines of log to show first [LOG_LINES, default 100]
  --no-follow              logs: print and exit instead of following
  --yes                    delete without asking
  --dry-run                print the commands instead of running them [DRY_RUN=1]
  -h, --help               this help

Example:
  export TPU_NAME=sage-v5p ZONE=us-east5-a ACCEL_TYPE=v5p-64 BUCKET=my-bucket
  launch/tpu_vm_pod.sh create --spot
  launch/tpu_vm_pod.sh setup
  launch/tpu_vm_pod.sh run --config configs/qwen7b_branch.py -- --config.train.steps=500
  launch/tpu_vm_pod.sh logs
  launch/tpu_vm_pod.sh delete
EOF
}

die() {
  echo "tpu_vm_pod.sh: error: $*" >&2
  echo "Run 'launch/tpu_vm_pod.sh --help' for usage." >&2
  exit 2
}

# One word, quoted for a POSIX shell only when it needs it (keeps printed commands readable and pasteable).
q() {
  local sq="'\\''"
  if [[ $1 =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/$sq}"
  fi
}

quote_words() {
  local out="" w
  for w in "$@"; do
    out+="${out:+ }$(q "$w")"
  done
  printf '%s' "$out"
}

run_cmd() {
  if [[ $DRY_RUN == 1 ]]; then
    echo "+ $(quote_words "$@")"
  else
    "$@"
  fi
}

gcloud_tpu() {
  run_cmd gcloud compute tpus tpu-vm "$@" --zone="$ZONE" ${PROJECT:+"--project=$PROJECT"}
}

require() {  # require VAR FLAG HINT
  if [[ -z ${!1} ]]; then
    die "$1 is not set: pass $2 or export $1=...${3:+ ($3)}"
  fi
}

option_variable() {
  case $1 in
    --name) echo TPU_NAME ;;
    --zone) echo ZONE ;;
    --project) echo PROJECT ;;
    --accelerator-type) echo ACCEL_TYPE ;;
    --version) echo RUNTIME_VERSION ;;
    --bucket) echo BUCKET ;;
    --config) echo CONFIG ;;
    --workdir) echo WORKDIR ;;
    --run-name) echo RUN_NAME ;;
    --remote-dir) echo REMOTE_DIR ;;
    --source) echo SOURCE_DIR ;;
    --git-url) echo GIT_URL ;;
    --git-ref) echo GIT_REF ;;
    --worker) echo WORKER ;;
    --lines) echo LOG_LINES ;;
    --env) echo ENV ;;
    *) return 1 ;;
  esac
}

set_option() {  # set_option FLAG VALUE
  local var
  var=$(option_variable "$1")
  if [[ $var == ENV ]]; then
    [[ $2 =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env expects KEY=VALUE, got '$2'"
    train_env+=("$2")
  else
    printf -v "$var" '%s' "$2"
  fi
}

parse_args() {
  while (($#)); do
    case $1 in
      -h | --help) usage; exit 0 ;;
      --dry-run) DRY_RUN=1 ;;
      --spot) SPOT=1 ;;
      --no-follow) FOLLOW=0 ;;
      -y | --yes) ASSUME_YES=1 ;;
      --config.*) train_args+=("$1") ;;  # ml_collections override, e.g. --config.loss.beta=0.01
      --)
        shift
        train_args+=("$@")
        break
        ;;
      --*=*)
        option_variable "${1%%=*}" >/dev/null || die "unknown option '${1%%=*}' (trainer flags go after '--')"
        set_option "${1%%=*}" "${1#*=}"
        ;;
      -*)
        option_variable "$1" >/dev/null || die "unknown option '$1' (trainer flags go after '--')"
        (($# >= 2)) || die "$1 needs a value"
        set_option "$1" "$2"
        shift
        ;;
      *)
        [[ -z $subcommand ]] || die "unexpected argument '$1' (trainer flags go after '--')"
        subcommand=$1
        ;;
    esac
    shift
  done
}

default_runtime() {
  case $1 in
    v2-* | v3-* | v4-*) echo tpu-ubuntu2204-base ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) echo v2-alpha-tpuv5-lite ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    *) die "no default runtime for accelerator '$1': pass --version (list: gcloud compute tpus versions list --zone=$ZONE)" ;;
  esac
}

validate_common() {
  [[ $TPU_NAME =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
    die "TPU_NAME '$TPU_NAME' is not a valid name: use lowercase letters, digits and hyphens, starting with a letter"
  require ZONE --zone "the zone of the slice, e.g. us-central2-b"
  case $REMOTE_DIR in
    "" | "~"* | *" "*) die "REMOTE_DIR '$REMOTE_DIR' must be a path without spaces, relative to the home folder or absolute" ;;
  esac
}

cmd_create() {
  require ACCEL_TYPE --accelerator-type "e.g. v4-64 or v5p-64"
  [[ $ACCEL_TYPE =~ ^v[0-9][a-z0-9]*-[0-9]+$ ]] ||
    die "ACCEL_TYPE '$ACCEL_TYPE' is not an accelerator type like v4-64, v5p-64, v5litepod-16, v6e-8"
  local version=${RUNTIME_VERSION:-$(default_runtime "$ACCEL_TYPE")}
  local args=(create "$TPU_NAME" --accelerator-type="$ACCEL_TYPE" --version="$version")
  if [[ $SPOT == 1 ]]; then
    args+=(--spot)
  fi
  gcloud_tpu "${args[@]}"
}

# NUL-separated files worth shipping: what git sees (tracked and untracked, minus .gitignore) or, outside git,
# everything; never venvs, caches or .git, even when no .gitignore lists them.
project_files() {
  local path
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z -co --exclude-standard
  else
    find . -type f -print0
  fi | while IFS= read -r -d '' path; do
    case /${path#./} in
      */.git/* | */.venv/* | */__pycache__/* | */.pytest_cache/* | */.ipynb_checkpoints/* | *.egg-info/*) ;;
      *) if [[ -e $path ]]; then printf '%s\0' "$path"; fi ;;  # git still lists tracked files deleted locally
    esac
  done
}

make_tarball() {  # make_tarball OUT
  if [[ $DRY_RUN == 1 ]]; then
    echo "+ (cd $(q "$SOURCE_DIR") && git ls-files -z -co --exclude-standard | (minus .git .venv caches) | tar -czf $(q "$1") --null -T -)"
  else
    (cd "$SOURCE_DIR" && project_files | tar -czf "$1" --null -T -)
  fi
}

cmd_setup() {
  local dir setup_cmd remote
  dir=$(q "$REMOTE_DIR")
  setup_cmd="bash $dir/launch/tpu_worker_setup.sh"
  if [[ -n $GIT_URL ]]; then
    local ref
    ref=$(q "$GIT_REF")
    remote="set -e; if [ ! -d $dir/.git ]; then git clone --quiet $(q "$GIT_URL") $dir; fi"
    remote+="; git -C $dir fetch --quiet origin $ref; git -C $dir checkout --quiet --force FETCH_HEAD; $setup_cmd"
  else
    [[ -f $SOURCE_DIR/launch/tpu_worker_setup.sh && -d $SOURCE_DIR/sage_jax ]] ||
      die "SOURCE_DIR '$SOURCE_DIR' is not the sage_jax project (no sage_jax/ or launch/); pass --source or --git-url"
    local archive=sage_jax_src.tgz
    SETUP_TARBALL="${TMPDIR:-/tmp}/sage_jax_src.$$.tgz"
    if [[ $DRY_RUN != 1 ]]; then
      trap 'rm -f "$SETUP_TARBALL"' EXIT
    fi
    make_tarball "$SETUP_TARBALL"
    gcloud_tpu scp "$SETUP_TARBALL" "$TPU_NAME:$archive" --worker=all
    remote="set -e; mkdir -p $dir; tar -xzf $archive -C $dir; rm -f $archive; $setup_cmd"
  fi
  gcloud_tpu ssh "$TPU_NAME" --worker=all --command="$remote"
}

cmd_run() {
  require CONFIG --config "e.g. configs/qwen7b_branch.py"
  if [[ -z $RUN_NAME ]]; then
    RUN_NAME="$(basename "${CONFIG%%:*}" .py)-$(date +%Y%m%d-%H%M%S)"
  fi
  [[ $RUN_NAME =~ ^[A-Za-z0-9._-]+$ ]] || die "RUN_NAME '$RUN_NAME' may use only letters, digits, '.', '_' and '-'"
  if [[ -z $WORKDIR ]]; then
    require BUCKET --bucket "a gs:// bucket every worker can write; or pass --workdir gs://..."
    local bucket=${BUCKET#gs://}
    WORKDIR="gs://${bucket%/}/$RUN_NAME"
  fi
  [[ $WORKDIR == gs://?* ]] ||
    die "workdir '$WORKDIR' must be a gs:// path: every worker writes checkpoints and logs to the same place"

  local train=(.venv/bin/python -m sage_jax.train --config "$CONFIG" --workdir "$WORKDIR")
  train+=(${train_args[@]+"${train_args[@]}"})
  if ((${#train_env[@]})); then
    train=(env "${train_env[@]}" "${train[@]}")
  fi
  local dir log pid=logs/train.pid
  dir=$(q "$REMOTE_DIR")
  log="logs/$RUN_NAME.log"
  local steps=(
    "cd $dir || exit 1"
    "test -x .venv/bin/python || { echo \"\$(hostname): no .venv in $dir; run: tpu_vm_pod.sh setup\" >&2; exit 1; }"
    "test -f $(q "${CONFIG%%:*}") || { echo \"\$(hostname): no config $(q "${CONFIG%%:*}") in $dir; run setup again\" >&2; exit 1; }"
    "mkdir -p logs"
    "if [ -f $pid ] && kill -0 \"\$(cat $pid)\" 2>/dev/null; then echo \"\$(hostname): training already running (pid \$(cat $pid)); run: tpu_vm_pod.sh stop\" >&2; exit 1; fi"
    "nohup $(quote_words "${train[@]}") > $log 2>&1 < /dev/null & echo \$! > $pid"
    "ln -sfn $RUN_NAME.log logs/latest.log"
    "echo \"\$(hostname): started pid \$(cat $pid), log $dir/$log\""
  )
  local remote="" step
  for step in "${steps[@]}"; do
    remote+="${remote:+; }$step"
  done
  echo "run $RUN_NAME: workdir $WORKDIR, log $REMOTE_DIR/$log on every worker" >&2
  gcloud_tpu ssh "$TPU_NAME" --worker=all --command="$remote"
}

cmd_logs() {
  [[ $WORKER =~ ^([0-9]+|all)$ ]] || die "WORKER '$WORKER' must be a worker number (0, 1, ...) or 'all'"
  [[ $LOG_LINES =~ ^[0-9]+$ ]] || die "LOG_LINES '$LOG_LINES' must be a number"
  local file=latest.log
  if [[ -n $RUN_NAME ]]; then
    file="$RUN_NAME.log"
  fi
  local tail_cmd="tail -n $LOG_LINES"
  if [[ $FOLLOW == 1 ]]; then
    tail_cmd+=" -F"
  fi
  gcloud_tpu ssh "$TPU_NAME" --worker="$WORKER" --command="$tail_cmd $(q "$REMOTE_DIR/logs/$file")"
}

cmd_status() {
  gcloud_tpu describe "$TPU_NAME" --format="yaml(state,health,acceleratorType,runtimeVersion,schedulingConfig)"
  local dir pid=logs/train.pid
  dir=$(q "$REMOTE_DIR")
  gcloud_tpu ssh "$TPU_NAME" --worker=all --command="if [ -f $dir/$pid ] && kill -0 \"\$(cat $dir/$pid)\" 2>/dev/null; then echo \"\$(hostname): training (pid \$(cat $dir/$pid))\"; else echo \"\$(hostname): idle\"; fi"
}

cmd_stop() {
  local dir pid=logs/train.pid
  dir=$(q "$REMOTE_DIR")
  gcloud_tpu ssh "$TPU_NAME" --worker=all --command="if [ -f $dir/$pid ] && kill \"\$(cat $dir/$pid)\" 2>/dev/null; then echo \"\$(hostname): stopped pid \$(cat $dir/$pid)\"; else echo \"\$(hostname): not running\"; fi"
}

cmd_delete() {
  local args=(delete "$TPU_NAME")
  if [[ $ASSUME_YES == 1 ]]; then
    args+=(--quiet)
  fi
  gcloud_tpu "${args[@]}"
}

main() {
  parse_args "$@"
  [[ -n $subcommand ]] || die "no command given: one of create, setup, run, logs, status, stop, delete"
  case $subcommand in
    create | setup | run | logs | status | stop | delete) ;;
    *) die "unknown command '$subcommand': one of create, setup, run, logs, status, stop, delete" ;;
  esac
  if ((${#train_args[@]})) && [[ $subcommand != run ]]; then
    die "trainer flags (${train_args[0]} ...) only go with 'run'"
  fi
  validate_common
  if [[ $DRY_RUN != 1 ]] && ! command -v gcloud >/dev/null 2>&1; then
    die "gcloud not found on PATH: install the Google Cloud SDK (https://cloud.google.com/sdk/docs/install) or use --dry-run"
  fi
  "cmd_$subcommand"
}

main "$@"
