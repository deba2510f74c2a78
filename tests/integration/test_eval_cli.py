"""`dyad eval CHECKPOINT`: the held-out loss and caption accuracy of a committed checkpoint or of
a run's newest, whatever layout wrote it, from the config the run wrote beside it; a path that
holds no committed checkpoint is one line, never a traceback."""

from __future__ import annotations

import re

import pytest

from dyad.app.cli import main
from dyad.router.checkpoints import checkpoint_dir
from dyad.wire import pb
from tests.helpers.resilience import in_process_router, job_config, run_followed

_RESULT = re.compile(
    r"(?P<path>\S+) \(step (?P<step>\d+)\): held-out loss (?P<loss>[\d.]+) over (?P<tokens>\d+) caption tokens, "
    r"caption_accuracy (?P<accuracy>[\d.]+) on (?P<samples>\d+) held-out samples"
)


def _eval(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(["eval", *argv, "--device", "cpu"])
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The same four steps under two LLM layouts."""
    runs = {}
    with in_process_router() as (client, _):
        for name, layout in (("tp1", []), ("tp2", ["parallel.llm.tp=2"])):
            out = tmp_path_factory.mktemp(name)
            run = run_followed(client, job_config(out, "train.steps=4", *layout))
            assert run.info.state == pb.RUN_STATE_SUCCEEDED, run.info.message
            runs[name] = out
    return runs


def test_a_runs_newest_checkpoint_is_evaluated_the_same_whatever_its_layout(trained, capsys):
    results = {}
    for name, out in trained.items():
        code, stdout, err = _eval(capsys, str(out))
        assert code == 0, err
        found = _RESULT.fullmatch(stdout.strip())
        assert found, stdout
        assert found["path"] == str(checkpoint_dir(out, 4)) and found["step"] == "4"
        results[name] = found
    tp1, tp2 = results["tp1"], results["tp2"]
    assert float(tp1["loss"]) > 0 and int(tp1["tokens"]) > 0 and int(tp1["samples"]) > 0
    assert (tp1["loss"], tp1["tokens"], tp1["accuracy"], tp1["samples"]) == (
        tp2["loss"], tp2["tokens"], tp2["accuracy"], tp2["samples"])


def test_an_earlier_checkpoint_is_evaluated_as_it_was(trained, capsys):
    code, earlier, _ = _eval(capsys, str(checkpoint_dir(trained["tp1"], 2)))
    code_newest, newest, _ = _eval(capsys, str(trained["tp1"]))
    assert code == code_newest == 0
    assert _RESULT.fullmatch(earlier.strip())["step"] == "2"
    assert float(_RESULT.fullmatch(earlier.strip())["loss"]) != float(_RESULT.fullmatch(newest.strip())["loss"])


def test_a_path_without_a_committed_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / "checkpoints" / "step_00000002" / "llm").mkdir(parents=True)  # written, never committed
    for path in (tmp_path, tmp_path / "checkpoints" / "step_00000002", tmp_path / "nowhere"):
        code, out, err = _eval(capsys, str(path))
        assert code == 2 and out == "", err
        assert err.startswith(f"dyad eval: CHECKPOINT ({path}) holds no committed checkpoint") and err.count("\n") == 1
