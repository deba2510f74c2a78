"""`dyad submit/status/watch/stop/scale/checkpoint` against a router: answers on stdout, gRPC
errors as one line `dyad <cmd>: <CODE>: <details>` on stderr with a non-zero exit, no traceback.
A command given no run id acts on the router's active run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from dyad.app.cli import main
from dyad.router.auth import Credentials
from dyad.router.launcher import Launcher
from dyad.router.server import serve

CREDENTIALS = Credentials(client_token="cli-client-token", join_token="cli-join-token")
UNKNOWN = "no-such-run"


class NoWorkers(Launcher):
    """Starts nothing: runs stay in STARTING until stopped."""

    def rendezvous(self, pools):
        return {pool: "127.0.0.1:1" for pool in pools}

    def start(self, *args, **kwargs):
        pass

    def dead(self):
        return []

    def stop(self, *args, **kwargs):
        pass


@pytest.fixture
def router(monkeypatch):
    for name in ("DYAD_TLS_CA", "DYAD_TLS_CERT", "DYAD_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    server, state = serve(host="127.0.0.1", port=0, launcher_factory=NoWorkers,
                          credentials=CREDENTIALS)
    monkeypatch.setenv("DYAD_ROUTER", state.address)
    monkeypatch.setenv("DYAD_TOKEN", CREDENTIALS.client_token)
    yield state
    for run_id in state.active_run_ids():
        state.get(run_id).stop_requested.set()
    state.wait_idle(10)
    server.stop(grace=None)


def dyad(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def _assert_grpc_error(code, err, command, status):
    assert code == 1, err
    assert err.startswith(f"dyad {command}: {status}: "), err
    assert "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [
        ("status", UNKNOWN),
        ("watch", UNKNOWN),
        ("stop", UNKNOWN),
        ("checkpoint", UNKNOWN),
        ("scale", "llm", "2", "--run", UNKNOWN),
    ],
    ids=lambda argv: argv[0],
)
def test_an_unknown_run_is_not_found(router, capsys, argv):
    code, out, err = dyad(capsys, *argv)
    _assert_grpc_error(code, err, argv[0], "NOT_FOUND")
    assert UNKNOWN in err and out == ""


def test_a_wrong_token_is_unauthenticated(router, capsys, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("not-the-token\n")
    code, _, err = dyad(capsys, "status", UNKNOWN, "--token-file", str(token_file))
    _assert_grpc_error(code, err, "status", "UNAUTHENTICATED")
    assert "client token" in err and "not-the-token" not in err


def test_the_token_file_wins_over_the_environment(router, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DYAD_TOKEN", "stale")
    token_file = tmp_path / "token"
    token_file.write_text(CREDENTIALS.client_token)
    code, _, err = dyad(capsys, "status", UNKNOWN, "--token-file", str(token_file))
    _assert_grpc_error(code, err, "status", "NOT_FOUND")


def test_no_token_is_a_usage_error_naming_how_to_give_one(router, capsys, monkeypatch):
    monkeypatch.delenv("DYAD_TOKEN")
    code, _, err = dyad(capsys, "status", UNKNOWN)
    assert code == 2
    assert "--token-file" in err and "DYAD_TOKEN" in err and "Traceback" not in err


def test_an_unreachable_router_is_unavailable(router, capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"
    code, _, err = dyad(capsys, "status", UNKNOWN, "--router", closed)
    _assert_grpc_error(code, err, "status", "UNAVAILABLE")


def test_submit_status_stop_watch(router, capsys, tmp_path):
    # Short timeouts: were the stop ignored, the run would fail soon rather than hang.
    code, out, err = dyad(
        capsys, "submit", "--steps", "2", "--out", str(tmp_path / "run"),
        "--set", "router.start_timeout_s=5", "--set", "router.max_recoveries=0",
    )
    assert code == 0, err
    run_id = out.strip()
    assert run_id and "\n" not in run_id and run_id in router.active_run_ids()

    code, out, _ = dyad(capsys, "status", run_id)
    assert code == 0 and out.startswith(f"run {run_id}: STARTING, step 0/2")
    assert str(tmp_path / "run") in out

    code, _, err = dyad(capsys, "watch", run_id, "--from-step", "-1")
    _assert_grpc_error(code, err, "watch", "INVALID_ARGUMENT")

    code, out, err = dyad(capsys, "stop", run_id)
    assert code == 0, err
    code, out, _ = dyad(capsys, "watch", run_id)
    assert code == 1  # watch succeeds only when the run did
    assert f"run {run_id}: STOPPED" in out

    code, _, err = dyad(capsys, "stop", run_id)
    _assert_grpc_error(code, err, "stop", "FAILED_PRECONDITION")


def test_commands_without_a_run_id_act_on_the_active_run(router, capsys, tmp_path):
    """`dyad scale encoder 2` as the issue writes it: requests are accepted and queued for the
    run the router drives (it waits for workers that never come; max_recoveries=0 and a 30 s
    start timeout end it soon were the stop ignored)."""
    code, out, err = dyad(
        capsys, "submit", "--steps", "2", "--out", str(tmp_path / "run"),
        "--set", "router.start_timeout_s=30", "--set", "router.max_recoveries=0",
    )
    assert code == 0, err
    run_id = out.strip()
    run = router.get(run_id)

    code, out, err = dyad(capsys, "scale", "encoder", "2")
    assert code == 0, err
    assert out.startswith(f"run {run_id}: STARTING")
    assert run.take_scale_requests() == {"encoder": 2}

    assert not run.checkpoint_requested.is_set()
    code, out, err = dyad(capsys, "checkpoint")
    assert code == 0 and out.startswith(f"run {run_id}: "), err
    assert run.checkpoint_requested.is_set()

    code, out, err = dyad(capsys, "status")
    assert code == 0 and out.startswith(f"run {run_id}: STARTING, step 0/2"), err

    code, out, err = dyad(capsys, "stop")
    assert code == 0 and out.startswith(f"run {run_id}: "), err
    assert run.stop_requested.is_set()
    code, out, _ = dyad(capsys, "watch", run_id)
    assert code == 1 and f"run {run_id}: STOPPED" in out

    code, _, err = dyad(capsys, "scale", "encoder", "2")
    assert code == 2 and "no run is active" in err and "--run RUN_ID" in err, err


@pytest.mark.parametrize(
    "argv, naming",
    [
        pytest.param(argv, naming, id=argv[0]) for argv, naming in [
            (("status",), "dyad status RUN_ID"),
            (("watch", "--from-step", "3"), "dyad watch RUN_ID"),
            (("stop",), "dyad stop RUN_ID"),
            (("checkpoint",), "dyad checkpoint RUN_ID"),
            (("scale", "encoder", "3"), "dyad scale POOL REPLICAS --run RUN_ID"),
        ]
    ],
)
def test_no_run_id_and_no_active_run_says_how_to_name_one(router, capsys, argv, naming):
    code, out, err = dyad(capsys, *argv)
    assert code == 2 and out == ""
    assert err == (
        f"dyad {argv[0]}: no run is active on the router at {router.address}; name one: {naming}\n"
    )


def test_submit_checks_the_config_before_calling(router, capsys):
    code, _, err = dyad(capsys, "submit", "--set", "train.lr=-1")
    assert code == 2 and "train.lr" in err
    assert router.active_run_ids() == []


def test_submit_checks_the_layouts_and_names_a_mistyped_field_before_calling(router, capsys):
    """The data and `checkpoint.resume_from` are the router's files: it checks those."""
    code, _, err = dyad(capsys, "submit", "--set", "parallel.llm.tp=3")
    assert (code, err) == (2, "dyad submit: parallel.llm: tp (3) must divide n_heads (4)\n")
    code, _, err = dyad(capsys, "submit", "--set", "train.lrr=1")
    assert (code, err) == (2, "dyad submit: unknown config field 'train.lrr'; did you mean 'train.lr'?\n")
    assert router.active_run_ids() == []


def test_the_router_command_needs_its_tokens(capsys, monkeypatch):
    monkeypatch.delenv("DYAD_TOKEN", raising=False)
    monkeypatch.setenv("DYAD_JOIN_TOKEN", "join")
    code, _, err = dyad(capsys, "router", "--port", "0")
    assert code == 2 and "DYAD_TOKEN" in err


def test_python_m_dyad_router_serves_with_token_files(tmp_path, capsys, monkeypatch):
    """The router process end to end: tokens from files, a state db, `dyad status` against it."""
    for name, token in (("client", "file-client-token"), ("join", "file-join-token")):
        (tmp_path / name).write_text(token + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DYAD_TOKEN", "DYAD_JOIN_TOKEN")}
    port_file = tmp_path / "address"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dyad.router", "--port-file", str(port_file),
         "--token-file", str(tmp_path / "client"), "--join-token-file", str(tmp_path / "join"),
         "--state-db", str(tmp_path / "state.db")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the router did not start"
            time.sleep(0.1)
        monkeypatch.setenv("DYAD_TOKEN", "file-client-token")
        code, _, err = dyad(capsys, "status", UNKNOWN, "--router", port_file.read_text())
        _assert_grpc_error(code, err, "status", "NOT_FOUND")
        monkeypatch.setenv("DYAD_TOKEN", "file-join-token")
        code, _, err = dyad(capsys, "status", UNKNOWN, "--router", port_file.read_text())
        _assert_grpc_error(code, err, "status", "UNAUTHENTICATED")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_submit_sends_paths_resolved_against_the_clients_directory(router, capsys, monkeypatch, tmp_path):
    """The router may run anywhere, in any directory: relative paths mean the client's."""
    import yaml

    from dyad.app.client import RouterClient

    sent = []
    start_run = RouterClient.start_run
    monkeypatch.setattr(RouterClient, "start_run", lambda self, text: sent.append(text) or start_run(self, text))
    monkeypatch.chdir(tmp_path)
    code, _, err = dyad(capsys, "submit", "--steps", "2", "--set", "out_dir=runs/a",
                        "--set", "data.tokenizer=tokenizers/words.json")
    # The router reads the file (absent here), at the path the client meant.
    assert code == 1 and f"data.tokenizer: file not found: '{tmp_path / 'tokenizers' / 'words.json'}'" in err, err
    code, _, err = dyad(capsys, "submit", "--steps", "2", "--set", "out_dir=runs/a")
    assert code == 0, err
    config = yaml.safe_load(sent[-1])
    assert config["out_dir"] == str(tmp_path / "runs" / "a")
    assert yaml.safe_load(sent[0])["data"]["tokenizer"] == str(tmp_path / "tokenizers" / "words.json")
