#!/usr/bin/env bash
# Device check: xpud on a host with real NVIDIA cards, changing nothing on them. See bench/device-check.md.
#
#   scripts/device-check.sh [--simulate MACHINE] [--out DIR] [--poll-seconds S]
#
# Steps: xpud check-hardware --json; the fake's fidelity to what the driver returned (python -m
# xpud.hw.fidelity); a daemon on the cards with isolation = "none" and mig_switch = "never"; xpu ls, health
# and topo; a whole-card `xpu run` whose child sees exactly its card (CUDA's device count and UUID, and
# nvidia-smi -L listing it); the health poll's CPU cost (bench/health_poll.py, and the daemon's own CPU);
# and the cards' settings before and after (MIG mode, compute mode, persistence, application clocks, power
# limit), which must not have changed. On real cards it then records what the driver answers where the
# fake had to assume (scripts/device_probe.py and the lines below): minor numbers against indices and
# /proc/devices, every MIG profile enum's return code, the NVSwitch fabric state, each health call's
# support, the recovery-action field, NVLink versions and counters, CUDA_VISIBLE_DEVICES by UUID as CUDA
# sees it, a 60 s CUDA load (PyTorch: power against the limit, clock-event bits, process utilisation) and an
# MPS client as nobody over its memory limit (its own control daemon in a private pipe directory, quit
# afterwards). It never sets a MIG mode, a compute mode, clocks or a power limit and never resets a card.
#
# --simulate MACHINE (or XPUD_DEVICE_CHECK_SIMULATE=MACHINE) runs the same steps over a simulated machine
# (no GPU, no nvidia-smi: the child checks its CUDA_VISIBLE_DEVICES instead), so the script is tested in CI.
# Prints one summary; exits 1 if any step failed, 2 on bad arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${XPUD_BIN:-.venv/bin}
py=$bin/python
simulate=${XPUD_DEVICE_CHECK_SIMULATE:-}
out=${OUT:-}
poll_seconds=10
while [[ $# -gt 0 ]]; do
  case $1 in
    --simulate) simulate=${2:?--simulate needs a machine name}; shift 2 ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --poll-seconds) poll_seconds=${2:?--poll-seconds needs a number}; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "device-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if ! [[ $poll_seconds =~ ^[0-9]+$ ]] || (( poll_seconds < 1 || poll_seconds > 600 )); then
  echo "device-check: --poll-seconds $poll_seconds: use a whole number of seconds, 1 to 600" >&2; exit 2
fi
for tool in "$bin/xpud" "$bin/xpu" "$py"; do
  [[ -x $tool ]] || { echo "device-check: $tool not found: set XPUD_BIN to the venv's bin" >&2; exit 2; }
done
work=$(mktemp -d /tmp/xpud-device-check.XXXXXX)
out=${out:-$work/out}
mkdir -p "$out"
sim=()
mode="real cards"
if [[ -n $simulate ]]; then
  sim=(--simulate "$simulate")
  mode="simulated $simulate"
elif ! command -v nvidia-smi >/dev/null; then
  echo "device-check: nvidia-smi not found: run on a host with the NVIDIA driver, or use --simulate" >&2
  exit 2
fi
export XPUD_RUNTIME_DIR=$work/run
unset CUDA_VISIBLE_DEVICES
daemon=
cleanup() {
  if [[ -n $daemon ]] && kill -0 "$daemon" 2>/dev/null; then kill "$daemon"; wait "$daemon" 2>/dev/null; fi
  rm -rf "$work/run" "$work/state" "$work/xpud.toml"
  rmdir "$work" 2>/dev/null || true  # kept when the logs went into it (no --out)
}
trap cleanup EXIT

summary=()
failed=0
skipped=0
record() {  # record NAME STATUS DETAIL
  summary+=("$(printf '%-4s %-16s %s' "$2" "$1" "$3")")
  case $2 in
    PASS) ;;
    SKIP) skipped=$((skipped + 1)) ;;
    *) failed=$((failed + 1)) ;;
  esac
}
# check NAME CMD...: run a check whose stdout's last line is its detail; PASS on exit 0.
check() {
  local name=$1; shift
  local log=$out/$name.log
  if "$@" >"$log" 2>&1; then record "$name" PASS "$(tail -n 1 "$log")"
  else record "$name" FAIL "$(tail -n 1 "$log") (log: $log)"; fi
}

settings() {  # the cards' settings that nothing here may change
  if [[ -z $simulate ]]; then
    nvidia-smi --query-gpu=index,uuid,mig.mode.current,mig.mode.pending,compute_mode,persistence_mode,clocks.applications.graphics,clocks.applications.memory,power.limit --format=csv,noheader
  else
    "$bin/xpu" ls --json | "$py" -c '
import json, sys
for c in json.load(sys.stdin):
    print(c["index"], c["uuid"], "mig", c["mig_enabled"])'
  fi
}

# 1. check-hardware (read-only), and the fake's fidelity to it
check check-hardware sh -c '"$0" "$@" check-hardware --json >"'"$out"'/check-hardware.json" && echo "driver read cleanly"' "$bin/xpud" "${sim[@]}"
check fidelity "$py" -m xpud.hw.fidelity "$out/check-hardware.json"

# 2. a daemon on the cards that changes nothing
[[ -z $simulate ]] && settings >"$out/settings-before.txt" 2>&1
printf '[cards]\nisolation = "none"\nmig_switch = "never"\n\n[health]\npoll_interval_s = 1.0\n' >"$work/xpud.toml"
"$bin/xpud" --config "$work/xpud.toml" "${sim[@]}" --runtime-dir "$work/run" --state-dir "$work/state" \
  --log-level info >"$out/xpud.log" 2>&1 &
daemon=$!
started=
for _ in $(seq 300); do
  if "$bin/xpu" info >/dev/null 2>&1; then started=1; break; fi
  kill -0 "$daemon" 2>/dev/null || break
  sleep 0.1
done
if [[ -z $started ]]; then
  if kill -0 "$daemon" 2>/dev/null; then why="did not serve within 30 s"; else why="exited: $(tail -n 1 "$out/xpud.log")"; fi
  record daemon FAIL "$why (log: $out/xpud.log)"
else
  record daemon PASS "serving on $XPUD_RUNTIME_DIR (isolation none, mig_switch never)"
  [[ -n $simulate ]] && settings >"$out/settings-before.txt" 2>&1

  # 3. xpu ls / health / topo against what check-hardware saw
  for what in ls health topo; do
    check "xpu-$what" sh -c '"$0" "$1" --json >"$2/$1.json" && "$3" scripts/device_check.py "$1" "$2"' \
      "$bin/xpu" "$what" "$out" "$py"
  done

  # 4. a whole-card lease: the child sees exactly its card
  if [[ -z $simulate ]]; then
    child='echo "CVD=$CUDA_VISIBLE_DEVICES"; "$0" scripts/device_check.py cuda; nvidia-smi -L | sed "s/^/SMI=/"'
  else
    child='echo "CVD=$CUDA_VISIBLE_DEVICES"'
  fi
  check whole-card-run sh -c \
    '"$0" run --mode xpu --gpus 1 -- sh -c "$1" "$2" >"$3/run.txt" && "$2" scripts/device_check.py run "$3" $4' \
    "$bin/xpu" "$child" "$py" "$out" "${simulate:+sim}"

  # 5. the health poll's CPU: one sweep in process, and the daemon's own CPU while it polls at 1 Hz
  if [[ -n $simulate ]]; then
    check health-poll "$py" bench/health_poll.py --machine "$simulate" --sweep-only --sweeps 50 \
      --json "$out/health_poll.json"
  else
    check health-poll "$py" bench/health_poll.py --real --sweeps 200 --json "$out/health_poll.json"
  fi
  check daemon-cpu "$py" scripts/device_check.py cpu "$daemon" "$poll_seconds"

  [[ -n $simulate ]] && settings >"$out/settings-after.txt" 2>&1
  kill "$daemon"
  if wait "$daemon"; then record daemon-stop PASS "exited 0 on SIGTERM"
  else record daemon-stop FAIL "exit status $? on SIGTERM (log: $out/xpud.log)"; fi
  daemon=
  if grep -q Traceback "$out/xpud.log"; then record daemon-log FAIL "a traceback in $out/xpud.log"
  else record daemon-log PASS "no traceback"; fi
fi

# 6. what the driver answers (real cards only; read-only): recorded answers, see bench/device-check.md.
# answer NAME CMD...: like check, but exit 3 means there was nothing to probe here (SKIP, not a failure).
answer() {
  local name=$1; shift
  local log=$out/$name.log rc=0
  "$@" >"$log" 2>&1 || rc=$?
  case $rc in
    0) record "$name" PASS "$(tail -n 1 "$log")" ;;
    3) record "$name" SKIP "$(tail -n 1 "$log")" ;;
    *) record "$name" FAIL "$(tail -n 1 "$log") (log: $log)" ;;
  esac
}
minors() {  # device nodes, cgroup rules and gres File= use the minor, never the index
  nvidia-smi --query-gpu=index,minor_number,uuid --format=csv,noheader >"$out/minors.csv" || return 1
  ls -l /dev/nvidia* /dev/nvidia-caps >"$out/dev-nodes.txt" 2>&1
  grep -i nvidia /proc/devices >"$out/proc-devices.txt"
  local differ
  differ=$(awk -F', *' '$1 != $2 {printf "GPU%s has minor %s; ", $1, $2}' "$out/minors.csv")
  echo "$(wc -l <"$out/minors.csv") card(s): ${differ:-minor = index on every card; }/proc/devices: $(tr -s ' \n' ' ' <"$out/proc-devices.txt")"
}
cvd_uuid() {  # CUDA_VISIBLE_DEVICES by UUID (the last card: not the identity mapping), as CUDA sees it
  local uuid
  uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | tail -n 1)
  CUDA_VISIBLE_DEVICES=$uuid "$py" scripts/device_check.py cuda >"$out/cvd-uuid.txt" 2>&1 || return 1
  if grep -qx "CUDA_COUNT=1" "$out/cvd-uuid.txt" && grep -qx "CUDA_UUID=$uuid" "$out/cvd-uuid.txt"; then
    echo "CUDA_VISIBLE_DEVICES=$uuid (by UUID): CUDA sees exactly that card"
  else
    echo "CUDA_VISIBLE_DEVICES=$uuid: CUDA saw $(grep ^CUDA_ "$out/cvd-uuid.txt" | tr '\n' ' ')"; return 1
  fi
}
mps_limit() {  # an MPS client as nobody over CUDA_MPS_PINNED_DEVICE_MEM_LIMIT must fail its allocation
  command -v nvidia-cuda-mps-control >/dev/null || { echo "SKIP: no nvidia-cuda-mps-control"; return 3; }
  "$py" -c 'import torch' 2>/dev/null || { echo "SKIP: no PyTorch for the MPS client"; return 3; }
  command -v setpriv >/dev/null && id nobody >/dev/null 2>&1 || { echo "SKIP: no setpriv or no user nobody"; return 3; }
  local as_nobody=(setpriv --reuid="$(id -u nobody)" --regid="$(id -g nobody)" --clear-groups)
  "${as_nobody[@]}" "$py" -c pass 2>/dev/null || { echo "SKIP: nobody cannot run $py (a venv nobody can read)"; return 3; }
  local mps=$work/mps uuid rc=0
  uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -n 1)
  mkdir -p "$mps/pipe" "$mps/log" && chmod 1777 "$mps/pipe" "$mps/log" && chmod 755 "$mps"
  CUDA_VISIBLE_DEVICES=$uuid CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log \
    nvidia-cuda-mps-control -d || { echo "the MPS control daemon did not start"; return 1; }
  "${as_nobody[@]}" env -i PATH=/usr/bin:/bin HOME=/tmp CUDA_VISIBLE_DEVICES="$uuid" \
    CUDA_MPS_PIPE_DIRECTORY="$mps/pipe" CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G "$py" -c '
import torch
torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
print("ALLOCATED 2 GiB under a 1 GiB limit")' >"$out/mps-client.txt" 2>&1 || rc=$?
  echo quit | CUDA_MPS_PIPE_DIRECTORY=$mps/pipe nvidia-cuda-mps-control
  if (( rc == 0 )); then echo "a client as nobody allocated 2 GiB over its 1 GiB MPS limit"; return 1; fi
  echo "a client as nobody over its 1 GiB MPS limit failed (exit $rc): $(grep -m1 -i 'memory' "$out/mps-client.txt")"
}
if [[ -z $simulate ]]; then
  answer minors minors
  for what in mig-profiles fabric fields recovery nvlink; do
    answer "$what" "$py" scripts/device_probe.py "$what" "$out"
  done
  answer cvd-uuid cvd_uuid
  answer cuda-load "$py" scripts/device_probe.py load "$out" 60
  answer mps-limit mps_limit
fi

# 7. nothing changed on the cards
[[ -z $simulate ]] && settings >"$out/settings-after.txt" 2>&1
if [[ -s $out/settings-before.txt ]] && cmp -s "$out/settings-before.txt" "$out/settings-after.txt"; then
  record settings PASS "unchanged: $(wc -l <"$out/settings-before.txt") card(s)"
else
  record settings FAIL "changed or unreadable: diff $out/settings-before.txt $out/settings-after.txt"
fi

extra=""
(( skipped )) && extra=" ($skipped skipped: nothing to probe)"
echo "device-check ($mode): $(( ${#summary[@]} - failed - skipped )) passed, $failed failed$extra; logs in $out"
printf '  %s\n' "${summary[@]}"
(( failed == 0 ))
