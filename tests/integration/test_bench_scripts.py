"""Every benchmark script runs once at toy size on CPU, only to keep it working (the numbers
mean nothing here; docs/performance.md has the GPU ones)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize(
    "script,args",
    [
        ("moe_layer.py", ["--iters", "2"]),
        ("moe_layer.py", ["--iters", "2", "--interleave", "--layers", "dyad,dyad-reference-router"]),
        ("router_kernels.py", ["--iters", "2"]),
        ("expert_order.py", ["--iters", "2"]),
        ("layer_clocks.py", ["--layers", "dyad"]),
        ("launch_costs.py", ["--iters", "2"]),
        ("boundary_bandwidth.py", ["--iters", "2", "--windows", "1", "2"]),
        ("ucx_message_cost.py", ["--iters", "2", "--variants", "perftest,dyad,ucxx-thread-polling+header+hop+event"]),
        ("llm_step.py", ["--iters", "2"]),
        ("packing.py", ["--iters", "2", "--packed-per-microbatch", "4"]),
        ("hf_load.py", ["--repeats", "1"]),
        ("vision_tower.py", ["--iters", "2"]),
        ("vision_attention.py", ["--iters", "1"]),
        ("encoder_balance.py", ["--iters", "2", "--microbatches", "2"]),
        ("module_profile.py", []),
        ("expert_gemms.py", ["--iters", "2"]),
        ("e2e_hetero.py", ["--set", "train.overlap_grad_reduce=false"]),
        ("ep_alltoall.py", ["--iters", "2"]),
        ("e2e_8gpu.py", []),
        ("resize.py", []),
        ("recovery.py", []),
        ("fp8_convergence.py", []),
        ("worker_threads.py", []),
        ("checkpoint_io.py", []),
        ("memory_plan.py", ["--steps", "2", "--variants", "sharded", "pp2-interleaved"]),
        ("compiled_gradients.py", ["--variants", "eager,all-blocks,moe-eager,dyad-compile"]),
    ],
)
def test_bench_script_runs_at_toy_size(tmp_path, script, args):
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(BENCH / script), "--toy", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(out.read_text())["device"] == "cpu"


def test_the_gpu_configs_of_the_scripts_load():
    """The toy runs above do not read the GPU-size configs; a bad value there would only show on
    a GPU host, after its machine time was spent."""
    sys.path.insert(0, str(BENCH))
    try:
        from e2e_8gpu import EIGHT_GPU, LARGER_ENCODER
        from e2e_hetero import VIT_L_224, WORKLOADS, layouts_for
        from memory_plan import GPU as MEMORY_PLAN
        from memory_plan import VARIANTS as MEMORY_PLAN_VARIANTS
        from resize import GPU_POOLS, RESIZE, device_lists, gpu_pools, parse_devices, pool_overrides
        from worker_threads import GPU_POOLS as THREAD_POOLS

        from dyad import config as config_lib
    finally:
        sys.path.remove(str(BENCH))
    resize_eight = pool_overrides(GPU_POOLS, device_lists(GPU_POOLS["encoder"], GPU_POOLS["llm"], GPU_POOLS["move"]))
    resize_two = pool_overrides(gpu_pools("1+2"), parse_devices("0,1/1,0"))
    configs = [EIGHT_GPU, [*RESIZE, *resize_eight], [*RESIZE, *resize_two], [*VIT_L_224, *LARGER_ENCODER, *THREAD_POOLS]]
    configs += [[*MEMORY_PLAN, *variant] for variant in MEMORY_PLAN_VARIANTS.values()]
    configs += [
        [*workload, f"train.global_batch={samples}", *overrides]
        for workload in WORKLOADS.values()
        for samples in (16, 64)
        for overrides, _ in layouts_for(samples).values()
    ]
    for overrides in configs:
        config = config_lib.load(None, overrides)
        assert config.train.device == "cuda"
    assert config_lib.load(None, EIGHT_GPU).train.lr == 3e-4


def test_e2e_layouts_keep_their_samples_a_microbatch_at_every_global_batch():
    sys.path.insert(0, str(BENCH))
    try:
        from e2e_hetero import WORKLOADS, layouts_for

        from dyad import config as config_lib
    finally:
        sys.path.remove(str(BENCH))
    for samples in (16, 32, 64):
        for name, (overrides, _) in layouts_for(samples).items():
            config = config_lib.load(None, [*WORKLOADS["vit-l-448-merge2"], f"train.global_batch={samples}", *overrides])
            per_microbatch = samples // (config.train.microbatches * config.parallel.llm.dp)
            assert per_microbatch == (4 if name.endswith("-4mb") else 8), (name, samples)
    with pytest.raises(SystemExit, match="--global-batch 24: not a multiple of 2 lanes x 8 samples"):
        layouts_for(24)
    assert list(layouts_for(24, ["heterogeneous"])) == ["heterogeneous"]  # the layouts not run are not checked


def test_e2e_layouts_run_in_the_order_named_and_an_unknown_one_is_named():
    sys.path.insert(0, str(BENCH))
    try:
        from e2e_hetero import chosen_layouts, layouts_for
    finally:
        sys.path.remove(str(BENCH))
    layouts = layouts_for(16)
    assert list(chosen_layouts(layouts, None)) == list(layouts)
    assert list(layouts_for(16, ["heterogeneous", "homogeneous-colocated"])) == ["heterogeneous", "homogeneous-colocated"]
    names = ["heterogeneous", "homogeneous-colocated-ep2"]
    assert list(chosen_layouts(layouts, names)) == names
    assert list(chosen_layouts(layouts, list(reversed(names)))) == list(reversed(names))
    with pytest.raises(SystemExit, match="no layout named heterogenous; there are homogeneous-colocated"):
        chosen_layouts(layouts, ["heterogenous"])


def test_the_plots_draw_from_the_committed_results(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCH / "plots.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("moe_layer_runs.png", "e2e_two_gpus.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_profiled_step_is_left_out_of_the_medians_and_its_kernel_tables_are_written(tmp_path):
    """Toy runs take steps 0-2 and leave out step 0: profiling step 2 leaves step 1 alone."""
    out, tables = tmp_path / "result.json", tmp_path / "tables"
    result = subprocess.run(
        [sys.executable, str(BENCH / "e2e_hetero.py"), "--toy", "--profile-step", "2",
         "--profile-dir", str(tables), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(out.read_text())["layouts"]["toy"]["steps_measured"] == 1
    written = sorted(p.name for p in (tables / "profile-toy").iterdir())
    assert {"encoder-0-step2.txt", "llm-0-step2.txt"} <= set(written), written


def test_the_eight_gpu_sweep_tries_smaller_microbatches_only_after_running_out_of_memory():
    sys.path.insert(0, str(BENCH))
    try:
        from e2e_8gpu import ran_out_of_memory, run_microbatch_sizes
    finally:
        sys.path.remove(str(BENCH))
    oom = {"error": "1 of 6 steps done: worker llm/0 ran out of GPU memory in its step; ..."}
    other = {"error": "0 of 6 steps done: worker encoder/1 failed: RuntimeError: NCCL timeout"}
    assert ran_out_of_memory(oom) and ran_out_of_memory({"error": "torch.OutOfMemoryError: CUDA out of memory."})
    assert not ran_out_of_memory(other) and not ran_out_of_memory({"step_s": 1.0})
    for outcomes, tried in (
        ({4: oom, 2: {"step_s": 2.0}, 1: {"step_s": 3.0}}, [4, 2]),  # fits at 2: 1 is not run
        ({4: {"step_s": 1.0}, 2: {"step_s": 2.0}}, [4]),
        ({4: other, 2: {"step_s": 2.0}}, [4]),  # another failure is not a reason to shrink
        ({4: oom, 2: oom, 1: oom}, [4, 2, 1]),
    ):
        assert list(run_microbatch_sizes(list(outcomes), outcomes.__getitem__)) == tried


def test_the_memory_estimate_stays_within_ten_percent_of_the_peaks_measured_on_the_gpu(tmp_path):
    """Today's `dyad plan` estimate of each variant of the committed H200 run (dp2 with the
    optimizer sharded and replicated, pp2 in 1F1B and interleaved) against the peaks measured
    there: a change to the estimate that moves it past 10 % of what a GPU held shows here."""
    out = tmp_path / "against.json"
    measured = BENCH.parent / "docs" / "results" / "memory_h200" / "memory_plan.json"
    result = subprocess.run([sys.executable, str(BENCH / "memory_plan.py"), "--against", str(measured), "--out", str(out)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    variants = json.loads(out.read_text())["variants"]
    assert set(variants) == {"sharded", "replicated", "pp2", "pp2-interleaved"}
    for name, variant in variants.items():
        for rank, entry in variant["ranks"].items():
            assert 0.9 <= entry["peak_over_estimate"] <= 1.1, (name, rank, entry)


def test_the_toy_module_profile_recommends_a_split_of_two_gpus(tmp_path):
    """bench/module_profile.py's profile of the digits config, read back by `dyad plan --gpus 2`:
    every placement of two GPUs is predicted, the pick printed (CPU times: the numbers mean nothing)."""
    profile = tmp_path / "profile.json"
    result = subprocess.run([sys.executable, str(BENCH / "module_profile.py"), "--toy", "--out", str(profile)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = tmp_path / "plan.json"
    result = subprocess.run([sys.executable, "-m", "dyad.app.cli", "plan", "digits", "--gpus", "2", "--profile",
                             str(profile), "--device-memory", "80", "--json", str(plan)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dyad plan --gpus 2: digits on 2 GPUs, predicted from the profile" in result.stdout
    predicted = json.loads(plan.read_text())["candidates"]
    assert {c["placement"] for c in predicted} == {"1+1", "colocated", "homogeneous"}
    assert all(c["tokens_per_s"] > 0 and not c["excluded"] for c in predicted)
    assert f"the pick, {predicted[0]['placement']}: " in result.stdout


def test_the_native_moe_workload_is_swept_at_toy_size(tmp_path):
    """bench/native_moe_workload.py's toy workload (a random Qwen3-VL-MoE, packed conversations
    with images of several sizes), profiled by bench/module_profile.py and swept by
    bench/plan_sweep.py: the pick and the best predicted candidate of each placement run for real
    (CPU times: only the bookkeeping is checked)."""
    pytest.importorskip("transformers", reason="transformers' config names the checkpoint's tensors")
    workload = tmp_path / "workload"
    config = workload / "workload.yaml"
    profile, out = tmp_path / "profile.json", tmp_path / "sweep.json"
    for script, args in (("native_moe_workload.py", ["--toy", "--dir", str(workload)]),
                         ("module_profile.py", [str(config), "--toy", "--out", str(profile)]),
                         ("plan_sweep.py", [str(config), "--toy", "--profile", str(profile), "--per-placement", "1",
                                            "--out", str(out), "--plot", str(tmp_path / "sweep.png"),
                                            "--work", str(tmp_path / "runs")])):
        result = subprocess.run([sys.executable, str(BENCH / script), *args],
                                capture_output=True, text=True, timeout=600, check=False)
        assert result.returncode == 0, f"{script}: {result.stderr[-3000:]}"
    sweep = json.loads(out.read_text())
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")
    runs, check = sweep["runs"], sweep["check"]
    assert {sweep["predicted"][name]["placement"] for name in runs} == {"1+1", "colocated", "homogeneous"}
    assert len(runs) == 3
    predicted = sweep["predicted"]  # fastest predicted first: the pick
    assert check["pick"] == next(iter(predicted)) and check["pick"] in runs
    assert [p["tokens_per_s"] for p in predicted.values()] == sorted((p["tokens_per_s"] for p in predicted.values()),
                                                                      reverse=True)
    assert all(r["tokens_per_s"] > 0 and r["predicted_tokens_per_s"] > 0 and r["tflops_per_gpu"] > 0
               and r["images"] > 0 for r in runs.values())
    tokens = {name: r["tokens_per_s"] for name, r in runs.items()}
    assert check["best_overall"] == max(tokens, key=tokens.get)
    homogeneous = tokens[check["best"]["homogeneous"]]
    heterogeneous = max(tokens[check["best"][kind]] for kind in ("split", "colocated"))
    assert check["heterogeneous_over_homogeneous"] == pytest.approx(heterogeneous / homogeneous)
    assert check["pick_over_best"] == pytest.approx(tokens[check["pick"]] / max(tokens.values()))
    assert check["pick_within"] == (check["pick_over_best"] >= 0.95)


def test_the_gpu_size_native_moe_workload_plans_on_eight_gpus(tmp_path):
    """The GPU host's workload (bench/native_moe_workload.py without its 13 GB of weights, fewer
    samples and images): `dyad plan` resolves its config as a run would, on eight GPUs."""
    pytest.importorskip("transformers", reason="transformers writes the checkpoint's config")
    workload = tmp_path / "workload"
    result = subprocess.run([sys.executable, str(BENCH / "native_moe_workload.py"), "--no-weights", "--samples", "64",
                             "--images", "6", "--dir", str(workload)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(workload.glob("*.safetensors"))
    result = subprocess.run([sys.executable, "-m", "dyad.app.cli", "plan", str(workload / "workload.yaml"),
                             "--device-memory", "141"], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "GPUs: 8 (encoder 2 + llm 6)" in result.stdout, result.stdout[-3000:]
    assert "27 blocks, native resolution" in result.stdout and "top 8 of 48 experts in 24 of 24 layers" in result.stdout


def test_the_module_profile_of_a_native_resolution_tower_is_read_back(tmp_path):
    """A Qwen3-VL tower's profile: square images of several sizes, each timed, and `dyad plan
    --gpus 2` reads it for the same config."""
    pytest.importorskip("transformers")
    from tests.helpers.native_images import native_conversations, qwen3_vl_checkpoint

    qwen3_vl_checkpoint(tmp_path / "qwen3-vl", weights=False)
    native_conversations(tmp_path)
    config = ["data.name=conversations", f"data.path={tmp_path / 'conversations.jsonl'}",
              f"data.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}", "data.channels=3",
              f"encoder.from_hf={tmp_path / 'qwen3-vl'}", "train.global_batch=8"]
    profile = tmp_path / "profile.json"
    result = subprocess.run([sys.executable, str(BENCH / "module_profile.py"), "--toy", *config, "--out", str(profile)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    points = json.loads(profile.read_text())["encoder"]["points"]
    assert len({p["patches_per_image"] for p in points}) >= 3
    assert all(p["tokens_per_image"] * 4 == p["patches_per_image"] for p in points)  # the 2 x 2 merge
    result = subprocess.run([sys.executable, "-m", "dyad.app.cli", "plan", "digits", *config, "--gpus", "2",
                             "--profile", str(profile)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the pick, " in result.stdout
