"""Checks of a checkpoint file before anything loads from it: its path and zip, its layout, and tensors that fit
no layer of the model (plus the checks that levels above register: :func:`register_meta_check`)."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_hbm.layers.correction import KEY_MARK as CORRECTION_MARK
from lightning_hbm.resume.keys import _canonical
from lightning_hbm.resume.packing import META_KEY
from lightning_hbm.resume.sealing import _damaged

# torch.save(..., _use_new_zipfile_serialization=False): a pickle (protocol 2) starting with torch's magic number
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


#: the largest pickled metadata (``data.pkl``) :func:`check_file` lets torch unpickle: a real checkpoint's holds key
#: names, settings and loop counters (tensors are stored apart), a few MiB for the largest models; junk above it
#: would cost about twice its size in memory before torch's unpickler fails
MAX_PICKLE_BYTES = 64 << 20


def check_file(path: Any) -> None:
    """A clear error for a checkpoint path that is a directory, or a file that is empty or cut short (torch says
    EOFError / Errno 22 / IsADirectoryError), and for a zip whose pickled metadata is too large or does not match
    its zip CRC (flipped bytes). A complete file in torch's legacy (non-zip) format passes: it loads."""
    if path is None:
        return
    try:
        file = Path(path)
        is_dir = file.is_dir()
        size = 0 if is_dir else file.stat().st_size
    except (OSError, TypeError, ValueError):
        return  # a remote URL or an unusual path: leave it to Lightning's own loader
    if is_dir:
        raise ValueError(
            f"Checkpoint {path} is a directory, not a checkpoint file. If it is a distributed (sharded) checkpoint, "
            "resume it with the strategy that wrote it (e.g. FSDP with state_dict_type='sharded'); otherwise pass the "
            "path of a .ckpt file inside it."
        )
    if size == 0:
        raise ValueError(f"Checkpoint {path} is empty (0 bytes): the save was interrupted. Resume from another checkpoint.")
    if zipfile.is_zipfile(file):
        _check_pickle(file, path)
        return
    with open(file, "rb") as handle:
        if handle.read(len(_LEGACY_MAGIC)) == _LEGACY_MAGIC:
            return  # torch's legacy format (_use_new_zipfile_serialization=False): torch.load reads it
    raise ValueError(
        f"Checkpoint {path} is not a complete torch checkpoint ({size} bytes; neither a zip archive with its directory "
        "nor torch's legacy format): the file was cut short, e.g. by a kill during save or a full disk, or it is "
        "not a checkpoint. Resume from another checkpoint."
    )


def _check_pickle(file: Path, path: Any) -> None:
    """Refuse, from the zip's central directory alone, a ``data.pkl`` above :data:`MAX_PICKLE_BYTES`; then check it
    against its zip CRC (torch's reader does not), so a flipped byte never reaches the unpickler."""
    try:
        with zipfile.ZipFile(file) as archive:
            pickles = [i for i in archive.infolist() if i.filename.count("/") == 1 and i.filename.endswith("/data.pkl")]
            for info in pickles:
                if info.file_size > MAX_PICKLE_BYTES or info.compress_size > MAX_PICKLE_BYTES:
                    raise ValueError(
                        f"Checkpoint {path} is damaged or not a checkpoint: its pickled metadata ({info.filename}) is "
                        f"{max(info.file_size, info.compress_size) / 2**20:.0f} MiB, above the "
                        f"{MAX_PICKLE_BYTES / 2**20:.0f} MiB a checkpoint's metadata needs (its tensors are stored "
                        "apart); it was refused unread. Resume from another checkpoint (to read such a file anyway, "
                        "raise lightning_hbm.resume.MAX_PICKLE_BYTES)."
                    )
                if info.CRC:  # 0: written without CRCs (torch.serialization.set_crc32_options(False))
                    with archive.open(info) as member:
                        while member.read(1 << 20):
                            pass
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, RuntimeError) as err:
        raise _damaged(path, f"its zip archive does not read back ({err})") from None


def _unreadable(path: Any, err: Exception) -> ValueError:
    """torch's unpickler failing on a file that passed :func:`check_file`: one clear error instead of its raw one."""
    detail = " ".join(str(err).split())[:300]
    if "Weights only load failed" in str(err):
        what = (f"it holds an object that torch's safe loader refuses to build (Weights only load failed: {detail}); "
                "a file that would run code is never loaded")
    else:
        what = f"its pickled metadata does not load ({type(err).__name__}: {detail})"
    return _damaged(path, what)


# key parts only a changed model writes: peft's adapters here; each quantized format adds the keys of its constants
# (``QuantFormat.state_marks``, registered by lightning_hbm.precision, which sits above this level)
_CHANGED_MARKS: list[str] = [".lora_A.", ".lora_B.", ".base_layer.", CORRECTION_MARK]


def register_changed_marks(marks: Iterable[str]) -> None:
    """Make :func:`check_layout` also recognize state_dict keys containing one of ``marks`` as changed tensors."""
    _CHANGED_MARKS.extend(mark for mark in marks if mark not in _CHANGED_MARKS)


def check_layout(checkpoint: Any, path: Any, model_keys: Iterable[str] = ()) -> None:
    """A clear error, before anything loads, for a checkpoint in lightning_hbm's older layout: the changed tensors
    (adapters, 4-bit constants) in ``state_dict`` itself, where Lightning's strict load into the model as built fails
    half-way with a raw "Unexpected key(s)" error."""
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        return
    meta = checkpoint.get(META_KEY)
    if isinstance(meta, dict) and "version" in meta:
        return  # the two-part layout (validated by verify)
    known = set(model_keys)  # a model built with such layers on purpose loads them as they are
    changed = [k for k in checkpoint["state_dict"] if k not in known and any(m in k for m in _CHANGED_MARKS)]
    if changed:
        raise ValueError(
            f"Checkpoint {path} holds tensors of an already changed model in its state_dict ({changed[:3]}): it was "
            "written in an older lightning_hbm layout (or by a plain peft/bitsandbytes model) that cannot be resumed. "
            "Start a new run from its weights instead: load them into your model yourself (model.load_state_dict("
            "torch.load(path, weights_only=True)['state_dict'], strict=False)) and call fit without ckpt_path."
        )


# checks of entries of the lightning_hbm part that levels above this one write (the smoothing exponents): each gets
# (meta, path, module as it is when the file is loaded) and raises a ValueError naming the file
_META_CHECKS: list[Callable[[dict[str, Any], Any, nn.Module], None]] = []


def register_meta_check(check: Callable[[dict[str, Any], Any, nn.Module], None]) -> None:
    """Make :func:`check_contents` run ``check`` on the lightning_hbm part of every checkpoint loaded into a model."""
    if check not in _META_CHECKS:
        _META_CHECKS.append(check)


def _is_changed(keys: Iterable[str]) -> bool:
    return any(mark in key for key in keys for mark in _CHANGED_MARKS)


def _owners(module: nn.Module) -> tuple[set[str], set[str]]:
    """Names of all modules, and of those holding tensors of their own (the layers a changed tensor can belong to)."""
    names, holders = set(), set()
    for name, sub in module.named_modules(remove_duplicate=False):
        names.add(name)
        if next(sub.parameters(recurse=False), None) is not None or next(sub.buffers(recurse=False), None) is not None:
            holders.add(name)
    return names, holders


def stray_keys(checkpoint: dict[str, Any], module: nn.Module) -> list[str]:
    """Tensors of ``checkpoint`` that no layer of ``module`` can take: ``state_dict`` keys a model as built lacks
    (Lightning's strict load), and changed tensors (adapters, 4-bit constants) under no layer holding tensors."""
    model_keys = module.state_dict().keys()
    stray = []
    # a model's own on_load_checkpoint runs before Lightning's strict load and may rename or drop keys (a migration)
    migrates = isinstance(module, pl.LightningModule) and is_overridden("on_load_checkpoint", module, pl.LightningModule)
    if getattr(module, "strict_loading", True) and not migrates and not _is_changed(model_keys):
        stray = [k for k in checkpoint.get("state_dict", {}) if k not in model_keys]
    meta = checkpoint.get(META_KEY)
    if isinstance(meta, dict) and isinstance(meta.get("state_dict"), dict):
        names, holders = _owners(module)
        # by its own name (into a changed model: x.base_layer) or its as-built one (into the model as built: x)
        stray += [k for k in meta["state_dict"] if not any(_owner(f, names) in holders for f in _forms(str(k)))]
    return stray


# peft's copy of a module trained in full (modules_to_save, possibly a container): x.modules_to_save.default.0.weight
_SAVED_COPY = re.compile(r"\.(?:modules_to_save\.[^.]+|original_module)\.")


def _forms(key: str) -> tuple[str, ...]:
    return key, _canonical(key), _SAVED_COPY.sub(".", _canonical(key))


def _owner(key: str, names: set[str]) -> str:
    """The deepest module of ``names`` that ``key`` lies under (``""``: the root)."""
    parts = key.split(".")
    return next((p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if p in names), "")


def check_contents(checkpoint: Any, path: Any, module: Optional[nn.Module], resumes_training: bool) -> None:
    """Before Lightning loads anything from ``checkpoint``: a file holding no dict, a weights-only file given to
    ``fit(ckpt_path=...)``, tensors that fit no layer of ``module`` (one short message, not Lightning's list of
    every key) and the registered checks of the lightning_hbm part (:func:`register_meta_check`)."""
    if not isinstance(checkpoint, dict):
        raise _damaged(path, f"it holds a {type(checkpoint).__name__}, not the dict of a Lightning checkpoint")
    lacking = [k for k in ("optimizer_states", "lr_schedulers") if k not in checkpoint]
    if resumes_training and lacking:
        raise ValueError(
            f"Checkpoint {path} holds only weights (no {' / '.join(lacking)}: saved with ModelCheckpoint("
            "save_weights_only=True) or trainer.save_checkpoint(..., weights_only=True)): fit(ckpt_path=...) resumes a "
            "whole training state and cannot start from it; nothing was loaded. Resume from a full checkpoint (e.g. "
            "last.ckpt), or use these weights with trainer.validate/test/predict(model, ckpt_path=...)."
        )
    if module is None:
        return
    stray = stray_keys(checkpoint, module)
    if stray:
        raise ValueError(
            f"Checkpoint {path} holds {len(stray)} tensor(s) that fit no layer of this model (first: {stray[:5]}): it "
            "was saved from another model or edited. Build the model of the run that saved it; nothing was loaded."
        )
    meta = checkpoint.get(META_KEY)
    if isinstance(meta, dict):
        for check in _META_CHECKS:
            check(meta, path, module)
