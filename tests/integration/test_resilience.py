"""Runs survive: a SIGKILLed encoder or LLM worker (once, twice, or while it writes a
checkpoint), a frozen worker (left stopped, or continued once it is replaced), pools resized
mid-run, a resume under another layout, checkpoints that cannot load (no manifest, a truncated or
changed shard: passed over, naming the file, without spending a recovery), a router killed and
started again — each run ends with the losses of an uninterrupted run (fp32, 1e-5) and trains on
every sample of the epoch exactly once."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal

import pytest

from dyad import config as config_lib
from dyad.app.cli import _describe_step, main
from dyad.app.client import RouterClient
from dyad.app.jobs import describe_evaluation
from dyad.router.checkpoints import MANIFEST, checkpoint_dir
from dyad.router.launcher import free_ports
from dyad.wire import pb
from tests.helpers.resilience import (
    CREDENTIALS,
    HeldWrite,
    assert_losses_match,
    exited,
    flip_bytes,
    follow,
    in_process_router,
    job_config,
    kill,
    largest_shard,
    run_followed,
    start_router,
    trained_samples,
    truncate_half,
)


@pytest.fixture(scope="module")
def baseline_router():
    """Serves the uninterrupted run's history for the module (the run itself is over)."""
    with in_process_router() as (client, _):
        yield client


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, baseline_router):
    out_dir = tmp_path_factory.mktemp("uninterrupted")
    run = run_followed(baseline_router, job_config(out_dir))
    assert run.info.state == 3, run.info.message  # RUN_STATE_SUCCEEDED
    assert sorted(run.steps) == list(range(8))
    return out_dir, run


def test_watch_from_a_step_replays_only_that_step_on(uninterrupted, baseline_router, capsys,
                                                      monkeypatch):
    """`dyad watch RUN_ID --from-step 5` on the finished run: the same step events as the live
    watch from step 5 on, the checkpoints committed at steps 6 and 8, the evaluation at the end,
    nothing earlier."""
    _, baseline = uninterrupted
    for name in ("DYAD_TLS_CA", "DYAD_TLS_CERT", "DYAD_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DYAD_TOKEN", CREDENTIALS.client_token)
    run_id = baseline.info.run_id
    with pytest.raises(SystemExit) as exited:
        main(["watch", run_id, "--from-step", "5", "--router", baseline_router.address])
    lines = capsys.readouterr().out.splitlines()
    assert exited.value.code == 0, lines
    steps = [line for line in lines if line.startswith("step ") and "held-out" not in line]
    assert steps == [_describe_step(baseline.steps[step]) for step in (5, 6, 7)], lines
    notices = [line.split(":")[0] for line in lines if line.startswith("checkpoint ")]
    assert notices == ["checkpoint at step 6", "checkpoint at step 8"], lines
    evaluations = [line for line in lines if "held-out" in line]
    assert evaluations == [describe_evaluation(baseline.evaluations[8])], lines  # eval.final
    assert len(steps) + len(notices) + len(evaluations) == lines.index(f"run {run_id}: SUCCEEDED, step 8/8")


def _assert_same_training(out_dir, run, uninterrupted) -> None:
    baseline_dir, baseline = uninterrupted
    assert run.info.state == 3, run.info.message
    assert_losses_match(run.steps, baseline.steps)
    samples, expected = trained_samples(out_dir), trained_samples(baseline_dir)
    assert samples == expected
    flat = [s for step in sorted(samples) for s in samples[step]]
    assert len(flat) == len(set(flat)), "a sample was trained on twice in the epoch"


# The LLM case runs two data-parallel ranks (one survives the kill), each taking one of the
# step's two microbatches: the same microbatches as the uninterrupted run.
KILL_LAYOUTS = {"encoder": [], "llm": ["parallel.llm.dp=2", "train.microbatches=1"]}


@pytest.mark.parametrize("pool", sorted(KILL_LAYOUTS))
def test_a_killed_worker_is_recovered_from_the_last_checkpoint(tmp_path, uninterrupted, pool):
    """No interval checkpoints here: the client asks for one after step 1, a worker is
    SIGKILLed after step 4, and the run goes back to that checkpoint."""
    killed = []

    with in_process_router() as (client, state):
        def act(metrics):  # the run may have ended by the last step's event: look it up only to act
            if metrics.step == 1:
                client.checkpoint(state.active_run_ids()[0])
            if metrics.step == 4 and not killed:
                killed.append(state.get(state.active_run_ids()[0]).pids[f"{pool}/0"])
                kill(killed[0])

        config = job_config(tmp_path, "checkpoint.interval_steps=0", *KILL_LAYOUTS[pool])
        run = run_followed(client, config, act)
    assert killed
    kinds = [(n.kind, n.step) for n in run.notices]
    # The on-demand checkpoint (written at a step between 2 and 4) and the recovery back to it;
    # in either order: the checkpoint's commit may still be going on in the background when the
    # recovery is announced (the recovery waits for it before restoring).
    committed = [step for kind, step in kinds if kind == "checkpoint"]
    assert 2 <= committed[0] <= 4 and committed[1:] == [8], kinds
    assert [step for kind, step in kinds if kind == "recovery"] == [committed[0]], kinds
    assert run.info.recoveries == 1 and run.info.generation == 2
    assert '"event": "recovery"' in (tmp_path / "metrics.jsonl").read_text()
    # The restarted workers, told that they restore the checkpoint, drew no initial weights; the
    # same training shows that the restore left nothing of what they were built with.
    for worker in ("encoder-0", "llm-0"):
        starts = re.findall(r"generation \d: started in .*", (tmp_path / "logs" / f"{worker}.log").read_text())
        assert [line.endswith("no initial weights drawn (a checkpoint is restored)") for line in starts] == [
            False, True], starts
    _assert_same_training(tmp_path, run, uninterrupted)


def test_recoveries_are_bounded_by_max_recoveries(tmp_path):
    """With router.max_recoveries=0 a SIGKILLed worker ends the run: FAILED, naming the bound,
    and no recovery counted or announced."""
    killed = []

    with in_process_router() as (client, state):
        def kill_once(metrics):
            if not killed:
                killed.append(state.get(state.active_run_ids()[0]).pids["encoder/0"])
                kill(killed[0])

        run = run_followed(client, job_config(tmp_path, "router.max_recoveries=0"), kill_once)
    assert killed
    assert run.info.state == pb.RUN_STATE_FAILED, run.info
    assert "gave up after router.max_recoveries=0" in run.info.message, run.info.message
    assert run.info.recoveries == 0 and run.info.generation == 1
    assert [n.kind for n in run.notices if n.kind != "checkpoint"] == [], run.notices
    assert max(run.steps) < 7


@pytest.mark.parametrize("continued", [False, True], ids=["left-stopped", "continued"])
def test_a_hung_worker_is_detected_by_its_silence_and_replaced(tmp_path, uninterrupted, continued):
    """SIGSTOP freezes every thread of the LLM worker, its heartbeats included. Left stopped, the
    recovery's signals end it; continued (SIGCONT) as soon as the recovery is announced, the stale
    process wakes into a run that has moved on to a new generation: it ends, and the run counts
    no second failure for it."""
    frozen = []

    with in_process_router() as (client, state):
        def freeze_once(metrics):
            if metrics.step == 3 and not frozen:
                frozen.append(state.get(state.active_run_ids()[0]).pids["llm/0"])
                kill(frozen[0], signal.SIGSTOP)

        def continue_it(notice):
            if continued and notice.kind == "recovery":
                with contextlib.suppress(ProcessLookupError):  # the recovery's SIGKILL came first
                    kill(frozen[0], signal.SIGCONT)

        config = job_config(tmp_path, "router.worker_timeout_s=4")
        run = run_followed(client, config, freeze_once, continue_it)
        replacement = state.get(run.info.run_id).pids["llm/0"]
    recoveries = [n for n in run.notices if n.kind == "recovery"]
    assert len(recoveries) == 1 and "silent" in recoveries[0].message, run.notices
    assert run.info.recoveries == 1 and run.info.generation == 2
    assert replacement != frozen[0] and exited(frozen[0])
    _assert_same_training(tmp_path, run, uninterrupted)


def test_a_second_worker_killed_right_after_a_recovery_is_recovered_too(tmp_path, uninterrupted):
    """The encoder worker is SIGKILLed after step 2; at the first step the recovered run reports,
    the LLM worker of the new generation is SIGKILLed too."""
    killed, recovered = [], []

    with in_process_router() as (client, state):
        def pid(key):
            return state.get(state.active_run_ids()[0]).pids[key]

        def kill_twice(metrics):
            if metrics.step == 2 and not killed:
                killed.append(pid("encoder/0"))
                kill(killed[-1])
            elif recovered and len(killed) == 1:
                killed.append(pid("llm/0"))
                kill(killed[-1])

        run = run_followed(client, job_config(tmp_path), kill_twice,
                           lambda notice: recovered.append(notice) if notice.kind == "recovery" else None)
    assert len(killed) == 2, killed
    assert [n.kind for n in run.notices].count("recovery") == 2, run.notices
    assert run.info.recoveries == 2 and run.info.generation == 3
    _assert_same_training(tmp_path, run, uninterrupted)


def test_a_worker_killed_while_it_writes_a_checkpoint_is_recovered_from_the_one_before(tmp_path, uninterrupted):
    """The LLM worker is held inside its write of step 4's checkpoint (its metadata file a FIFO
    nobody reads) and SIGKILLed there: the checkpoint is never committed, the run goes back to
    step 2's, and writes step 4's again, whole, when it gets there."""
    held = HeldWrite(checkpoint_dir(tmp_path, 4), "llm")
    killed = []

    with in_process_router() as (client, state):
        def kill_in_the_write(metrics):
            if metrics.step == 3 and not killed:  # step 4's checkpoint is due next
                held.wait()
                killed.append(state.get(state.active_run_ids()[0]).pids["llm/0"])
                kill(killed[0])
                held.release()

        run = run_followed(client, job_config(tmp_path), kill_in_the_write)
    assert killed
    assert [(n.kind, n.step) for n in run.notices if n.kind != "checkpoint"] == [("recovery", 2)], run.notices
    assert run.info.recoveries == 1 and run.info.generation == 2
    assert (checkpoint_dir(tmp_path, 4) / MANIFEST).exists()
    _assert_same_training(tmp_path, run, uninterrupted)


def test_a_recovery_passes_over_a_checkpoint_changed_since_its_commit(tmp_path, uninterrupted):
    """Step 4's checkpoint is committed, then 64 bytes of one of its shards are inverted while
    the run goes on; the LLM worker is SIGKILLed while it writes step 6's (held there, so step
    4's is the newest committed one). The recovery finds the shard changed, names it, and goes
    back to step 2's instead: one recovery, not one per attempt to load the bad checkpoint."""
    held = HeldWrite(checkpoint_dir(tmp_path, 6), "llm")
    killed, changed = [], []

    with in_process_router() as (client, state):
        def change_then_kill(metrics):
            if metrics.step == 5 and not killed:  # step 6's checkpoint is due next; step 4's committed before it
                held.wait()
                changed.append(largest_shard(checkpoint_dir(tmp_path, 4), "encoder"))
                flip_bytes(changed[0])
                killed.append(state.get(state.active_run_ids()[0]).pids["llm/0"])
                kill(killed[0])
                held.release()

        run = run_followed(client, job_config(tmp_path), change_then_kill)
    assert killed
    kinds = [(n.kind, n.step) for n in run.notices if n.kind != "checkpoint"]
    assert kinds == [("recovery", 4), ("corrupt_checkpoint", 4)], run.notices
    assert f"{changed[0]}: sha256 mismatch" in run.notices[[n.kind for n in run.notices].index("corrupt_checkpoint")].message
    assert run.info.recoveries == 1 and run.info.generation == 2
    assert '"event": "corrupt_checkpoint"' in (tmp_path / "metrics.jsonl").read_text()
    _assert_same_training(tmp_path, run, uninterrupted)


def test_pools_resized_mid_run_keep_the_math(tmp_path, uninterrupted):
    """Encoder 1 -> 2 -> 1 and LLM data-parallel 1 -> 2, each at a step boundary."""
    requests = {1: ("encoder", 2), 3: ("encoder", 1), 5: ("llm", 2)}

    with in_process_router() as (client, state):
        def resize(metrics):
            if metrics.step in requests:
                client.scale_pool(state.active_run_ids()[0], *requests.pop(metrics.step))

        run = run_followed(client, job_config(tmp_path), resize)
    resizes = [n for n in run.notices if n.kind == "resize"]
    assert [n.message.split(" in ")[0] for n in resizes] == [
        "encoder 1 -> 2", "encoder 2 -> 1", "llm 1 -> 2"], resizes
    phases = r"in [\d.]+s \(stopping [\d.]+ s, starting and registering [\d.]+ s, setting up and restoring [\d.]+ s\)$"
    assert all(re.search(phases, n.message) for n in resizes), resizes  # where each restart's time went
    assert run.info.llm_replicas == 2 and run.info.encoder_replicas == 1
    assert run.info.recoveries == 0
    _assert_same_training(tmp_path, run, uninterrupted)


def _lose_manifests(source):
    for step in (6, 8):
        (checkpoint_dir(source, step) / MANIFEST).unlink()
    return []


def _truncate_a_shard(source):
    shard = largest_shard(checkpoint_dir(source, 8), "llm")
    truncate_half(shard)
    return [shard]


def _change_shards(source):
    shards = [largest_shard(checkpoint_dir(source, step), "encoder") for step in (8, 6)]
    for shard in shards:
        flip_bytes(shard)
    return shards


# How the source's newest checkpoints are damaged (returning the files that no longer verify,
# newest first), and the step the run resumes at.
DAMAGE = {
    "lost-manifests": (_lose_manifests, 4),  # as if the router died while committing them
    "truncated-shard": (_truncate_a_shard, 6),
    "changed-shards": (_change_shards, 4),  # 64 bytes inverted in each: sizes unchanged
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_under_another_llm_layout_skips_checkpoints_that_cannot_load(tmp_path, uninterrupted, damage):
    """Resume from a copy of the uninterrupted run whose newest checkpoints were damaged: the run
    continues from the newest one that is committed and whose files verify, under LLM tp=2
    instead of 1, with the same losses; each one passed over is announced naming its bad file,
    and none costs a recovery."""
    baseline_dir, baseline = uninterrupted
    source = tmp_path / "source"
    shutil.copytree(baseline_dir / "checkpoints", source / "checkpoints")
    damage_it, start = DAMAGE[damage]
    bad_files = damage_it(source)

    with in_process_router() as (client, _):
        config = job_config(tmp_path / "resumed", "parallel.llm.tp=2",
                            f"checkpoint.resume_from={source}")
        run = run_followed(client, config)
    assert run.info.state == 3, run.info.message
    assert run.info.recoveries == 0 and run.info.generation == 1
    passed_over = [n.message for n in run.notices if n.kind == "corrupt_checkpoint"]
    assert len(passed_over) == len(bad_files), run.notices
    assert all(message.startswith(f"{path}: ") for message, path in zip(passed_over, bad_files)), passed_over
    steps = list(range(start, 8))
    assert sorted(run.steps) == steps
    assert_losses_match(run.steps, {s: baseline.steps[s] for s in steps})
    resumed = trained_samples(tmp_path / "resumed")
    assert resumed == {s: trained_samples(baseline_dir)[s] for s in steps}


def test_a_restarted_router_finishes_the_run(tmp_path, uninterrupted):
    port = free_ports(1)[0]
    first = start_router(tmp_path, port, "router-1")
    client = RouterClient(f"127.0.0.1:{port}", token=CREDENTIALS.client_token)
    second = None
    try:
        info = client.start_run(config_lib.to_yaml(job_config(tmp_path / "run")))
        for event in client.watch(info.run_id):
            if event.HasField("step") and event.step.step == 4:
                first.send_signal(signal.SIGKILL)
                break
        first.wait(10)
        second = start_router(tmp_path, port, "router-2")
        run = follow(client, info.run_id)
        assert run.info.state == 3, (run.info.message, (tmp_path / "router-2.log").read_text()[-3000:])
        # Every worker registered again and the run went on in place: one left waiting for a
        # peer that never got the dead router's last command is unblocked by the new router
        # sending that peer the command.
        assert [n.kind for n in run.notices if n.kind in ("resume", "recovery")] == ["resume"], run.notices
        assert run.info.recoveries == 0
        _assert_same_training(tmp_path / "run", run, uninterrupted)
    finally:
        client.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
