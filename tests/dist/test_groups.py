"""dyad.parallel.groups on 8 spawned gloo ranks: every group holds exactly the ranks the layout
math says, in the same order."""

import pytest
import torch
import torch.distributed as dist

from dyad.layout import EncoderLayout, LLMLayout
from dyad.parallel.groups import ProcessGroups
from tests.helpers.distributed import run_distributed

LAYOUTS = [
    LLMLayout(tp=2, cp=2, dp=2, ep=4, etp=1),
    LLMLayout(tp=2, cp=1, dp=4, ep=2, etp=2),
    LLMLayout(tp=2, dp=2, ep=2, pp=2),
    EncoderLayout(dp=4, tp=2),
]


def _groups_hold_the_layouts_ranks(rank, world_size, layouts):
    for layout in layouts:
        groups = ProcessGroups.build(layout)
        assert groups.layout == layout and groups.coords == layout.coords(rank)
        for name in layout.GROUP_NAMES:
            (expected,) = [g for g in layout.groups(name) if rank in g]
            group = groups.group(name)
            gathered = [torch.zeros(1, dtype=torch.int64) for _ in expected]
            dist.all_gather(gathered, torch.tensor([rank]), group=group)
            assert [int(t) for t in gathered] == expected, (layout, name)
            assert groups.ranks(name) == expected
            assert groups.size(name) == len(expected) == dist.get_world_size(group)
            assert groups.index(name) == expected.index(rank) == dist.get_rank(group)


def _build_with_wrong_world_size(rank, world_size, layout, message):
    with pytest.raises(ValueError) as raised:
        ProcessGroups.build(layout)
    assert str(raised.value) == message


def test_groups_hold_the_layouts_ranks():
    # One spawn for all layouts keeps the test fast; each build creates its own groups.
    run_distributed(_groups_hold_the_layouts_ranks, 8, LAYOUTS, timeout_s=120)


def test_build_refuses_a_world_size_other_than_the_layouts():
    layout = LLMLayout(tp=2, dp=4)
    message = f"the process group has world size 2, but the layout {layout} needs world_size 8"
    run_distributed(_build_with_wrong_world_size, 2, layout, message, timeout_s=60)


def test_unknown_group_name_names_the_valid_ones():
    groups = ProcessGroups(EncoderLayout(), 0, {}, {})
    with pytest.raises(ValueError, match="unknown group 'ep'; valid names: tp, dp, world"):
        groups.group("ep")
