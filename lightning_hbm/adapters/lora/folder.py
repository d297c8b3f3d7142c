"""An adapter folder written as a unit: each file atomically into it, a manifest last, writers serialised
(:func:`write_folder`), and a folder whose save did not complete refused before loading (:func:`check_adapter_folder`)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Union

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

from lightning_hbm import resume
from lightning_hbm.memory.report import plain_file_mode, set_mode


def _fsync_tree(folder: Path) -> None:
    for item in folder.rglob("*"):
        if item.is_file():
            with open(item, "rb") as file:
                os.fsync(file.fileno())
    for sub in [folder, *(d for d in folder.rglob("*") if d.is_dir())]:
        resume.fsync_dir(sub)


MANIFEST = "lightning_hbm_export.json"  # written last: its absence or a size mismatch marks a save cut short
_LOCK = ".lightning_hbm_export.lock"
# a folder that cannot be written (no permission, a read-only filesystem: root gets EROFS too) is said so, never
# "free space" (issue 55); a full disk or quota is
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def write_folder(path: Path, write: Callable[[Path], Any]) -> None:
    """Write the files of ``write(tmp)`` into the folder ``path``, each atomically, without replacing the folder.

    ``write`` writes into a temporary folder inside ``path`` (same filesystem); each file is fsynced there and
    renamed over its name in ``path`` (``os.replace``). The folder itself is left as it is: its mode (a 02775 team
    folder), the user's other files and links, and a folder that is a symlink (``latest -> run-17``: written
    through, into ``run-17``). Writers of one folder are serialised by a lock on the folder (:func:`_lock_folder`). A manifest
    (:data:`MANIFEST`: each file's size) is removed before the first file is replaced and written after the last:
    a save cut short between two files leaves no manifest (issue 55: the folder was replaced by a renamed copy,
    which lost links and modes and raced with other writers). A failure before the first replace (a full disk while
    writing) leaves the previous adapter untouched.
    """
    if path.exists() and not path.is_dir():
        raise ValueError(f"LoRA.save_adapter: {path} is a file, not a folder. Pass a folder path (it is created).")
    try:
        path.mkdir(parents=True, exist_ok=True)  # the user's umask decides a new folder's mode
        folder = path.resolve()  # a symlinked folder: written through to its target
        tmp = Path(tempfile.mkdtemp(prefix=".lightning_hbm-export.", suffix=".partial", dir=folder))  # can we write?
    except OSError as err:
        if err.errno in (errno.ENOTDIR, errno.EEXIST):  # a file on the way, or a link to nowhere: nothing written
            raise ValueError(
                f"LoRA.save_adapter: {path} cannot be a folder ({err.strerror}: {err.filename}): a part of the path is a "
                "file or a broken link. Pass a folder path whose parents are folders; nothing was written."
            ) from err
        if err.errno not in _NOT_WRITABLE:
            raise
        raise PermissionError(
            err.errno, f"LoRA.save_adapter cannot write into {path} ({err.strerror}): save into a folder you can write to."
        ) from err
    try:
        lock = _lock_folder(folder)
        try:
            _write_locked(path, folder, tmp, write)
        finally:
            os.close(lock)  # releases the lock
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _lock(fd: int) -> None:
    if fcntl is not None:  # POSIX only: on Windows the writers are not serialised
        fcntl.flock(fd, fcntl.LOCK_EX)


def _lock_folder(folder: Path) -> int:
    """A descriptor holding the lock that serialises the writers of ``folder``: the folder's own (nothing is left in
    it: was a ``.lightning_hbm_export.lock`` file in every adapter folder, uploaded with it), or, where a folder
    cannot be locked (NFS maps ``flock`` to POSIX locks, which need a file open for writing; Windows), a lock file."""
    if fcntl is not None:
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return fd
        except OSError:
            os.close(fd)
    fd = os.open(folder / _LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    _lock(fd)
    return fd


def _write_locked(path: Path, folder: Path, tmp: Path, write: Callable[[Path], Any]) -> None:
    replaced = False
    try:
        write(tmp)
        files = sorted(f for f in tmp.rglob("*") if f.is_file())
        _check_targets(path, [folder / f.relative_to(tmp) for f in files])
        _fsync_tree(tmp)
        (folder / MANIFEST).unlink(missing_ok=True)
        replaced = True
        for file in files:
            target = folder / file.relative_to(tmp)
            target.parent.mkdir(parents=True, exist_ok=True)
            set_mode(None, file, plain_file_mode(target))  # safetensors writes 0600: the team could not read the weights
            os.replace(file, target)
        manifest = {str(f.relative_to(tmp)): (folder / f.relative_to(tmp)).stat().st_size for f in files}
        with open(tmp / MANIFEST, "w") as handle:
            json.dump({"files": manifest}, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp / MANIFEST, folder / MANIFEST)
        resume.fsync_dir(folder)
    except BaseException as err:
        if not isinstance(err, OSError):
            raise
        if replaced:
            previous = "some files were replaced: save again (the folder has no manifest until a save completes)"
        else:
            previous = "the previous adapter there is untouched"
        if isinstance(err, PermissionError) or err.errno in _NOT_WRITABLE:
            raise PermissionError(err.errno, f"LoRA.save_adapter cannot write into {path} ({err.strerror}); {previous}.") from err
        fix = " Free space on that disk or save elsewhere." if err.errno in _FULL else " Save elsewhere."
        raise OSError(err.errno or 0, f"LoRA.save_adapter could not write {path} ({err}); {previous}.{fix}") from err


def _check_targets(path: Path, targets: list[Path]) -> None:
    """A ``ValueError`` before the first file is replaced when a file's name in the folder is a folder (``os.replace``
    cannot put a file there). Was: the manifest removed and the config replaced, then ``IsADirectoryError`` at the
    weights, saying "save again", which failed the same way: a half-written adapter folder."""
    blocked = [t for t in targets if t.is_dir() and not t.is_symlink()]
    if blocked:
        raise ValueError(
            f"LoRA.save_adapter: {blocked[0]} is a folder, where the adapter's file of that name goes. Move or rename "
            f"it, or save into another folder ({path} is unchanged: nothing was written)."
        )


def check_adapter_folder(path: Union[str, Path]) -> Path:
    """Refuse an adapter folder whose last :func:`save_adapter` did not complete, before anything loads it.

    ``save_adapter`` writes :data:`MANIFEST` (each file's size) after the last file and removes it before the first:
    a folder without it, or whose files' sizes differ from it, holds a save cut short (a kill, a full disk between
    two files): peft would load a new ``adapter_config.json`` with the old weights, or fail on truncated weights.
    peft's own loaders do not read the manifest: call this before ``PeftModel.from_pretrained(base, path)``.
    Returns ``path``.

    Raises:
        ValueError: no manifest, an unreadable one, or a listed file missing or of another size (named, with the fix).
    """
    folder = Path(path)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(
            f"{folder} has no {MANIFEST}: a LoRA.save_adapter into it did not complete (or the folder was not written "
            "by LoRA.save_adapter: a folder of peft's own save_pretrained, or of a lightning_hbm older than the "
            "manifest, has none). Save the adapter again; a folder you know is complete loads with peft directly."
        )
    try:
        files = json.loads(manifest_path.read_text())["files"]
        sizes = {str(name): int(size) for name, size in files.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise ValueError(f"{manifest_path} cannot be read ({type(err).__name__}: {err}): save the adapter again.") from None
    for name, size in sizes.items():
        file = folder / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            found = "is missing" if actual is None else f"has {actual:,} bytes, not the {size:,} its save wrote"
            raise ValueError(
                f"{file} {found} ({MANIFEST}): the adapter in {folder} is not the one its last LoRA.save_adapter "
                "completed (a file replaced or cut short since). Save the adapter again."
            )
    return folder

