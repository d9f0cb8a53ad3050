#!/usr/bin/env bash
# Create a Cloud TPU VM (single host or pod slice), install jax-tinybert on every worker, run
# `python -m jax_tinybert.main` on all workers at once, follow the logs, delete it.
# The same command line runs on all workers, with no coordinator: on start each worker's
# jax_tinybert.parallel.cluster.maybe_initialize_distributed() asks the GCE metadata server (JAX's
# GceTpuCluster: agent-worker-number, worker-network-endpoints, tpu-env) for its worker number and
# the workers' addresses, and starts jax.distributed with worker 0 as the coordinator (port 8482,
# JAX_COORDINATOR_PORT: another) when there is more than one worker; a single host runs alone.
# --cluster=none skips that, --coordinator/--num_processes/--process_id override it.
# `run --until-done` keeps a run going across preemptions: it recreates a lost slice and starts
# the same command on the same gs:// workdir until <workdir>/summary.json exists (see --help).
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
  run --until-done CONFIG --workdir=gs://BUCKET/DIR [ARGS]
                      the same, watched until the run has finished: every --poll seconds the
                      slice's state (tpu-vm describe, or queued-resources describe with --queued)
                      and every worker's exit status are read; a slice that is PREEMPTED,
                      TERMINATED, STOPPED, FAILED, SUSPENDED or missing is deleted, created again
                      (same --spot/--queued/--create-arg), set up (`setup`, then --worker-setup),
                      and the command is started again on the same workdir, which it resumes.
                      A missing slice at the start is created too. Each worker copies its log to
                      <workdir>/logs/worker-<i>-attempt-<k>.log while it runs and when it ends.
                      Exit status: 0 once <workdir>/summary.json exists; 1 after --max-attempts
                      starts without it; 2 when a worker exits 2 (a mistake in the command line,
                      config or data: rerunning cannot help) or the settings are wrong; 130 on
                      Ctrl-C (the run goes on on the slice). Exit 143/130 (preempted, interrupted),
                      any other failure or a lost slice: the next attempt, after --backoff seconds
                      (doubled each attempt, at most 30 min).
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
  --max-attempts N             MAX_ATTEMPTS      run --until-done: starts of the command, default 10
  --backoff SECS               BACKOFF_S         run --until-done: wait before a new attempt, default 30
  --poll SECS                  POLL_S            run --until-done: state and status polls, default 60
  --log-upload SECS            LOG_UPLOAD_S      run --until-done: log copies to the bucket, default 120
  --worker-setup CMD           WORKER_SETUP      run --until-done: run on every worker of each new slice
                                                 after setup, e.g. a gcsfuse mount or staging the
                                                 teacher: 'gcloud storage cp -r gs://b/teacher ~/teacher'
Options:
  --spot                 create a Spot TPU (create)
  --queued               use queued resources (create / status / delete)
  --wait                 create --queued: wait until the queued resource is ACTIVE
  --run-id ID            run: name of the log folder (default: UTC time stamp); tail/stop: which run
  --env KEY=VALUE        run: set an environment variable for the program (repeatable)
  --until-done           run: watch the run and start it again until it has finished (above)
  --create-arg ARG       run --until-done: an extra gcloud flag for creating the slice (repeatable)
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
Or, preemptible and unattended (creates the slice if needed; deletes it when done):
  launch/tpu_vm.sh --spot run --until-done configs/general_distill.py --workdir=gs://my-bucket/jtb/general \
    && launch/tpu_vm.sh delete
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
MAX_ATTEMPTS="${MAX_ATTEMPTS:-10}"
BACKOFF_S="${BACKOFF_S:-30}"
POLL_S="${POLL_S:-60}"
LOG_UPLOAD_S="${LOG_UPLOAD_S:-120}"
WORKER_SETUP="${WORKER_SETUP:-}"
UNTIL_DONE=0
CREATE_ARGS=()
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
    --remote-dir|--venv|--python-version|--log-dir|--git|--ref|--jax-spec|--run-id|--env|--worker|-n|--lines| \
    --max-attempts|--backoff|--poll|--log-upload|--worker-setup|--create-arg)
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
        --max-attempts) MAX_ATTEMPTS="$val" ;;
        --backoff) BACKOFF_S="$val" ;;
        --poll) POLL_S="$val" ;;
        --log-upload) LOG_UPLOAD_S="$val" ;;
        --worker-setup) WORKER_SETUP="$val" ;;
        --create-arg) CREATE_ARGS+=("$val") ;;
      esac ;;
    --spot) SPOT=1 ;;
    --queued) QUEUED=1 ;;
    --wait) WAIT=1 ;;
    --until-done) UNTIL_DONE=1 ;;
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
[[ "$MAX_ATTEMPTS" =~ ^[1-9][0-9]*$ ]] || die "--max-attempts must be a positive whole number, got '$MAX_ATTEMPTS'"
for v in BACKOFF_S POLL_S; do
  if ! [[ "${!v}" =~ ^[0-9]+([.][0-9]+)?$ ]]; then
    flag="--${v%_S}"; die "$v (${flag,,}) must be a number of seconds, got '${!v}'"
  fi
done
[[ "$LOG_UPLOAD_S" =~ ^[1-9][0-9]*$ ]] || die "LOG_UPLOAD_S (--log-upload) must be a whole number of seconds, got '$LOG_UPLOAD_S'"

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

do_create() {  # do_create [GCLOUD_FLAGS...]: tpu-vm create, or queued-resources create (+ --wait)
  local extra=()
  if [[ "$SPOT" -eq 1 ]]; then extra+=(--spot); fi
  if [[ "$QUEUED" -eq 1 ]]; then
    run gcloud compute tpus queued-resources create "$QUEUED_RESOURCE_ID" --node-id="$TPU_NAME" "${LOC[@]}" \
      --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" \
      "${extra[@]+"${extra[@]}"}" "$@"
  else
    run gcloud compute tpus tpu-vm create "$TPU_NAME" "${LOC[@]}" \
      --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" \
      "${extra[@]+"${extra[@]}"}" "$@"
  fi
}

wait_queued_active() {  # create --queued --wait: poll the queued resource every 30 s until ACTIVE
  local describe state every=30
  describe=(gcloud compute tpus queued-resources describe "$QUEUED_RESOURCE_ID" "${LOC[@]}" --format='value(state.state)')
  echo "+ # poll every $every s until ACTIVE: $(quote "${describe[@]}")"
  if [[ "$DRY_RUN" -eq 1 ]]; then return 0; fi
  while true; do
    state="$("${describe[@]}")"
    echo "queued resource $QUEUED_RESOURCE_ID: $state"
    case "$state" in
      ACTIVE) return 0 ;;
      FAILED|SUSPENDED) echo "tpu_vm.sh: queued resource $QUEUED_RESOURCE_ID is $state" >&2; return 1 ;;
    esac
    sleep "$every"
  done
}

STAGE_PARENT=""
do_setup() {  # copy (or clone) the checkout to every worker, then the venv and the install
  local dir venv branch stage install
  dir="$(rpath "$REMOTE_DIR")"
  venv="$(rpath "$REMOTE_VENV")"
  if [[ -n "$GIT_URL" ]]; then
    branch=""
    if [[ -n "$GIT_REF" ]]; then branch="--branch $(printf '%q' "$GIT_REF") "; fi
    tpu_ssh all "set -e; rm -rf $dir; git clone --depth 1 $branch$(printf '%q' "$GIT_URL") $dir" || return 1
  else
    if [[ -z "$STAGE_PARENT" ]]; then
      if [[ "$DRY_RUN" -eq 0 ]]; then
        STAGE_PARENT="$(mktemp -d "${TMPDIR:-/tmp}/jtb-stage-XXXXXX")"
        trap cleanup EXIT
      else
        STAGE_PARENT="${TMPDIR:-/tmp}/jtb-stage-XXXXXX"
      fi
    fi
    stage="$STAGE_PARENT/jax-tinybert"
    rm -rf "$stage"
    stage_project "$stage" || return 1
    tpu_ssh all "rm -rf $dir" || return 1
    run gcloud compute tpus tpu-vm scp --worker=all --recurse "$stage" "$TPU_NAME:$REMOTE_DIR" "${LOC[@]}" || return 1
  fi
  install="set -euo pipefail; export PATH=\"\$HOME/.local/bin:\$PATH\"
command -v uv >/dev/null || python3 -m pip install --user --quiet uv || curl -LsSf https://astral.sh/uv/install.sh | sh
test -x $venv/bin/python || uv venv --python $(printf '%q' "$PYTHON_VERSION") $venv
uv pip install --python $venv/bin/python -e $dir'[gcs]' $(printf '%q' "$JAX_SPEC")
$venv/bin/python -c 'import jax, jax_tinybert; print(\"jax\", jax.__version__, \"ok\")'"
  tpu_ssh all "$install"
}

# On each worker of `run --until-done`: runs the command with its output in LOG, copies LOG to
# DEST every EVERY seconds and once more at the end, then writes the exit status to <LOG>.rc
# (after the copy: a status seen means the log is in the bucket). SIGTERM (a preemption notice,
# `stop`) is passed on to the command, which saves its step and exits 143. No single quote in
# it: it travels single-quoted.
# shellcheck disable=SC2016  # expanded by the worker's shell
RUNNER='log=$1; dest=$2; every=$3; shift 3; rcf=${log%.log}.rc; rm -f "$rcf"
up() { timeout 300 gcloud storage cp --quiet "$log" "$dest" >/dev/null 2>&1 || echo "jtb-runner: could not copy $log to $dest" >&2; }
"$@" > "$log" 2>&1 < /dev/null & pid=$!
trap "kill -TERM \$pid 2>/dev/null" TERM INT
t=0; while kill -0 "$pid" 2>/dev/null; do sleep 1; t=$((t + 1)); if [ "$t" -ge "$every" ]; then t=0; up; fi; done
rc=0; wait "$pid" || rc=$?
up; echo "$rc" > "$rcf.tmp" && mv "$rcf.tmp" "$rcf"'

launch_command() {  # launch_command RUN_ID [DEST_PREFIX ATTEMPT]: the remote command of `run`
  local run_id="$1" dest="${2:-}" attempt="${3:-}" dir logs latest envs="" args="" prog kv a
  dir="$(rpath "$REMOTE_DIR")"
  logs="$(rpath "$REMOTE_LOG_DIR")/$(printf '%q' "$run_id")"
  latest="$(rpath "$REMOTE_LOG_DIR")/latest"
  for kv in "${RUN_ENV[@]+"${RUN_ENV[@]}"}"; do envs+="$(printf '%q' "$kv") "; done
  for a in "${PROG_ARGS[@]+"${PROG_ARGS[@]}"}"; do args+=" $(printf '%q' "$a")"; done
  prog="env ${envs}$(rpath "$REMOTE_VENV")/bin/python -m jax_tinybert.main --config=$(printf '%q' "$CONFIG")$args"
  printf '%s\n' "set -e; cd $dir; mkdir -p $logs; ln -sfn $(printf '%q' "$run_id") $latest
W=\$(curl -sf -H 'Metadata-Flavor: Google' http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname)"
  if [[ -z "$dest" ]]; then
    printf '%s\n' "nohup $prog > $logs/worker-\$W.log 2>&1 < /dev/null &"
  else
    printf '%s\n' "nohup bash -c '${RUNNER//$'\n'/; }' jtb-runner $logs/worker-\$W.log $(printf '%q' "$dest")/worker-\$W-attempt-$attempt.log $LOG_UPLOAD_S $prog > $logs/worker-\$W.runner.log 2>&1 < /dev/null &"
  fi
  printf '%s\n' "echo \$! > $logs/worker-\$W.pid
echo \"worker \$W: started pid \$!, log $REMOTE_LOG_DIR/$run_id/worker-\$W.log\""
}

stop_command() {  # stop_command LOGS: SIGTERM to every pid of a run's pid files on a worker
  printf '%s' "for f in $1/worker-*.pid; do p=\$(cat \"\$f\"); if kill \"\$p\" 2>/dev/null; then echo \"\$(hostname): stopped pid \$p\"; else echo \"\$(hostname): pid \$p not running\"; fi; done"
}

# --------------------------------------------------------------------------- run --until-done

program_workdir() {  # the program's --workdir (the last one, as absl takes it)
  local a next=0 wd=""
  for a in "${PROG_ARGS[@]+"${PROG_ARGS[@]}"}"; do
    if [[ "$next" -eq 1 ]]; then wd="$a"; next=0; continue; fi
    case "$a" in
      --workdir=*|-workdir=*) wd="${a#*=}" ;;
      --workdir|-workdir) next=1 ;;
    esac
  done
  printf '%s' "$wd"
}

TMP_DIR=""
cleanup() { rm -rf "${STAGE_PARENT:-}" "${TMP_DIR:-}"; }

gs_exists() {  # gs_exists URL: 0 if the object exists, 1 if not; stops on any other answer
  local rc=0 err
  gcloud storage ls "$1" >/dev/null 2>"$TMP_DIR/ls.err" || rc=$?
  if [[ "$rc" -eq 0 ]]; then return 0; fi
  err="$(tr '\n' ' ' < "$TMP_DIR/ls.err")"
  if [[ "$err" == *"matched no objects"* ]]; then return 1; fi
  echo "tpu_vm.sh: cannot read $1 (gcloud storage ls exited $rc: ${err:0:400})" >&2
  echo "  check the bucket's name and your access to it: gcloud auth login; gcloud storage ls ${1%/*}/" >&2
  exit 2
}

next_attempt() {  # ATTEMPT = 1 + the highest attempt number among the logs in <workdir>/logs
  local out n max=0
  out="$(gcloud storage ls "$WORKDIR/logs/" 2>/dev/null || true)"
  for n in $(grep -o 'attempt-[0-9]*\.log' <<< "$out" | tr -dc '0-9\n' || true); do
    if (( 10#$n > max )); then max=$((10#$n)); fi
  done
  ATTEMPT=$((max + 1))
}

slice_name() {
  if [[ "$QUEUED" -eq 1 ]]; then echo "queued resource $QUEUED_RESOURCE_ID"; else echo "TPU VM $TPU_NAME"; fi
}

slice_state() {  # STATE = the TPU VM's state (the queued resource's with --queued), MISSING or UNKNOWN
  local rc=0 out
  if [[ "$QUEUED" -eq 1 ]]; then
    out="$(gcloud compute tpus queued-resources describe "$QUEUED_RESOURCE_ID" "${LOC[@]}" \
      --format='value(state.state)' 2>"$TMP_DIR/describe.err")" || rc=$?
  else
    out="$(gcloud compute tpus tpu-vm describe "$TPU_NAME" "${LOC[@]}" --format='value(state)' \
      2>"$TMP_DIR/describe.err")" || rc=$?
  fi
  if [[ "$rc" -eq 0 ]]; then
    STATE="$(tr -d '[:space:]' <<< "$out")"; STATE="${STATE:-UNKNOWN}"
  elif grep -qiE 'NOT_FOUND|not found' "$TMP_DIR/describe.err"; then
    STATE=MISSING
  else
    STATE=UNKNOWN
    echo "tpu_vm.sh: describe exited $rc: $(tr '\n' ' ' < "$TMP_DIR/describe.err" | cut -c1-300)" >&2
  fi
}

state_class() {  # up, lost (to be created again) or wait (in transition), for the state $1
  if [[ "$QUEUED" -eq 1 ]]; then
    case "$1" in
      ACTIVE) echo up ;;
      SUSPENDING|SUSPENDED|FAILED|DELETING|MISSING) echo lost ;;
      *) echo wait ;;   # ACCEPTED, PROVISIONING, WAITING_FOR_RESOURCES, CREATING, UNKNOWN
    esac
  else
    case "$1" in
      READY) echo up ;;
      PREEMPTED|TERMINATED|STOPPING|STOPPED|FAILED|DELETING|HIDING|HIDDEN|MISSING) echo lost ;;
      *) echo wait ;;   # CREATING, STARTING, RESTARTING, REPAIRING, REIMAGING, UNHIDING, UNKNOWN
    esac
  fi
}

LAST_STATE=""
wait_for_slice() {  # poll until the slice is up or lost: sets STATE and CLASS; says each change
  local unknown=0
  while true; do
    slice_state
    CLASS="$(state_class "$STATE")"
    if [[ "$STATE" != "$LAST_STATE" ]]; then echo "tpu_vm.sh: $(slice_name) is $STATE"; LAST_STATE="$STATE"; fi
    if [[ "$CLASS" != wait ]]; then return 0; fi
    if [[ "$STATE" == UNKNOWN ]]; then unknown=$((unknown + 1)); else unknown=0; fi
    if [[ "$unknown" -ge 30 ]]; then
      echo "tpu_vm.sh: gave up: could not read the state of $(slice_name) 30 times in a row (see above)" >&2
      exit 1
    fi
    sleep "$POLL_S"
  done
}

recreate() {  # delete what is left of the slice, create it again, set it up; non-zero on failure
  if [[ "$STATE" != MISSING ]]; then
    if [[ "$QUEUED" -eq 1 ]]; then
      run gcloud compute tpus queued-resources delete "$QUEUED_RESOURCE_ID" "${LOC[@]}" --force --quiet || true
    else
      run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${LOC[@]}" --quiet || true
    fi
  fi
  do_create "${CREATE_ARGS[@]+"${CREATE_ARGS[@]}"}" || return 1
  wait_for_slice   # a queued resource provisions for a while; a TPU VM is READY once created
  [[ "$CLASS" == up ]] || return 1
  do_setup || return 1
  if [[ -n "$WORKER_SETUP" ]]; then tpu_ssh all "$WORKER_SETUP" || return 1; fi
}

exit_meaning() {  # a few words on a worker's exit status
  case "$1" in
    0) echo "finished" ;;
    2) echo "a mistake in the command line, config or data" ;;
    130) echo "interrupted: saved its step" ;;
    134) echo "aborted, e.g. after another worker died" ;;
    137) echo "killed (SIGKILL), e.g. out of memory" ;;
    143) echo "preempted: saved its step" ;;
    *) echo "failed" ;;
  esac
}

status_command() {  # status_command LOGS: one "jtb-status worker W running|exit RC|gone" line a worker
  # shellcheck disable=SC2016  # expanded by the worker's shell
  printf '%s' "for f in $1/worker-*.pid; do "'[ -e "$f" ] || continue; w=${f##*/worker-}; w=${w%.pid}; r=${f%.pid}.rc; if [ -f "$r" ]; then echo "jtb-status worker $w exit $(cat "$r")"; elif kill -0 "$(cat "$f")" 2>/dev/null; then echo "jtb-status worker $w running"; else echo "jtb-status worker $w gone"; fi; done'
}

watch_attempt() {  # watch_attempt RUN_ID: until every worker has ended or the slice is lost;
  # sets OUTCOME (what happened) and FATAL (an exit status to stop with; empty: try again)
  local logs status out failed user_error running ended quiet=0 answered="$SECONDS" first_fail="" w what code
  logs="$(rpath "$REMOTE_LOG_DIR")/$(printf '%q' "$1")"
  status="$(status_command "$logs")"
  FATAL=""
  echo "+ # every $POLL_S s: the $(slice_name)'s state, and on every worker: $(quote gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOC[@]}" --worker=all --command="$status")"
  while true; do
    sleep "$POLL_S"
    wait_for_slice
    if [[ "$CLASS" == lost ]]; then OUTCOME="the $(slice_name) was $STATE"; return 0; fi
    if ! out="$(gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOC[@]}" --worker=all --command="$status" 2>"$TMP_DIR/ssh.err")"; then
      out=""
    fi
    running=0 ended=0 failed="" user_error=""
    while read -r _ _ w what code; do
      case "$what" in
        running) running=$((running + 1)) ;;
        exit)
          ended=$((ended + 1))
          if [[ "$code" != 0 ]]; then failed+="worker $w exited $code ($(exit_meaning "$code")), "; fi
          if [[ "$code" == 2 ]]; then user_error="$w"; fi ;;
        gone) ended=$((ended + 1)); failed+="worker $w's program vanished (no exit status), " ;;
      esac
    done < <(grep -oE 'jtb-status worker [A-Za-z0-9._-]+ (running|gone|exit [0-9]+)' <<< "$out" || true)
    if (( running + ended < NWORKERS )); then   # not every worker answered (a slice going down?)
      quiet=$((quiet + 1))
      if (( quiet >= 10 && SECONDS - answered >= 300 )); then
        OUTCOME="the workers did not answer for $((SECONDS - answered)) s ($(tr '\n' ' ' < "$TMP_DIR/ssh.err" | cut -c1-200))"
        return 0
      fi
      continue
    fi
    quiet=0 answered="$SECONDS"
    if (( running > 0 )); then
      # A failed worker takes the others down within JAX's heartbeat timeout (100 s); stop
      # any still running 5 min after it.
      if [[ -n "$failed" && -z "$first_fail" ]]; then first_fail="$SECONDS"; fi
      if [[ -n "$first_fail" ]] && (( SECONDS - first_fail > 300 )); then
        echo "tpu_vm.sh: ${failed%, }; stopping the workers still running"
        tpu_ssh all "$(stop_command "$logs")" || true
        first_fail=$((SECONDS + 600))
      fi
      continue
    fi
    if [[ -n "$user_error" ]]; then
      OUTCOME="${failed%, }; see $WORKDIR/logs/worker-$user_error-attempt-$ATTEMPT_NOW.log"; FATAL=2; return 0
    fi
    if [[ -n "$failed" ]]; then OUTCOME="${failed%, }"; return 0; fi
    if gs_exists "$SUMMARY"; then OUTCOME="every worker finished"; return 0; fi
    OUTCOME="every worker exited 0 but $SUMMARY is missing (a --check run, or not a training stage?)"
    FATAL=1; return 0
  done
}

run_until_done() {
  local base tries=0 delay="$BACKOFF_S" out rc
  WORKDIR="$(program_workdir)"; WORKDIR="${WORKDIR%/}"
  [[ -n "$WORKDIR" ]] || die "run --until-done needs the program's --workdir=gs://BUCKET/DIR (where it checks for summary.json and copies the logs)"
  if [[ "$WORKDIR" != gs://?* ]]; then
    die "run --until-done: --workdir=$WORKDIR is not a gs:// URL; a new slice starts with empty disks and this machine must see the workdir: pass the bucket's URL (--workdir=gs://BUCKET/DIR; setup installs gcsfs), also when the workers mount it"
  fi
  SUMMARY="$WORKDIR/summary.json"
  base="${RUN_ID:-$(date -u +%Y%m%d-%H%M%S)}"
  if [[ "$DRY_RUN" -eq 1 ]]; then
    echo "+ # until $SUMMARY exists, at most $MAX_ATTEMPTS attempts, $BACKOFF_S s between them (doubled each time):"
    run gcloud storage ls "$SUMMARY"
    if [[ "$QUEUED" -eq 1 ]]; then
      run gcloud compute tpus queued-resources describe "$QUEUED_RESOURCE_ID" "${LOC[@]}" --format='value(state.state)'
    else
      run gcloud compute tpus tpu-vm describe "$TPU_NAME" "${LOC[@]}" --format='value(state)'
    fi
    echo "+ # a missing or lost slice: delete, create${CREATE_ARGS[*]:+ $(quote "${CREATE_ARGS[@]}")}, setup${WORKER_SETUP:+, then on every worker: $WORKER_SETUP}"
    tpu_ssh all "$(launch_command "$base-attempt-1" "$WORKDIR/logs" 1)"
    echo "+ # every $POLL_S s: the state, and on every worker: $(status_command "$(rpath "$REMOTE_LOG_DIR")/$base-attempt-1")"
    return 0
  fi
  TMP_DIR="$(mktemp -d "${TMPDIR:-/tmp}/jtb-until-done-XXXXXX")"
  trap cleanup EXIT
  trap 'echo "tpu_vm.sh: stopped watching; the run goes on on the slice (launch/tpu_vm.sh tail / stop / delete)" >&2; exit 130' INT
  next_attempt
  while true; do
    if gs_exists "$SUMMARY"; then
      echo "tpu_vm.sh: finished: $SUMMARY exists ($tries attempt(s) by this command); logs in $WORKDIR/logs/"
      exit 0
    fi
    if (( tries >= MAX_ATTEMPTS )); then
      echo "tpu_vm.sh: gave up after $tries attempt(s) (--max-attempts $MAX_ATTEMPTS) without $SUMMARY; the last: ${OUTCOME:-?}. Logs: $WORKDIR/logs/. Rerun the same command to go on from the last checkpoint." >&2
      exit 1
    fi
    if (( tries > 0 )); then
      echo "tpu_vm.sh: next attempt in $delay s"
      sleep "$delay"
      delay="$(awk -v d="$delay" 'BEGIN { d *= 2; if (d > 1800) d = 1800; print d }')"
    fi
    tries=$((tries + 1)); ATTEMPT_NOW="$ATTEMPT"; ATTEMPT=$((ATTEMPT + 1))
    echo "tpu_vm.sh: attempt $ATTEMPT_NOW ($tries of at most $MAX_ATTEMPTS), workdir $WORKDIR"
    wait_for_slice
    if [[ "$CLASS" == lost ]]; then
      echo "tpu_vm.sh: the $(slice_name) is $STATE: deleting it and creating it again"
      if ! recreate; then OUTCOME="could not create and set up the $(slice_name)"; continue; fi
    fi
    rc=0
    out="$(tpu_ssh all "$(launch_command "$base-attempt-$ATTEMPT_NOW" "$WORKDIR/logs" "$ATTEMPT_NOW")")" || rc=$?
    printf '%s\n' "$out"
    NWORKERS="$(grep -cE '^worker [^ ]+: started pid [0-9]+' <<< "$out" || true)"
    if [[ "$rc" -ne 0 || "$NWORKERS" -eq 0 ]]; then OUTCOME="could not start the command (ssh exited $rc)"; continue; fi
    watch_attempt "$base-attempt-$ATTEMPT_NOW"
    echo "tpu_vm.sh: attempt $ATTEMPT_NOW ended: $OUTCOME; logs: $WORKDIR/logs/worker-*-attempt-$ATTEMPT_NOW.log"
    if [[ -n "$FATAL" ]]; then
      echo "tpu_vm.sh: gave up: $OUTCOME; rerunning cannot help: fix it, then run the same command" >&2
      exit "$FATAL"
    fi
  done
}

case "$SUBCOMMAND" in
  create)
    require TPU_NAME ZONE PROJECT ACCELERATOR_TYPE RUNTIME_VERSION
    check_gcloud
    do_create "${POSITIONAL[@]+"${POSITIONAL[@]}"}"
    if [[ "$QUEUED" -eq 1 ]]; then
      if [[ "$WAIT" -eq 1 ]]; then
        wait_queued_active || exit 2
      else
        echo "# queued: check with 'launch/tpu_vm.sh --queued status'; run 'setup' once it is ACTIVE"
      fi
    fi
    ;;

  setup)
    require TPU_NAME ZONE PROJECT
    check_gcloud
    do_setup
    ;;

  run)
    require TPU_NAME ZONE PROJECT
    if [[ "$UNTIL_DONE" -eq 1 ]]; then require ACCELERATOR_TYPE RUNTIME_VERSION; fi
    check_gcloud
    [[ ${#POSITIONAL[@]} -ge 1 ]] || die "run needs a CONFIG, e.g. run configs/general_distill.py --workdir=gs://bucket/dir"
    CONFIG="${POSITIONAL[0]#--config=}"   # `run -- --config=X ...` too
    PROG_ARGS=("${POSITIONAL[@]:1}")
    if [[ "$UNTIL_DONE" -eq 1 ]]; then run_until_done; exit 0; fi
    RUN_ID="${RUN_ID:-$(date -u +%Y%m%d-%H%M%S)}"
    tpu_ssh all "$(launch_command "$RUN_ID")"
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
    tpu_ssh all "$(stop_command "$logs")"
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
