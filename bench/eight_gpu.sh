#!/usr/bin/env bash
# Issue 8's runs on one host of eight GPUs, results under $OUT (default ./out), run directories
# (checkpoints, logs) under $WORK (default /tmp/dyad-8gpu): the parts named as arguments, each
# with its own time limit, so that one slow part cannot take the others' results with it.
#   bash bench/eight_gpu.sh e2e resize
# E2E_ARGS narrows bench/e2e_8gpu.py's layout sweep (e.g. "--ep 8 7 2 --tp 1") or adds --compile; E2E_LIMIT and
# RESIZE_LIMIT are the parts' limits in seconds. The workers' logs come back in logs.tgz.
set -u
OUT=$(realpath -m "${OUT:-out}")
WORK=$(realpath -m "${WORK:-/tmp/dyad-8gpu}")
mkdir -p "$OUT" "$WORK"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())" >> "$OUT/gpu.txt"
PART_TAIL=20
source bench/parts.sh
for name in "$@"; do
    case $name in
    e2e) part e2e_8gpu "${E2E_LIMIT:-540}" python3 bench/e2e_8gpu.py --out "$OUT/e2e_8gpu.json" \
        --work "$WORK/e2e" ${E2E_ARGS:-} ;;
    resize) part resize "${RESIZE_LIMIT:-540}" python3 bench/resize.py --out "$OUT/resize.json" \
        --work "$WORK/resize" ${RESIZE_ARGS:-} ;;
    *) echo "unknown part $name (e2e, resize)" >&2; exit 2 ;;
    esac
done
(cd "$WORK" && find . -name "*.log" -o -name "metrics.jsonl" | tar czf "$OUT/logs.tgz" -T -)
