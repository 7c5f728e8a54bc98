"""Durable writes, the one place files are published: written beside their place, flushed to the disk, renamed over
it, the directory flushed after. A reader (or a crash, or a power loss) finds the old file or the new one, never half
of one. `write_atomic` writes one file (the checkpoint's own files, the token cache's meta and memo); `publish_files`
several into a directory (hf/model.py's exports and imports). Torch-free."""

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["fsync_path", "publish_files", "write_atomic"]


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


def publish_files(out, writers: dict) -> Path:
    """Each `writers[name](path)` writes one file into a temporary directory beside `out`; every file is fsynced,
    then moved into `out` (made if absent), and `out` fsynced: an interrupted write leaves no half directory and no
    half file, a power loss neither. The temporary directory is removed whatever happens; errors propagate.

    Args:
        out (str | os.PathLike): the directory to publish into.
        writers (dict[str, Callable[[Path], object]]): file name -> a function writing that file at the path given.

    Returns:
        Path: `out`.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()) / "export"
        >>> sorted(p.name for p in publish_files(d, {"a.txt": lambda p: p.write_text("a")}).iterdir())
        ['a.txt']
    """
    out = Path(out)
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        for name, write in writers.items():
            write(tmp / name)
            fsync_path(tmp / name)  # the content on disk before the rename publishes it
        out.mkdir(exist_ok=True)
        for name in writers:
            os.replace(tmp / name, out / name)
        fsync_path(out)  # the renames themselves
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out

