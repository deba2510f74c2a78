"""A Hugging Face model directory as dyad reads it: `config.json` and the weights in safetensors
files (one `model.safetensors`, or shards named by `model.safetensors.index.json`), read with the
`safetensors` library: memory-mapped, one tensor (or one slice of one) at a time, never the whole
model. A missing directory, config, weight file or tensor, or a tensor of another shape than the
model needs, is a ValueError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at import: the services' configs (the router's) read config.json here
    from dyad.slices import Stored

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# transformers' Qwen3-VL vision_config default for the blocks its DeepStack mergers read
QWEN3_VL_DEEPSTACK_INDEXES = (8, 16, 24)


class HFCheckpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / CONFIG).is_file():
            raise ValueError(f"{self.path} has no {CONFIG}: not a Hugging Face model directory")
        self.config: dict = json.loads((self.path / CONFIG).read_text())
        self._file_of = self._weight_map()
        self._open: dict[str, object] = {}

    def _weight_map(self) -> dict[str, str]:
        """Tensor name -> the file holding it."""
        from safetensors import safe_open

        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{self.path / INDEX} has no weight_map")
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                raise ValueError(f"{self.path / INDEX} names {missing[0]}, which is not in {self.path}")
            return dict(weight_map)
        if (self.path / SINGLE_FILE).is_file():
            with safe_open(self.path / SINGLE_FILE, framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)
        raise ValueError(f"{self.path} has neither {SINGLE_FILE} nor {INDEX}: no safetensors weights")

    @property
    def names(self) -> set[str]:
        return set(self._file_of)

    def _handle(self, name: str):
        from safetensors import safe_open

        if name not in self._file_of:
            raise ValueError(f"{self.path}: the checkpoint has no tensor {name!r}")
        file = self._file_of[name]
        if file not in self._open:
            self._open[file] = safe_open(self.path / file, framework="pt")  # memory-mapped
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def stored(self, name: str, shape: tuple[int, ...]) -> Stored:
        """The tensor `name`, which must have `shape`, to read whole or in pieces (nothing read yet)."""
        from dyad.slices import Stored

        found = self.shape(name)
        if found != tuple(shape):
            raise ValueError(f"{self.path}: tensor {name!r} has shape {list(found)}, the model needs {list(shape)}")
        return Stored(self._handle(name), name, found)


def read_config(directory: str, field: str) -> dict:
    """`directory`/config.json, or a ValueError naming the run's `field` that points there."""
    path = Path(directory) / CONFIG
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{field}: {directory} has no {CONFIG}: not a Hugging Face model directory") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{field}: cannot read {path}: {error}") from None


def adopted(ours: Any, theirs: Any, names: tuple[str, ...], *, section: str, source: str) -> dict[str, Any]:
    """The checkpoint's values of `names` (fields of the config dataclass `theirs`) for the run's
    `ours`: a ValueError where the run set one away from its default to something else
    (`section`.name, contradicting `source`)."""
    default = type(ours)()
    for name in names:
        value, checkpoint = getattr(ours, name), getattr(theirs, name)
        if value != getattr(default, name) and value != checkpoint:
            raise ValueError(f"{section}.{name}={value!r} contradicts {source} ({checkpoint!r}): leave it unset")
    return {name: getattr(theirs, name) for name in names}
