"""A config the client refuses is refused in about a second, before anything starts: the client
checks every field, value, layout, data file and checkpoint to resume without importing torch,
and says what is wrong in one line on stderr (exit status 2), with the closest field for a typo."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from dyad import config as config_lib
from dyad.app.cli import _job_config, _parser, main
from dyad.app.jobs import run_job

HEAVY = ("torch", "matplotlib")


def dyad(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.mark.parametrize(
    "override, message",
    [
        ("foo.bar=1", "unknown config field 'foo'"),
        ("parallel.llm.tp=3", "parallel.llm: tp (3) must divide n_heads (4)"),  # a layout against its model
        ("data.path=/no/such.jsonl", "data.path: file not found"),  # the data (with data.name below)
    ],
)
def test_a_refused_config_imports_no_torch_and_leaves_no_run_directory(tmp_path, override, message):
    """The import budget of the refusal (torch alone is seconds on a small CPU), not its wall time."""
    overrides = [override] + (["data.name=jsonl"] if override.startswith("data.") else [])
    script = (
        "import sys\n"
        "from dyad.app.cli import main\n"
        "try:\n"
        f"    main(['train', *{[a for o in overrides for a in ('--set', o)]!r}])\n"
        "except SystemExit as exited:\n"
        f"    print(exited.code, *sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], check=False, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env=dict(os.environ))
    assert result.stdout.split() == ["2"], (result.stdout, result.stderr)  # exit 2, nothing heavy imported
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert list(tmp_path.iterdir()) == []  # no runs/<timestamp>/


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("train.lrr=1", "unknown config field 'train.lrr'; did you mean 'train.lr'?"),
        ("trian.lr=1", "unknown config field 'trian'; did you mean 'train'?"),
        ("llm.moe.top_kk=1", "unknown config field 'llm.moe.top_kk'; did you mean 'llm.moe.top_k'?"),
        ("parallel.llm.tpp=2", "unknown config field 'parallel.llm.tpp'; did you mean 'parallel.llm.tp'?"),
        ("lr=1", "unknown config field 'lr'; did you mean 'train.lr'?"),  # a field without its section
        ("dp=2", "unknown config field 'dp'; did you mean 'parallel.encoder.dp' or 'parallel.llm.dp'?"),
    ],
)
def test_an_unknown_field_names_the_closest_known_one(override, suggestion):
    with pytest.raises(ValueError) as error:
        config_lib.load(None, [override])
    assert str(error.value) == suggestion


def test_an_unknown_field_like_no_known_one_suggests_nothing():
    with pytest.raises(ValueError) as error:
        config_lib.load(None, ["foo.bar=1"])
    assert str(error.value) == "unknown config field 'foo'"


def test_user_mistakes_are_one_line_and_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv, message in [
        (["--config", "missing.yaml"], ("dyad train: --config missing.yaml: No such file or directory "
                                       f"(dyad ships: {', '.join(config_lib.bundled_configs())})")),
        (["--set", "train.lr"], "dyad train: --set expects key=value, got 'train.lr'"),
        (["--set", "train.steps=0"], "dyad train: train.steps must be >= 1, got 0"),
    ]:
        code, out, err = dyad(capsys, "train", *argv)
        assert (code, out, err) == (2, "", message + "\n")
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_data_file_is_one_line_naming_it(capsys, tmp_path, monkeypatch):
    path = tmp_path / "data.jsonl"
    path.write_text("{}\n")
    real_read_bytes = Path.read_bytes

    def read_bytes(self):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)  # root reads any file: no chmod
    code, _, err = dyad(capsys, "train", "--set", "data.name=jsonl", "--set", f"data.path={path}")
    assert code == 2 and err == f"dyad train: data: cannot read {path}: Permission denied\n"


def test_a_local_router_refuses_more_workers_than_it_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = dyad(capsys, "train", "--set", "parallel.llm.dp=100000", "--set", "train.global_batch=100000",
                        "--set", "train.microbatches=1")
    assert code == 2 and "1 encoder + 100000 llm = 100001 worker processes" in err, err
    assert list(tmp_path.iterdir()) == []


def test_the_router_names_the_flag_and_variable_of_the_token_it_lacks(capsys, monkeypatch):
    monkeypatch.setenv("DYAD_TOKEN", "client")
    monkeypatch.delenv("DYAD_JOIN_TOKEN", raising=False)
    code, _, err = dyad(capsys, "router", "--port", "0")
    assert code == 2
    assert err == "dyad router: no join token: pass --join-token-file FILE or set $DYAD_JOIN_TOKEN\n"
    monkeypatch.delenv("DYAD_TOKEN")
    code, _, err = dyad(capsys, "router", "--port", "0", "--join-token-file", "/no/such/file")
    assert code == 2 and err == "dyad router: no client token: pass --token-file FILE or set $DYAD_TOKEN\n"
    monkeypatch.setenv("DYAD_TOKEN", "client")
    code, _, err = dyad(capsys, "router", "--port", "0", "--join-token-file", "/no/such/file")
    assert code == 2 and err == "dyad router: --join-token-file: join token file '/no/such/file' does not exist\n"


def _committed_run(tmp_path: Path, *, steps: int, at: int) -> Path:
    """A run directory as `dyad train` leaves it: its config and a committed checkpoint."""
    run = tmp_path / "before"
    checkpoint = run / "checkpoints" / f"step_{at:08d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text(json.dumps({"step": at, "cursor": {"epoch": 0, "offset": 0}}))
    (run / "config.yaml").write_text(config_lib.to_yaml(config_lib.load(None, [f"train.steps={steps}"])))
    return run


def _resumed_config(resume_from: Path, *argv: str):
    return _job_config(_parser().parse_args(
        ["train", "--device", "cpu", "--set", f"checkpoint.resume_from={resume_from}", *argv]
    ))


def test_resuming_with_other_steps_warns_that_the_schedule_follows_them(tmp_path, capsys):
    run = _committed_run(tmp_path, steps=800, at=400)
    for resume_from in (run, run / "checkpoints" / "step_00000400"):
        assert _resumed_config(resume_from, "--steps", "1200").train.steps == 1200
        assert capsys.readouterr().err == (
            "dyad train: warning: train.steps is 1200, the run resumed at step 400 had 800: the learning rate "
            "decays over the new count from here on (at step 400: 0.000789, not the 0.000568 of the run's "
            "schedule)\n"
        )
    _resumed_config(run, "--steps", "800")
    _resumed_config(run)  # the bundled config's 800
    assert capsys.readouterr().err == ""


def test_resuming_past_the_steps_or_from_no_checkpoint_is_refused(tmp_path):
    run = _committed_run(tmp_path, steps=800, at=400)
    with pytest.raises(ValueError, match=r"continues from step 400, past train.steps \(300\)"):
        _resumed_config(run, "--steps", "300")
    with pytest.raises(ValueError, match="holds no committed checkpoint"):
        _resumed_config(tmp_path / "empty")


class _Refusing:
    """A router that refuses every run."""

    def start_run(self, config_yaml):
        error = grpc.RpcError("refused")
        error.code = lambda: grpc.StatusCode.INVALID_ARGUMENT
        raise error


def _writing_to(out_dir: Path):
    return dataclasses.replace(config_lib.load(None, []), out_dir=str(out_dir))


def test_a_run_the_router_refuses_leaves_no_directory_it_made(tmp_path):
    with pytest.raises(grpc.RpcError):
        run_job(_writing_to(tmp_path / "new" / "run"), router=_Refusing(), progress=False)
    assert not (tmp_path / "new" / "run").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(grpc.RpcError):
        run_job(_writing_to(existing), router=_Refusing(), progress=False)
    assert existing.is_dir()  # not its to remove
