"""Durable writes, the one place files are published: written beside their place, flushed to the disk, renamed over
it, the directory flushed after. A reader (or a crash, or a power loss) finds the old file or the new one, never half
of one. `write_atomic` writes one file (the checkpoint's own files, the token cache's meta and memo); hf/model.py
`write_files` publishes several into a directory with the same steps (exports, imports). Torch-free."""

import os
import tempfile

__all__ = ["fsync_path", "write_atomic"]


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


def write_atomic(path, write) -> None:
    """`write(f)` (f: a binary file) into a temporary file beside `path`, fsynced, renamed over `path`, the directory
    fsynced; on any failure (a signal included) the temporary file is removed and `path` is as it was.

    Args:
        path (str | os.PathLike): the file to publish.
        write (Callable[[BinaryIO], object]): writes the content.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "meta.json"
        >>> write_atomic(p, lambda f: f.write(b"{}"))
        >>> p.read_bytes()
        b'{}'
    """
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the content on disk before the rename publishes it
        os.replace(tmp, path)
        fsync_path(folder)  # the rename itself
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
