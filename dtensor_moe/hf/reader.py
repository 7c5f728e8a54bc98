"""Lazy reads of Hugging Face weights: a safetensors checkpoint directory, or a module's state dict.

`checkpoint_files(directory)`: every tensor's file, dtype and shape, from model.safetensors.index.json's weight_map
(else every *.safetensors file in the directory) and the files' headers alone, each header checked against its
file (a garbage, truncated or missing file, or an index naming a key its file lacks, is a ValueError naming the
file and what was expected) before any tensor is read. `SafetensorsReader` opens each shard once and reads only
the box asked for (`get_slice`), so a rank reads its own expert slices and never the whole checkpoint.
`elements_read` counts what was read.
"""

import json
import struct
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100_000_000  # safetensors' own bound on the JSON header
# Bytes per element of safetensors' dtypes (others, e.g. packed 4-bit ones, are not size-checked).
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
            "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8}


class Entry(NamedTuple):
    """One tensor of a checkpoint, from its file's header."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def _not_safetensors(path: Path, why: str) -> ValueError:
    return ValueError(f"{path} is not a readable safetensors file: {why}; expected what save_pretrained or "
                      "safetensors.torch.save_file writes (re-download or re-save it)")


def read_header(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (dtype, shape) of a safetensors file, from its header alone, every entry checked against the file's
    size: a ValueError names the file and what is wrong (never a MemoryError on a garbage length)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _not_safetensors(path, f"{size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER):
                raise _not_safetensors(path, f"its header length says {n} bytes, the file holds {size - 8} after it")
            text = f.read(n)
    except FileNotFoundError:
        raise ValueError(f"{path} is missing; expected a safetensors file there") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a directory; expected a safetensors file") from None
    except OSError as e:
        raise ValueError(f"{path} cannot be read: {e.strerror}") from None
    try:
        header = json.loads(text)
    except ValueError as e:
        raise _not_safetensors(path, f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _not_safetensors(path, f"its header is a JSON {type(header).__name__}, not an object")
    data, out = size - 8 - n, {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            dtype, shape, begin, end = None, (), 0, -1
        ints = all(type(d) is int and d >= 0 for d in (*shape, begin, end))
        if not isinstance(dtype, str) or not ints or begin > end:
            raise _not_safetensors(path, f"{key!r}'s header entry {info!r} is malformed")
        if end > data:
            raise _not_safetensors(path, f"{key!r} ends at byte {end} of its data, the file holds {data} (truncated)")
        numel = 1
        for d in shape:
            numel *= d
        if dtype in ITEMSIZE and end - begin != numel * ITEMSIZE[dtype]:
            raise _not_safetensors(path, f"{key!r} ({dtype} {list(shape)}) has {end - begin} bytes, expected "
                                         f"{numel * ITEMSIZE[dtype]}")
        out[key] = (dtype, shape)
    return out


def checkpoint_files(directory) -> dict[str, Entry]:
    """key -> (file, dtype, shape) of every tensor of a checkpoint directory: the index's weight_map if there is
    one (each file it names present, holding the keys it names), else every *.safetensors file; headers only."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"no Hugging Face checkpoint directory at {str(directory)!r}")
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            weight_map = None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} is not a shard index: expected JSON with a \"weight_map\" object "
                             "{tensor key: file name} (what save_pretrained writes)")
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} holds no safetensors weights; expected {INDEX} or *.safetensors files "
                         "(what save_pretrained writes)")
    out = {}
    for name in files:
        path = directory / name
        if weight_map is not None and not path.is_file():
            keys = sorted(k for k, f in weight_map.items() if f == name)
            raise ValueError(f"{path} is missing: {INDEX} names it for {len(keys)} tensors ({keys[0]}, ...); "
                             "expected every shard the index names (download it again)")
        for key, (dtype, shape) in read_header(path).items():
            if weight_map is None or weight_map.get(key) == name:
                out[key] = Entry(path, dtype, shape)
    if weight_map is not None:
        lost = sorted(k for k in weight_map if k not in out)
        if lost:
            raise ValueError(f"{directory / weight_map[lost[0]]} lacks {lost[0]}, which {INDEX} places there"
                             f"{f' (and {len(lost) - 1} more)' if len(lost) > 1 else ''}; expected the shards the "
                             "index was written with")
    return out


class SafetensorsReader:
    """Lazy reads of a Hugging Face safetensors checkpoint directory: every file's header is read and checked at
    construction (`checkpoint_files`), each shard is opened at its first read, and `read` reads only the box asked
    for, so a rank loads its own slices and never the whole checkpoint. `elements_read` counts the elements read.

    Args:
        directory (str | Path): the checkpoint directory: model.safetensors.index.json and its shards, or
            *.safetensors files.

    Raises:
        ValueError: no such directory, no safetensors weights in it, or a damaged file or index (naming it).

    Example:
        >>> import tempfile, torch
        >>> from safetensors.torch import save_file
        >>> from dtensor_moe.hf import SafetensorsReader
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_file({"w": torch.arange(12.0).reshape(3, 4)}, f"{d}/model.safetensors")
        ...     reader = SafetensorsReader(d)
        ...     reader.shape("w"), reader.read("w", (slice(1, 2), slice(0, 4))).tolist(), reader.elements_read
        ((3, 4), [[4.0, 5.0, 6.0, 7.0]], 4)
    """

    def __init__(self, directory):
        self.directory = Path(directory)
        self._entries = checkpoint_files(self.directory)
        self._open: dict[Path, object] = {}
        self.elements_read = 0

    def keys(self) -> set[str]:
        return set(self._entries)

    def _slice(self, key: str):
        path = self._entries[key].file
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path].get_slice(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key].shape

    def read(self, key: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor under `key`, or only its `box` (one slice per dim, unit steps)."""
        sl = self._slice(key)
        t = sl[box] if box is not None else sl[:]
        self.elements_read += t.numel()
        return t


class StateDictReader:
    """`SafetensorsReader`'s reads (keys, shape, read of a key or of a box of it) over tensors in memory, such as a
    transformers module's state dict; `elements_read` counts the elements read.

    Args:
        tensors (dict[str, torch.Tensor]): key -> tensor; reads return detached views, not copies.

    Example:
        >>> import torch
        >>> from dtensor_moe.hf import StateDictReader
        >>> reader = StateDictReader({"w": torch.arange(12.0).reshape(3, 4)})
        >>> reader.shape("w"), reader.read("w", (slice(0, 3), slice(2, 3))).flatten().tolist(), reader.elements_read
        ((3, 4), [2.0, 6.0, 10.0], 3)
    """

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
