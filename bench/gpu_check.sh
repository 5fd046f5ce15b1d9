#!/usr/bin/env bash
# GPU check of the runtime, for a machine with at least one NVIDIA GPU (CI never needs it).
#
#   bash bench/gpu_check.sh        # < 5 minutes on one GPU and 16 cores
#
# What one GPU allows: NCCL refuses two ranks of one communicator on the same GPU
# ("Duplicate GPU detected", NCCL >= 2.5), so ranks cannot share one GPU over NCCL.
#  1. NCCL + CUDA, one rank: the reference job (30 steps) runs on the GPU through the NCCL
#     backend and must match the same job on the CPU within 1e-4 relative (fp32, TF32 off;
#     GPU kernels sum in another order than CPU ones).
#  2. With N >= 8 GPUs, the 8-rank equivalence test runs over NCCL (one GPU per rank);
#     with fewer, it runs over gloo on the CPUs, as in CI.
#  3. bench/runtime.py (gloo on the CPUs; a live coordinator and agent).
# Written without a GPU at hand: it has not been run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=$(mktemp -d /tmp/resihp-gpu-check-XXXX)
export PYTHONHASHSEED=0 OMP_NUM_THREADS=1 NVIDIA_TF32_OVERRIDE=0
START=$SECONDS

command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "nvidia-smi not found"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
[ "$NGPU" -ge 1 ] || { echo "no CUDA device visible to torch; this check needs a GPU" >&2; exit 2; }
echo "== 1. one rank on the GPU over NCCL vs the CPU over gloo"
mkdir -p "$OUT/gpu" "$OUT/cpu"
RESIHP_BACKEND=nccl timeout 120 "$PY" tests/mpi_scripts/equivalence.py --reference --out "$OUT/gpu" --steps 30
RESIHP_BACKEND=gloo timeout 120 "$PY" tests/mpi_scripts/equivalence.py --reference --out "$OUT/cpu" --steps 30
"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
gpu = json.load(open(f"{out}/gpu/single.json"))["losses"]
cpu = json.load(open(f"{out}/cpu/single.json"))["losses"]
worst = max(abs(g - c) / abs(c) for g, c in zip(gpu, cpu))
print(f"GPU vs CPU: worst relative loss difference over 30 steps {worst:.2e}")
sys.exit(0 if worst <= 1e-4 else 1)
PYEOF

echo "== 2. 8-rank equivalence (TP2xPP2xDP2, TP2xPP2, PP4, DP4, unequal DP)"
if [ "$NGPU" -ge 8 ]; then export RESIHP_BACKEND=nccl; else export RESIHP_BACKEND=gloo; fi
echo "backend: $RESIHP_BACKEND ($NGPU GPU(s))"
timeout 240 .venv/bin/pytest -q tests/test_equivalence_mpi.py
unset RESIHP_BACKEND

echo "== 3. bench/runtime.py"
RESIHP_BACKEND=gloo timeout 240 "$PY" bench/runtime.py | tee "$OUT/bench.txt"
echo "gpu_check: done in $((SECONDS - START)) s; outputs in $OUT"
