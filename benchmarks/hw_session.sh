#!/bin/bash
# One borrowed-GPU session, as one command: probe the node, run the hardware
# acceptance kit (docs/selftest.md), then measure co-location (benchmarks/hw_colocation.py).
# Writes everything under $OUT (default /tmp/colloc-hw); results are committed to
# benchmarks/results/hardware/. Runs as root on a drained GPU node with torch installed:
#   OUT=/tmp/hw bash benchmarks/hw_session.sh
set -u
OUT=${OUT:-/tmp/colloc-hw}
PARTS=${PARTS:-probe,kit,coloc}   # also: mpsdiag (how the MPS daemon looks when colloc starts it)
has() { case ",$PARTS," in *",$1,"*) return 0;; esac; return 1; }
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3)}
COLLOC=(env "PYTHONPATH=$PWD" "$PY" -c 'import sys; from slurm_colloc.cli import main; sys.argv[0] = "colloc"; main()')

has probe && {
  date -u; uname -a; nvidia-smi; nvidia-smi -q | sed -n 1,40p
  echo "python: $PY"; "$PY" -c 'import torch, pynvml; print("torch", torch.__version__, torch.version.cuda, torch.cuda.is_available())'
  echo "mps control: $(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin 2>&1)"
  command -v useradd; findmnt -no FSTYPE /sys/fs/cgroup
  echo "trust: $(PYTHONPATH=$PWD "$PY" -c 'import sys; from slurm_colloc.selftest import trust; print(trust.untrusted_interpreter(sys.argv[1]))' "$PY")"
} >"$OUT/probe.txt" 2>&1
has probe && cat "$OUT/probe.txt"

# The MPS daemon started exactly as colloc's prolog starts it (slurm_colloc/mps/control.py).
has mpsdiag && {
  bin=$(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin command -v nvidia-cuda-mps-control)
  uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
  d=$(mktemp -d); mkdir -m 700 "$d/pipe" "$d/log"
  echo "binary $bin -> $(realpath "$bin")"; ls -la "$bin" /usr/local/nvidia/bin/nvidia-cuda-mps-control
  stat -c '%n inode %i dev %d links %h size %s' "$bin" "$(realpath "$bin")" /usr/local/nvidia/bin/nvidia-cuda-mps-control
  head -c 80 "$bin" | od -c | head -3; findmnt -T "$bin"; echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; ldconfig -p | grep -E "libcuda.so|libnvidia-ml.so"
  env -i PATH=/usr/local/bin:/usr/bin:/bin CUDA_VISIBLE_DEVICES="$uuid" CUDA_DEVICE_ORDER=PCI_BUS_ID \
    CUDA_MPS_PIPE_DIRECTORY="$d/pipe" CUDA_MPS_LOG_DIRECTORY="$d/log" "$bin" -d </dev/null; echo "-d rc=$?"
  sleep 2; ls -la "$d/pipe" "$d/log"; pid=$(cat "$d/pipe/nvidia-cuda-mps-control.pid"); echo "pid file: $pid"
  ps -eo pid,ppid,uid,stat,lstart,args | grep -i [m]ps
  for p in $pid $(pgrep -f nvidia-cuda-mps-control); do
    echo "== $p exe=$(readlink /proc/$p/exe) argv=$(tr '\0' ' ' </proc/$p/cmdline)"; tr '\0' '\n' </proc/$p/environ | grep CUDA_
  done
  cat "$d/log/control.log"
  echo quit | env -i PATH=/usr/bin:/bin CUDA_MPS_PIPE_DIRECTORY="$d/pipe" "$bin"; sleep 1; pgrep -fa nvidia-cuda-mps
} >"$OUT/mpsdiag.txt" 2>&1
has mpsdiag && cat "$OUT/mpsdiag.txt"

# The kit refuses an interpreter that is not root's alone; on a throwaway node make it so.
why=$(PYTHONPATH=$PWD "$PY" -c 'import sys; from slurm_colloc.selftest import trust; print(trust.untrusted_interpreter(sys.argv[1]) or "")' "$PY")
if [ -n "$why" ]; then
  echo "making $(dirname "$(dirname "$PY")") root's alone: $why" | tee -a "$OUT/probe.txt"
  venv=$(dirname "$(dirname "$(realpath "$PY")")")
  chown -R root:root "$venv" "$(dirname "$(dirname "$PY")")" 2>/dev/null
  chmod -R go-w "$venv" "$(dirname "$(dirname "$PY")")" 2>/dev/null
fi

has kit && timeout 170 "${COLLOC[@]}" selftest --gpu --create-users --python "$PY" --bench-seconds 3 --json "$OUT/selftest.json" >"$OUT/selftest.txt" 2>&1
rc=$?
has kit && echo "selftest rc=$rc" >>"$OUT/selftest.txt"
if has kit && [ "$rc" = 2 ]; then   # refused (users?): the single-user checks still say something
  timeout 120 "${COLLOC[@]}" selftest --gpu --python "$PY" --bench-seconds 3 --json "$OUT/selftest-root.json" >>"$OUT/selftest.txt" 2>&1
  echo "selftest (root clients) rc=$?" >>"$OUT/selftest.txt"
fi
has kit && cat "$OUT/selftest.txt"

has coloc && PYTHONUNBUFFERED=1 timeout 290 "$PY" benchmarks/hw_colocation.py --seconds 2.0 --budget-s 230 \
  --out "$OUT/hw_colocation.json" >"$OUT/hw_colocation.txt" 2>&1
has coloc && { echo "hw_colocation rc=$?" >>"$OUT/hw_colocation.txt"; cat "$OUT/hw_colocation.txt"; }
exit 0
