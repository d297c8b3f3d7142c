"""Writing and reading checkpoint files: atomic saves beside the target, and the checked checkpoint IO."""

from __future__ import annotations

import errno
import os
import re
import secrets
import socket
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hbm.memory.report import plain_file_mode, set_mode
from lightning_hbm.resume.checks import _unreadable, check_contents, check_file, check_layout
from lightning_hbm.resume.fingerprints import _plain
from lightning_hbm.resume.packing import META_KEY, is_placeholder, pack_for
from lightning_hbm.resume.pending import opened
from lightning_hbm.resume.sealing import seal

_PARTIAL = ".lightning_hbm-partial"  # ``.{name}.{host}~{pid}~{token}.lightning_hbm-partial``: a save in progress
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # Windows has none; O_EXCL alone already refuses an existing link there


def _host() -> str:
    # the host in the name: a folder shared by hosts (NFS) holds other hosts' saves, whose pids mean nothing here
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


def _open_partial(path: Path) -> tuple[Path, int]:
    """A new partial file beside ``path``, created by us alone (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600 until
    :func:`atomic_save` gives it the mode a plain save would).

    The name is predictable in part (a killed save is found by it), so in a folder others can write to someone may
    plant a symlink or file there: exclusive creation never writes through it, and a random token picks a new name.
    """
    for _ in range(16):
        partial = path.with_name(f".{path.name}.{_host()}~{os.getpid()}~{secrets.token_hex(4)}{_PARTIAL}")
        try:
            return partial, os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW | getattr(os, "O_BINARY", 0), 0o600)
        except FileExistsError:
            continue
    raise FileExistsError(f"Could not create a partial file beside {path}: 16 names taken; check who writes into {path.parent}.")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def clean_partials(folder: Path) -> list[Path]:
    """Remove the partial files that killed saves of ours left in ``folder``: this host's, whose process is gone.

    Another host's partial (a folder shared over NFS) is never touched: its pid says nothing about a process here.
    Partials of the older ``.{name}.{pid}`` form carry no host, so they are left alone too.
    """
    removed = []
    host = _host()
    for partial in folder.glob(f".*{_PARTIAL}"):
        fields = partial.name[: -len(_PARTIAL)].rsplit(".", 1)[-1].split("~")
        if len(fields) != 3 or fields[0] != host or not fields[1].isdigit():
            continue
        pid = int(fields[1])
        if pid != os.getpid() and not _alive(pid) and not partial.is_symlink():
            partial.unlink(missing_ok=True)
            removed.append(partial)
    return removed


def fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` survive a power cut (checkpoints here, adapter folders in ``LoRA.save_adapter``)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # e.g. Windows: no directory handles; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _not_writable(folder: Path, err: OSError) -> PermissionError:
    return PermissionError(
        err.errno, f"Cannot save checkpoints into {folder} ({err.strerror}): pass ModelCheckpoint(dirpath=<a folder you "
        "can write to>) or Trainer(default_root_dir=...)."
    )


def check_checkpoint_dirs(trainer: Any) -> None:
    """A ``PermissionError`` at fit start, before the model is changed, when a ``ModelCheckpoint`` that saves would
    write into a folder this process cannot write to (no permission, a read-only filesystem): was the raw ``[Errno
    30]`` of a hidden partial file at the first save, the steps before it lost. The folder, or its nearest existing
    parent, gets a probe file created and removed (``os.access`` misjudges read-only mounts and root). Not under
    ``fast_dev_run``, where Lightning's ``ModelCheckpoint`` saves nothing (was: a smoke test from a read-only folder
    refused, session 30).

    In a distributed run every rank checks and the results are gathered: every rank raises the same error, naming
    the rank(s) that cannot write (was: a node whose folder was read-only raised alone, the others waited in the next
    collective until the timeout, issue 55)."""
    failure = None if getattr(trainer, "fast_dev_run", False) else _unwritable_checkpoint_dir(trainer)
    failures = gather_from_ranks(trainer, failure)
    if failures is None:  # one process
        if failure is not None:
            raise _not_writable(Path(failure[0]), OSError(failure[1], failure[2]))
        return
    refused = [(rank, f) for rank, f in enumerate(failures) if f is not None]
    if not refused:
        return
    parts = []
    for folder in sorted({f[0] for _, f in refused}):
        ranks = [rank for rank, f in refused if f[0] == folder]
        reason = next(f[2] for _, f in refused if f[0] == folder)
        plural = "s" if len(ranks) > 1 else ""
        parts.append(f"{folder} on rank{plural} {', '.join(map(str, ranks))} of {len(failures)} ({reason})")
    raise PermissionError(
        refused[0][1][1], f"Cannot save checkpoints into {'; '.join(parts)}: every rank saves through its own filesystem (a node's "
        "scratch may be read-only where another's is not); pass ModelCheckpoint(dirpath=<a folder every rank can write "
        "to>) or Trainer(default_root_dir=...). No rank changed the model."
    )


def _unwritable_checkpoint_dir(trainer: Any) -> Optional[tuple[str, int, str]]:
    """``(folder, errno, reason)`` of the first saving ``ModelCheckpoint`` folder this process cannot write, else ``None``."""
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        if not isinstance(callback, ModelCheckpoint) or (callback.save_top_k == 0 and not callback.save_last):
            continue  # saves nothing
        # dirpath is resolved in ModelCheckpoint.setup (before the surgery); else where that setup would put it
        loggers = getattr(trainer, "loggers", None)
        folder = callback.dirpath or (getattr(loggers[0], "save_dir", None) if loggers else None) or trainer.default_root_dir
        if folder is None or not _is_local(folder):
            continue  # a remote store (s3://...): its own IO answers
        existing = Path(os.path.abspath(os.path.expanduser(str(folder))))
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        try:
            handle, probe = tempfile.mkstemp(prefix=".lightning_hbm-write-check.", dir=existing)
            os.close(handle)
            os.remove(probe)
        except OSError as err:
            if err.errno in _NOT_WRITABLE:
                return str(folder), int(err.errno), str(err.strerror)  # a file on the way: Lightning's own error later
    return None


def gather_from_ranks(trainer: Any, mine: Any) -> Optional[list[Any]]:
    """Every rank's ``mine``, by rank, in a distributed run (a collective: every rank calls it); ``None`` in one process."""
    import torch.distributed as dist

    world = int(getattr(trainer, "world_size", 1) or 1)
    if world < 2 or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() != world:
        return None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return gathered


def atomic_save(checkpoint: dict[str, Any], path: Any) -> None:
    """``torch.save`` that never leaves a partial file under ``path``, nor replaces a good one by it.

    Lightning writes into the temp folder and ``shutil.move`` s the file over the target: across
    filesystems (a mounted checkpoint volume) that move is a copy *over the target*, so a kill or a full
    disk mid-copy leaves a 0-byte or partial checkpoint under its final name. Here the file is written
    beside the target (same folder, so same filesystem), flushed and fsynced, then renamed over it in one
    step (``os.replace``); the folder is fsynced so the rename survives a power cut. On any error the
    partial file is removed and the previous checkpoint is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_partials(path.parent)
    mode = plain_file_mode(path)  # what Lightning's own save leaves: the umask's, or the replaced file's
    try:
        partial, fd = _open_partial(path)
    except OSError as err:
        if err.errno in _NOT_WRITABLE:
            raise _not_writable(path.parent, err) from err
        raise
    try:
        set_mode(fd, partial, mode)
        with os.fdopen(fd, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException as err:
        partial.unlink(missing_ok=True)
        if not isinstance(err, Exception):
            raise  # KeyboardInterrupt, SystemExit: as they are
        # torch's zip writer hides a full disk behind "unexpected pos": name the real cause
        cause = next((e for e in _chain(err) if isinstance(e, OSError)), err)
        previous = "the previous checkpoint there is untouched" if path.exists() else "no file was left there"
        raise OSError(
            getattr(cause, "errno", None) or 0,
            f"Could not save checkpoint {path} ({cause}); {previous}. Free space on that disk or save elsewhere.",
        ) from err
    fsync_dir(path.parent)


def _chain(err: Optional[BaseException]) -> Iterator[BaseException]:
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def _is_local(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and "://" not in str(path)


class CheckedCheckpointIO(CheckpointIO):
    """The strategy's checkpoint IO, made safe: atomic saves and clear errors for damaged files.

    Every lightning_hbm run gets one (wrapping the strategy's IO). To set its options, pass it yourself:
    ``Trainer(plugins=[CheckedCheckpointIO(refuse_non_finite=False)])``.

    Args:
        inner: the IO that reads and deletes files (and writes those that are not local files); default
            Lightning's ``TorchCheckpointIO``.
        refuse_non_finite: refuse (ValueError, nothing written) to save a checkpoint whose trained tensors hold
            NaN or inf, so a diverged step cannot replace the last good checkpoint.
    """

    def __init__(self, inner: Optional[CheckpointIO] = None, refuse_non_finite: bool = True) -> None:
        self.inner = inner if inner is not None else TorchCheckpointIO()
        self.refuse_non_finite = refuse_non_finite
        self.trainer: Any = None  # the Trainer whose strategy holds this IO (set by lightning_hbm.surgery.check_saves)

    def _writes_atomically(self, path: Any, storage_options: Optional[Any]) -> bool:
        # a user's own IO (async, cloud, ...) keeps its own way of writing
        plain = type(self.inner).save_checkpoint is TorchCheckpointIO.save_checkpoint
        return plain and storage_options is None and _is_local(path)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if self.trainer is not None:
            # save_weights_only=True: Lightning calls no save hook, so the lightning_hbm part is packed here, with what
            # the surgery handed down (resume.expect_saves); a checkpoint a save hook packed already is left as it is
            pack_for(self.trainer, checkpoint)
        if self.refuse_non_finite:
            self._refuse_non_finite(checkpoint, path)
        seal(checkpoint)
        if self._writes_atomically(path, storage_options):
            atomic_save(checkpoint, path)
        else:
            self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def _refuse_non_finite(self, checkpoint: dict[str, Any], path: Any) -> None:
        module = getattr(self.trainer, "lightning_module", None)
        weights = {**checkpoint.get("state_dict", {}), **checkpoint.get(META_KEY, {}).get("state_dict", {})}
        if module is not None:  # the trained tensors (a frozen base may hold inf on purpose, e.g. masks)
            trained = {n for n, p in module.named_parameters() if p.requires_grad}
            weights = {k: v for k, v in weights.items() if k in trained}
        bad = [
            k for k, v in weights.items()
            if _plain(v) and v.is_floating_point() and not is_placeholder(v) and not torch.isfinite(v).all()
        ]
        if bad:
            kept = "the previous checkpoint there is kept" if Path(str(path)).exists() else "nothing was written"
            raise ValueError(
                f"Refusing to save checkpoint {path}: {len(bad)} trained tensor(s) hold NaN or inf ({bad[:5]}); {kept}. "
                "The loss diverged: lower the learning rate, clip gradients (Trainer(gradient_clip_val=1.0)) or check "
                "the data, and resume from the last good checkpoint. To save such tensors anyway, pass "
                "Trainer(plugins=[lightning_hbm.CheckedCheckpointIO(refuse_non_finite=False)])."
            )

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
        check_file(path)
        try:
            checkpoint = self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except OSError:
            raise  # a missing file, no permission, a remote store: as the IO says
        except Exception as err:  # flipped bytes reach torch's unpickler as any of a dozen exception types
            raise _unreadable(path, err) from err
        module = getattr(self.trainer, "lightning_module", None)
        if isinstance(checkpoint, dict):
            check_layout(checkpoint, path, module.state_dict().keys() if module is not None else ())
            opened(checkpoint, path)  # verified here, before Lightning loads anything from it: once per resume
        state = getattr(self.trainer, "state", None)
        fitting = getattr(state, "fn", None) == "fit" and getattr(self.trainer.strategy, "lightning_restore_optimizer", True)
        check_contents(checkpoint, path, module, fitting)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def read_file(path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """A checkpoint a strategy restores itself (not through its checkpoint IO), read and verified.

    Args:
        path: a local single-file checkpoint.
        weights_only: passed to ``torch.load`` (Lightning's ``None``: torch's default, ``True``).

    Raises:
        ValueError: an empty or cut-short file (:func:`check_file`), or a damaged lightning_hbm part (:func:`opened`).
    """
    check_file(path)  # an empty or cut-short file is a clear error, as through the checked IO
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    opened(checkpoint, path)  # before the strategy reads a setting or copies a tensor
    return checkpoint
