"""Reading sysfs attribute files, with the failure reasons an operator can act on.

Every sysfs meter reads through a ``Reader`` (``Path -> str``) passed to its constructor, so tests
can build a fake tree under ``tmp_path`` and simulate what a tree cannot: a permission error, which
``chmod 000`` does not produce when the tests run as root.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

Reader = Callable[[Path], str]


def read_text(path: Path) -> str:
    """The default reader: sysfs attributes are small text files, read whole each time (sysfs
    regenerates the value on every open, so a kept-open file would return stale text)."""
    return path.read_text()


def read_int(reader: Reader, path: Path) -> int:
    """One integer attribute. Raises OSError (from the reader) or ValueError (garbled content)."""
    text = reader(path).strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected an integer, got {text[:40]!r}") from None


def explain(exc: BaseException, path: Path | None = None, hint: str = "") -> str:
    """A one-line reason for a failed read, naming the file (``path``, else the one the OSError
    names): what ``probe()`` returns."""
    if path is None:
        path = Path(getattr(exc, "filename", None) or "?")
    denied = getattr(exc, "errno", None) in (errno.EACCES, errno.EPERM)
    if isinstance(exc, PermissionError) or denied:
        return f"permission denied reading {path}" + (f" ({hint})" if hint else "")
    if isinstance(exc, FileNotFoundError):
        return f"{path} does not exist"
    if isinstance(exc, OSError):
        return f"cannot read {path}: {exc.strerror or exc}"
    return str(exc)
