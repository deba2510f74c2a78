"""The recipes that describe a model tensor over a checkpoint's stored ones read any selection of
it as indexing the whole tensor would (unsorted, repeated and empty selections included), and the
stored tensor reads only the box its selection spans."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dyad.slices import Concatenated, Merged, Stacked, Stored, Transposed, everything, load_pieces


@pytest.fixture
def stored(tmp_path):
    torch.manual_seed(0)
    tensors = {"a": torch.randn(6, 5), "b": torch.randn(6, 5), "c": torch.randn(4, 5), "d": torch.randn(3, 2, 4)}
    save_file(tensors, tmp_path / "w.safetensors")
    handle = safe_open(tmp_path / "w.safetensors", framework="pt")
    return tensors, {name: Stored(handle, name, tuple(t.shape)) for name, t in tensors.items()}


def _select(full: torch.Tensor, index) -> torch.Tensor:
    for dim, i in enumerate(index):
        full = full.index_select(dim, i)
    return full


def _selections(shape, count=6):
    g = torch.Generator().manual_seed(sum(shape))
    yield everything(shape)
    yield tuple(torch.arange(n // 2, n) for n in shape)  # a box
    yield tuple(torch.tensor([], dtype=torch.long) if d == 0 else torch.arange(n) for d, n in enumerate(shape))
    for _ in range(count):
        yield tuple(torch.randint(0, n, (int(torch.randint(1, n + 2, (), generator=g)),), generator=g) for n in shape)


def test_each_recipe_reads_a_selection_as_indexing_the_whole_would(stored):
    tensors, sources = stored
    cases = {
        "stored": (sources["d"], tensors["d"]),
        "transposed": (Transposed(sources["a"]), tensors["a"].T),
        "stacked": (Stacked([sources["a"], sources["b"]], dim=1), torch.stack([tensors["a"], tensors["b"]], 1)),
        "concatenated": (Concatenated([sources["a"], sources["c"], sources["b"]]),
                         torch.cat([tensors["a"], tensors["c"], tensors["b"]])),
        "merged": (Merged(sources["d"], 1), tensors["d"].reshape(3, 8)),
        # an expert's interleaved (gate, up) pairs: [D, F, 2] -> [D, 2F], as the LLM's w13 is made
        "pairs": (Merged(Stacked([Transposed(sources["a"]), Transposed(sources["b"])], dim=2), 1),
                  torch.stack([tensors["a"].T, tensors["b"].T], -1).reshape(5, 12)),
    }
    for name, (source, full) in cases.items():
        assert source.shape == tuple(full.shape), name
        for index in _selections(source.shape):
            assert torch.equal(source.read(index), _select(full, index)), (name, index)


def test_a_stored_tensor_reads_only_the_box_of_its_selection(stored, monkeypatch):
    tensors, sources = stored
    boxes = []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __getitem__(self, box):
            boxes.append(box)
            return self.inner[box]

    source = sources["d"]
    handle = source.handle
    monkeypatch.setattr(source, "handle", type("H", (), {"get_slice": lambda self, n: Recording(handle.get_slice(n))})())
    value = source.read((torch.tensor([2, 1]), torch.tensor([1]), torch.tensor([0, 1, 3])))
    assert torch.equal(value, tensors["d"][[2, 1]][:, [1]][:, :, [0, 1, 3]])
    assert boxes == [(slice(1, 3), slice(1, 2), slice(0, 4))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the pieces are read on the host and copied there")
def test_pieces_load_into_a_model_on_a_gpu(stored):
    tensors, sources = stored
    model = torch.nn.Linear(5, 6, device="cuda")
    load_pieces(model, {"weight": sources["a"]})
    assert torch.equal(model.weight.cpu(), tensors["a"])
