#!/usr/bin/env bash
# Start N processes of `python -m jax_tinybert.main` on this machine, each with D CPU devices,
# joined by jax.distributed (gloo collectives) into one N*D-device job. This is how multi-host
# code is exercised without a pod (see docs/scaling.md).
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: launch/local_multiprocess.sh [options] -- [program args...]

Runs N processes of `$PYTHON -m jax_tinybert.main <program args>` on localhost. Each process gets
  JTB_COORDINATOR=127.0.0.1:<free port>  JTB_NUM_PROCESSES=N  JTB_PROCESS_ID=i  JTB_CPU_DEVICES=D
  JAX_PLATFORMS=cpu (unless already set)
and jax_tinybert.parallel.sharding.maybe_initialize_distributed() turns them into a jax.distributed job
with N*D global CPU devices and gloo collectives.

Options:
  -n, --num-processes N   number of processes (default 2)
  -d, --devices D         CPU devices per process (default 4)
  -p, --port P            coordinator port (default: a free port chosen now)
  -t, --timeout SECS      kill everything and exit 124 after SECS seconds (default 0 = none)
  -l, --log-dir DIR       per-process logs DIR/process_<i>.log
                          (default: <workdir>/logs if --workdir=... is a local folder, else a
                          new temp dir)
  -m, --module MOD        Python module to run (default jax_tinybert.main)
  -q, --quiet             do not echo process 0's log to the console
      --dry-run           print the commands and exit
  -h, --help              this help

Environment:
  PYTHON   interpreter (default: .venv/bin/python of the repo if it exists, else python3)
  MALLOC_ARENA_MAX / MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ default to the values that
           stop glibc from unmapping XLA's per-step temporaries (as the Makefile does).
  JTB_STOP_GRACE  seconds the processes get to save and stop after Ctrl-C (default 120).

Process 0's log is also shown on the console. The script waits for all processes; as soon as
one fails it kills the others, names the failed process and its log, and exits with its code.
Where several have failed by then, it names first one that did not abort (SIGABRT): a process
that gloo or JAX aborts because a peer died is the consequence, not the cause.
Ctrl-C (or SIGTERM to this script) sends every process SIGTERM: each saves its step and stops,
as a preempted run does, and the script waits for them (up to JTB_STOP_GRACE seconds, default
120, then kills them) and exits 130 (143 after SIGTERM); rerunning the command resumes. A
second Ctrl-C kills them at once.

Example:
  launch/local_multiprocess.sh -n 2 -d 4 -- --config=configs/demo.py --workdir=runs/mp
USAGE
}

die() { echo "local_multiprocess.sh: $*" >&2; exit 2; }

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(dirname "$SCRIPT_DIR")"

NUM_PROCESSES=2
DEVICES=4
PORT=""
TIMEOUT=0
LOG_DIR=""
MODULE="jax_tinybert.main"
STOP_GRACE="${JTB_STOP_GRACE:-120}"
QUIET=0
DRY_RUN=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    -n|--num-processes) [[ $# -ge 2 ]] || die "$1 needs a value"; NUM_PROCESSES="$2"; shift 2 ;;
    --num-processes=*) NUM_PROCESSES="${1#*=}"; shift ;;
    -d|--devices) [[ $# -ge 2 ]] || die "$1 needs a value"; DEVICES="$2"; shift 2 ;;
    --devices=*) DEVICES="${1#*=}"; shift ;;
    -p|--port) [[ $# -ge 2 ]] || die "$1 needs a value"; PORT="$2"; shift 2 ;;
    --port=*) PORT="${1#*=}"; shift ;;
    -t|--timeout) [[ $# -ge 2 ]] || die "$1 needs a value"; TIMEOUT="$2"; shift 2 ;;
    --timeout=*) TIMEOUT="${1#*=}"; shift ;;
    -l|--log-dir) [[ $# -ge 2 ]] || die "$1 needs a value"; LOG_DIR="$2"; shift 2 ;;
    --log-dir=*) LOG_DIR="${1#*=}"; shift ;;
    -m|--module) [[ $# -ge 2 ]] || die "$1 needs a value"; MODULE="$2"; shift 2 ;;
    --module=*) MODULE="${1#*=}"; shift ;;
    -q|--quiet) QUIET=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option '$1' (program arguments go after --; see --help)" ;;
  esac
done
PROGRAM_ARGS=("$@")

[[ "$NUM_PROCESSES" =~ ^[1-9][0-9]*$ ]] || die "--num-processes must be a positive integer, got '$NUM_PROCESSES'"
[[ "$DEVICES" =~ ^[1-9][0-9]*$ ]] || die "--devices must be a positive integer, got '$DEVICES'"
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] || die "--timeout must be a whole number of seconds, got '$TIMEOUT'"
[[ -z "$PORT" || "$PORT" =~ ^[0-9]+$ ]] || die "--port must be a number, got '$PORT'"
[[ "$STOP_GRACE" =~ ^[0-9]+$ ]] || die "JTB_STOP_GRACE must be a whole number of seconds, got '$STOP_GRACE'"

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO_DIR/.venv/bin/python" ]]; then
    PYTHON="$REPO_DIR/.venv/bin/python"
  else
    PYTHON="python3"
  fi
fi

if [[ -z "$PORT" ]]; then
  if [[ "$DRY_RUN" -eq 1 ]]; then
    PORT="<free-port>"
  else
    PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')" \
      || die "could not pick a free port with $PYTHON"
  fi
fi

if [[ -z "$LOG_DIR" ]]; then
  for arg in "${PROGRAM_ARGS[@]+"${PROGRAM_ARGS[@]}"}"; do
    # A bucket URL (gs://...) is no local folder: its logs go to a temp dir instead.
    case "$arg" in --workdir=*://*) ;; --workdir=*) LOG_DIR="${arg#--workdir=}/logs" ;; esac
  done
fi
if [[ -z "$LOG_DIR" ]]; then
  if [[ "$DRY_RUN" -eq 1 ]]; then
    LOG_DIR="<temp-dir>"
  else
    LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/jtb-local-XXXXXX")"
  fi
fi

export MALLOC_ARENA_MAX="${MALLOC_ARENA_MAX:-1}"
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-17179869184}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-17179869184}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"

quote() {  # print arguments shell-quoted, readable when nothing needs quoting
  local out="" a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+="$a "; else out+="'${a//\'/\'\\\'\'}' "; fi
  done
  printf '%s\n' "${out% }"
}

PIDS=()
TAIL_PID=""

kill_all() {  # kill_all SIGNAL [GRACE]: signal every running process, KILL after GRACE s (5)
  local sig="$1" grace="${2:-5}" pid i
  for pid in "${PIDS[@]+"${PIDS[@]}"}"; do
    if kill -0 "$pid" 2>/dev/null; then kill "-$sig" "$pid" 2>/dev/null || true; fi
  done
  for ((i = 0; i < grace * 10; i++)); do
    local alive=0
    for pid in "${PIDS[@]+"${PIDS[@]}"}"; do
      if kill -0 "$pid" 2>/dev/null; then alive=1; fi
    done
    if [[ "$alive" -eq 0 ]]; then return 0; fi
    sleep 0.1
  done
  for pid in "${PIDS[@]+"${PIDS[@]}"}"; do kill -KILL "$pid" 2>/dev/null || true; done
  # Reaped before this script goes on (or exits): none is left running behind it.
  for pid in "${PIDS[@]+"${PIDS[@]}"}"; do wait "$pid" 2>/dev/null || true; done
}

describe_exit() {  # describe_exit RC: "exit code RC", with the signal's name for 129-192
  local rc="$1" name
  if [[ "$rc" -gt 128 && "$rc" -le 192 ]] && name=$(kill -l $((rc - 128)) 2>/dev/null); then
    echo "exit code $rc (SIG$name)"
  else
    echo "exit code $rc"
  fi
}

stop_tail() {
  if [[ -n "$TAIL_PID" ]]; then
    sleep 0.2  # let tail flush the last lines
    kill "$TAIL_PID" 2>/dev/null || true
    wait "$TAIL_PID" 2>/dev/null || true
    TAIL_PID=""
  fi
}

fail_fast() {  # fail_fast INDEX RC: process INDEX ended with RC != 0; stop all, report, exit
  local failed_idx=("$1") failed_rc=("$2") j k rc_j first=0
  # Others that ended in the same poll: when a peer is killed, gloo or JAX's coordination
  # service aborts the survivors within milliseconds, and scanning in index order would
  # name a survivor first.
  for ((j = 0; j < NUM_PROCESSES; j++)); do
    if [[ "$j" -eq "$1" || "${FINISHED[$j]}" -eq 1 ]] || kill -0 "${PIDS[$j]}" 2>/dev/null; then
      continue
    fi
    rc_j=0
    wait "${PIDS[$j]}" || rc_j=$?
    if [[ "$rc_j" -ne 0 ]]; then failed_idx+=("$j"); failed_rc+=("$rc_j"); fi
  done
  for k in "${!failed_rc[@]}"; do   # an abort (SIGABRT, 134) is usually the consequence
    if [[ "${failed_rc[$k]}" -ne 134 ]]; then first=$k; break; fi
  done
  kill_all TERM
  stop_tail
  local i="${failed_idx[$first]}" rc="${failed_rc[$first]}"
  local log="$LOG_DIR/process_$i.log"
  {
    echo "local_multiprocess.sh: process $i (pid ${PIDS[$i]}) failed with $(describe_exit "$rc"); log: $log"
    echo "----- last lines of $log -----"
    tail -n 30 "$log" || true
    echo "-----"
    for k in "${!failed_idx[@]}"; do
      if [[ "$k" -eq "$first" ]]; then continue; fi
      j="${failed_idx[$k]}"
      echo "local_multiprocess.sh: process $j (pid ${PIDS[$j]}) had failed too, with $(describe_exit "${failed_rc[$k]}"); log: $LOG_DIR/process_$j.log"
    done
    echo "local_multiprocess.sh: stopped the other processes; all logs in $LOG_DIR"
  } >&2
  exit "$rc"
}

STOP_CODE=0

kill_now() {  # a second interrupt while the processes save
  echo "local_multiprocess.sh: killing all processes now" >&2
  kill_all KILL 0
  stop_tail
  exit "$STOP_CODE"
}

on_signal() {  # on_signal EXIT_CODE: Ctrl-C or SIGTERM to this script
  STOP_CODE="$1"
  # The processes run in the background, where Ctrl-C does not reach them: SIGTERM makes each
  # save its step and stop (jax_tinybert/train/preemption.py), which can take a step and a save.
  trap kill_now INT TERM
  echo "local_multiprocess.sh: interrupted; every process saves its step and stops (waiting up to ${STOP_GRACE}s; interrupt again to kill them at once)" >&2
  kill_all TERM "$STOP_GRACE"
  stop_tail
  echo "local_multiprocess.sh: all processes stopped; rerun the same command to resume; logs in $LOG_DIR" >&2
  exit "$STOP_CODE"
}

echo "local_multiprocess.sh: $NUM_PROCESSES processes x $DEVICES CPU devices, coordinator 127.0.0.1:$PORT, logs in $LOG_DIR" >&2
if [[ "$DRY_RUN" -eq 0 ]]; then
  mkdir -p "$LOG_DIR"
  trap 'on_signal 130' INT
  trap 'on_signal 143' TERM
fi

for ((i = 0; i < NUM_PROCESSES; i++)); do
  log="$LOG_DIR/process_$i.log"
  cmd=(env "JTB_COORDINATOR=127.0.0.1:$PORT" "JTB_NUM_PROCESSES=$NUM_PROCESSES" "JTB_PROCESS_ID=$i"
       "JTB_CPU_DEVICES=$DEVICES" "$PYTHON" -m "$MODULE" "${PROGRAM_ARGS[@]+"${PROGRAM_ARGS[@]}"}")
  echo "+ $(quote "${cmd[@]}") > $(quote "$log") 2>&1" >&2
  if [[ "$DRY_RUN" -eq 0 ]]; then
    "${cmd[@]}" > "$log" 2>&1 < /dev/null &
    PIDS+=("$!")
  fi
done
if [[ "$DRY_RUN" -eq 1 ]]; then exit 0; fi

if [[ "$QUIET" -eq 0 ]]; then
  tail -n +1 -f "$LOG_DIR/process_0.log" &
  TAIL_PID=$!
fi

START=$SECONDS
REMAINING=$NUM_PROCESSES
FINISHED=()
for ((i = 0; i < NUM_PROCESSES; i++)); do FINISHED+=(0); done

while [[ "$REMAINING" -gt 0 ]]; do
  for ((i = 0; i < NUM_PROCESSES; i++)); do
    if [[ "${FINISHED[$i]}" -eq 1 ]]; then continue; fi
    pid="${PIDS[$i]}"
    if ! kill -0 "$pid" 2>/dev/null; then
      rc=0
      wait "$pid" || rc=$?
      FINISHED[i]=1
      REMAINING=$((REMAINING - 1))
      if [[ "$rc" -ne 0 ]]; then
        fail_fast "$i" "$rc"
      fi
    fi
  done
  if [[ "$TIMEOUT" -gt 0 && $((SECONDS - START)) -ge "$TIMEOUT" ]]; then
    kill_all TERM
    stop_tail
    echo "local_multiprocess.sh: timeout after ${TIMEOUT}s; killed all processes; logs in $LOG_DIR" >&2
    exit 124
  fi
  if [[ "$REMAINING" -gt 0 ]]; then sleep 0.2; fi
done

stop_tail
echo "local_multiprocess.sh: all $NUM_PROCESSES processes finished successfully; logs in $LOG_DIR" >&2
