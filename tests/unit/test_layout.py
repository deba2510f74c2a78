"""dyad.layout: group algebra against an independent reshape of `arange(world)`, coordinate maps,
and every validation message. Pure: no processes, no process groups."""

import itertools
import re
import subprocess
import sys

import numpy as np
import pytest

from dyad.encoder_service.config import EncoderConfig
from dyad.layout import (
    EncoderLayout,
    LLMLayout,
    group_ranks,
    validate_encoder_layout,
    validate_llm_layout,
)
from dyad.llm_service.config import LLMConfig, MoEConfig

WORLD_SIZES = (1, 2, 4, 6, 8, 12, 16)

# Reference: which axes of which grid vary inside each named group. Grids are C-ordered with the
# fastest axis LAST, so `arange(world).reshape(dp, cp, tp)` has tp fastest, as the layout promises.
LLM_REFERENCE = {
    "tp": ("attention", {"tp"}),
    "cp": ("attention", {"cp"}),
    "dp": ("attention", {"dp"}),
    "dp_cp": ("attention", {"dp", "cp"}),
    "tp_cp": ("attention", {"tp", "cp"}),
    "stage": ("attention", {"tp", "cp", "dp"}),
    "pp": ("attention", {"pp"}),
    "world": ("attention", {"tp", "cp", "dp", "pp"}),
    "etp": ("expert", {"etp"}),
    "ep": ("expert", {"ep"}),
    "edp": ("expert", {"edp"}),
    "ep_etp": ("expert", {"ep", "etp"}),
}
ENCODER_REFERENCE = {"tp": {"tp"}, "dp": {"dp"}, "world": {"tp", "dp"}}


def reference_groups(names: list[str], sizes: list[int], varying: set[str]) -> list[list[int]]:
    """`names`/`sizes` slowest axis first. Move the varying axes last, flatten them into rows."""
    grid = np.arange(int(np.prod(sizes))).reshape(sizes)
    fixed_axes = [i for i, n in enumerate(names) if n not in varying]
    varying_axes = [i for i, n in enumerate(names) if n in varying]
    group_size = int(np.prod([sizes[i] for i in varying_axes]))
    rows = grid.transpose(fixed_axes + varying_axes).reshape(-1, group_size)
    return sorted((sorted(row.tolist()) for row in rows), key=lambda row: row[0])


def llm_reference(layout: LLMLayout, name: str) -> list[list[int]]:
    view, varying = LLM_REFERENCE[name]
    if view == "attention":
        return reference_groups(["pp", "dp", "cp", "tp"], [layout.pp, layout.dp, layout.cp, layout.tp], varying)
    return reference_groups(["pp", "edp", "ep", "etp"], [layout.pp, layout.edp, layout.ep, layout.etp], varying)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def all_llm_layouts() -> list[LLMLayout]:
    layouts = []
    for world in WORLD_SIZES:
        for pp in divisors(world):
            stage = world // pp
            for tp, cp in itertools.product(divisors(stage), repeat=2):
                if stage % (tp * cp):
                    continue
                for etp, ep in itertools.product(divisors(stage), repeat=2):
                    if stage % (etp * ep) == 0:
                        layouts.append(LLMLayout(tp=tp, cp=cp, dp=stage // (tp * cp), ep=ep, etp=etp, pp=pp))
    return layouts


LLM_LAYOUTS = all_llm_layouts()
ENCODER_LAYOUTS = [EncoderLayout(dp=w // tp, tp=tp) for w in WORLD_SIZES for tp in divisors(w)]


def layout_id(layout) -> str:
    return "-".join(f"{k}{v}" for k, v in vars(layout).items())


def test_layout_grid_is_wide():
    assert len(LLM_LAYOUTS) > 300
    assert {layout.world_size for layout in LLM_LAYOUTS} == set(WORLD_SIZES)


def test_layout_math_imports_no_torch():
    code = "import sys, dyad.layout; assert 'torch' not in sys.modules, 'dyad.layout imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- group_ranks -----------------------------------------------------------------------------


def test_group_ranks_small_example():
    axes = {"a": 2, "b": 3}  # a fastest: rank = a + 2*b
    assert group_ranks(axes, ["a"]) == [[0, 1], [2, 3], [4, 5]]
    assert group_ranks(axes, ["b"]) == [[0, 2, 4], [1, 3, 5]]
    assert group_ranks(axes, ["a", "b"]) == [[0, 1, 2, 3, 4, 5]]
    assert group_ranks(axes, []) == [[0], [1], [2], [3], [4], [5]]


def test_group_ranks_rejects_unknown_axis():
    with pytest.raises(ValueError, match=re.escape("unknown axes ['ep']; valid axes: tp, cp, dp")):
        group_ranks({"tp": 2, "cp": 1, "dp": 2}, ["tp", "ep"])


def test_llm_groups_golden():
    layout = LLMLayout(tp=2, cp=2, dp=2, ep=2, etp=2)  # edp = 2
    expected = {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "tp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "stage": [list(range(8))],
        "pp": [[r] for r in range(8)],
        "world": [list(range(8))],
        "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "ep_etp": [[0, 1, 2, 3], [4, 5, 6, 7]],
    }
    assert {name: layout.groups(name) for name in layout.GROUP_NAMES} == expected


def test_llm_pipeline_groups_golden():
    """pp slowest: each stage's ranks contiguous, every group but pp and world inside a stage."""
    layout = LLMLayout(tp=2, dp=2, ep=2, pp=2)  # stage 0: ranks 0-3, stage 1: ranks 4-7
    expected = {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": [[r] for r in range(8)],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "stage": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "world": [list(range(8))],
        "etp": [[r] for r in range(8)],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "ep_etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    }
    assert {name: layout.groups(name) for name in layout.GROUP_NAMES} == expected
    assert [layout.coords(r)["pp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.rank(tp=1, cp=0, dp=1, pp=1) == 7


@pytest.mark.parametrize(
    "kwargs, n_layers, stages",
    [
        ({"pp": 2}, 4, [range(2), range(2, 4)]),
        ({"pp": 4}, 8, [range(2), range(2, 4), range(4, 6), range(6, 8)]),
        # interleaved: stage s is chunk s // pp of pipeline rank s % pp
        ({"pp": 2, "pp_virtual": 2}, 4, [range(1), range(1, 2), range(2, 3), range(3, 4)]),
        ({"pp": 2, "pp_layers": (1, 3)}, 4, [range(1), range(1, 4)]),
        ({"pp": 2, "pp_virtual": 2, "pp_layers": (2, 1, 1, 2)}, 6, [range(2), range(2, 3), range(3, 4), range(4, 6)]),
        ({}, 3, [range(3)]),
    ],
)
def test_llm_stage_layers(kwargs, n_layers, stages):
    layout = LLMLayout(**kwargs)
    assert layout.stage_layers(n_layers) == stages
    held = sorted(s for r in range(layout.pp) for s in layout.rank_stages(r))
    assert held == list(range(layout.stages))


def test_llm_rank_stages_interleave():
    assert [LLMLayout(pp=4, pp_virtual=2).rank_stages(r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert LLMLayout(pp=2).rank_stages(1) == [1]


@pytest.mark.parametrize(
    "kwargs, n_layers, message",
    [
        ({"pp": 4}, 6, ("parallel.llm: pp*pp_virtual (4*1 = 4) stages must divide n_layers (6); "
                        "parallel.llm.pp_layers splits them unevenly")),
        ({"pp": 2, "pp_layers": (2, 3)}, 4, "parallel.llm.pp_layers [2, 3] sums to 5, not n_layers (4)"),
    ],
)
def test_llm_stage_layers_messages(kwargs, n_layers, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLMLayout(**kwargs).stage_layers(n_layers)


# --- LLM layouts over the whole grid ---------------------------------------------------------


@pytest.mark.parametrize("layout", LLM_LAYOUTS, ids=layout_id)
def test_llm_groups_match_reference_and_partition_world(layout):
    assert set(layout.GROUP_NAMES) == set(LLM_REFERENCE)
    for name in layout.GROUP_NAMES:
        groups = layout.groups(name)
        assert groups == llm_reference(layout, name), name
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size)), name
        assert len({len(g) for g in groups}) == 1, name


@pytest.mark.parametrize("layout", LLM_LAYOUTS, ids=layout_id)
def test_llm_folding_and_coordinates(layout):
    tp, cp, dp, etp, ep, edp, pp = layout.tp, layout.cp, layout.dp, layout.etp, layout.ep, layout.edp, layout.pp
    assert tp * cp * dp == etp * ep * edp == layout.stage_size == layout.world_size // pp
    sizes = {name: len(layout.groups(name)[0]) for name in layout.GROUP_NAMES}
    assert sizes == {
        "tp": tp, "cp": cp, "dp": dp, "dp_cp": dp * cp, "tp_cp": tp * cp, "stage": tp * cp * dp, "pp": pp,
        "world": tp * cp * dp * pp, "etp": etp, "ep": ep, "edp": edp, "ep_etp": ep * etp,
    }
    # Both views cover the same ranks of each stage: one stage, two coordinate systems.
    stages = [sorted(r for g in layout.groups("ep_etp") for r in g if g[0] // layout.stage_size == s) for s in range(pp)]
    assert layout.groups("stage") == stages
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert rank == c["tp"] + tp * (c["cp"] + cp * (c["dp"] + dp * c["pp"]))
        assert rank == c["etp"] + etp * (c["ep"] + ep * (c["edp"] + edp * c["pp"]))
        assert layout.rank(tp=c["tp"], cp=c["cp"], dp=c["dp"], pp=c["pp"]) == rank


@pytest.mark.parametrize("layout", LLM_LAYOUTS, ids=layout_id)
def test_llm_dp_cp_is_the_product_of_dp_and_cp(layout):
    group_of = {name: {r: g for g in layout.groups(name) for r in g} for name in ("cp", "dp", "dp_cp")}
    for rank in range(layout.world_size):
        product = sorted(m for c in group_of["cp"][rank] for m in group_of["dp"][c])
        assert group_of["dp_cp"][rank] == product
        # a rank's index in dp_cp is its (cp, dp) coordinate, cp fastest
        c = layout.coords(rank)
        assert group_of["dp_cp"][rank].index(rank) == c["cp"] + layout.cp * c["dp"]


def test_llm_rank_rejects_out_of_range_coordinate():
    with pytest.raises(ValueError, match=re.escape("coordinate cp=2 outside [0, 2)")):
        LLMLayout(tp=2, cp=2, dp=2).rank(tp=0, cp=2, dp=0, pp=0)


def test_llm_unknown_group_name():
    message = ("parallel.llm: unknown group 'vpp'; valid names: tp, cp, dp, dp_cp, tp_cp, stage, pp, world, "
               "etp, ep, edp, ep_etp")
    with pytest.raises(ValueError, match=re.escape(message)):
        LLMLayout().groups("vpp")


# --- encoder layouts -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ENCODER_LAYOUTS, ids=layout_id)
def test_encoder_groups_match_reference(layout):
    assert layout.GROUP_NAMES == ("tp", "dp", "world")
    for name in layout.GROUP_NAMES:
        expected = reference_groups(["dp", "tp"], [layout.dp, layout.tp], ENCODER_REFERENCE[name])
        groups = layout.groups(name)
        assert groups == expected, name
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size)), name
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert rank == c["tp"] + layout.tp * c["dp"] == layout.rank(**c)


def test_encoder_unknown_group_name():
    with pytest.raises(ValueError, match=re.escape("parallel.encoder: unknown group 'ep'; valid names: tp, dp, world")):
        EncoderLayout().groups("ep")


# --- validation messages ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp": 0}, "parallel.llm.tp must be a positive integer, got 0"),
        ({"ep": -1}, "parallel.llm.ep must be a positive integer, got -1"),
        ({"cp": 1.5}, "parallel.llm.cp must be a positive integer, got 1.5"),
        ({"tp": 2, "ep": 4}, "parallel.llm: etp*ep (1*4) must divide tp*cp*dp (2*1*1 = 2)"),
        ({"tp": 2, "dp": 3, "ep": 2, "etp": 2}, "parallel.llm: etp*ep (2*2) must divide tp*cp*dp (2*1*3 = 6)"),
        ({"pp": 0}, "parallel.llm.pp must be a positive integer, got 0"),
        ({"pp_virtual": 2}, "parallel.llm.pp_virtual (2) needs parallel.llm.pp > 1"),
        ({"pp": 2, "pp_layers": (1, 1, 2)}, "parallel.llm.pp_layers has 3 entries, one per stage: pp*pp_virtual (2*1 = 2)"),
        ({"pp": 2, "pp_layers": (0, 2)}, "parallel.llm.pp_layers must hold positive integers, got [0, 2]"),
        # ep folds inside a stage: 4 ranks in all, 2 a stage
        ({"dp": 2, "pp": 2, "ep": 4}, "parallel.llm: etp*ep (1*4) must divide tp*cp*dp (1*1*2 = 2)"),
    ],
)
def test_llm_layout_post_init_messages(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLMLayout(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dp": 0}, "parallel.encoder.dp must be a positive integer, got 0"),
        ({"tp": "2"}, "parallel.encoder.tp must be a positive integer, got '2'"),
    ],
)
def test_encoder_layout_post_init_messages(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EncoderLayout(**kwargs)


def llm_cfg(moe: MoEConfig | None = None, **kwargs) -> LLMConfig:
    defaults = dict(dim=96, n_heads=12, n_kv_heads=4, dense_ffn_dim=96)
    return LLMConfig(**(defaults | kwargs), moe=moe or MoEConfig(num_experts=8, expert_dim=96, shared_expert_dim=0))


@pytest.mark.parametrize(
    "layout, cfg, message",
    [
        (LLMLayout(tp=8), llm_cfg(), "parallel.llm: tp (8) must divide n_heads (12)"),
        (LLMLayout(tp=3), llm_cfg(), "parallel.llm: tp (3) must divide n_kv_heads (4)"),
        (LLMLayout(tp=4), llm_cfg(dense_ffn_dim=90), "parallel.llm: tp (4) must divide dense_ffn_dim (90)"),
        (
            LLMLayout(tp=4),
            llm_cfg(MoEConfig(num_experts=8, expert_dim=96, shared_expert_dim=6)),
            "parallel.llm: tp (4) must divide moe.shared_expert_dim (6)",
        ),
        (
            LLMLayout(dp=4, ep=4),
            llm_cfg(MoEConfig(num_experts=6, expert_dim=96)),
            "parallel.llm: num_experts (6) must be divisible by ep (4)",
        ),
        (
            LLMLayout(dp=8, etp=8),
            llm_cfg(MoEConfig(num_experts=8, expert_dim=100)),
            "parallel.llm: etp (8) must divide moe.expert_dim (100)",
        ),
        (LLMLayout(pp=4), llm_cfg(n_layers=6), "parallel.llm: pp*pp_virtual (4*1 = 4) stages must divide n_layers (6)"),
        (LLMLayout(pp=2), llm_cfg(n_layers=4, deepstack_levels=3),
         "parallel.llm: the first pipeline stage holds 2 layers, fewer than llm.deepstack_levels (3)"),
    ],
)
def test_validate_llm_layout_messages(layout, cfg, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_llm_layout(layout, cfg)


def test_validate_llm_layout_accepts_a_fitting_layout():
    cfg = llm_cfg(MoEConfig(num_experts=8, expert_dim=96, shared_expert_dim=0))  # 0: no shared expert
    validate_llm_layout(LLMLayout(tp=4, cp=2, dp=2, ep=8, etp=2), cfg)
    validate_llm_layout(LLMLayout(), LLMConfig())
    validate_llm_layout(LLMLayout(pp=2, pp_layers=(3, 1)), llm_cfg(n_layers=4, deepstack_levels=3))


@pytest.mark.parametrize(
    "tp, cfg, message",
    [
        (8, EncoderConfig(dim=64, heads=4), "parallel.encoder: tp (8) must divide heads (4)"),
        (4, EncoderConfig(dim=48, heads=4, mlp_ratio=1.125, out_dim=64), "parallel.encoder: tp (4) must divide mlp_dim (54)"),
        (2, EncoderConfig(dim=64, heads=4, out_dim=33), "parallel.encoder: tp (2) must divide out_dim (33)"),
    ],
)
def test_validate_encoder_layout_messages(tp, cfg, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_encoder_layout(EncoderLayout(dp=2, tp=tp), cfg)


def test_validate_encoder_layout_accepts_a_fitting_layout():
    validate_encoder_layout(EncoderLayout(dp=2, tp=4), EncoderConfig(dim=64, heads=4, out_dim=64))


def test_pool_placement_on_local_gpus():
    """parallel.<pool>_devices pins a pool's ranks to GPUs; empty shares them (rank % count)."""
    from dyad import config as config_lib

    config = config_lib.load(None, ["parallel.encoder_devices=[0]", "parallel.llm_devices=[1, 2]"])
    assert [config.parallel.local_gpu("encoder", r, 4) for r in range(2)] == [0, 0]
    assert [config.parallel.local_gpu("llm", r, 4) for r in range(3)] == [1, 2, 1]
    shared = config_lib.load(None, [])
    assert [shared.parallel.local_gpu("llm", r, 2) for r in range(3)] == [0, 1, 0]
    with pytest.raises(ValueError, match="parallel.llm_devices names GPU 2"):
        config.parallel.local_gpu("llm", 1, 2)
    with pytest.raises(ValueError, match="parallel.encoder_devices"):
        config_lib.load(None, ["parallel.encoder_devices=[-1]"])


def test_a_resize_moves_a_gpu_that_both_device_lists_name():
    """A resize changes a pool's dp and keeps the device lists (rank r on devices[r % len]), so a
    GPU named at the end of both lists serves the LLM pool at 2+6 and the encoder pool at 3+5
    (bench/resize.py relies on this)."""
    from dyad import config as config_lib

    def placement(config):
        return {
            pool: [config.parallel.local_gpu(pool, r, 8) for r in range(getattr(config.parallel, pool).world_size)]
            for pool in ("encoder", "llm")
        }

    config = config_lib.load(None, [
        "parallel.encoder.dp=2", "parallel.llm.dp=6", "train.global_batch=30", "train.microbatches=5",
        "parallel.encoder_devices=[0, 1, 7]", "parallel.llm_devices=[2, 3, 4, 5, 6, 7]",
    ])
    assert placement(config) == {"encoder": [0, 1], "llm": [2, 3, 4, 5, 6, 7]}
    resized = config_lib.scaled(config_lib.scaled(config, "llm", 5), "encoder", 3)
    assert placement(resized) == {"encoder": [0, 1, 7], "llm": [2, 3, 4, 5, 6]}
    assert resized.train.microbatches == 6  # the step's 30 microbatches over 5 LLM ranks


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.llm.pp=2", "parallel.llm.pp_virtual=2", "llm.n_layers=4", "train.microbatches=3"],
         "train.microbatches (3) must be a multiple of parallel.llm.pp (2) for the interleaved schedule"),
        (["parallel.llm.pp=4", "llm.n_layers=4", "train.microbatches=4"],
         "boundary.prefetch_depth (2) must be >= 4 with parallel.llm.pp 4 (pp_virtual 1) and train.microbatches 4"),
        (["parallel.llm.pp=2", "parallel.llm.pp_virtual=2", "llm.n_layers=4", "train.microbatches=4",
          "boundary.prefetch_depth=3"], "boundary.prefetch_depth (3) must be >= 4"),
        (["parallel.llm.pp=2", "parallel.llm.pp_layers=[1, 2]"], "parallel.llm.pp_layers [1, 2] sums to 3, not n_layers (2)"),
    ],
)
def test_a_pipeline_that_cannot_run_the_step_is_refused_naming_the_fields(overrides, message):
    from dyad import config as config_lib

    with pytest.raises(ValueError, match=re.escape(message)):
        config_lib.resolve(config_lib.load(None, overrides), vocab_size=32)


def test_a_pipeline_resizes_by_whole_pipelines():
    """A resize of the LLM pool changes dp; pp, like tp and cp, stays."""
    from dyad import config as config_lib

    config = config_lib.load(None, ["parallel.llm.pp=2", "train.global_batch=8", "train.microbatches=4"])
    resized = config_lib.scaled(config, "llm", 4)
    assert (resized.parallel.llm.pp, resized.parallel.llm.dp, resized.train.microbatches) == (2, 2, 2)
    with pytest.raises(ValueError, match=re.escape("replicas (3) must be a multiple of parallel.llm.tp*cp*pp (1*1*2)")):
        config_lib.scaled(config, "llm", 3)
    config_lib.resolve(config_lib.load(None, ["parallel.llm.pp=4", "llm.n_layers=4", "boundary.prefetch_depth=4",
                                              "train.microbatches=4"]), vocab_size=32)
