#!/usr/bin/env bash
# The GPU checks in one prepared run (about 8-10 minutes on one H100/H200-class GPU with 64 GB of
# free disk), for the day a GPU machine is at hand: each step has its own time limit, writes one
# JSON line (or its error) under $OUT, and a failing step does not stop the next.
#
#   OUT=/tmp/gpu-out bash bench/gpu_session.sh            # then read $OUT/*.jsonl and $OUT/*.log
#
# Needs only torch (CUDA) and safetensors for the ditfleet side; diffusers is used for the
# side-by-side DiT forward when it is importable (carry its wheel if the machine lacks it), and
# skipped otherwise. Record the numbers in the README's benchmark table with these commands.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ditfleet-gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run one check under a time limit, keep its output
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > >(tee "$OUT/$name.jsonl") 2> "$OUT/$name.log"
  echo "== $name: exit $? after $((SECONDS - start)) s"
}

{ nvidia-smi; $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } \
  > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device is visible: these checks are for a GPU machine (CPU benches: bench/README.md)" >&2
  exit 2
fi

DIFFUSERS=--no-diffusers
if $PY -c "import diffusers" 2>/dev/null; then DIFFUSERS=; fi

# 1. The DiT alone at full depth (random weights, bf16): ms per forward, percent of the bf16 peak,
#    ours eager / compiled (/ diffusers), CFG step per modulation-cache mode.
step dit_forward 300 $PY bench/dit_forward.py --device cuda --size 1024 --size 1328 --layers 60 $DIFFUSERS

# 2. The real-size pipeline from a hub-style sharded checkpoint written on local disk: load seconds,
#    peak GPU memory next to the memory plan, DiT forward and CFG step, VAE decode eager vs compiled,
#    images per hour at 50 steps.
step gpu_realsize 420 $PY bench/gpu_realsize.py --device cuda --workdir "${WORKDIR:-/tmp/gpu_realsize}" --repeat 2
rm -rf "${WORKDIR:-/tmp/gpu_realsize}"

# 3. Loading memory on a GPU: peak host RSS above the baseline while streaming the shards.
step load_rss 120 $PY bench/load_rss.py --device cuda
