"""Out of disk space ends the run without recovering (a restart would write the same files), with
the file and the bytes where they are known; the run's JSON lines stay whole lines. The full
disk here is `tests.helpers.full_disk`."""

from __future__ import annotations

import errno
import json
import os

import pytest

from dyad.app.worker import would_repeat
from dyad.router.driver import RunAborted, RunDriver
from dyad.router.failures import blame, could_not_write
from dyad.router.records import JsonLines, NotWritten
from dyad.router.run import Run
from dyad.service import _not_written
from dyad.wire import pb
from tests.helpers.full_disk import fill_up
from tests.helpers.resilience import job_config, records_of

NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _records(path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), text[-200:]
    return [json.loads(line) for line in text.splitlines()]


def test_a_line_that_does_not_fit_is_cut_off_again_and_the_error_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    with JsonLines(path) as lines:
        lines.write(json.dumps({"step": 0}) + "\n")
    fill_up({path: 30}, monkeypatch)  # 30 more bytes: the next line fits, the one after only in part
    with JsonLines(path) as lines:
        lines.write(json.dumps({"step": 1}) + "\n")
        with pytest.raises(NotWritten) as failed:
            lines.write(json.dumps({"step": 2, "loss": 0.125}) + "\n")
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(path)
    assert failed.value.size == len(json.dumps({"step": 2, "loss": 0.125})) + 1
    assert _records(path) == [{"step": 0}, {"step": 1}]


def test_the_routers_write_that_fails_ends_the_run_naming_the_file_and_the_bytes(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    fill_up({path: 10}, monkeypatch)
    driver = object.__new__(RunDriver)  # only its recording is under test
    run = Run("r", job_config(tmp_path))
    with records_of(run, tmp_path), pytest.raises(RunAborted) as aborted:
        driver._record(run.notice, "checkpoint", 2, "committed")
    message = str(aborted.value)
    assert aborted.value.state == pb.RUN_STATE_FAILED
    record = {"event": "checkpoint", "step": 2, "generation": 0, "recoveries": 0, "message": "committed"}
    size = len(json.dumps(record)) + 1
    assert message.startswith(f"out of disk space writing {path} (No space left on device: {size} bytes to write, ")
    assert message.endswith("so the run ends without recovering")
    assert path.read_text() == ""


def test_other_write_failures_name_the_file_too():
    assert could_not_write(OSError(errno.EIO, "Input/output error", "/runs/a/metrics.jsonl")) == (
        "could not write /runs/a/metrics.jsonl: Input/output error")


def _checkpoint_failure(cause: BaseException):
    """What torch.distributed.checkpoint raises on every rank when one rank's write failed."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise cause
    except BaseException as error:  # noqa: BLE001 - wrapped as DCP wraps it
        return CheckpointException("write_data", {1: _wrap_exception(error)})


def test_a_full_disk_would_repeat_wherever_it_is_in_the_chain():
    assert would_repeat(NO_SPACE)
    assert would_repeat(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)))
    assert would_repeat(_checkpoint_failure(NO_SPACE))  # DCP's wrapping, a BaseException
    try:
        try:
            raise NO_SPACE
        except OSError as error:
            raise RuntimeError("the save failed") from error
    except RuntimeError as error:
        assert would_repeat(error)
    assert not would_repeat(OSError(errno.ECONNRESET, "Connection reset by peer"))
    assert not would_repeat(_checkpoint_failure(ConnectionError("a peer went away")))


def test_a_failed_checkpoint_save_is_reported_as_an_exception_naming_its_directory():
    """DCP's CheckpointException is a BaseException, which a worker would not report: the pool's
    save raises the first rank's OSError instead, errno kept, naming the checkpoint directory."""
    error = _not_written(_checkpoint_failure(NO_SPACE), "/runs/a/checkpoints/step_00000004/llm")
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC and would_repeat(error)
    assert str(error) == "[Errno 28] No space left on device: '/runs/a/checkpoints/step_00000004/llm'"
    other = _not_written(_checkpoint_failure(ValueError("bad tensor")), "/x/llm")
    assert isinstance(other, RuntimeError) and str(other) == "could not write the checkpoint /x/llm: ValueError('bad tensor')"


def test_the_router_ends_the_run_on_a_workers_full_disk_naming_the_path():
    traceback = (
        "Traceback (most recent call last):\n  ...\n"
        "torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:dict_keys([0])\n"
        "OSError: [Errno 28] No space left on device\n\n"
        "The above exception was the direct cause of the following exception:\n\n"
        "Traceback (most recent call last):\n  ...\n"
        "OSError: [Errno 28] No space left on device: '/runs/a/checkpoints/step_00000004/encoder'\n"
    )
    failure = pb.WorkerResult(error=traceback, error_repeats=True)
    verdict = blame([], {("encoder", 0): failure}, "its save", reporter=("encoder", 0))
    assert verdict.repeats
    assert verdict.message.startswith(
        "worker encoder/0 ran out of disk space in its save writing /runs/a/checkpoints/step_00000004/encoder; "
        "a restart from the checkpoint would too, so the run ends without recovering"), verdict.message
    assert "GPU" not in verdict.message


def test_json_lines_keep_a_file_like_face_for_the_samples(tmp_path):
    """The driver's loop writes samples.jsonl with write() and flush()."""
    with JsonLines(tmp_path / "samples.jsonl") as lines:
        lines.write('{"step": 0, "samples": [1, 2]}\n')
        lines.flush()
    assert _records(tmp_path / "samples.jsonl") == [{"step": 0, "samples": [1, 2]}]


def test_a_diverged_steps_record_is_strict_json():
    """NaN and infinities (a skipped step's loss) are written as null, which any JSON reader
    reads; Python's own writer would emit NaN, which strict readers refuse."""
    from dyad.router.records import json_line

    line = json_line({"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "skipped": True,
                      "nested": [float("-inf"), 1.5]})
    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line, parse_constant=lambda name: pytest.fail(f"non-standard JSON {name}")) == {
        "step": 3, "loss": None, "grad_norm": None, "skipped": True, "nested": [None, 1.5],
    }
