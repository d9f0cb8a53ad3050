#!/usr/bin/env bash
# Run `python -m jax_tinybert.main` on one host with all of its GPUs: one process, JAX sees every
# local GPU, and the config's mesh spreads the batch over them.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: launch/gpu.sh [options] [--] --config=configs/<stage>.py[:variant] --workdir=DIR [--config.x.y=...]

Starts one process of `$PYTHON -m jax_tinybert.main ARGS` that uses every local GPU.
The first argument this script does not know, and everything after it (or after `--`), is
passed to the program unchanged.

Options:
  --gpus LIST            restrict to these GPUs (sets CUDA_VISIBLE_DEVICES, e.g. 0,1,2,3)
  --mem-fraction F       XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.90; JAX's own default is 0.75)
  --no-preallocate       XLA_PYTHON_CLIENT_PREALLOCATE=false (allocate on demand; slower, shares the GPU)
  --log FILE             also append the output to FILE
  -m, --module MOD       Python module to run (default jax_tinybert.main)
  --dry-run              print the environment and the command, do not run
  -h, --help             this help

Environment (already-set values win over the defaults above):
  PYTHON                          interpreter (default: .venv/bin/python of the repo if it exists, else python3)
  JAX_PLATFORMS                   default "cuda": fail loudly instead of silently running on the CPU
  XLA_PYTHON_CLIENT_MEM_FRACTION  fraction of each GPU's memory JAX preallocates
  XLA_PYTHON_CLIENT_PREALLOCATE   "false" to allocate on demand
  NCCL_DEBUG                      default WARN
  XLA_FLAGS                       passed through; the program adds the fast-compile GPU flags
                                  --xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0
                                  that it does not name (~20 s a program instead of ~2 min)
  JTB_GPU_AUTOTUNE                1: keep XLA's autotuned defaults instead
JTB_CPU_DEVICES is removed from the environment (it would force CPU devices).
Several GPU hosts: use launch/slurm.sbatch, or run this script on every host with
--coordinator=HOST0:PORT --num_processes=N --process_id=i after the program arguments.

Examples:
  launch/gpu.sh --config=configs/task_distill.py:sst2 --workdir=runs/sst2
  # bf16 compute is the GPU's default (dtype=auto); float32 (TF32) instead, ~0.5x the speed:
  launch/gpu.sh --config=configs/task_distill.py:sst2 --workdir=runs/sst2 \
      --config.student.dtype=float32 --config.teacher.dtype=float32
USAGE
}

die() { echo "gpu.sh: $*" >&2; exit 2; }

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(dirname "$SCRIPT_DIR")"

MODULE="jax_tinybert.main"
LOG=""
DRY_RUN=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpus) [[ $# -ge 2 ]] || die "$1 needs a value"; export CUDA_VISIBLE_DEVICES="$2"; shift 2 ;;
    --gpus=*) export CUDA_VISIBLE_DEVICES="${1#*=}"; shift ;;
    --mem-fraction) [[ $# -ge 2 ]] || die "$1 needs a value"; export XLA_PYTHON_CLIENT_MEM_FRACTION="$2"; shift 2 ;;
    --mem-fraction=*) export XLA_PYTHON_CLIENT_MEM_FRACTION="${1#*=}"; shift ;;
    --no-preallocate) export XLA_PYTHON_CLIENT_PREALLOCATE=false; shift ;;
    --log) [[ $# -ge 2 ]] || die "$1 needs a value"; LOG="$2"; shift 2 ;;
    --log=*) LOG="${1#*=}"; shift ;;
    -m|--module) [[ $# -ge 2 ]] || die "$1 needs a value"; MODULE="$2"; shift 2 ;;
    --module=*) MODULE="${1#*=}"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
PROGRAM_ARGS=("$@")

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO_DIR/.venv/bin/python" ]]; then PYTHON="$REPO_DIR/.venv/bin/python"; else PYTHON="python3"; fi
fi

export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# Host side: keep glibc from unmapping large temporaries every step (as the Makefile does).
export MALLOC_ARENA_MAX="${MALLOC_ARENA_MAX:-1}"
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-17179869184}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-17179869184}"
unset JTB_CPU_DEVICES

quote() {
  local out="" a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+="$a "; else out+="'${a//\'/\'\\\'\'}' "; fi
  done
  printf '%s\n' "${out% }"
}

if command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu.sh: GPUs (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all}):" >&2
  nvidia-smi -L >&2 || true
elif [[ "$DRY_RUN" -eq 0 && "$JAX_PLATFORMS" == *cuda* ]]; then
  echo "gpu.sh: warning: nvidia-smi not found; JAX_PLATFORMS=$JAX_PLATFORMS will fail if no GPU is usable" >&2
fi

env_line=(JAX_PLATFORMS="$JAX_PLATFORMS" XLA_PYTHON_CLIENT_MEM_FRACTION="$XLA_PYTHON_CLIENT_MEM_FRACTION")
if [[ -n "${XLA_PYTHON_CLIENT_PREALLOCATE:-}" ]]; then env_line+=(XLA_PYTHON_CLIENT_PREALLOCATE="$XLA_PYTHON_CLIENT_PREALLOCATE"); fi
if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then env_line+=(CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"); fi
cmd=("$PYTHON" -m "$MODULE" "${PROGRAM_ARGS[@]+"${PROGRAM_ARGS[@]}"}")
echo "+ $(quote "${env_line[@]}" "${cmd[@]}")${LOG:+ 2>&1 | tee -a $(quote "$LOG")}" >&2
if [[ "$DRY_RUN" -eq 1 ]]; then exit 0; fi

if [[ -n "$LOG" ]]; then
  mkdir -p "$(dirname "$LOG")"
  "${cmd[@]}" 2>&1 | tee -a "$LOG"
  exit "${PIPESTATUS[0]}"
fi
exec "${cmd[@]}"
