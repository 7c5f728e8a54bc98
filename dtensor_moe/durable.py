"""Durable writes: a file's content, or a directory's entries, flushed to the disk before (and after) the rename that
publishes them, so the atomic writers (hf/model.write_files, the token cache) survive a power loss whole. Torch-free."""

import os

__all__ = ["fsync_path"]


def fsync_path(path) -> None:
    """`path` (a file, or a directory: its entries) flushed to the disk.

    Args:
        path (str | os.PathLike): an existing file or directory.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> (d / "a.txt").write_text("x")
        1
        >>> fsync_path(d / "a.txt"); fsync_path(d)
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
