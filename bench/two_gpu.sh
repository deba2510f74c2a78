#!/usr/bin/env bash
# The performance issue's two-GPU runs on one host of two GPUs, results under $OUT (default ./out):
# the parts named as arguments (default: all), each with its own time limit, so that one slow
# part cannot take the others' results with it.
#   bash bench/two_gpu.sh bandwidth e2e
# bandwidth: ucxx against NCCL send/recv between the two GPUs, one message at a time, eight and
#   64 in flight (bench/boundary_bandwidth.py).
# e2e: heterogeneous against homogeneous pools with compiled blocks (bench/e2e_hetero.py
#   --compile), the layouts in E2E_LAYOUTS in that order (reverse it in a second run, so that
#   neither always runs first), 14 steps with the first 4 left out (steps 2-3 still recompile
#   blocks for new lengths: the LLM waited 40-58 ms for rows there in every layout on two H200s)
#   and step 9 profiled (a kernel table and a Chrome-trace timeline per worker under
#   $OUT/profiles, left out of the medians);
#   E2E_ARGS adds options (e.g. "--workload vit-l-224").
# e2e-batches: heterogeneous against dp2 at 64, 32 and 16 samples a step, eight samples in every
#   LLM microbatch (`--global-batch`), one invocation per layout and size, alternating which runs
#   first, no profile; each writes $OUT/e2e-<samples>-<layout>.json. dp2 needs 95-100 GB a GPU at
#   32 and 64 samples: on H100s it runs out of memory there (docs/performance.md, "End to end on
#   two GPUs", on 80 GB GPUs); BATCH_DP2=homogeneous-colocated-recompute-encoder runs the dp2 that
#   fits them (its encoder's blocks recomputing).
# e2e-560: heterogeneous against dp2 at 560 pixels and 64 samples a step, the encoder two and
#   three rounds ahead (`boundary.prefetch_depth`): the comparisons of the 560-pixel table under
#   docs/performance.md's "End to end on two GPUs" in five invocations (that table's ran one by
#   one, in the order it lists); each writes $OUT/e2e-560-<n>-<layout>-d<rounds>.json.
# BANDWIDTH_LIMIT, E2E_LIMIT and BATCH_LIMIT (each e2e-batches and e2e-560 invocation) are the parts' limits in seconds.
# The GPU hosts lack ucxx and the router's grpcio-tools, grpcio-health-checking and prometheus-client:
# fetch them here with ../shared/gpu/fetch-wheels.sh grpcio-tools==1.84.0 grpcio-health-checking==1.84.0
# prometheus-client, install them there first (without grpc_health the router exits at start).
set -u
OUT=$(realpath -m "${OUT:-out}")
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())" >> "$OUT/gpu.txt"
PART_TAIL=20
source bench/parts.sh
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(bandwidth e2e)
for name in "${parts[@]}"; do
    case $name in
    bandwidth) part bandwidth "${BANDWIDTH_LIMIT:-150}" python3 bench/boundary_bandwidth.py \
        --out "$OUT/bandwidth.json" ;;
    e2e) part e2e "${E2E_LIMIT:-420}" python3 bench/e2e_hetero.py --compile --steps 14 --skip 4 \
        --profile-step 9 --profile-dir "$OUT/profiles" --out "$OUT/e2e.json" --layouts ${E2E_LAYOUTS:-homogeneous-colocated-ep2 heterogeneous homogeneous-colocated} \
        ${E2E_ARGS:-} ;;
    e2e-batches)
        first=(heterogeneous "${BATCH_DP2:-homogeneous-colocated}")
        for samples in 64 32 16; do
            steps=$(( samples >= 64 ? 30 : (samples >= 32 ? 40 : 60) )); skip=$(( samples >= 64 ? 6 : 8 ))
            for layout in "${first[@]}"; do
                part "e2e-$samples-$layout" "${BATCH_LIMIT:-200}" python3 bench/e2e_hetero.py --compile \
                    --global-batch "$samples" --steps "$steps" --skip "$skip" --layouts "$layout" \
                    --out "$OUT/e2e-$samples-$layout.json" ${E2E_ARGS:-}
            done
            first=("${first[1]}" "${first[0]}")
        done ;;
    e2e-560)
        n=0
        for run in homogeneous-colocated:2 heterogeneous:2 heterogeneous:3 homogeneous-colocated:3 heterogeneous:3; do
            n=$((n + 1)); layout=${run%:*}; rounds=${run#*:}
            part "e2e-560-$n-$layout-d$rounds" "${BATCH_LIMIT:-200}" python3 bench/e2e_hetero.py --compile \
                --workload vit-l-560-merge2 --global-batch 64 --steps 14 --skip 4 --layouts "$layout" \
                --set boundary.prefetch_depth="$rounds" --out "$OUT/e2e-560-$n-$layout-d$rounds.json" ${E2E_ARGS:-}
        done ;;
    *) echo "unknown part $name (bandwidth, e2e, e2e-batches, e2e-560)" >&2; exit 2 ;;
    esac
done
# one archive: the lent hosts return a limited number of files
[ -d "$OUT/profiles" ] && tar czf "$OUT/profiles.tgz" -C "$OUT" profiles && rm -r "$OUT/profiles"
exit 0
