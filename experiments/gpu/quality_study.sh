#!/usr/bin/env bash
# The C6-C8 quality study (experiments/quality.py) on one H200 in one command, stopped by the
# script itself before BUDGET_S seconds (issue 17, item 6). Run from anywhere:
#
#   experiments/gpu/quality_study.sh          # GPU: results under $OUT (or RESULTS), about 9 minutes
#   DRY=1 experiments/gpu/quality_study.sh    # the same stages at tiny size on the CPU, under 2 minutes
#
# 1. Compile probe (at most PROBE_S = 40 s): dsa at 16 frames, batch 8, training steps/s without
#    and with train.compile, the two in parallel processes -> RESULTS/quality_compile/NAME.json.
# 2. The study -> RESULTS/quality/NAME.json (+ sample grids, RESULTS/quality.md): 3 seeds x {dense,
#    swin, dsa, dsa_zero} at 16 frames (batch 8, SHORT steps), then progressively at 64 frames
#    (batch 2: the same tokens per step), each 64-frame run continuing its 16-frame run for LONG
#    more steps. All 12 runs of a clip length train at once, one process and one CPU thread each;
#    a 64-frame run starts when its 16-frame run ends. train.compile is on when the probe says it
#    pays for itself within a third of SHORT_MAX steps, with a speed-up of at least 1.2. SHORT (at
#    most SHORT_MAX) and LONG (at most LONG_MAX; below LONG_MIN: no 64-frame clip) fill MARGIN of
#    the time left, from the probe's steps/s times CONTENTION (the share of it each of 12 runs on
#    one GPU keeps, measured on an H200 with 16 cores: 12 eager runs at 16 frames kept 0.29 (dsa),
#    0.38 (swin, dsa_zero) and 0.45 (dense) of the dsa probe's solo rate), OVERHEAD_S per
#    clip length (start-up, sampling, scoring) and, compiled, twice the probe's compile warm-up.
# 3. Tars of the runs' sample clips, W&B offline runs, metrics.jsonl and the stage logs
#    (checkpoints left out) -> RESULTS/NAME_runs.tar.gz, or _logs + _samples if one would pass 15 MiB
#    (a device machine returns files of up to 16 MiB, 8 files in all: the stages write 6 or 7).
# The GPU recipe's knobs are environment variables: BATCHES ("8 2": batch at 16 and at 64 frames;
# "32 8" keeps the same tokens per step at 64 frames), LR (1e-3), SEEDS ("[0,1,2]"), WORKERS (12),
# and the budget ones above (BUDGET_S, SHORT_MAX, LONG_MAX, CONTENTION, ...).
# DETERMINISTIC=1 passes train.deterministic=true to the probe and every run (0, the default: false): each run's
# training then gives the same bits at its seed on every call, at a cost in speed (docs/quality_study.md,
# "Repeatability"); the probe times the steps that way too, so the plan allows for the cost (CONTENTION was
# measured without it). The study's JSON records it (config.deterministic), as does the probe's.
# PROXY=large trains a larger clip: 32 x 32 px (16 x 16 tokens of 2 x 2 px), 32 frames then 64, an 8 px object
# moving 8 px (4 tokens) a frame, past a 3 x 3 x 3 DSA window (reach 1 token) and a Swin window (4 tokens) every
# frame; PROXY=small (the default) is the 16 x 16 px, 16- and 64-frame study with 3 px (1.5 tokens) a frame. The
# probe then times the larger clip, and the plan sizes SHORT and LONG from it. With SEEDS="[0]" WORKERS=4 one
# call trains the four variants of one seed; PLAN and RESUME continue them over more calls.
# RECIPE=<file> trains each variant with its own learning rate and warm-up, from a recipe JSON of
# experiments/tune_recipe.py (docs/quality_study.md, "Tuning each variant's recipe"; LR is then not used):
# quality.py refuses a recipe tuned for other data, model, batch or short-clip steps (use PLAN for fixed steps).
# Machines that do not outlive a call: with PLAN and RESUME=1, the runs the result JSON in RESULTS holds are kept
# (a fresh machine needs only that file there), and MAX_RUNS=n starts only the next n runs, in job order
# (quality.py max_runs); each call must finish the runs it starts (a progressive run's clips on one machine).
# Stages 1 and 2 run under `timeout`: the result JSON is rewritten after every finished run, so a
# stage cut short leaves an honest partial result (jobs_done < jobs_total).
# A study longer than one call: PLAN="SHORT LONG" fixes the steps (no probe, no planning) and every
# run checkpoints each CKPT_EVERY (200) steps, keeping its newest; RESUME=1 then runs the same study
# again over the RUNS of the cut one (on the same machine): runs its result JSON holds are kept,
# other finished runs re-score their final weights, cut ones continue from their newest checkpoint
# (quality.py continue_runs=true).
# MPS=1 runs the study's processes under CUDA MPS, where nvidia-cuda-mps-control exists and a CUDA
# client starts under it (their small kernels then share the GPU instead of time-slicing it); the
# daemon is stopped when the script ends, and the log says whether MPS was used.
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$SECONDS
DRY=${DRY:-0}
if [ "$DRY" = 1 ]; then
  SIZE="model=tiny data.height=8 data.width=8 data.shape_size=4 data.speed=2 data.num_videos=8 train.device=cpu
        n_eval=2 sample_batch=2 train.sample_steps=1 save_mp4=false"
  CLIPS=(4 8); BATCHES=(2 2); SEEDS="[0]"; WORKERS=2
  : "${BUDGET_S:=110}" "${SHORT_MAX:=4}" "${LONG_MAX:=3}" "${LONG_MIN:=1}" "${NAME:=cpu_dry}"
  PROBE="probe_warmup=1 probe_steps=3"; : "${OVERHEAD_S:=15}"
else
  case "${PROXY:-small}" in   # the clip: 16 x 16 px, 16 then 64 frames; or 32 x 32 px, 32 then 64 frames
    small) FRAME="data.height=16 data.width=16 data.shape_size=6 data.speed=3"; CLIPS=(16 64) ;;
    large) FRAME="data.height=32 data.width=32 data.shape_size=8 data.speed=8"; CLIPS=(32 64) ;;
    *) echo "PROXY=$PROXY must be small or large (the clip size; see the header)" >&2; exit 2 ;;
  esac
  SIZE="model=quality_gpu $FRAME data.num_videos=512
        train.device=cuda train.lr=${LR:-1e-3} train.ema_decay=0.995 train.log_every=100 n_eval=32 sample_batch=32
        train.sample_steps=20 save_mp4=false"
  read -ra BATCHES <<< "${BATCHES:-8 2}"; SEEDS=${SEEDS:-"[0,1,2]"}; WORKERS=${WORKERS:-12}
  : "${BUDGET_S:=540}" "${SHORT_MAX:=2800}" "${LONG_MAX:=3000}" "${LONG_MIN:=300}" "${NAME:=h200_progressive}"
  PROBE="probe_warmup=5 probe_steps=60"; : "${OVERHEAD_S:=35}"   # per clip length: start-up, sampling, scoring
fi
: "${PROBE_S:=40}" "${TAR_S:=20}" "${CONTENTION:=0.29}" "${MARGIN:=0.95}"
case "${DETERMINISTIC:-0}" in
  0) DETERMINISTIC=false ;;
  1) DETERMINISTIC=true ;;
  *) echo "DETERMINISTIC=$DETERMINISTIC must be 0 or 1 (1: train.deterministic=true in every run)" >&2; exit 2 ;;
esac
if [ -n "${RECIPE:-}" ] && [ ! -f "$RECIPE" ]; then
  echo "RECIPE=$RECIPE is not a file: pass a recipe JSON of experiments/tune_recipe.py, or leave RECIPE unset" >&2
  exit 2
fi
RESULTS=${RESULTS:-${MEGASLIDE_RESULTS_DIR:-${OUT:-/tmp/quality_study/results}}}
RUNS=${RUNS:-/tmp/quality_study/runs}    # out_dir: checkpoints, W&B runs, samples, logs
if [ "${RESUME:-0}" != 1 ] && [ -n "$(ls -A "$RUNS" 2>/dev/null)" ]; then
  echo "RUNS=$RUNS holds an earlier study (its files would go into the tars): remove it, set RUNS, or" \
       "continue it with RESUME=1 and the same PLAN" >&2; exit 2
fi
if [ "${RESUME:-0}" = 1 ] && [ -z "${PLAN:-}" ]; then
  echo "RESUME=1 needs PLAN=\"SHORT LONG\", the steps of the study it continues" >&2; exit 2
fi
mkdir -p "$RESULTS" "$RUNS/logs"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 WANDB_MODE=${WANDB_MODE:-offline}
left() { echo $(( BUDGET_S - (SECONDS - START) )); }
say() { echo "[quality_study $(( SECONDS - START ))s] $*" | tee -a "$RUNS/logs/script.log"; }

# ---- setup: Hydra/W&B from carried wheels (.whl) and the package's entry points, where missing
if ! python3 -c "import hydra" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/quality_study/site .whl/*.whl
  export PYTHONPATH=/tmp/quality_study/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import hydra" 2>/dev/null || { say "no Hydra: carry the Hydra/OmegaConf wheels in .whl"; exit 1; }
if ! python3 -c "from importlib.metadata import entry_points as e; assert e(group='megaslide.attention')" 2>/dev/null
then   # swin is found through the package's entry point
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
if [ "$WANDB_MODE" != disabled ] && ! python3 -c "import wandb" 2>/dev/null; then
  say "wandb is not installed: WANDB_MODE=disabled (each run still writes metrics.jsonl)"; export WANDB_MODE=disabled
fi
[ -f .provenance.json ] && export MEGASLIDE_PROVENANCE=${MEGASLIDE_PROVENANCE:-stamp}
COMMON="$SIZE train.deterministic=$DETERMINISTIC out_dir=$RUNS results_dir=$RESULTS results_name=$NAME"
say "train.deterministic=$DETERMINISTIC in the probe and every run (DETERMINISTIC=1 sets it true)"
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/quality_study/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/quality_study/mps_log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d &&
     timeout 60 python3 -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    say "MPS: on"
  else
    echo quit | nvidia-cuda-mps-control 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    say "MPS: not available here, the processes time-slice the GPU"
  fi
fi

if [ -n "${PLAN:-}" ]; then
  read -r SHORT LONG <<< "$PLAN"; COMPILE=false
  COMMON="$COMMON train.ckpt_every=${CKPT_EVERY:-200} train.keep_checkpoints=1 continue_runs=true"
  say "plan (PLAN): ${CLIPS[0]} frames $SHORT steps, ${CLIPS[1]} frames $LONG more steps; RESUME=${RESUME:-0}"
else
# ---- 1. compile probe
say "compile probe, at most $PROBE_S s"
# shellcheck disable=SC2086
timeout -k 5 "$PROBE_S" python3 experiments/quality.py $COMMON compile_probe=true "variants=[dsa]" \
  "clip_frames=[${CLIPS[0]}]" "clip_batch_sizes=[${BATCHES[0]}]" workers=2 $PROBE 2>&1 | tee "$RUNS/logs/probe.log"
say "probe exit status ${PIPESTATUS[0]} (124: cut at $PROBE_S s; its JSON keeps what it measured)"

# ---- plan: compile or not, SHORT and LONG from the probe and the time left
read -r COMPILE SHORT LONG EST < <(python3 - "$RESULTS/quality_compile/$NAME.json" "$(left)" <<PY
import json, sys
try:
    rows = {r["compile"]: r for r in json.load(open(sys.argv[1]))["rows"] if r["status"] == "ok"}
except (OSError, ValueError, KeyError):
    rows = {}
usable = $MARGIN * (int(sys.argv[2]) - $TAR_S)          # seconds the study may plan to use
eager, compiled = rows.get(False), rows.get(True)
compile = bool(compiled and compiled.get("break_even_steps") is not None
               and 3 * compiled["break_even_steps"] <= $SHORT_MAX and compiled["speedup"] >= 1.2)
rate = (compiled if compile else eager or {"steps_per_s": 9.0})["steps_per_s"] * $CONTENTION  # per run
fixed = $OVERHEAD_S + (2 * compiled["warmup_s"] if compile else 0.0)  # per clip length; 12 compile at once
short = max(0, min($SHORT_MAX, int((usable - fixed) * rate)))
long = min($LONG_MAX, int((usable - 2 * fixed - short / rate) * rate))
long = long if long >= $LONG_MIN else 0
est = f"{fixed + short / rate:.0f}s+{fixed + long / rate if long else 0:.0f}s"
print(str(compile).lower(), short, long, est)
PY
)
say "plan: train.compile=$COMPILE, ${CLIPS[0]} frames $SHORT steps, ${CLIPS[1]} frames $LONG more steps" \
    "(0: skipped); estimated $EST; $(left) s left"
fi

# ---- 2. the study
STUDY_S=$(( $(left) - TAR_S ))
if [ "${SHORT:-0}" -gt 0 ] && [ "$STUDY_S" -gt 0 ]; then
  if [ "$LONG" -gt 0 ]; then
    STUDY="clip_frames=[${CLIPS[0]},${CLIPS[1]}] clip_batch_sizes=[${BATCHES[0]},${BATCHES[1]}]
           clip_steps=[$SHORT,$LONG] progressive=true"
  else
    STUDY="clip_frames=[${CLIPS[0]}] clip_batch_sizes=[${BATCHES[0]}] clip_steps=[$SHORT]"
  fi
  say "study, at most $STUDY_S s"
  # shellcheck disable=SC2086
  TORCHINDUCTOR_COMPILE_THREADS=1 timeout -k 10 "$STUDY_S" python3 experiments/quality.py $COMMON $STUDY \
    "seeds=$SEEDS" workers=$WORKERS train.compile=$COMPILE ${RECIPE:+recipe=$RECIPE} ${MAX_RUNS:+max_runs=$MAX_RUNS} \
    2>&1 | tee -a "$RUNS/logs/study.log"
  STATUS=${PIPESTATUS[0]}
  say "study exit status $STATUS (124: cut at $STUDY_S s; its JSON holds the runs that finished)"
else
  STATUS=1
  say "no time left for the study"
fi

# ---- 3. tars: everything under RUNS but the checkpoints, in at most two files of <= TAR_MAX_KIB
LIMIT=$(( ${TAR_MAX_KIB:-15360} * 1024 ))
rm -f "$RESULTS/${NAME}"_runs*.tar.gz
tar -C "$RUNS" --exclude=checkpoints -czf "$RESULTS/${NAME}_runs.tar.gz" .
if [ "$(stat -c %s "$RESULTS/${NAME}_runs.tar.gz")" -gt "$LIMIT" ]; then
  rm "$RESULTS/${NAME}_runs.tar.gz"
  tar -C "$RUNS" --exclude=checkpoints --exclude=samples -czf "$RESULTS/${NAME}_runs_logs.tar.gz" .
  (cd "$RUNS" && find . -path '*/samples/*' -type f -print0 |
     tar --null -T - -czf "$RESULTS/${NAME}_runs_samples.tar.gz")
fi
for f in "$RESULTS/${NAME}"_runs*.tar.gz; do
  size=$(stat -c %s "$f"); [ "$size" -gt "$LIMIT" ] && say "WARNING: $f is over $LIMIT bytes"
  say "$f: $(( size / 1024 )) KiB"
done
say "done in $(( SECONDS - START )) s; results under $RESULTS"
exit "$STATUS"   # the study's: 0 complete, 124 cut short by the budget
