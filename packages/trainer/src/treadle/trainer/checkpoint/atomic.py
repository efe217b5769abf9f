"""Publishing a directory atomically: build it under a hidden temporary name, fsync every file
and folder, then rename it into place (a rename within one filesystem is atomic).

A process killed while saving leaves only a ``.tmp-*`` folder, which readers ignore and the next
save removes; it never leaves a half-written directory under the final name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


def staging_dir(final: Path) -> Path:
    """An empty hidden sibling folder of ``final`` to build it in (a leftover one is removed)."""
    tmp = final.parent / f"{TMP_PREFIX}{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> Path:
    """fsync ``tmp``'s contents and rename it to ``final``, replacing an older ``final``.

    An existing ``final`` is first renamed aside and deleted after the swap, so at every moment
    either the old or the new complete directory is in place, or (between the two renames, for
    an instant) neither, never a partial one.
    """
    fsync_tree(tmp)
    old = None
    if final.exists():
        old = final.parent / f"{OLD_PREFIX}{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def clean_leftovers(parent: Path) -> None:
    """Remove the ``.tmp-*`` / ``.old-*`` folders a killed save left in ``parent``."""
    if parent.is_dir():
        for p in parent.iterdir():
            if p.is_dir() and p.name.startswith((TMP_PREFIX, OLD_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)
