#!/usr/bin/env bash
# The GPU issue's checks in one device call, sized for a 15-minute lease:
# decode at 1 and 8 steps per call, a 5-step GRPO smoke of the 3B shape on the
# embedded engine, and the train step's op profile. Each run has its own time
# limit and prints (and writes under $OUT) as it goes, so a run stopped by its
# limit keeps what it measured. Needs nvidia-h200: the 3B train state (fp32
# parameters, gradients and AdamW) is 60 GB beside the engine's copy and cache.
#
#   bash bench/gpu_runs.sh [decode_s] [grpo_s] [mfu_s]       # on the device machine
#
# The defaults (60 for the kernel check and 140, 220 + 40, 100) fit one
# 600 s device call with the wheels' install. Two calls back to back (the
# machine stays warm between them) give decode its twelve rows (2 attention
# backends x 2 steps per call x 3 levels): `bash bench/gpu_runs.sh 300 0 0`,
# then `bash bench/gpu_runs.sh 0 220 100`.
#
# A limit of 0 skips that run; CONCURRENCY (default 1,32,256) picks decode's levels,
# and DECODE_PROFILE=1 traces decode at the largest (rollout.py --profile).
#
# The device image lacks some of fluxjax's dependencies: carry them as wheels
# in .whl_train/ (grain, array_record, portpicker, ml_collections, av,
# tensorboardx; see .library/device/README.md for `pip download`).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
since() { echo "== $1 at $(( $(date +%s) - t0 )) s"; }
if [ -d .whl_train ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl_train/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/machine.txt"
quiet() { grep -v "^E11\|onstant\|XLA_FLAGS\|^$\|file a bug\|^  %\|This isn't"; }

run() { [ "${1:-1}" != 0 ]; }

since decode
run "${1:-140}" && {
# The decode kernel compiled by Triton against the xla reference (interpret mode on CPUs).
FLUXJAX_PALLAS_INTERPRET=0 timeout 60 python3 -m pytest -q -n 0 -p no:cacheprovider --noconftest \
  -k reads_the_cache tests/test_attention_pallas_decode.py 2>&1 | tail -15 | tee "$OUT/kernels.log"
timeout "${1:-140}" python3 bench/rollout.py --preset 3b --dtype bfloat16 --slots 256 \
  --concurrency "${CONCURRENCY:-1,32,256}" --requests 4 --loop-requests 1 --new-tokens 128 --prefill-len 1024 \
  --decode-steps 8,1 --decode-attention xla,pallas_gpu --repeats 2 ${DECODE_PROFILE:+--profile /tmp/prof_r} --json "$OUT/rollout.json" > "$OUT/rollout.log" 2>&1
quiet < "$OUT/rollout.log" | tail -70
}

since grpo
# Memory at 0.92 of 141 GB: the engine's bf16 copy (7.5 GB) and cache (16 slots
# x 16k tokens x 36 KB = 9.6 GB), the fp32 state and AdamW (45 GB) with the
# gradient sums (15 GB), and the update's new state beside the old (45 GB,
# train_step.apply_update keeps the old until the new is known finite). At 32
# slots the cache's 19 GB ran out of memory in the update. Rows of 16k tokens
# hold the longest sequence the context allows (a 16,256-token prompt and its
# 128 new tokens) at half the activations of 32k.
run "${2:-220}" && {
wd=/dev/shm/fluxjax-grpo; rm -rf "$wd"
# -k: SIGTERM first (the run checkpoints its step and stops), SIGKILL 40 s later.
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout -k 40 "${2:-220}" python3 -m fluxjax.train \
  --config=configs/vlm.py:qwen25_vl_3b --workdir="$wd" \
  --config.rollout.backend=embedded --config.rollout.launch="()" \
  --config.total_steps=5 --config.rl.prompts_per_step=4 --config.rl.max_new_tokens=128 \
  --config.rollout.num_slots=16 --config.rollout.context_length=16384 \
  --config.sharding.capacity=16384 --config.eval.every=0 --config.eval.prompts=4 \
  --config.eval.samples_per_prompt=1 --config.data.synth_train=32 --config.data.synth_eval=4 \
  > "$OUT/grpo.log" 2>&1
cp "$wd/metrics.jsonl" "$OUT/grpo_metrics.jsonl"
quiet < "$OUT/grpo.log" | tail -25
}

since mfu
run "${3:-100}" && timeout "${3:-100}" python3 bench/mfu.py --layers 8 --rows 2 --row-tokens 16384 \
  --seq-tokens 4096 --remat save_dots --attention pallas_gpu --reps 3 --profile /tmp/prof_m \
  --json "$OUT/mfu.json" > "$OUT/mfu.log" 2>&1
quiet < "$OUT/mfu.log" | tail -40
since done
