#!/usr/bin/env bash
# Create a Cloud TPU VM (single host or pod slice), install jax-tinybert on every worker, run
# `python -m jax_tinybert.main` on all workers at once, follow the logs, delete it.
# The same command line runs on all workers, with no coordinator: on start each worker's
# jax_tinybert.parallel.cluster.maybe_initialize_distributed() asks the GCE metadata server (JAX's
# GceTpuCluster: agent-worker-number, worker-network-endpoints, tpu-env) for its worker number and
# the workers' addresses, and starts jax.distributed with worker 0 as the coordinator (port 8482,
# JAX_COORDINATOR_PORT: another) when there is more than one worker; a single host runs alone.
# --cluster=none skips that, --coordinator/--num_processes/--process_id override it.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: launch/tpu_vm.sh [options] SUBCOMMAND [arguments]

Subcommands:
  create              create the TPU VM (tpu-vm create), or with --queued a queued resource
                      (queued-resources create); extra gcloud flags may follow `--`
  setup               copy this checkout to every worker (tpu-vm scp --worker=all --recurse), or
                      clone --git URL there, then create a Python venv with uv and
                      `pip install -e "<dir>[gcs]" "jax[tpu]"` on every worker (gcsfs: gs:// workdirs)
  run CONFIG [ARGS]   on every worker, nohup `<venv>/bin/python -m jax_tinybert.main --config=CONFIG ARGS`
                      in <remote-dir>, each worker logging to <log-dir>/<run-id>/worker-<i>.log;
                      everything after CONFIG is passed to the program unchanged
  tail                show the last lines of every worker's log of the latest run (-f: follow)
  stop                kill the latest run on every worker (by the pid files written by `run`)
  ssh [COMMAND]       run COMMAND on every worker (--worker to pick one), or open a shell
  status              describe the TPU VM (or the queued resource with --queued)
  delete              delete the TPU VM (with --queued: the queued resource and its node)

Settings (flag or environment variable; flags win):
  --name NAME                  TPU_NAME          TPU VM name                               [required]
  --zone ZONE                  ZONE              e.g. us-central2-b                        [required]
  --project PROJECT            PROJECT           Google Cloud project id                   [required]
  --accelerator-type TYPE      ACCELERATOR_TYPE  e.g. v4-8, v4-32, v5litepod-16  [required by create]
  --runtime-version VERSION    RUNTIME_VERSION   default tpu-ubuntu2204-base (v5e: v2-alpha-tpuv5-lite,
                                                 v5p: v2-alpha-tpuv5, v6e: v2-alpha-tpuv6e)
  --queued-resource-id ID      QUEUED_RESOURCE_ID  default <name>-qr
  --remote-dir DIR             REMOTE_DIR        checkout on the workers, default jax-tinybert
                                                 (relative paths are relative to the remote home)
  --venv DIR                   REMOTE_VENV       venv on the workers, default jtb-venv
  --python-version V           PYTHON_VERSION    venv Python (jax 0.10 needs >= 3.11), default 3.12
  --log-dir DIR                REMOTE_LOG_DIR    logs on the workers, default jtb-logs
  --git URL                    GIT_URL           setup: clone URL instead of copying this checkout
  --ref REF                    GIT_REF           setup: branch or tag to clone
  --jax-spec SPEC              JAX_SPEC          setup: default "jax[tpu]>=0.10,<0.11"
Options:
  --spot                 create a Spot TPU (create)
  --queued               use queued resources (create / status / delete)
  --wait                 create --queued: wait until the queued resource is ACTIVE
  --run-id ID            run: name of the log folder (default: UTC time stamp); tail/stop: which run
  --env KEY=VALUE        run: set an environment variable for the program (repeatable)
  --worker W             ssh / tail: one worker (default all)
  -n, --lines N          tail: number of lines (default 40)
  -f, --follow           tail: follow (tail -F)
  --dry-run              print the commands without running them
  -h, --help             this help
Options go before CONFIG; every command is printed (prefixed with "+") before it runs.
A missing required setting stops the script with the list of all missing ones.

Example (v4-32 = 4 hosts x 4 chips):
  export TPU_NAME=jtb ZONE=us-central2-b PROJECT=my-project ACCELERATOR_TYPE=v4-32
  launch/tpu_vm.sh create --spot
  launch/tpu_vm.sh setup
  launch/tpu_vm.sh run configs/general_distill.py --workdir=gs://my-bucket/jtb/general
  launch/tpu_vm.sh tail -f
  launch/tpu_vm.sh delete
USAGE
}

die() { echo "tpu_vm.sh: $*" >&2; exit 2; }

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(dirname "$SCRIPT_DIR")"

TPU_NAME="${TPU_NAME:-}"
ZONE="${ZONE:-}"
PROJECT="${PROJECT:-}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-}"
RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
QUEUED_RESOURCE_ID="${QUEUED_RESOURCE_ID:-}"
REMOTE_DIR="${REMOTE_DIR:-jax-tinybert}"
REMOTE_VENV="${REMOTE_VENV:-jtb-venv}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
REMOTE_LOG_DIR="${REMOTE_LOG_DIR:-jtb-logs}"
GIT_URL="${GIT_URL:-}"
GIT_REF="${GIT_REF:-}"
JAX_SPEC="${JAX_SPEC:-jax[tpu]>=0.10,<0.11}"
SPOT=0
QUEUED=0
WAIT=0
RUN_ID=""
WORKER="all"
LINES=40
FOLLOW=0
DRY_RUN=0
RUN_ENV=()
SUBCOMMAND=""
POSITIONAL=()

# Options are accepted before and after the subcommand; for `run`, everything after CONFIG and
# everything after `--` is passed through untouched.
while [[ $# -gt 0 ]]; do
  if [[ "$SUBCOMMAND" == "run" && ${#POSITIONAL[@]} -ge 1 ]]; then
    POSITIONAL+=("$@"); break
  fi
  opt="$1"; val=""; has_val=0
  if [[ "$opt" == --*=* ]]; then val="${opt#*=}"; opt="${opt%%=*}"; has_val=1; fi
  shift_n=1
  case "$opt" in
    --name|--tpu-name|--zone|--project|--accelerator-type|--runtime-version|--queued-resource-id| \
    --remote-dir|--venv|--python-version|--log-dir|--git|--ref|--jax-spec|--run-id|--env|--worker|-n|--lines)
      if [[ "$has_val" -eq 0 ]]; then
        [[ $# -ge 2 ]] || die "$opt needs a value"
        val="$2"; shift_n=2
      fi
      case "$opt" in
        --name|--tpu-name) TPU_NAME="$val" ;;
        --zone) ZONE="$val" ;;
        --project) PROJECT="$val" ;;
        --accelerator-type) ACCELERATOR_TYPE="$val" ;;
        --runtime-version) RUNTIME_VERSION="$val" ;;
        --queued-resource-id) QUEUED_RESOURCE_ID="$val" ;;
        --remote-dir) REMOTE_DIR="$val" ;;
        --venv) REMOTE_VENV="$val" ;;
        --python-version) PYTHON_VERSION="$val" ;;
        --log-dir) REMOTE_LOG_DIR="$val" ;;
        --git) GIT_URL="$val" ;;
        --ref) GIT_REF="$val" ;;
        --jax-spec) JAX_SPEC="$val" ;;
        --run-id) RUN_ID="$val" ;;
        --env) [[ "$val" == *=* ]] || die "--env needs KEY=VALUE, got '$val'"; RUN_ENV+=("$val") ;;
        --worker) WORKER="$val" ;;
        -n|--lines) LINES="$val" ;;
      esac ;;
    --spot) SPOT=1 ;;
    --queued) QUEUED=1 ;;
    --wait) WAIT=1 ;;
    -f|--follow) FOLLOW=1 ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; POSITIONAL+=("$@"); break ;;
    -*)
      if [[ "$SUBCOMMAND" == "ssh" ]]; then POSITIONAL+=("$1"); else die "unknown option '$1' (see --help)"; fi ;;
    *)
      if [[ -z "$SUBCOMMAND" ]]; then SUBCOMMAND="$1"; else POSITIONAL+=("$1"); fi ;;
  esac
  shift "$shift_n"
done

[[ -n "$SUBCOMMAND" ]] || { usage >&2; exit 2; }
QUEUED_RESOURCE_ID="${QUEUED_RESOURCE_ID:-${TPU_NAME}-qr}"
[[ "$LINES" =~ ^[0-9]+$ ]] || die "--lines must be a number, got '$LINES'"

require() {  # require VAR...: stop with the list of every missing one
  local missing=() v
  for v in "$@"; do
    if [[ -z "${!v:-}" ]]; then missing+=("$v"); fi
  done
  if [[ ${#missing[@]} -gt 0 ]]; then
    echo "tpu_vm.sh $SUBCOMMAND: missing required settings: ${missing[*]}" >&2
    echo "  set them as environment variables or flags (e.g. TPU_NAME=... or --name ...); see --help" >&2
    exit 2
  fi
}

quote() {  # print arguments shell-quoted, readable when nothing needs quoting
  local out="" a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+="$a "; else out+="'${a//\'/\'\\\'\'}' "; fi
  done
  printf '%s\n' "${out% }"
}

run() {  # print, then run unless --dry-run
  echo "+ $(quote "$@")"
  if [[ "$DRY_RUN" -eq 0 ]]; then "$@"; fi
}

check_gcloud() {
  if [[ "$DRY_RUN" -eq 0 ]] && ! command -v gcloud >/dev/null 2>&1; then
    die "gcloud not found: install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install)"
  fi
}

# A path on the workers as a remote shell word: relative paths are relative to $HOME there.
rpath() {
  # shellcheck disable=SC2016  # $HOME is meant for the remote shell
  if [[ "$1" == /* ]]; then printf '%q' "$1"; else printf '"$HOME"/%q' "$1"; fi
}

LOC=(--zone="$ZONE" --project="$PROJECT")

tpu_ssh() {  # tpu_ssh WORKER REMOTE_COMMAND
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOC[@]}" --worker="$1" --command="$2"
}

stage_project() {  # copy the checkout's tracked and untracked-but-not-ignored files to $1
  local dest="$1"
  echo "+ # stage $REPO_DIR (git-tracked and untracked, not ignored files) into $dest"
  if [[ "$DRY_RUN" -eq 1 ]]; then return 0; fi
  mkdir -p "$dest"
  if git -C "$REPO_DIR" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$REPO_DIR" && git ls-files -z --cached --others --exclude-standard |
      while IFS= read -r -d '' f; do if [[ -f "$f" ]]; then printf '%s\0' "$f"; fi; done |
      tar --null -T - -cf -) | tar -xf - -C "$dest"
  else
    (cd "$REPO_DIR" && tar --exclude=./.venv --exclude=./.git --exclude=./runs -cf - .) | tar -xf - -C "$dest"
  fi
}

case "$SUBCOMMAND" in
  create)
    require TPU_NAME ZONE PROJECT ACCELERATOR_TYPE RUNTIME_VERSION
    check_gcloud
    extra=()
    if [[ "$SPOT" -eq 1 ]]; then extra+=(--spot); fi
    if [[ "$QUEUED" -eq 1 ]]; then
      run gcloud compute tpus queued-resources create "$QUEUED_RESOURCE_ID" --node-id="$TPU_NAME" "${LOC[@]}" \
        --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" \
        "${extra[@]+"${extra[@]}"}" "${POSITIONAL[@]+"${POSITIONAL[@]}"}"
      if [[ "$WAIT" -eq 1 ]]; then
        describe=(gcloud compute tpus queued-resources describe "$QUEUED_RESOURCE_ID" "${LOC[@]}" --format='value(state.state)')
        echo "+ # poll every 30 s until ACTIVE: $(quote "${describe[@]}")"
        if [[ "$DRY_RUN" -eq 0 ]]; then
          while true; do
            state="$("${describe[@]}")"
            echo "queued resource $QUEUED_RESOURCE_ID: $state"
            case "$state" in
              ACTIVE) break ;;
              FAILED|SUSPENDED) die "queued resource $QUEUED_RESOURCE_ID is $state" ;;
            esac
            sleep 30
          done
        fi
      else
        echo "# queued: check with 'launch/tpu_vm.sh --queued status'; run 'setup' once it is ACTIVE"
      fi
    else
      run gcloud compute tpus tpu-vm create "$TPU_NAME" "${LOC[@]}" \
        --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" \
        "${extra[@]+"${extra[@]}"}" "${POSITIONAL[@]+"${POSITIONAL[@]}"}"
    fi
    ;;

  setup)
    require TPU_NAME ZONE PROJECT
    check_gcloud
    dir="$(rpath "$REMOTE_DIR")"
    venv="$(rpath "$REMOTE_VENV")"
    if [[ -n "$GIT_URL" ]]; then
      branch=""
      if [[ -n "$GIT_REF" ]]; then branch="--branch $(printf '%q' "$GIT_REF") "; fi
      tpu_ssh all "set -e; rm -rf $dir; git clone --depth 1 $branch$(printf '%q' "$GIT_URL") $dir"
    else
      stage_parent=""
      if [[ "$DRY_RUN" -eq 0 ]]; then
        stage_parent="$(mktemp -d "${TMPDIR:-/tmp}/jtb-stage-XXXXXX")"
        trap 'rm -rf "$stage_parent"' EXIT
      else
        stage_parent="${TMPDIR:-/tmp}/jtb-stage-XXXXXX"
      fi
      stage="$stage_parent/jax-tinybert"
      stage_project "$stage"
      tpu_ssh all "rm -rf $dir"
      run gcloud compute tpus tpu-vm scp --worker=all --recurse "$stage" "$TPU_NAME:$REMOTE_DIR" "${LOC[@]}"
    fi
    install="set -euo pipefail; export PATH=\"\$HOME/.local/bin:\$PATH\"
command -v uv >/dev/null || python3 -m pip install --user --quiet uv || curl -LsSf https://astral.sh/uv/install.sh | sh
test -x $venv/bin/python || uv venv --python $(printf '%q' "$PYTHON_VERSION") $venv
uv pip install --python $venv/bin/python -e $dir'[gcs]' $(printf '%q' "$JAX_SPEC")
$venv/bin/python -c 'import jax, jax_tinybert; print(\"jax\", jax.__version__, \"ok\")'"
    tpu_ssh all "$install"
    ;;

  run)
    require TPU_NAME ZONE PROJECT
    check_gcloud
    [[ ${#POSITIONAL[@]} -ge 1 ]] || die "run needs a CONFIG, e.g. run configs/general_distill.py --workdir=gs://bucket/dir"
    config="${POSITIONAL[0]}"
    prog_args=("${POSITIONAL[@]:1}")
    RUN_ID="${RUN_ID:-$(date -u +%Y%m%d-%H%M%S)}"
    dir="$(rpath "$REMOTE_DIR")"
    logs="$(rpath "$REMOTE_LOG_DIR")/$(printf '%q' "$RUN_ID")"
    latest="$(rpath "$REMOTE_LOG_DIR")/latest"
    envs=""
    for kv in "${RUN_ENV[@]+"${RUN_ENV[@]}"}"; do envs+="$(printf '%q' "$kv") "; done
    args=""
    for a in "${prog_args[@]+"${prog_args[@]}"}"; do args+=" $(printf '%q' "$a")"; done
    remote="set -e; cd $dir; mkdir -p $logs; ln -sfn $(printf '%q' "$RUN_ID") $latest
W=\$(curl -sf -H 'Metadata-Flavor: Google' http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname)
nohup env ${envs}$(rpath "$REMOTE_VENV")/bin/python -m jax_tinybert.main --config=$(printf '%q' "$config")$args > $logs/worker-\$W.log 2>&1 < /dev/null &
echo \$! > $logs/worker-\$W.pid
echo \"worker \$W: started pid \$!, log $REMOTE_LOG_DIR/$RUN_ID/worker-\$W.log\""
    tpu_ssh all "$remote"
    echo "# follow with: launch/tpu_vm.sh tail -f   (run id $RUN_ID)"
    ;;

  tail)
    require TPU_NAME ZONE PROJECT
    check_gcloud
    logs="$(rpath "$REMOTE_LOG_DIR")/$(printf '%q' "${RUN_ID:-latest}")"
    if [[ "$FOLLOW" -eq 1 ]]; then
      tpu_ssh "$WORKER" "tail -v -n $LINES -F $logs/worker-*.log"
    else
      tpu_ssh "$WORKER" "tail -v -n $LINES $logs/worker-*.log"
    fi
    ;;

  stop)
    require TPU_NAME ZONE PROJECT
    check_gcloud
    logs="$(rpath "$REMOTE_LOG_DIR")/$(printf '%q' "${RUN_ID:-latest}")"
    tpu_ssh all "for f in $logs/worker-*.pid; do p=\$(cat \"\$f\"); if kill \"\$p\" 2>/dev/null; then echo \"\$(hostname): stopped pid \$p\"; else echo \"\$(hostname): pid \$p not running\"; fi; done"
    ;;

  ssh)
    require TPU_NAME ZONE PROJECT
    check_gcloud
    if [[ ${#POSITIONAL[@]} -ge 1 ]]; then
      tpu_ssh "$WORKER" "${POSITIONAL[*]}"
    else
      [[ "$WORKER" != "all" ]] || WORKER=0
      run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOC[@]}" --worker="$WORKER"
    fi
    ;;

  status)
    require TPU_NAME ZONE PROJECT
    check_gcloud
    if [[ "$QUEUED" -eq 1 ]]; then
      run gcloud compute tpus queued-resources describe "$QUEUED_RESOURCE_ID" "${LOC[@]}"
    else
      run gcloud compute tpus tpu-vm describe "$TPU_NAME" "${LOC[@]}"
    fi
    ;;

  delete)
    require TPU_NAME ZONE PROJECT
    check_gcloud
    if [[ "$QUEUED" -eq 1 ]]; then
      run gcloud compute tpus queued-resources delete "$QUEUED_RESOURCE_ID" "${LOC[@]}" --force --quiet
    else
      run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${LOC[@]}" --quiet
    fi
    ;;

  *)
    die "unknown subcommand '$SUBCOMMAND' (create, setup, run, tail, stop, ssh, status, delete; see --help)" ;;
esac
