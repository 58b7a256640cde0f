#!/usr/bin/env bash
# Launch the vLLM server that rollout.engines.vllm_engine.VLLMEngine talks to.
#   deployments/vllm/launch.sh VENV MODEL_DIR [PORT] [extra vllm serve args...]
# VENV: the environment built from deployments/vllm/requirements.txt.
# MODEL_DIR: a checkpoint of the run's model (config.json, model*.safetensors, tokenizer files):
# its base checkpoint, or a weight version directory; a rollout worker loads the run's newest
# version onto the server as it starts.
set -euo pipefail
VENV=${1:?usage: launch.sh VENV MODEL_DIR [PORT] [vllm serve args...]}
MODEL_DIR=${2:?usage: launch.sh VENV MODEL_DIR [PORT] [vllm serve args...]}
PORT=${3:-8000}
shift $(( $# < 3 ? $# : 3 ))
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Dev mode exposes /collective_rpc (weight reload) and /reset_prefix_cache.
export VLLM_SERVER_DEV_MODE=1
# The worker extension (treadle_reload_weights) is imported by the workers from here.
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"

exec "$VENV/bin/vllm" serve "$MODEL_DIR" \
  --host 127.0.0.1 --port "$PORT" \
  --enable-prefix-caching \
  --enable-prompt-tokens-details \
  --logprobs-mode processed_logprobs \
  --generation-config vllm \
  --worker-extension-cls treadle_vllm_ext.WeightReloadExtension \
  --max-logprobs 1 \
  "$@"
