"""`dyad plan --gpus N --profile`: from profiles whose times are made up, the recommendation
follows the obvious cases (the heavier module gets more GPUs; what does not fit a GPU is never
picked; one GPU leaves only shared placements); bad arguments and profiles are refused naming
the argument, the file or the field; torch is never imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dyad import config as config_lib
from dyad.app.cli import main
from dyad.app.module_costs import fit, load_profile
from dyad.app.recommend import Machine, candidates, recommend
from dyad.data import make_dataset
from dyad.layout import LLMLayout
from tests.helpers.module_profiles import synthetic_profile

ENCODER_HEAVY = {"ms_per_patch": 1.0, "ms_per_token": 0.001}
LLM_HEAVY = {"ms_per_patch": 0.001, "ms_per_token": 1.0}


def resolved(overrides=()):
    config = config_lib.load(None, list(overrides))
    dataset = make_dataset(config.data)
    return config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size), dataset


def predictions(tmp_path, gpus: int, device_memory=None, **costs):
    config, dataset = resolved()
    costs = load_profile(synthetic_profile(tmp_path / "profile.json", config, **costs), config)
    return recommend(config, dataset, costs, gpus, device_memory=device_memory)


def best_split(predicted) -> tuple[int, int]:
    split = next(p.candidate for p in predicted if not p.excluded and not p.candidate.colocated)
    return split.encoder.world_size, split.llm.world_size


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def test_the_heavier_module_gets_more_of_the_gpus(tmp_path):
    assert best_split(predictions(tmp_path, 4, **ENCODER_HEAVY)) == (3, 1)
    assert best_split(predictions(tmp_path, 4, **LLM_HEAVY)) == (1, 3)


def test_a_candidate_past_the_device_memory_is_excluded_and_never_picked(tmp_path):
    everything = predictions(tmp_path, 4, **LLM_HEAVY)
    memories = sorted({p.memory_gib for p in everything if not p.excluded})
    limit = (memories[0] + memories[-1]) / 2
    limited = predictions(tmp_path, 4, device_memory=limit, **LLM_HEAVY)
    over = {p.candidate for p in everything if p.memory_gib > limit}
    assert over and {p.candidate for p in limited if p.excluded} == over
    assert all(p.excluded.startswith("memory: an estimated") for p in limited if p.candidate in over)
    assert not limited[0].excluded and limited[0].memory_gib <= limit
    assert all(p.excluded for p in limited[len(limited) - len(over):])  # the excluded come last


def test_one_gpu_leaves_only_the_pools_sharing_it(tmp_path):
    predicted = predictions(tmp_path, 1, **ENCODER_HEAVY)
    assert predicted and {p.candidate.placement for p in predicted} <= {"colocated", "homogeneous"}
    assert all(p.candidate.encoder.world_size == p.candidate.llm.world_size == 1 for p in predicted)


def test_every_candidate_is_a_layout_the_models_take_on_exactly_the_gpus(tmp_path):
    config, _ = resolved()
    found = candidates(config, 4)
    assert {c.placement for c in found} == {"1+3", "2+2", "3+1", "colocated", "homogeneous"}
    for c in found:
        gpus = 4 if c.colocated else c.encoder.world_size + c.llm.world_size
        assert gpus == 4 and c.llm.tp in (1, 2)  # digits' LLM has 2 kv heads
        assert (c.placement == "homogeneous") == (c.colocated and c.encoder.tp == c.llm.tp)


def test_the_pick_is_printed_as_overrides_and_every_candidate_written_as_json(tmp_path, capsys):
    config, _ = resolved()
    profile = synthetic_profile(tmp_path / "profile.json", config, **ENCODER_HEAVY)
    code, out, err = run(capsys, "plan", "digits", "--gpus", "4", "--profile", profile, "--device-memory", "80",
                         "--json", str(tmp_path / "plan.json"))
    assert code == 0, err
    assert "a model, not yet checked against measured runs" in out
    table = [line for line in out.splitlines() if line.startswith("  * ")]
    assert len(table) == 1
    written = json.loads((tmp_path / "plan.json").read_text())
    pick = written["candidates"][0]
    assert pick["placement"] in table[0] and f"{pick['tokens_per_s']:,.0f}" in table[0]
    assert f"the pick, {pick['placement']}: " + " ".join(pick["overrides"]) in out
    steps = [c["step_s"] for c in written["candidates"] if not c["excluded"]]
    assert steps == sorted(steps) and written["gpus"] == 4


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--gpus", "0", "--profile", "PROFILE"], "dyad plan: --gpus must be >= 1, got 0"),
        (["--gpus", "2"], "dyad plan: --gpus needs --profile PROFILE.json"),
        (["--profile", "PROFILE"], "dyad plan: --profile needs --gpus N"),
        (["--gpus", "2", "--profile", "MISSING"], "dyad plan: --profile MISSING: No such file or directory"),
        (["--gpus", "2", "--profile", "NOT_JSON"], "dyad plan: --profile NOT_JSON: not JSON"),
        (["--gpus", "2", "--profile", "NO_LLM"], "dyad plan: --profile NO_LLM: no 'llm' section"),
        (["--gpus", "2", "--profile", "OTHER_MODEL"],
         "differs from this config's: llm.n_layers 3 there, 2 in this config"),
        (["--gpus", "2", "--profile", "BFLOAT16"], "train.dtype 'bfloat16' there, 'float32' in this config"),
    ],
)
def test_bad_arguments_and_profiles_are_refused_naming_what_is_wrong(tmp_path, capsys, argv, message):
    config, _ = resolved()
    files = {
        "PROFILE": synthetic_profile(tmp_path / "profile.json", config, **ENCODER_HEAVY),
        "MISSING": str(tmp_path / "missing.json"),
        "NOT_JSON": str(tmp_path / "broken.json"),
        "NO_LLM": str(tmp_path / "no_llm.json"),
        "OTHER_MODEL": synthetic_profile(tmp_path / "other.json", resolved(["llm.n_layers=3"])[0], **ENCODER_HEAVY),
        "BFLOAT16": synthetic_profile(tmp_path / "bf16.json", resolved(["train.dtype=bfloat16"])[0], **ENCODER_HEAVY),
    }
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "no_llm.json").write_text(json.dumps({"shape": {}, "train": {}, "encoder": {}}))
    argv = [files.get(arg, arg) for arg in argv]
    message = message.replace("MISSING", files["MISSING"]).replace("NOT_JSON", files["NOT_JSON"])
    code, _, err = run(capsys, "plan", "digits", *argv)
    assert code == 2 and message.replace("NO_LLM", files["NO_LLM"]) in err, err


def test_a_collective_over_more_than_a_host_uses_the_link_between_hosts():
    machine = Machine(gpus_per_host=8)
    assert machine.bandwidth(LLMLayout(tp=8, dp=2), "tp") == machine.link_bytes_per_s
    assert machine.bandwidth(LLMLayout(tp=8, dp=2), "dp") == machine.inter_host_bytes_per_s
    assert machine.bandwidth(LLMLayout(dp=8, ep=8), "ep", all_to_all=True) == machine.all_to_all_bytes_per_s
    assert machine.bandwidth(LLMLayout(dp=16, ep=16), "ep", all_to_all=True) == machine.inter_host_bytes_per_s


def test_the_fit_recovers_the_costs_and_keeps_them_non_negative():
    patches, images = [16, 64, 256, 1024], [8, 4, 2, 1]
    ms = [0.5 + n * (0.01 * p + 1e-5 * p * p) for p, n in zip(patches, images)]
    curve = fit({"calls": [1] * 4, "patches": [n * p for n, p in zip(images, patches)],
                 "squares": [n * p * p for n, p in zip(images, patches)]}, ms)
    assert curve.coefficients == pytest.approx({"calls": 0.5, "patches": 0.01, "squares": 1e-5})
    assert curve.worst_error < 1e-9
    falling = fit({"calls": [1, 1, 1], "tokens": [1, 2, 3]}, [3.0, 2.0, 1.0])  # noise only: no negative cost
    assert falling.coefficients["tokens"] == 0 and falling.coefficients["calls"] > 0


def test_the_recommendation_imports_no_torch(tmp_path):
    config, _ = resolved()
    profile = synthetic_profile(tmp_path / "profile.json", config, **ENCODER_HEAVY)
    script = (
        "import sys\nfrom dyad.app.cli import main\n"
        f"try:\n    main(['plan', 'digits', '--gpus', '2', '--profile', {profile!r}])\n"
        "except SystemExit as exited:\n    print('exit', exited.code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.stdout.splitlines()[-1] == "exit 0 False", (result.stdout, result.stderr)


def test_each_candidates_overrides_make_the_config_that_candidate(tmp_path):
    """Also from a config with a pipeline and sequence parallelism, which the candidates leave."""
    base = ["parallel.llm.tp=2", "parallel.sequence_parallel=true", "parallel.llm.pp=2", "train.global_batch=8"]
    config, dataset = resolved(base)
    costs = load_profile(synthetic_profile(tmp_path / "profile.json", config, **ENCODER_HEAVY), config)
    predicted = recommend(config, dataset, costs, 2, device_memory=None)
    assert predicted and not any(p.excluded for p in predicted)
    for p in predicted:
        overrides = p.candidate.overrides(config, 2, Machine())
        made = config_lib.resolve(config_lib.load(None, [*base, *overrides]), vocab_size=config.llm.vocab_size)
        assert (made.parallel.encoder, made.parallel.llm) == (p.candidate.encoder, p.candidate.llm)
        assert made.train.microbatches == p.candidate.microbatches
        assert made.parallel.sequence_parallel == (p.candidate.llm.tp > 1)
