"""Lazy reads of Hugging Face weights: a safetensors checkpoint directory, or a module's state dict.

`SafetensorsReader` opens each shard once (model.safetensors.index.json's weight_map, else every
*.safetensors file in the directory) and reads only the box asked for (`get_slice`), so a rank
reads its own expert slices and never the whole checkpoint. `elements_read` counts what was read.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"


class SafetensorsReader:
    def __init__(self, directory):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"no Hugging Face checkpoint directory at {str(self.directory)!r}")
        index = self.directory / INDEX
        if index.is_file():
            self._file_of = {k: self.directory / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            self._file_of = {}
            for path in sorted(self.directory.glob("*.safetensors")):
                with safe_open(path, framework="pt") as f:
                    self._file_of.update(dict.fromkeys(f.keys(), path))
        if not self._file_of:
            raise ValueError(f"{self.directory} holds no safetensors weights ({INDEX} or *.safetensors)")
        self._open: dict[Path, object] = {}
        self.elements_read = 0

    def keys(self) -> set[str]:
        return set(self._file_of)

    def _slice(self, key: str):
        path = self._file_of[key]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path].get_slice(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def read(self, key: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor under `key`, or only its `box` (one slice per dim, unit steps)."""
        sl = self._slice(key)
        t = sl[box] if box is not None else sl[:]
        self.elements_read += t.numel()
        return t


class StateDictReader:
    """The same reads over tensors in memory (a transformers module's state dict)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = tensors
        self.elements_read = 0

    def keys(self) -> set[str]:
        return set(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def read(self, key: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        t = self._tensors[key].detach()
        t = t[box] if box is not None else t
        self.elements_read += t.numel()
        return t
