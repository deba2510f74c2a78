"""Pool checkpoints (`dyad.checkpoint`) restore under another layout or pool size, and with the
optimizer sharded over the replicas (`dyad.parallel.sharded_optimizer`) or not.

Each pool trains two AdamW steps under layout A, saves, and takes a third step. Then:
- the same ranks restore the checkpoint and redo the third step: bit for bit the same loss,
  parameters and RNG draws;
- a fresh pool under layout B (another sharding, or one rank) trains a step of its own, restores
  over it, and holds exactly the saved full model and optimizer state; its third step matches
  layout A's (1e-5: the layouts sum the same numbers in another order);
- a single process without a process group reads the full model state back.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dyad import checkpoint
from dyad import config as config_lib
from dyad.checkpoint import full_pool_state, load_pool_state, pool_dir, restore_pool, save_pool, saved_ranks
from dyad.clipping import clip_scale
from dyad.data import FixedTokens, make_dataset
from dyad.data.batch import collate
from dyad.encoder_service.parallelize import parallelize_encoder
from dyad.layout import EncoderLayout, LLMLayout
from dyad.llm_service.config import MoEConfig
from dyad.llm_service.moe import MoELayer, update_expert_biases
from dyad.llm_service.parallelize import parallelize_llm
from dyad.llm_service.pipeline import StageMicrobatch, StageSteps
from dyad.llm_service.sharding import shard_microbatch
from dyad.llm_service.step import microbatch_loss
from dyad.optim import apply_update, build_optimizer
from dyad.parallel.gradients import GradientPlan, full_tensors, pool_grad_sq_norm
from dyad.parallel.groups import ProcessGroups
from dyad.parallel.overlap import GradientReduction
from dyad.parallel.pipeline import Pipeline
from dyad.parallel.sharded_optimizer import ShardedOptimizer
from dyad.pipeline_schedule import schedule
from dyad.router.sampler import EpochSampler, split_microbatches
from dyad.service import build_model, has_replicas
from dyad.working_weights import WorkingWeights, trained_parameters
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_close, assert_tensors_close

SAVED_STEP = 2
LR = 1e-2
MICROBATCHES, GLOBAL_BATCH = 2, 4  # LLM: fixed whatever the layout's dp
IMAGES = 4  # encoder: the global batch, split over dp

LAYOUTS = {"encoder": EncoderLayout, "llm": LLMLayout}
PARALLELIZE = {"encoder": parallelize_encoder, "llm": parallelize_llm}


def _config(pool):
    if pool == "encoder":
        config = config_lib.load(None, ["encoder.heads=4", "train.grad_clip=0.1"])
        return config_lib.resolve(config, vocab_size=32), None
    config = config_lib.load(None, [
        "data.multi_image_fraction=0.3", "data.text_only_fraction=0.2",
        "llm.n_heads=4", "llm.n_kv_heads=2", "llm.moe.num_experts=8", "llm.moe.top_k=2",
        "llm.moe.shared_expert_dim=32", "llm.moe.expert_dim=32", "llm.dense_ffn_dim=64",
        "llm.moe.expert_bias=true", "train.grad_clip=0.5",
    ])
    dataset = make_dataset(config.data)
    return config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size), dataset


class _Pool:
    """One rank of a pool, trained the way the workers train it: `shard`, the optimizer sharded
    where some parameter has replicas, as `train.shard_optimizer` does it."""

    def __init__(self, pool, layout_kwargs, shard=False):
        self.pool = pool
        self.config, self.dataset = _config(pool)
        self.groups = ProcessGroups.build(LAYOUTS[pool](**layout_kwargs))
        self.model = build_model(self.config, pool)
        self.plan = self.parallelize(self.model)
        self.shards = None
        if shard and has_replicas(self.plan, self.groups):
            self.shards = ShardedOptimizer(self.plan, self.groups, self.config.train)
        self.adamw = self.shards.adamw if self.shards else build_optimizer(self.model, self.config.train)
        self.optimizer = self.shards or self.adamw  # what the checkpoint reads and writes
        self.reduction = GradientReduction(self.plan, self.groups, overlap=False, into=self.shards)

    def parallelize(self, model):
        return PARALLELIZE[self.pool](model, self.groups)

    def train_step(self, step: int, lr: float = LR) -> float:
        """The pool's loss for `step`'s batch, after updating the model."""
        loss = self._encoder_loss(step) if self.pool == "encoder" else self._llm_loss(step)
        if self.pool == "llm":
            update_expert_biases(self.model, group=self.groups.group("stage"))
        self.reduction.finish()
        sq_norm = self.shards.grad_sq_norm() if self.shards else pool_grad_sq_norm(self.plan, self.groups)
        apply_update(self.adamw, lr=lr, grad_scale=clip_scale(sq_norm, self.config.train.grad_clip))
        total = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total)

    def _encoder_loss(self, step):
        images = torch.rand(IMAGES, 1, 16, 16, generator=torch.Generator().manual_seed(step))
        upstream = torch.randn(IMAGES, 16, self.config.encoder.out_dim,
                               generator=torch.Generator().manual_seed(99 + step))
        per_rank = IMAGES // self.groups.size("dp")
        mine = slice(per_rank * self.groups.index("dp"), per_rank * (self.groups.index("dp") + 1))
        loss = (self.model(images[mine]) * upstream[mine]).sum()
        loss.backward()
        return float(loss) if self.groups.index("tp") == 0 else 0.0

    def _llm_loss(self, step):
        layout, dataset = self.groups.layout, self.dataset
        sampler = EpochSampler(dataset.train_ids, seed=0)
        for _ in range(step):
            sampler.next_batch(GLOBAL_BATCH)
        microbatches = split_microbatches(sampler.next_batch(GLOBAL_BATCH), MICROBATCHES)
        image_tokens = FixedTokens(self.config.encoder.tokens_per_image)
        batches = [collate(dataset.tokenizer, [dataset.sample(s) for s in mb], image_tokens)
                   for mb in microbatches]
        targets = sum(b.n_targets for b in batches)
        mine = []
        for index, batch in enumerate(batches):
            if index * layout.dp // MICROBATCHES != self.groups.index("dp"):
                continue
            rows = torch.randn(batch.image_positions.numel(), self.config.llm.dim,
                               generator=torch.Generator().manual_seed(1000 * step + index))
            local = shard_microbatch(batch, pad_id=dataset.tokenizer.pad_id, cp=layout.cp,
                                     cp_rank=self.groups.index("cp"), tp=layout.tp)
            spliced = rows.numel() > 0 and self.groups.index("pp") == 0
            mine.append(StageMicrobatch(local, rows[local.image_rows_Nl] if spliced else None))
        if layout.pp > 1:
            return self._pipelined_llm_loss(mine, targets)
        total = 0.0
        for micro in mine:
            loss = microbatch_loss(self.model, micro.local, micro.rows_NlD,
                                   global_target_tokens=targets, global_microbatches=MICROBATCHES)
            loss.total.backward()
            total += (float(loss.lm) if self.groups.index("tp") == 0 else 0.0) + float(loss.aux)
        return total

    def _pipelined_llm_loss(self, mine, targets):
        layout, pp_rank = self.groups.layout, self.groups.index("pp")
        work = StageSteps(self.model, layout, pp_rank, mine, device=torch.device("cpu"), global_target_tokens=targets,
                          global_microbatches=MICROBATCHES)
        pipeline = Pipeline(self.groups.ranks("pp"), self.groups.group("pp"), pp_rank, layout.pp_virtual)
        pipeline.run(schedule(layout.pp, pp_rank, len(mine), layout.pp_virtual), work, len(mine))
        return (float(work.lm) if self.groups.index("tp") == 0 else 0.0) + float(work.aux)

    @property
    def holders(self):
        return self.groups.group(self.groups.layout.PARAMETER_GROUP)

    def save(self, directory):
        save_pool(directory, self.pool, self.model, self.optimizer, step=SAVED_STEP, holders=self.holders)

    def restore(self, directory, batch_bytes=None) -> int:
        extra = {} if batch_bytes is None else {"batch_bytes": batch_bytes}
        return restore_pool(directory, self.pool, self.model, self.optimizer, holders=self.holders, **extra)

    def state(self) -> dict:
        """The pool's full state (every stage's, under pipeline parallelism) on every rank."""
        return self.whole({k: v.clone() if isinstance(v, torch.Tensor) else v
                           for k, v in full_pool_state(self.model, self.optimizer).items()})

    def full_tensors(self) -> dict:
        return self.whole(full_tensors(self.model))

    def whole(self, held: dict) -> dict:
        """`held` (this rank's stage's tensors) with every other stage's of its pipeline."""
        if self.pool == "encoder" or self.groups.size("pp") == 1:
            return held
        stages = [None] * self.groups.size("pp")
        dist.all_gather_object(stages, held, group=self.groups.group("pp"))
        return {key: value for stage in stages for key, value in stage.items()}


def _assert_same_state(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: {sorted(set(actual) ^ set(expected))}"
    for key, value in expected.items():
        same = torch.equal(actual[key], value) if isinstance(value, torch.Tensor) else actual[key] == value
        assert same, f"{what}: {key} differs"


def _save_body(rank, world_size, pool, layout_kwargs, tmp, shard=False):
    """Layout A: two steps, save, a third step; then restore and redo the third step."""
    run = _Pool(pool, layout_kwargs, shard)
    for step in range(SAVED_STEP):
        run.train_step(step)
    run.save(tmp / "checkpoint")
    saved = run.state()
    _assert_rank_holds_its_share(run)
    if pool == "llm":  # the expert biases are part of the state, and have moved
        assert all(saved[k].abs().sum() > 0 for k in saved if k.endswith("expert_bias_E"))
    draws = torch.rand(8)
    loss = run.train_step(SAVED_STEP)
    params = {k: v.clone() for k, v in run.full_tensors().items()}
    assert any(not torch.equal(params[k], saved[f"model.{k}"]) for k in params)  # the third step moved them
    if rank == 0:
        torch.save({"state": saved, "loss": loss, "params": params}, tmp / "expected.pt")
    torch.save(draws, tmp / f"draws-rank{rank}.pt")

    assert run.restore(tmp / "checkpoint") == SAVED_STEP
    assert all(p.grad is None for p in run.model.parameters())
    assert torch.equal(torch.rand(8), draws)
    _assert_same_state(run.state(), saved, "restored under the same layout")
    assert run.train_step(SAVED_STEP) == loss
    _assert_same_state(run.full_tensors(), params, "the third step again")


def _restore_body(rank, world_size, pool, layout_kwargs, tmp, shard=False):
    """Layout B: a step of its own (so nothing matches by accident), restore (one full tensor in
    host memory at a time), the third step."""
    expected = torch.load(tmp / "expected.pt")
    run = _Pool(pool, layout_kwargs, shard)
    run.train_step(7, lr=3 * LR)
    assert run.restore(tmp / "checkpoint", batch_bytes=1) == SAVED_STEP
    if rank in saved_ranks(tmp / "checkpoint", pool):  # a rank the saving pool had
        assert torch.equal(torch.rand(8), torch.load(tmp / f"draws-rank{rank}.pt"))
    _assert_same_state(run.state(), expected["state"], f"restored under {layout_kwargs}")
    loss = run.train_step(SAVED_STEP)
    assert_close(loss, expected["loss"], "the third step's loss")
    # 2-norm: AdamW turns a rounding difference of a near-zero gradient entry into a visible
    # difference of that entry's update (tests/helpers/parity.py).
    assert_tensors_close(run.full_tensors(), expected["params"], "the third step", norm="l2")


def _assert_rank_holds_its_share(run):
    """While saving, a rank keeps in host memory only the full tensors it writes: about
    1/holders of the state of its holders' parameters (within the largest tensor)."""
    full_state = full_pool_state(run.model, run.optimizer)
    sizes = [v.numel() * v.element_size() for v in full_state.values() if isinstance(v, torch.Tensor)]
    rank, world_size = dist.get_rank(run.holders), dist.get_world_size(run.holders)
    held = checkpoint._owned_full_state(run.model, run.optimizer, rank, world_size)
    held_bytes = sum(v.numel() * v.element_size() for v in held.values() if isinstance(v, torch.Tensor))
    assert all(v.device.type == "cpu" for v in held.values() if isinstance(v, torch.Tensor))
    assert 0 < held_bytes <= sum(sizes) / world_size + max(sizes), (held_bytes, sum(sizes))


def _assert_ranks_share_the_writing(directory, pool, holders: list[list[int]]):
    """Each full tensor is written by one rank, and the bytes of the ranks of each group of
    `holders` differ by at most the largest tensor: no rank holds the whole state while saving."""
    metadata = dcp.FileSystemReader(pool_dir(directory, pool)).read_metadata()
    written = dict.fromkeys((rank for group in holders for rank in group), 0)
    largest = 0
    for index, storage in metadata.storage_data.items():
        meta = metadata.state_dict_metadata[index.fqn]
        if not index.fqn.startswith(("model.", "optimizer.")) or not isinstance(meta, TensorStorageMetadata):
            continue
        nbytes = meta.size.numel() * meta.properties.dtype.itemsize
        written[int(storage.relative_path.split("_")[2])] += nbytes
        largest = max(largest, nbytes)
    assert all(written.values()), written
    for group in holders:
        assert max(written[r] for r in group) - min(written[r] for r in group) <= largest, written


def _check_round_trip(tmp_path, pool, saved_under, restored_under, shard=False):
    layout = LAYOUTS[pool](**saved_under)
    run_distributed(_save_body, layout.world_size, pool, saved_under, tmp_path, shard)
    assert saved_ranks(tmp_path / "checkpoint", pool) == list(range(layout.world_size))
    _assert_ranks_share_the_writing(tmp_path / "checkpoint", pool, layout.groups(layout.PARAMETER_GROUP))
    # A single process, no process group: the full model state.
    state = load_pool_state(tmp_path / "checkpoint", pool)
    expected = torch.load(tmp_path / "expected.pt")["state"]
    _assert_same_state({f"model.{k}": v for k, v in state.items()},
                       {k: v for k, v in expected.items() if k.startswith("model.")}, "load_pool_state")
    for layout in restored_under:
        run_distributed(_restore_body, LAYOUTS[pool](**layout).world_size, pool, layout, tmp_path, shard)


def test_llm_checkpoint_restores_under_other_layouts(tmp_path):
    # Saved with tp2 and the experts split over ep; restored with the experts' ffn dim split
    # over etp (no tp), in two pipeline stages, and on a single rank.
    _check_round_trip(tmp_path, "llm", dict(tp=2, ep=2), [dict(dp=2, etp=2), dict(pp=2), dict()])


def test_a_pipelines_checkpoint_restores_under_other_layouts(tmp_path):
    # Saved by two stages, each of tp2 with the experts over ep2 (each stage writes its own
    # parameters, shared out over its ranks); restored by two stages of dp2, and on a single rank.
    _check_round_trip(tmp_path, "llm", dict(pp=2, tp=2, ep=2), [dict(pp=2, dp=2), dict()])


def test_encoder_checkpoint_restores_under_other_layouts(tmp_path):
    _check_round_trip(tmp_path, "encoder", dict(dp=2), [dict(tp=2), dict()])


def test_a_sharded_optimizers_checkpoint_resumes_at_other_data_parallel_sizes(tmp_path):
    # Saved at dp2: every parameter sharded over the two ranks. Resumed at dp4, over four; and on
    # one rank, with nothing to shard, the optimizer replicated.
    _check_round_trip(tmp_path, "llm", dict(dp=2), [dict(dp=4), dict()], shard=True)


def _sharded_masters_body(rank, world_size, tmp):
    """bf16 working weights whose float32 masters the sharded optimizer keeps in pieces: saved
    whole, and restored (after another step) into the pieces and the working weights."""
    groups = ProcessGroups.build(LLMLayout(dp=world_size))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    WorkingWeights(model)
    params = trained_parameters(model)
    plan = GradientPlan(reduce_over={"dp": params}, counted=params)
    shards = ShardedOptimizer(plan, groups, _config("encoder")[0].train)
    reduction = GradientReduction(plan, groups, overlap=False, into=shards)

    def train_step(seed):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))).float().sum().backward()
        reduction.finish()
        apply_update(shards.adamw, lr=LR, grad_scale=1.0)

    train_step(rank)
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in full_pool_state(model, shards).items()}
    save_pool(tmp, "llm", model, shards, step=1)
    train_step(10 + rank)
    assert restore_pool(tmp, "llm", model, shards) == 1
    _assert_same_state(full_pool_state(model, shards), saved, "restored")
    for name, working in model.named_parameters():
        assert torch.equal(working, saved[f"model.{name}"].to(working.dtype)), name


def test_working_weights_masters_in_the_sharded_optimizers_pieces_round_trip(tmp_path):
    run_distributed(_sharded_masters_body, 2, tmp_path)


def _meta(*size, dtype=torch.float32):
    return TensorStorageMetadata(properties=dcp.metadata.TensorProperties(dtype=dtype), size=torch.Size(size),
                                 chunks=[])


def test_a_restore_batch_is_read_into_one_reused_buffer_cut_into_aligned_tensors():
    staging = checkpoint._Staging(torch.device("cpu"))
    first = staging.holders({"a": _meta(3, 5), "b": _meta(7, dtype=torch.bfloat16), "c": _meta(2, 2)})
    assert [t.shape for t in first.values()] == [(3, 5), (7,), (2, 2)]
    assert [t.dtype for t in first.values()] == [torch.float32, torch.bfloat16, torch.float32]
    base = staging._buffer.data_ptr()
    assert [t.data_ptr() - base for t in first.values()] == [0, 64, 128]  # 60 and 14 bytes, each aligned to 64
    for value, tensor in enumerate(first.values()):
        tensor.fill_(value)
    assert [t.unique().tolist() for t in first.values()] == [[0.0], [1.0], [2.0]]  # no overlap
    smaller = staging.holders({"d": _meta(4, 4)})
    assert smaller["d"].data_ptr() == base  # the same buffer, not a new one
    larger = staging.holders({"e": _meta(100)})
    assert larger["e"].numel() == 100 and staging._buffer.numel() >= 400
    staging.release()
    assert staging._buffer.numel() == 0


def _stored(tmp_path, tensors: dict) -> tuple:
    path = tmp_path / "stored"
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path, thread_count=2), no_dist=True)
    return path, dcp.FileSystemReader(path).read_metadata()


def test_a_rank_reads_its_tensors_of_a_batch_with_threads_each_tensor_once(tmp_path):
    tensors = {f"t{i}": torch.randn(10 + 7 * i) for i in range(7)}
    path, metadata = _stored(tmp_path, tensors)
    with checkpoint._ThreadedReader(path, metadata, threads=3) as reader:
        shares = reader._shares({key: torch.empty_like(t) for key, t in tensors.items()})
        assert sorted(key for share in shares for key in share) == sorted(tensors)  # each once
        share_bytes = [sum(t.nbytes for t in share.values()) for share in shares]
        assert max(share_bytes) - min(share_bytes) <= max(t.nbytes for t in tensors.values())
        holders = {key: torch.zeros_like(t) for key, t in tensors.items()}
        reader.load(holders)
    assert all(torch.equal(holders[key], tensors[key]) for key in tensors)


def test_a_failed_read_in_a_reader_thread_fails_the_restore_and_no_threads_is_refused(tmp_path):
    path, metadata = _stored(tmp_path, {"a": torch.ones(4), "b": torch.ones(5)})
    reader = checkpoint._ThreadedReader(path, metadata, threads=2)
    with reader, pytest.raises(dcp.api.CheckpointException) as failed:
        reader.load({"a": torch.empty(4), "missing": torch.empty(3)})
    assert "missing" in str(next(iter(failed.value.failures.values())))
    with pytest.raises(ValueError, match="reader_threads"):
        checkpoint._ThreadedReader(path, metadata, threads=0)


def _cuda_round_trip_body(rank, world_size, tmp):
    dims = [96 + 8 * i for i in range(9)]  # sizes that do not fill the buffer evenly
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(dims)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    model(torch.randn(2, dims[0], device="cuda")).sum().backward()
    optimizer.step()
    saved = {key: full.clone() for key, full in checkpoint._full_entries(model, optimizer)}
    save_pool(tmp, "llm", model, optimizer, step=1)
    with torch.no_grad():
        for param in model.parameters():
            for tensor in (param, *(optimizer.state[param][moment] for moment in checkpoint.MOMENTS)):
                tensor.fill_(7.0)
    restore_pool(tmp, "llm", model, optimizer, batch_bytes=100_000)  # several batches, the buffer reused
    restored = dict(checkpoint._full_entries(model, optimizer))
    assert [key for key in saved if not torch.equal(saved[key], restored[key])] == []


def _other_model_body(rank, world_size, tmp):
    def moe(shared_expert_dim):
        cfg = MoEConfig(num_experts=4, top_k=2, expert_dim=8, shared_expert_dim=shared_expert_dim)
        model = torch.nn.ModuleDict({"moe": MoELayer(8, cfg)})
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    save_pool(tmp, "llm", *moe(0), step=1)
    with pytest.raises(ValueError, match=r"has no model\.moe\.shared_expert\.w1\.weight.*written for another model"):
        restore_pool(tmp, "llm", *moe(8))


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path):
    run_distributed(_other_model_body, 1, tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the page-locked staging of a restore is not exercised")
def test_cuda_a_restore_through_the_page_locked_buffer_brings_back_every_tensor(tmp_path):
    run_distributed(_cuda_round_trip_body, 1, tmp_path)


def _files_synced_by_save(rank, world_size, tmp):
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    synced, real_fsync = [], os.fsync
    os.fsync = lambda fd: (synced.append(fd), real_fsync(fd))[1]
    save_pool(tmp / "background", "llm", model, optimizer, step=1, sync_files=False)
    assert synced == []  # left to the router's commit (`dyad.router.checkpoints.commit`)
    save_pool(tmp / "synced", "llm", model, optimizer, step=1, sync_files=True)
    assert len(synced) >= 2  # the data file and the metadata at least
    assert load_pool_state(tmp / "background", "llm").keys() == load_pool_state(tmp / "synced", "llm").keys()


def test_a_save_leaves_its_files_unsynced_only_when_asked(tmp_path):
    run_distributed(_files_synced_by_save, 1, tmp_path)
