"""The router's side of a run: bring up a generation of workers, then for every step send
commands, collect results, combine the global gradient norm and publish metrics; between steps,
evaluate on the held-out split, commit checkpoints and resize pools; when a worker is lost, restore both pools from the last
committed checkpoint in a new generation and go on (a bounded number of times).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from dyad import config as config_lib
from dyad.clipping import clip_scale
from dyad.pools import pool_names, pool_type, pool_types
from dyad.router import checkpoints, schedule
from dyad.router.boundary import BoundaryPlan
from dyad.router.checkpoints import Committed
from dyad.router.evaluation import answer_lengths, evaluation_metrics
from dyad.router.failures import OUT_OF_SPACE, blame, could_not_write
from dyad.router.launcher import Launcher, WorkerSpec
from dyad.router.records import JsonLines, json_line
from dyad.router.run import Run, worker_key
from dyad.router.sampler import Cursor
from dyad.router.sinks import open_sinks
from dyad.router.steps import StepPlanner, StepSpec, step_command
from dyad.ucx_progress import worker_progress_env
from dyad.wire import pb

log = logging.getLogger(__name__)
_POLL_S = 0.2
# How long after a worker reports an error the router waits for a peer's death to show before it
# blames the reporter: the error may be the death's consequence (its transfers canceled), and
# a launcher may see deaths late (a pod watch; a local child's exit shows at once).
_DEATH_SEEN_WITHIN_S = 2.0


class RunAborted(RuntimeError):
    """The run ends: stopped by the client, or failed beyond recovery."""

    def __init__(self, message: str, state: int = pb.RUN_STATE_FAILED):
        super().__init__(message)
        self.state = state


class WorkerLost(RuntimeError):
    """A worker died, hung, went silent or failed: the run can recover from a checkpoint."""


class _NothingToRestore(Exception):
    """A recovery's workers, started to restore a checkpoint, have none left that verifies."""


@dataclass
class SentStep:
    """A step whose command has gone out: what it trains on, and when its time began."""

    spec: StepSpec
    plan: BoundaryPlan
    started: float  # time.perf_counter()


@dataclass(frozen=True)
class GenerationStart:
    """How long a new generation of workers took to start, phase by phase."""

    stopping_s: float  # the restarted pools' old workers told to stop, and gone
    registering_s: float  # their successors started, and every worker registered
    setting_up_s: float  # every worker set up: peers, and the checkpoint restored

    @property
    def total_s(self) -> float:
        return self.stopping_s + self.registering_s + self.setting_up_s

    def __str__(self) -> str:
        return (
            f"{self.total_s:.1f}s (stopping {self.stopping_s:.1f} s, starting and registering "
            f"{self.registering_s:.1f} s, setting up and restoring {self.setting_up_s:.1f} s)"
        )


class RunDriver:
    def __init__(
        self, run: Run, launcher: Launcher, router_address: str, dataset, *,
        worker_env: dict[str, str] | None = None, resumed: bool = False,
    ):
        self.run = run
        self.launcher = launcher
        self.router_address = router_address
        self.dataset = dataset
        self.worker_env = worker_env or {}
        self.resumed = resumed  # a restarted router taking over: workers may still be running
        self.out_dir = Path(run.config.out_dir)
        self.committed: Committed | None = None  # the newest checkpoint with its manifest
        # The newest checkpoint both pools have written: the committed one, or one whose files
        # `self.commits` is syncing before it writes the manifest.
        self.written: Committed | None = None
        self.commits = checkpoints.BackgroundCommits()
        self.step = 0
        self.planner = StepPlanner(run.config, dataset)
        self._ahead: SentStep | None = None  # the next step, sent with this one's update
        self._stop_seen: float | None = None  # when a client's stop was first seen mid-step
        self._early: list[pb.WorkerResult] = []  # results of it that came before their collection

    @property
    def config(self):
        return self.run.config

    def __call__(self) -> None:
        state, message = pb.RUN_STATE_SUCCEEDED, ""
        try:
            self._drive()
        except RunAborted as error:
            state, message = error.state, str(error)
        except Exception as error:
            log.exception("run %s failed", self.run.run_id)
            state, message = pb.RUN_STATE_FAILED, _ended_by(error)
        finally:
            self.run.send(pb.WorkerCommand(stop=pb.StopCommand(reason=message or "done")))
            self.launcher.stop(timeout_s=self.config.router.stop_grace_s)
            self.commits.close()
            self.run.set_state(state, message)

    def _drive(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        sinks = open_sinks(self.run, self.out_dir)
        for sink in sinks:
            self.run.subscribe(sink)
        # The samples each step trained on, to audit that none is lost or repeated.
        with JsonLines(self.out_dir / "samples.jsonl") as self._samples_file:
            try:
                self._train_to_the_end()
            finally:  # a stopped or failed run's last checkpoint is committed all the same
                self._commit_before_leaving()
                for sink in sinks:
                    self.run.unsubscribe(sink)
                    sink.close()

    def _train_to_the_end(self) -> None:
        self._continue_from(self._first_checkpoint())
        self._warn_of_a_changed_schedule()
        if self.step == 0:  # a start, not a resume
            for pool in pool_types():
                for warning in pool.warnings(self.config):
                    self._notice("warning", warning)
        try:
            if self.resumed:
                self._take_over_workers()
            else:
                self._start_generation(restarting=pool_names(), restore_all=True)
        except WorkerLost as lost:
            self._recover(lost)
        self.run.set_state(pb.RUN_STATE_RUNNING)
        total = self.config.train.steps
        while self.written is None or self.written.step != total:
            if self._ahead is None:  # a step sent ahead is trained first: its samples are taken
                self._stop_if_requested()
            try:
                if self.step == total:  # the final checkpoint (a recovery rewinds the step)
                    self._commit(wait=True)
                    continue
                self._between_steps()
                metrics, samples = self._train_step(self.step)
            except WorkerLost as lost:
                self._recover(lost)
                continue
            self._record(self.run.record_step, metrics)
            self._samples_file.write(json_line(
                {"step": self.step, "generation": self.run.generation, "samples": samples}
            ))
            self.step += 1
            try:
                if self._evaluation_due(self.step):
                    self._evaluate()
            except WorkerLost as lost:  # evaluated again once the run is back at this step
                self._recover(lost)
                continue
            interval = self.config.checkpoint.interval_steps
            if interval and self.step % interval == 0 and self.step < total:
                self._commit_or_recover()
        self._wait_for_commit()

    def _write_config(self) -> None:
        """The run's config as it runs (derived fields filled, the pools' current layouts) in
        out_dir/config.yaml: what `dyad eval` and a resume read back."""
        path = self.out_dir / "config.yaml"
        try:
            tmp = path.with_suffix(".yaml.tmp")
            tmp.write_text(self.run.config_yaml)
            os.replace(tmp, path)
        except OSError as error:
            raise RunAborted(could_not_write(error)) from error

    def _record(self, emit, *args):
        """`emit(*args)` (a step's metrics, a notice): the run's history and every sink (its
        metrics.jsonl among them) have it; the run ends where a sink cannot write it (a full
        disk would fail a restart the same way)."""
        try:
            return emit(*args)
        except OSError as error:
            raise RunAborted(could_not_write(error)) from error

    def _notice(self, kind: str, message: str, step: int | None = None) -> None:
        """A RunNotice in the WatchRun stream and an `event` record in metrics.jsonl, of `step`
        (default the current one)."""
        self._record(self.run.notice, kind, self.step if step is None else step, message)

    # ------------------------------------------------------------------ checkpoints

    def _first_checkpoint(self) -> Committed | None:
        """Where the run starts: after a router restart its own newest checkpoint, else
        `checkpoint.resume_from`'s, else the initial weights (none); the newest whose files
        verify (`_verified`)."""
        own = checkpoints.committed_in(self.out_dir) if self.resumed else []
        return self._verified(self._lineage(own))

    def _lineage(self, own: list[Committed]):
        """`own` checkpoints (of this run's out_dir, newest first), then those
        `checkpoint.resume_from` offers, read only if reached."""
        yield from own
        if self.config.checkpoint.resume_from:
            yield from checkpoints.resume_candidates(self.config.checkpoint.resume_from)

    def _verified(self, candidates) -> Committed | None:
        """The first of `candidates` whose files verify. Each one passed over is a
        `corrupt_checkpoint` notice naming its bad file, and no recovery. None where none
        verifies: the initial weights, as with no checkpoint, unless the run resumes from
        `checkpoint.resume_from`, which then fails naming the bad files rather than start over."""
        bad = []

        def passed_over(committed: Committed, error: checkpoints.CorruptCheckpoint) -> None:
            bad.append(str(error))
            self._notice("corrupt_checkpoint", f"{error}; passing over {committed.path}", step=committed.step)

        found = checkpoints.first_verified(candidates, passed_over)
        if found is None and bad and self.config.checkpoint.resume_from:
            raise RunAborted(f"no checkpoint to continue from verifies: {'; '.join(bad)}")
        return found

    def _warn_of_a_changed_schedule(self) -> None:
        """A run resumed from another with a different train.steps: a `warning` notice (in `dyad
        watch` and metrics.jsonl) says the learning rate's decay bends from the resumed step."""
        if self.resumed or self.committed is None or not self.config.checkpoint.resume_from:
            return
        previous = schedule.steps_of_run(self.committed.path.parent.parent)
        change = schedule.schedule_change(self.committed.step, self.config.train, previous)
        if change:
            self._notice("warning", change)

    def _continue_from(self, committed: Committed | None) -> None:
        self.committed = self.written = committed
        self.step = committed.step if committed else 0
        self._ahead, self._early = None, []  # a step sent ahead is the last generation's
        self.run.continue_from(self.step)
        cursor = committed.cursor if committed else Cursor()
        self.planner = StepPlanner(self.config, self.dataset, cursor)
        if self.step > self.config.train.steps:
            raise RunAborted(
                f"the checkpoint to resume ({committed.path}) is at step {self.step}, past "
                f"train.steps ({self.config.train.steps})"
            )

    def _commit(self, wait: bool = False) -> None:
        """Both pools write their part, then the manifest makes it a checkpoint once their files
        are synced: by the commit thread while training goes on (`checkpoint.sync_in_background`),
        or, when the run waits for it (`wait`, or the option off), by the workers as they write,
        which overlaps writing and syncing and so ends sooner than writing first and syncing in
        the commit thread (docs/resilience.md, "Committed checkpoints")."""
        self._wait_for_commit()  # one at a time, in order
        wait = wait or not self.config.checkpoint.sync_in_background
        path = checkpoints.checkpoint_dir(self.out_dir, self.step)
        path.mkdir(parents=True, exist_ok=True)
        # A run that went back past this step committed it once: the pools now write it again,
        # and its old manifest no longer describes the files (it becomes a checkpoint again at
        # its new commit).
        (path / checkpoints.MANIFEST).unlink(missing_ok=True)
        save = pb.SaveCommand(step=self.step, path=str(path), sync_files=wait)
        self.run.send(pb.WorkerCommand(save=save))
        self._collect("save", lambda result: result.step == self.step)
        parallel = config_lib.to_dict(self.config.parallel)
        layouts = {pool: parallel[pool] for pool in pool_names()}
        self.written = Committed(path, self.step, self.planner.cursor, layouts)
        self.commits.start(self.written, run_id=self.run.run_id, keep_last=self.config.checkpoint.keep_last)
        if wait:
            self._wait_for_commit()

    def _wait_for_commit(self) -> None:
        self._take_commit(wait=True)

    def _commit_if_synced(self) -> None:
        self._take_commit(wait=False)

    def _take_commit(self, wait: bool) -> None:
        """The checkpoint being committed (if any), once it is (`wait`: block until then); a
        failure to sync it ends the run."""
        try:
            committed = self.commits.wait() if wait else self.commits.finished()
        except (OSError, RuntimeError) as error:
            raise RunAborted(f"the checkpoint {self.written.path} could not be committed: {error}") from error
        if committed is not None:
            self.committed = committed
            self.run.set_checkpoint(str(committed.path))
            self._notice("checkpoint", f"committed {committed.path}", step=committed.step)

    def _commit_before_leaving(self) -> None:
        try:
            self._wait_for_commit()
        except RunAborted as error:
            log.error("run %s: %s", self.run.run_id, error)

    def _commit_or_recover(self) -> None:
        try:
            self._commit()
        except WorkerLost as lost:
            self._recover(lost)

    # ------------------------------------------------------------------ generations

    def _start_generation(
        self, restarting, restore_all: bool, timeout_s: float | None = None, stop_grace_s: float | None = None,
        before_setup=None, as_they_register=lambda: None,
    ) -> GenerationStart:
        """Stop the workers of the `restarting` pools (waiting `stop_grace_s` for them to exit, by
        default router.stop_grace_s), start them at the pools' current sizes, wait until every
        rank of both pools is registered, call `before_setup` (if given), and set them up: peers,
        and the committed checkpoint to restore (all pools, or only the restarted ones). Returns
        how long each phase took (also logged)."""
        started = time.perf_counter()
        restarting = tuple(restarting)
        # The new generation begins before the old workers are told to stop, so a worker
        # restarted quickly (a pod's container) registers into it, never into the old one.
        leaving = self.run.registered(restarting)
        generation = self.run.new_generation(
            restarting, self.launcher.rendezvous(restarting), restores=self.committed is not None,
            exit_within_s=stop_grace_s or 0.0,
        )
        if restarting:
            for channel in leaving.values():
                channel.commands.put(pb.WorkerCommand(stop=pb.StopCommand(reason="restart")))
            self.launcher.stop(restarting, timeout_s=stop_grace_s or self.config.router.stop_grace_s)
        stopped = time.perf_counter()
        specs = [
            WorkerSpec(pool, rank) for pool in restarting for rank in range(self.run.pool_sizes[pool])
        ]
        env = worker_progress_env(self.config.train.device) | self.worker_env
        self.launcher.start(self.run.run_id, self.router_address, specs, self.out_dir / "logs", env)
        timeout_s = timeout_s or self.config.router.start_timeout_s
        def check() -> None:
            self._check_stop_or_lost()
            as_they_register()

        if not self.run.wait_for_workers(timeout_s, check):
            missing = ", ".join(f"{pool}/{rank}" for pool, rank in self.run.missing())
            raise WorkerLost(f"worker(s) {missing} did not register within {timeout_s:g}s")
        as_they_register()
        registered = time.perf_counter()
        if before_setup is not None:
            before_setup()
        peers = [
            pb.Peer(worker=pb.WorkerId(pool=pool_type(pool).wire_id, rank=rank), data_address=channel.address)
            for (pool, rank), channel in sorted(self.run.registered().items())
        ]
        restore = str(self.committed.path) if self.committed else ""
        for pool in pool_names():
            setup = pb.SetupCommand(
                peers=peers,
                generation=generation,
                restore_path=restore if restore_all or pool in restarting else "",
            )
            self.run.send(pb.WorkerCommand(setup=setup), [pool])
        self._collect("setup", lambda result: result.generation == generation)
        timing = GenerationStart(stopped - started, registered - stopped, time.perf_counter() - registered)
        log.info("run %s: generation %d started in %s", self.run.run_id, generation, timing)
        return timing

    def _take_over_workers(self) -> None:
        """After a router restart: the run's workers register again and restore the last
        committed checkpoint in place. The last router may have died having sent a command to
        only some of them, and one that has it may wait for a peer that has not (a step's
        boundary, a collective): each worker that registers is first sent the recent commands
        it never received, so that every in-flight command completes everywhere and its waiting
        peers come back too. A worker that does not come back within router.worker_timeout_s
        makes it a recovery instead."""
        for key, pid in self.run.pids.items():
            pool, rank = key.split("/")
            self.launcher.adopt(WorkerSpec(pool, int(rank)), pid)
        if self.committed is None:
            # Nothing to restore in place, and the workers' weights have moved on from the initial
            # ones the run goes back to: the pools start again, as at the run's start.
            self._start_generation(
                restarting=pool_names(), restore_all=True, stop_grace_s=self.config.router.abort_grace_s
            )
            self._notice("restart", "router restarted with no committed checkpoint: the pools started "
                         "again from their initial weights", step=0)
            return
        caught_up: set[tuple[str, int]] = set()

        def catch_up() -> None:
            for key, channel in self.run.registered().items():
                if key not in caught_up:
                    caught_up.add(key)
                    missed = self.run.missed_by(key)
                    if missed:
                        log.info("run %s: %s/%d missed commands %s of the last router; sending them",
                                 self.run.run_id, *key, [command.seq for command in missed])
                    for command in missed:
                        channel.commands.put(command)

        try:
            self._start_generation(
                restarting=(), restore_all=True, timeout_s=self.config.router.worker_timeout_s,
                as_they_register=catch_up,
            )
        except WorkerLost as lost:
            raise WorkerLost(f"after the router restart: {lost}") from None
        self._notice("resume", "router restarted; every worker registered again")

    def _recover(self, lost: WorkerLost) -> None:
        """Restart both pools from the last committed checkpoint, as often as allowed."""
        while True:
            limit = self.config.router.max_recoveries
            if self.run.info().recoveries >= limit:  # RunInfo.recoveries never exceeds the bound
                raise RunAborted(f"gave up after router.max_recoveries={limit}: {lost}")
            used = self.run.count_recovery()
            # The step it goes back to: the newest checkpoint written, committed by the setup (its
            # sync's failure would end the run).
            back_to = self.written.step if self.written else 0
            log.warning("run %s: recovering (%d/%d) to step %d: %s",
                        self.run.run_id, used, limit, back_to, lost)
            self._notice("recovery", f"attempt {used}/{limit}: {lost}", step=back_to)
            try:
                self._restart_from_the_committed_checkpoint()
                return
            except WorkerLost as again:
                lost = again

    def _restart_from_the_committed_checkpoint(self) -> None:
        """A recovery's new generation, set up from the last committed checkpoint that verifies.
        Where none does and the run goes back to its initial weights, workers started to
        restore one (built without them) are started again to draw them: one more generation,
        not another recovery."""
        restart = functools.partial(
            self._start_generation, restarting=pool_names(), restore_all=True,
            stop_grace_s=self.config.router.abort_grace_s,
        )
        try:
            restart(before_setup=self._back_to_the_committed_checkpoint)
        except _NothingToRestore:
            restart()

    def _back_to_the_committed_checkpoint(self) -> None:
        """A recovery's workers have registered: the run goes back to the last committed
        checkpoint, the one being synced included (waiting for its commit here, not before the
        workers stop, lets the sync go on while they stop and start; docs/resilience.md, "What a
        failure costs (two H200s)"), or, where its files no longer verify, to the newest earlier
        one that does (`_verified`)."""
        began = time.perf_counter()
        self._wait_for_commit()
        committed = time.perf_counter()
        newest = self.committed
        if newest is not None:
            earlier = (c for c in self._lineage(checkpoints.committed_in(self.out_dir)) if c.step < newest.step)
            newest = self._verified(itertools.chain([newest], earlier))
        self._continue_from(newest)
        log.info("run %s: back at step %d (%.1fs waited for its checkpoint's commit, %.1fs verifying its files)",
                 self.run.run_id, self.step, committed - began, time.perf_counter() - committed)
        if newest is None and self.run.restores:
            raise _NothingToRestore()

    def _between_steps(self) -> None:
        """Requests that wait for a step boundary: resizes, then an on-demand checkpoint. A
        resize waits for the checkpoint's commit: pools restarted while its files were being
        synced took longer to start (docs/resilience.md, "Committed checkpoints")."""
        self._commit_if_synced()
        if self._ahead is not None:  # the next step is already out: the requests wait for its end
            return
        resizes = self.run.take_scale_requests()
        if resizes or self.run.checkpoint_requested.is_set():
            self.run.checkpoint_requested.clear()
            if self.written is None or self.written.step != self.step:
                self._commit(wait=bool(resizes))
        if not resizes:
            return
        self._wait_for_commit()
        config = self.config
        for pool, replicas in resizes.items():
            config = config_lib.scaled(config, pool, replicas)
        before = self.run.pool_sizes
        self.run.resize(config)
        self._write_config()
        self.planner = StepPlanner(config, self.dataset, self.planner.cursor)
        changed = [pool for pool in pool_names() if before[pool] != self.run.pool_sizes[pool]]
        timing = self._start_generation(restarting=changed, restore_all=False)
        sizes = ", ".join(f"{pool} {before[pool]} -> {self.run.pool_sizes[pool]}" for pool in changed)
        self._notice("resize", f"{sizes or 'no change'} in {timing}")

    # ------------------------------------------------------------------ one step

    def _train_step(self, step: int) -> tuple[pb.StepMetrics, list[int]]:
        """The step's metrics, and the samples it trained on. The step's command may have gone
        out with the last step's update (`router.send_ahead`); the next one may go out with this
        step's."""
        sent = self._ahead or self._send_step(step)  # sent ahead: always this step (reset on every rewind)
        self._ahead = None
        spec, plan = sent.spec, sent.plan
        results = self._collect("step", lambda result: result.step == step)
        llm = [r for (pool, _), r in results.items() if pool == "llm"]
        encoder = [r for (pool, _), r in results.items() if pool == "encoder"]
        lm_loss = sum(r.lm_loss_sum for r in llm)
        aux_loss = sum(r.aux_loss for r in llm)
        total_sq = sum(r.grad_sq_norm for r in results.values())

        update = step_update(step, lm_loss + aux_loss, total_sq, self.config.train.grad_clip)
        self.run.send(pb.WorkerCommand(apply=update))
        if self._may_send_ahead(step + 1):
            self._ahead = self._send_step(step + 1)
        self._collect("apply", lambda result: result.step == step)
        ended = time.perf_counter()
        if self._ahead is not None:  # the next step's time counts from here: none is counted twice
            self._ahead.started = ended

        elapsed = ended - sent.started
        slowest = max(llm, key=lambda r: r.boundary_wait_s, default=None)  # the LLM rank that waited longest
        metrics = pb.StepMetrics(
            step=step,
            loss=lm_loss + aux_loss,
            lm_loss=lm_loss,
            aux_loss=aux_loss,
            tokens=spec.tokens,
            target_tokens=spec.target_tokens,
            grad_norm=math.sqrt(total_sq),
            lr=spec.lr,
            step_time_s=elapsed,
            tokens_per_s=spec.tokens / elapsed,
            boundary_bytes_fwd=sum(r.boundary_bytes_sent for r in encoder),
            boundary_bytes_bwd=sum(r.boundary_bytes_sent for r in llm),
            encoder_wait_s=max((r.boundary_wait_s for r in encoder), default=0.0),
            llm_wait_s=slowest.boundary_wait_s if slowest else 0.0,
            llm_fill_wait_s=slowest.boundary_fill_wait_s if slowest else 0.0,
            encoder_imbalance=plan.encoder_imbalance,
            encoder_peak_memory_gb=max((r.peak_memory_gb for r in encoder), default=0.0),
            llm_peak_memory_gb=max((r.peak_memory_gb for r in llm), default=0.0),
            skipped=update.skip,
        )
        if update.skip:
            self._count_skipped(metrics)
        return metrics, [s for microbatch in spec.microbatches for s in microbatch]

    def _count_skipped(self, metrics: pb.StepMetrics) -> None:
        """A step whose update every worker skipped: the run fails once more than
        train.max_skipped_steps were, with that step recorded first."""
        count, limit = self.run.count_skipped(), self.config.train.max_skipped_steps
        log.warning("run %s: step %d skipped (loss %s, gradient norm %s), %d so far of at most %d",
                    self.run.run_id, metrics.step, metrics.loss, metrics.grad_norm, count, limit)
        if count > limit:
            self._record(self.run.record_step, metrics)
            raise RunAborted(
                f"{count} steps skipped for a non-finite loss or gradient norm, more than "
                f"train.max_skipped_steps={limit} (the last: step {metrics.step}, loss {metrics.loss}, "
                f"gradient norm {metrics.grad_norm})"
            )

    # ------------------------------------------------------------------ evaluation

    def _evaluation_due(self, step: int) -> bool:
        """Whether the model is evaluated once `step` steps are trained: every
        eval.interval_steps, and at the end (eval.final)."""
        settings = self.config.eval
        periodic = settings.interval_steps and step % settings.interval_steps == 0
        return step > 0 and bool(periodic or (settings.final and step == self.config.train.steps))

    def _evaluate(self) -> None:
        """Every held-out batch forward through both pools' layouts (the workers take them one
        by one; none waits on the router between them), recorded as the run's evaluation at
        this step."""
        started = time.perf_counter()
        batches = self.planner.heldout_batches
        command = pb.EvalCommand(step=self.step, batches=[step_command(spec, plan) for spec, plan in batches])
        self.run.send(pb.WorkerCommand(evaluate=command))
        step = self.step
        results = self._collect(
            "evaluate", lambda result: result.step == step,
            timeout_s=self.config.router.step_timeout_s * len(batches),
        )
        specs = [spec for spec, _ in batches]
        metrics = evaluation_metrics(
            step, specs, results.values(), answer_lengths(self.dataset, specs, self.planner.image_tokens),
            seconds=time.perf_counter() - started,
        )
        log.info("run %s: step %d held-out loss %.4f, accuracy %.3f (%.1fs)",
                 self.run.run_id, step, metrics.loss, metrics.accuracy, metrics.seconds)
        self._record(self.run.record_evaluation, metrics)

    def _send_step(self, step: int) -> SentStep:
        started = time.perf_counter()
        spec = self.planner.next(step)
        plan = self.planner.boundary_plan(spec)
        self.run.send(pb.WorkerCommand(step=step_command(spec, plan)))
        return SentStep(spec, plan, started)

    def _may_send_ahead(self, step: int) -> bool:
        """Whether `step` may go out before the step before it is applied everywhere: not when
        something waits for the boundary between them (a checkpoint, periodic, requested or the
        final one; a resize; an evaluation). A request that comes after it went out waits one step more."""
        if not self.config.router.send_ahead or step >= self.config.train.steps or self._evaluation_due(step):
            return False
        interval = self.config.checkpoint.interval_steps
        if interval and step % interval == 0:
            return False
        return not (
            self.run.checkpoint_requested.is_set() or self.run.has_scale_requests()
            or self.run.stop_requested.is_set()
        )

    # ------------------------------------------------------------------ waiting

    def _collect(self, kind: str, matches, timeout_s: float | None = None) -> dict[tuple[str, int], object]:
        """One `kind` result of this generation from every worker within `timeout_s` (default
        router.step_timeout_s), or WorkerLost/RunAborted. A result of a step sent ahead that
        comes meanwhile (a worker with no part in it finishes at once) is kept for the next
        collection."""
        pending = set(self.run.registered())
        generation = self.run.generation
        timeout_s = timeout_s or self.config.router.step_timeout_s
        deadline = time.monotonic() + timeout_s
        results = {}
        early, self._early = self._early, []

        def take(result: pb.WorkerResult) -> None:
            if result.generation != generation:
                return
            key = worker_key(result.worker)
            which = result.WhichOneof("result")
            if which == "error":
                self._fail(f"its {kind}", reporter=(key, result))
            if which == kind and key in pending and matches(getattr(result, kind)):
                results[key] = getattr(result, kind)
                pending.discard(key)
            elif which == "step" and result.step.step > self.step:
                self._early.append(result)

        for result in early:
            take(result)
        while pending:
            # A stop waits for the step in flight, to commit the step it ends at, but not for one
            # that does not end.
            stopping = kind in ("step", "apply") and self.run.stop_requested.is_set()
            if stopping and time.monotonic() > self._stop_deadline():
                raise RunAborted(
                    f"stopped by the client during step {self.step}, which did not end within "
                    f"router.stop_grace_s={self.config.router.stop_grace_s}", pb.RUN_STATE_STOPPED,
                )
            self._check_alive()
            if time.monotonic() > deadline:
                late = ", ".join(f"{pool}/{rank}" for pool, rank in sorted(pending))
                raise WorkerLost(f"no {kind} result from {late} within {timeout_s:g}s (router.step_timeout_s="
                                 f"{self.config.router.step_timeout_s} per step or held-out batch; hung?)")
            try:
                take(self.run.results.get(timeout=_POLL_S))
            except queue.Empty:
                continue
        return results

    def _check_stop(self) -> None:
        if self.run.stop_requested.is_set():
            raise RunAborted("stopped by the client", pb.RUN_STATE_STOPPED)

    def _stop_deadline(self) -> float:
        if self._stop_seen is None:
            self._stop_seen = time.monotonic()
        return self._stop_seen + self.config.router.stop_grace_s

    def _stop_if_requested(self) -> None:
        """Between steps: a client's stop first commits the step the run has reached (unless
        it is committed already), so that nothing trained is lost, then ends the run."""
        if not self.run.stop_requested.is_set():
            return
        if self.step > 0 and (self.written is None or self.written.step != self.step):
            try:
                self._commit(wait=True)
            except (WorkerLost, RunAborted) as error:
                raise RunAborted(
                    f"stopped by the client at step {self.step}; its checkpoint could not be committed: {error}",
                    pb.RUN_STATE_STOPPED,
                ) from error
        where = f"; checkpoint {self.committed.path}" if self.committed else ""
        raise RunAborted(f"stopped by the client at step {self.step}{where}", pb.RUN_STATE_STOPPED)

    def _check_stop_or_lost(self) -> None:
        self._check_stop()
        self._check_alive()

    def _check_alive(self) -> None:
        if self._lost():
            self._fail("its work")

    def _lost(self) -> list[tuple[tuple[str, int], str]]:
        """Workers whose process exited, or that went silent, with why."""
        lost = [((spec.pool, spec.rank), reason) for spec, reason in self.launcher.dead()]
        timeout_s = self.config.router.worker_timeout_s
        deadline = time.monotonic() - timeout_s
        return lost + [
            (key, f"silent for more than router.worker_timeout_s={timeout_s}")
            for key, channel in self.run.registered().items()
            if channel.last_seen < deadline
        ]

    def _fail(self, during: str, reporter: tuple[tuple[str, int], pb.WorkerResult] | None = None) -> NoReturn:
        """Raise what the step failed of (`failures.blame`): RunAborted where a restart would
        fail the same way, else WorkerLost. A reported error may follow from a peer's death that
        the launcher has not shown yet: unless one that would repeat is known, wait up to
        _DEATH_SEEN_WITHIN_S for a worker lost without a word before blaming a reporter."""
        waited_until = time.monotonic() + _DEATH_SEEN_WITHIN_S
        while True:
            lost = self._lost()
            failures = self._reported([key for key, _ in lost])
            if reporter is not None:
                failures.setdefault(*reporter)
            settled = any(f.error_repeats for f in failures.values()) or any(k not in failures for k, _ in lost)
            if settled or time.monotonic() >= waited_until:
                break
            time.sleep(_POLL_S)
        verdict = blame(lost, failures, during, reporter[0] if reporter else None)
        raise (RunAborted if verdict.repeats else WorkerLost)(verdict.message)

    def _reported(self, lost: list[tuple[str, int]]) -> dict[tuple[str, int], pb.WorkerResult]:
        """The failures reported in this generation, those of the `lost` workers first."""
        keys = dict.fromkeys([*lost, *self.run.registered()])
        return {key: failure for key in keys if (failure := self.run.failure_of(key)) is not None}


def step_update(step: int, loss: float, grad_sq_norm: float, grad_clip: float) -> pb.ApplyCommand:
    """A step's update from its loss and global squared gradient norm: the gradients scaled to
    clip the norm at `grad_clip`, or none applied (`skip`) where either is not finite, since one
    update would spread a NaN or an infinity into every weight through the optimizer's moments
    (Megatron skips such an iteration too)."""
    if not (math.isfinite(loss) and math.isfinite(grad_sq_norm)):
        return pb.ApplyCommand(step=step, skip=True)
    return pb.ApplyCommand(step=step, grad_scale=clip_scale(grad_sq_norm, grad_clip))


def _ended_by(error: Exception) -> str:
    """A failed run's message: out of disk space names the file the router could not write,
    anything else is the exception."""
    if isinstance(error, OSError) and error.errno in OUT_OF_SPACE and error.filename:
        return could_not_write(error)
    return f"{type(error).__name__}: {error}"
