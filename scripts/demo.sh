#!/usr/bin/env bash
# The main job on the simulated default: start a simulated daemon (dgx-h100), run a vxpu-half job and an
# `xpu --gpus 4` job side by side, and show `xpu ls` while they hold their cards. No GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${XPUD_BIN:-.venv/bin}
machine=${1:-dgx-h100}
dir=$(mktemp -d /tmp/xpud-demo.XXXXXX)
export XPUD_RUNTIME_DIR=$dir/run
"$bin/xpud" --simulate "$machine" --runtime-dir "$dir/run" --state-dir "$dir/state" >"$dir/xpud.log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do "$bin/xpu" info >/dev/null 2>&1 && break; sleep 0.1; done
"$bin/xpu" info | sed -n '1,4p'
echo
echo '$ xpu run --mode vxpu-half -- sh -c ...   (an inference job on half a card)'
"$bin/xpu" run --mode vxpu-half -- sh -c \
  'echo "  [half] lease $XPU_LEASE_ID ($XPU_MODE): CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"; sleep 3' &
echo '$ xpu run --mode xpu --gpus 4 -- sh -c ...   (a training job on 4 NVLinked cards)'
"$bin/xpu" run --mode xpu --gpus 4 -- sh -c \
  'echo "  [xpu]  lease $XPU_LEASE_ID ($XPU_MODE): CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"; sleep 3' &
sleep 1.5
echo
echo '$ xpu ls'
"$bin/xpu" ls
echo
echo '$ xpu leases'
"$bin/xpu" leases
wait %2 %3
echo
echo "both jobs finished and released their cards:"
"$bin/xpu" ls
