#!/usr/bin/env bash
# The one-GPU runs behind goals 1, 2 and 5 of docs/performance.md in one go, results under $OUT
# (default ./out): the kernels' CUDA tests, the MoE layer against its peers (one after the other, then
# interleaved with the host ahead too), the router's kernels, the permutation's sort, the LLM step's variants
# (with kernel tables), and float8 against bf16 over 200 steps. Each part has its own time limit
# so that one slow part cannot take the others' results with it.
set -u
OUT=$(realpath -m "${OUT:-out}")
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda)" >> "$OUT/gpu.txt"
source bench/parts.sh
# The float8 job test starts a router, whose gRPC stubs need grpc_tools, absent on the GPU hosts
# (CI runs it on CPU).
part kernel_tests 150 python3 -m pytest -q -rs tests/integration/test_fp8.py tests/unit/test_kernels.py tests/unit/test_moe_router.py \
    tests/unit/test_swiglu.py tests/unit/test_token_rows.py tests/unit/test_expert_weight_grads.py tests/unit/test_gated_experts.py \
    tests/dist/test_checkpoint.py::test_cuda_a_restore_through_the_page_locked_buffer_brings_back_every_tensor --deselect tests/integration/test_fp8.py::test_a_disaggregated_job_trains_with_llm_fp8
part moe_layer 170 python3 bench/moe_layer.py --out "$OUT/moe_layer.json" --profile-dir "$OUT"
part moe_layer_interleaved 200 python3 bench/moe_layer.py --interleave --head-start --iters 40 \
    --layers dyad,dyad-gate-up-interleaved,torchtitan-0.3.0 --out "$OUT/moe_layer_interleaved.json"
part router_kernels 120 python3 bench/router_kernels.py --out "$OUT/router_kernels.json"
part expert_order 60 python3 bench/expert_order.py --out "$OUT/expert_order.json"
part llm_step 300 python3 bench/llm_step.py --out "$OUT/llm_step.json" --profile-dir "$OUT"
part fp8_convergence 300 python3 bench/fp8_convergence.py --out "$OUT/fp8_convergence.json"
tar czf /tmp/results.tgz -C "$OUT" . && find "$OUT" -type f ! -name summary.txt -delete && mv /tmp/results.tgz "$OUT/"
