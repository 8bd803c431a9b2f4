#!/usr/bin/env bash
# Qwen2.5-VL-7B on one 8-GPU node: the trainer (one JAX process) on GPUs 0-3,
# four SGLang servers on GPUs 4-7 (one each) behind a launched sglang-router,
# weights through the work directory (rollout.weight_sync=disk).
#
# Not yet run on GPUs. DRY_RUN=1 checks it on any machine (no GPU): it
# validates the config and prints each server's command and GPUs.
#
#   MODEL=/ckpt/Qwen2.5-VL-7B-Instruct bash examples/one_node_8gpu.sh
#   DRY_RUN=1 MODEL=/ckpt/Qwen2.5-VL-7B-Instruct bash examples/one_node_8gpu.sh
#
# Extra arguments go to fluxjax.train, e.g. --config.data.train=train.parquet.
# Check the install first: python -m fluxjax.install_check --sglang.
set -euo pipefail

MODEL=${MODEL:?set MODEL to a Qwen2.5-VL checkpoint folder}
CONFIG=${CONFIG:-configs/vlm.py:qwen25_vl_7b}
WORKDIR=${WORKDIR:-workdir/one-node-7b}
TRAINER_GPUS=${TRAINER_GPUS:-0,1,2,3}
SERVER_GPUS=${SERVER_GPUS:-4,5,6,7}
NUM_SERVERS=${NUM_SERVERS:-4}
# SGLang's share of each server GPU for weights and KV cache; JAX's of the
# trainer's (XLA preallocates 75% by default).
SGLANG_MEM_FRACTION=${SGLANG_MEM_FRACTION:-0.85}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}

server="(\"python\",\"-m\",\"sglang.launch_server\",\"--model-path\",\"$MODEL\","
server+="\"--mem-fraction-static\",\"$SGLANG_MEM_FRACTION\",\"--enable-deterministic-inference\")"
router='("python","-m","sglang_router.launch_router","--policy","cache_aware")'
dry=()
if [[ "${DRY_RUN:-0}" == 1 ]]; then dry=(--dry_run); fi

CUDA_VISIBLE_DEVICES=$TRAINER_GPUS exec python -m fluxjax.train \
  --config="$CONFIG" --workdir="$WORKDIR" \
  --config.model.hf_path="$MODEL" \
  --config.rollout.launch="$server" \
  --config.rollout.num_servers="$NUM_SERVERS" \
  --config.rollout.server_gpus="$SERVER_GPUS" \
  --config.rollout.router_launch="$router" \
  "${dry[@]}" "$@"
