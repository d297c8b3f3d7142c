"""A trained LoRA out of the model: its weights, peft's adapter format, a merged plain state_dict."""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Union, cast

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from safetensors.torch import save_file
from torch import nn

from lightning_hbm import resume
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.adapters.lora import variants
from lightning_hbm.adapters.lora.base import ADAPTER_NAME, _lora_layer_cls
from lightning_hbm.adapters.lora.weight_delta import WeightDeltaForward
from lightning_hbm.layers import stored_in, task_heads, task_type
from lightning_hbm.layers.correction import correction_of, correction_weight
from lightning_hbm.layers.embedding import TiedHead
from lightning_hbm.layers.weight_norm import WeightNorm, weight_norm_of
from lightning_hbm.memory.report import plain_file_mode, set_mode
from lightning_hbm.naming import name_list, name_matches, under
from lightning_hbm.precision.registry import format_of, to_dtype
from lightning_hbm.surgery.record import as_built


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights of ``module`` (adapters + ``modules_to_save``), under their own names.

    Tied parameters appear under every name, as in ``module.state_dict()``.
    """
    return {n: p.detach() for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}

is_quantized = variants.is_quantized  # its home: variants needs it, and export imports variants


def _hf_root(module: nn.Module, submodule: Optional[str]) -> str:
    if submodule is not None:
        try:
            module.get_submodule(submodule)
        except AttributeError as err:
            raise ValueError(f"submodule={submodule!r} is not a submodule of {type(module).__name__}.") from err
        return submodule
    # the outermost Hugging Face model inside the LightningModule: peft's format is relative to it
    found = [n for n, m in module.named_modules() if hasattr(getattr(m, "config", None), "model_type")]
    outer = [n for n in found if not any(under(n, [o]) and n != o for o in found)]
    if len(outer) > 1:
        raise ValueError(f"{type(module).__name__} holds several Hugging Face models {outer}: pass submodule=NAME.")
    return outer[0] if outer else ""

def save_adapter(
    module: nn.Module,
    path: Union[str, Path],
    submodule: Optional[str] = None,
    base_model_name_or_path: Optional[str] = None,
    with_correction: bool = False,
) -> Path:
    """Write the adapter in peft's format (``adapter_config.json`` + ``adapter_model.safetensors``).

    Names are made relative to ``submodule`` (default: the Hugging Face model inside ``module``,
    e.g. ``model`` of :class:`~lightning_hbm.models.LlamaLM`; the module itself if there is
    none), so ``peft.PeftModel.from_pretrained(base, path)`` loads it onto that base model.
    ``adapter_config.json`` gets ``target_modules`` as short names (``["q_proj", "v_proj"]``) when
    they select exactly the adapted layers (else the full names), ``modules_to_save`` (the fully trained
    modules, task heads included, whose weights are in the file), ``task_type`` from what the model is
    (``"SEQ_CLS"`` for a ``...ForSequenceClassification``, ``"CAUSAL_LM"``, ``"TOKEN_CLS"``, ...:
    :func:`lightning_hbm.layers.task_type`) and ``base_model_name_or_path`` (default: the folder the model
    was loaded from, ``config._name_or_path``), so ``peft.AutoPeftModelForCausalLM.from_pretrained(path)``
    finds the base by itself. A task head left out of the adapter (frozen, so a reload gets the base's own,
    possibly random head) is warned about. Each file is written atomically into the folder (:func:`write_folder`:
    the folder's other files, links and mode are left alone), a manifest last: :func:`check_adapter_folder` refuses
    a folder whose save did not complete. Returns ``path``.

    The calibrated correction of ``QuantizedPrecision(correction_rank=r)`` (frozen factors ``L = B_c A_c`` beside each
    quantized layer) is **left out** by default: the adapter is the one for the full-precision base, where the
    original weights stand in for ``Q + L`` (said in one line when the model carries corrections).
    ``with_correction=True`` writes the adapter for the plain quantized base instead (the same mode quantized again,
    without ``correction_rank``): each corrected layer's correction is folded into its adapter, ``lora_A`` =
    ``[A; A_c]`` and ``lora_B`` = ``[B, B_c / scaling]`` at rank ``r_lora + r`` with ``alpha`` keeping the scaling
    (``rank_pattern``/``alpha_pattern``), so ``scaling * B A + B_c A_c`` is computed as before; a corrected layer
    without an adapter gets one holding the correction alone. Not for DoRA (its magnitudes depend on the norm of the
    whole update: a ``ValueError``).
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        # was: "" wrote the adapter into the working directory (an unset variable, say), None a TypeError from pathlib
        raise ValueError(
            f"LoRA.save_adapter(path={path!r}): give the folder to write the adapter into, e.g. "
            "'checkpoints/adapter' (it is created). Nothing was written."
        )
    config = getattr(module, "peft_config", {}).get(ADAPTER_NAME)
    if config is None:
        raise ValueError(
            f"{type(module).__name__} has no LoRA adapter: train it with the LoRA callback (or call "
            "LoRA(...).transform_model(module)) before save_adapter."
        )
    root = _hf_root(module, submodule)
    prefix = root + "." if root else ""
    lora_cls: type[Any] = _lora_layer_cls()  # peft's LoraLayer, a mixin of the nn.Module layers it finds
    adapted: dict[str, nn.Module]
    adapted, tensors, saved = {}, {}, set()
    for name, sub in module.named_modules():
        if isinstance(sub, lora_cls) and name.startswith(prefix):
            adapted[name[len(prefix) :]] = sub
    for name, param in adapter_state_dict(module).items():
        if not name.startswith(prefix):
            raise ValueError(f"Trainable parameter {name!r} lies outside submodule {root!r}; pass submodule=''.")
        rel = name[len(prefix) :]
        trained_bias = config.bias != "none" and rel.endswith(".bias")  # peft's bias="all"/"lora_only": saved as is
        if ".lora_" not in rel and not trained_bias:
            # a parametrized weight's factors (weight_norm's ...parametrizations.weight.original0) belong to their layer
            saved.add(re.sub(r"\.parametrizations\.[^.]+$", "", rel.rsplit(".", 1)[0]))
        # peft's file format drops the adapter name: ...q_proj.lora_A.weight, and DoRA's ...q_proj.lora_magnitude_vector
        key = "base_model.model." + rel.replace(f".{ADAPTER_NAME}.", ".")
        key = key[: -len(".weight")] if key.endswith(".lora_magnitude_vector.weight") else key
        tensors[key] = param.contiguous().cpu()
    hf_model = module.get_submodule(root) if root else module
    _warn_unsaved_heads(hf_model, saved, list(adapted))
    _warn_weight_deltas(adapted)
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(getattr(hf_model, "config", None), "_name_or_path", None) or None
    ranks, alphas = variants.export_patterns(adapted, ADAPTER_NAME, config.r, config.lora_alpha)
    targets = list(adapted)
    if with_correction:
        targets += _fold_corrections(module, prefix, adapted, tensors, config, ranks, alphas)
    elif any(correction_of(sub) is not None for sub in module.modules()):
        rank_zero_info(
            "LoRA.save_adapter: the calibrated corrections (QuantizedPrecision(correction_rank=...)) are not in the "
            "adapter: it is the one for the full-precision base. save_adapter(..., with_correction=True) folds them in, "
            "for the plain quantized base."
        )
    export = dataclasses.replace(
        config,
        target_modules=_compact_targets(hf_model, targets),
        rank_pattern=ranks,
        alpha_pattern=alphas,
        modules_to_save=sorted(saved) or None,
        inference_mode=True,
        base_model_name_or_path=base_model_name_or_path,
        task_type=task_type(hf_model) or config.task_type,
    )

    def write(folder: Path) -> None:
        export.save_pretrained(str(folder))
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})

    path = Path(path)
    write_folder(path, write)
    return path


def _fold_corrections(
    module: nn.Module,
    prefix: str,
    adapted: dict[str, nn.Module],
    tensors: dict[str, torch.Tensor],
    config: Any,
    ranks: dict[str, int],
    alphas: dict[str, float],
) -> list[str]:
    """``save_adapter(with_correction=True)``: fold each layer's calibrated correction into the exported adapter
    (``tensors``, ``ranks``, ``alphas`` changed in place; see :func:`save_adapter`). Returns the corrected layers that
    had no adapter (new targets, names relative to the exported model)."""
    if config.use_dora:
        raise ValueError(
            "LoRA.save_adapter(with_correction=True): a DoRA adapter's magnitudes depend on the norm of its whole "
            "update, so the calibrated correction cannot be folded into it. Save without with_correction (the adapter "
            "for the full-precision base), or merge: LoRA.merge(model) includes the correction."
        )
    added: list[str] = []
    for name, sub in module.named_modules():
        correction = correction_of(sub)
        if correction is None or not name.startswith(prefix):
            continue
        rel = name[len(prefix) :].removesuffix(".base_layer")  # under peft's wrapper when the layer is adapted
        lora = adapted.get(rel)
        key = "base_model.model." + rel
        right, left = correction.right.detach().float().cpu(), correction.left.detach().float().cpu()
        if lora is None:
            rank, scaling, dtype = correction.rank, 1.0, torch.float32
            tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"] = right, left
            added.append(rel)
        else:
            rank = int(cast(dict[str, int], lora.r)[ADAPTER_NAME]) + correction.rank  # peft's per-adapter dicts
            scaling = float(cast(dict[str, float], lora.scaling)[ADAPTER_NAME])
            dtype = tensors[key + ".lora_A.weight"].dtype
            a, b = tensors[key + ".lora_A.weight"].float(), tensors[key + ".lora_B.weight"].float()
            tensors[key + ".lora_A.weight"] = torch.cat([a, right]).to(dtype).contiguous()
            tensors[key + ".lora_B.weight"] = torch.cat([b, left / scaling], dim=1).to(dtype).contiguous()
        ranks[re.escape(rel)] = rank
        alphas[re.escape(rel)] = scaling * (math.sqrt(rank) if config.use_rslora else rank)  # peft: alpha / r (/ sqrt r)
    return added


def _warn_unsaved_heads(hf_model: nn.Module, saved: set[str], adapted: list[str]) -> None:
    """A task head not trained in full is not in the adapter: a reload gets the base's own head (an adapter on it too)."""
    lost = [h for h in task_heads(hf_model) if not under(h, sorted(saved))]
    if lost:
        adapted_too = [h for h in lost if any(under(a, [h]) for a in adapted)]
        rank_zero_warn(
            f"LoRA.save_adapter: the task head(s) {lost} of {type(hf_model).__name__} are not in the adapter (frozen"
            + (f"; only the LoRA update of {adapted_too} is" if adapted_too else "")
            + "): a reload onto a base checkpoint gets that checkpoint's own head, randomly initialised when it has "
            "none (a classifier), so its outputs differ from this model's. Train them with LoRA() (the default "
            f"modules_to_save) or LoRA(modules_to_save={lost}), or save the whole model."
        )


def _warn_weight_deltas(adapted: dict[str, nn.Module]) -> None:
    """A convolution adapted by a delta of its weight (``weight_delta.py``: its own forward, a dilation, a padding mode
    other than zeros) computes ``conv(x, W + scaling * B @ A)``; plain peft, loading the file, computes its term
    ``lora_B(lora_A(x))`` instead: another function (a shape error for a dilated one). Said by name, with the ways
    that give the trained function (session 32: was silent, the reloaded model's outputs differed by up to 1e23)."""
    names = [name for name, layer in adapted.items() if isinstance(torch_compat.forward_override(layer), WeightDeltaForward)]
    if names:
        rank_zero_warn(
            f"LoRA.save_adapter: {len(names)} convolution(s) {name_list(names)} are adapted by a low-rank delta of their "
            "weight (their own forward, a dilation or a padding mode other than zeros runs on W + scaling * B @ A); "
            "plain peft (PeftModel.from_pretrained) computes lora_B(lora_A(x)) for them instead, another function, or a "
            "shape error. For the trained function: LoRA.merge(model) (the delta added to the weights, a plain state "
            "dict), or LoRA(...).transform_model(base) with lightning_hbm before loading this adapter's weights."
        )


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


@torch.no_grad()
def merge(
    module: nn.Module,
    dtype: str = "bfloat16",
    base_state_dict: Optional[dict[str, torch.Tensor]] = None,
    allow_base_change: bool = False,
) -> dict[str, torch.Tensor]:
    """A plain state_dict of the model as the user built it, adapters folded into the weights.

    The LoRA update ``B @ A * alpha / r`` is added in fp32 to a base weight (DoRA: ``m / ||W + BA|| * (W + BA)``,
    peft's own norm) and the result is cast to
    ``dtype`` (bf16 by default); ``module`` itself is not changed. Which base weight:

    - ``base_state_dict`` given (the original full-precision weights, e.g.
      ``AutoModelForCausalLM.from_pretrained(path).state_dict()``, keys relative to the Hugging Face
      model or to ``module``): the update goes onto them, and quantized layers without an adapter
      come back exactly. Use this after QLoRA: the adapters were trained to correct the 4-bit base,
      but on SmolLM2 the fp32 base + adapter beats the 4-bit one (held-out loss 2.064 vs 2.143). They must
      be the weights the adapters were trained on: compared with the fingerprints the surgery took of the
      model as built, a differing frozen weight (another checkpoint, another seed) is a ``ValueError`` naming
      the first differing keys, before anything is merged; ``allow_base_change=True`` merges onto them anyway.
    - not given: a quantized base is dequantized (by its precision format's ``dequantize``)
      and its 4-bit rounding error is baked into the merged weights (a warning says so). Never
      re-quantized. A layer's calibrated correction (``QuantizedPrecision(correction_rank=...)``) is added to its
      dequantized weight (it is part of the base the adapters trained on); onto ``base_state_dict`` it is left out
      (the original weights stand in for the quantized weight plus its correction).

    A layer under ``weight_norm`` (Wav2Vec2 / HuBERT's positional convolution; quantized, its weight_norm was folded
    into one weight) comes back as the factors the model as built holds (``parametrizations.weight.original0`` /
    ``original1``, or ``weight_g`` / ``weight_v``): ``v`` the merged weight, ``g`` its norm, so the model's weight_norm
    computes the merged weight; from ``base_state_dict`` its weight is computed from the factors given there.
    """
    out_dtype = to_dtype(dtype)
    lora_cls: type[Any] = _lora_layer_cls()  # peft's LoraLayer, a mixin of the nn.Module layers it finds
    init = getattr(getattr(module, "peft_config", {}).get(ADAPTER_NAME), "init_lora_weights", True)
    if base_state_dict is not None and init in variants.REWRITES_BASE:
        raise ValueError(
            f"LoRA.merge(base_state_dict=...): the adapters were initialised with init_lora_weights={init!r}, which "
            "rewrote the base to W - B0 A0 (B0 A0: the initial adapters), so they belong on that residual, not on the "
            "original weights given. Call LoRA.merge(model) without base_state_dict: it merges onto the residual base "
            "the model holds."
        )
    root = _hf_root(module, None) if base_state_dict is not None else ""
    if base_state_dict is not None and not allow_base_change:
        _check_base(module, base_state_dict, root)
    dequantized: list[str] = []

    def original(name: str, key: str, layer: nn.Module) -> torch.Tensor:
        """The full-precision ``key`` of layer ``name`` from ``base_state_dict``."""
        rel = name[len(root) + 1 :] if root and name.startswith(root + ".") else None
        tensor = cast(dict[str, torch.Tensor], base_state_dict).get(f"{name}.{key}")  # called only with a base_state_dict
        if tensor is None and rel is not None:
            tensor = cast(dict[str, torch.Tensor], base_state_dict).get(f"{rel}.{key}")
        if tensor is None:
            raise ValueError(
                f"base_state_dict has no {name}.{key}" + (f" (nor {rel}.{key})" if rel else "")
                + ": pass the state_dict of the original model (keys relative to it or to the LightningModule)."
            )
        shape = (layer.out_features, layer.in_features) if key == "weight" and hasattr(layer, "out_features") else None
        if shape is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"base_state_dict[{name}.{key}] has shape {tuple(tensor.shape)}, the layer {shape}.")
        return tensor.float()

    def dense(name: str, layer: nn.Module) -> torch.Tensor:
        fmt = format_of(layer)
        if fmt is None and stored_in(layer) is None:
            return _eval_weight(layer)
        if base_state_dict is not None:
            norm = _weight_norm(layer)
            if norm is None:
                return original(name, "weight", layer)
            return norm.weight(original(name, norm.g, layer), original(name, norm.v, layer))  # a folded weight_norm's
        dequantized.append(name)
        if fmt is None:  # a quantized convolution: its weight reads back dequantized, in the conv's shape
            return cast(torch.Tensor, layer.weight).float()
        weight = fmt.dequantize(layer, torch.float32).float()  # e.g. int8 values times their per-row scales
        correction = correction_weight(layer)  # QuantizedPrecision(correction_rank=...): part of the base trained on
        return weight if correction is None else weight + correction.to(weight.device)

    merged: dict[str, torch.Tensor] = {}
    done: list[str] = []
    for name, sub in module.named_modules():
        if under(name, done):
            continue
        prefix = name + "." if name else ""
        if isinstance(sub, lora_cls):
            base = sub.get_base_layer()
            weight = dense(name, base)
            if ADAPTER_NAME in sub.lora_A:
                weight = variants.merged_weight(sub, ADAPTER_NAME, weight)  # W + delta; DoRA's rescaled direction
            merged.update(_as_built_weight(prefix, base, weight))
            if getattr(base, "bias", None) is not None:
                merged[prefix + "bias"] = base.bias
            done.append(name)
            continue
        if format_of(sub) is not None or stored_in(sub) is not None:
            merged.update(_as_built_weight(prefix, sub, dense(name, sub)))
            if getattr(sub, "bias", None) is not None:  # an embedding stored quantized has none
                merged[prefix + "bias"] = sub.bias
            done.append(name)
            continue
        for pname, param in sub._parameters.items():
            if param is not None:
                merged[prefix + pname] = param
        for bname, buf in sub._buffers.items():
            if buf is not None and bname not in sub._non_persistent_buffers_set:
                merged[prefix + bname] = buf
    merged.update(_tied_head_weights(module, merged))
    if dequantized:
        rank_zero_warn(
            f"LoRA.merge: {len(dequantized)} layer(s) merged into their DEQUANTIZED base weights "
            f"({name_list(dequantized)}): the quantization error is baked into the merged model. Pass "
            "base_state_dict=<the original full-precision state_dict> to merge onto the original weights instead."
        )
    elif base_state_dict is not None:
        rank_zero_info("LoRA.merge: adapters merged onto the original full-precision weights (base_state_dict).")
    return {k: v.detach().to(out_dtype) if v.is_floating_point() else v.detach().clone() for k, v in merged.items()}


def _tied_head_weights(module: nn.Module, merged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{head.weight: the merged embedding's weight}`` of each head tied to a quantized embedding (:class:`TiedHead`,
    which holds no weight of its own): the merged state_dict has both keys, as the tied model as built does."""
    names = {id(sub): name for name, sub in module.named_modules()}
    tied = {}
    for name, sub in module.named_modules():
        embedding = sub.__dict__.get("embedding") if isinstance(sub, TiedHead) else None
        key = f"{names.get(id(embedding), '')}.weight".lstrip(".")
        if embedding is not None and key in merged:
            tied[f"{name}.weight"] = merged[key]
    return tied


def _weight_norm(layer: nn.Module) -> Optional[WeightNorm]:
    """The weight_norm ``layer``'s weight comes from in the model as built: folded into a quantized convolution
    (which keeps it: ``layers/conv.py``), or still computing it (an unquantized layer), else ``None``."""
    folded = getattr(layer, "weight_norm", None)
    return folded if isinstance(folded, WeightNorm) else weight_norm_of(layer)


def _as_built_weight(prefix: str, layer: nn.Module, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` (merged) under the keys the model as built holds it: a weight_norm's factors ``g`` and ``v``, which
    its weight_norm computes back into ``weight`` (was: one ``weight`` key the model as built does not have, so a
    strict load failed and a non-strict one kept the random or old factors), else ``weight``."""
    norm = _weight_norm(layer)
    if norm is not None:
        return {prefix + key: tensor for key, tensor in norm.factors(weight).items()}
    if torch.nn.utils.parametrize.is_parametrized(layer, "weight"):
        return {prefix + key: tensor for key, tensor in _parametrized_factors(prefix[:-1], layer, weight).items()}
    return {prefix + "weight": weight}


def _eval_weight(layer: nn.Module) -> torch.Tensor:
    """``layer.weight`` as the model computes it in eval mode, without changing ``layer``: a parametrization runs on a
    copy (spectral_norm's power iteration advances its ``u``, ``v`` at each read in training mode)."""
    if not torch.nn.utils.parametrize.is_parametrized(layer, "weight"):
        return cast(torch.Tensor, layer.weight).float()
    return cast(torch.Tensor, copy.deepcopy(layer).eval().weight).float()


def _parametrized_factors(name: str, layer: nn.Module, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` (merged) as the state of ``layer``'s parametrization (``parametrizations.weight.original`` and the
    parametrizations' own tensors, local keys), found by its ``right_inverse`` and proven by computing the weight
    back from it (eval mode, on a copy).

    Raises:
        ValueError: the parametrization cannot compute ``weight`` (spectral_norm divides any weight by its largest
            singular value, orthogonal gives orthogonal weights only, a symmetric one symmetric weights: a LoRA update
            leaves their range), naming the layer and the fixes; raised before anything is merged.
    """
    built = copy.deepcopy(layer).eval()
    listed = cast(Any, built).parametrizations.weight
    kinds = [type(p).__name__ for p in listed]
    # the first parametrization's input: ``original``, or ``original0``, ``original1``... where its right_inverse gives
    # several tensors (a weight_norm first in a chain: a raw AttributeError "no attribute 'original'" was raised)
    original = cast(torch.Tensor, listed.original if hasattr(listed, "original") else listed.original0)
    error = "its right_inverse failed"
    try:
        with torch.no_grad():
            setattr(built, "weight", weight.to(original.dtype))  # torch calls right_inverse, last first
        back = cast(torch.Tensor, built.weight).float()
        error = f"it computes a weight {float((back - weight).norm() / weight.norm()):.2e} (relative) away from it"
        if torch.allclose(back, weight, rtol=1e-5, atol=1e-6 * float(weight.abs().max())):
            return dict(built.state_dict())
    except Exception as err:  # noqa: BLE001 - a user's right_inverse may raise anything: said in the refusal, as a ValueError
        error = f"its right_inverse failed ({type(err).__name__}: {(str(err).splitlines() or [''])[0]})"  # one line
    raise ValueError(
        f"LoRA.merge: the weight of {name} is computed by the parametrization(s) {kinds}, and its merged weight is "
        f"not one they compute: set as the parametrization's input (right_inverse), {error}. Nothing was merged. "
        f"Load the adapter onto the model as built instead (LoRA.save_adapter, then peft.PeftModel.from_pretrained: "
        f"peft adapts the parametrized layer), or leave the layer out of the adapters (LoRA(exclude_modules=[{name!r}])), "
        f"or remove the parametrization before training "
        f"(torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight')) so the merged weight is a plain one."
    )


def _check_base(module: nn.Module, base_state_dict: dict[str, torch.Tensor], root: str) -> None:
    """Refuse ``base_state_dict`` if a frozen weight differs from the model as built (fingerprints of the surgery)."""
    record = as_built(module)
    if not record:  # adapters injected without the surgery (LoRA().transform_model): nothing was recorded
        return
    prints = record["fingerprints"]
    trained = set(adapter_state_dict(module))  # modules_to_save: their as-built weights are not the base
    differing: list[str]
    unsure: list[str]
    differing, unsure, compared = [], [], 0
    for key, tensor in base_state_dict.items():
        full = key if key in prints else f"{root}.{key}" if root and f"{root}.{key}" in prints else None
        if full is None or full in trained or prints[full] is None or not isinstance(tensor, torch.Tensor):
            continue
        if tuple(tensor.shape) != tuple(record["schema"][full][0]):
            continue  # another shape: merge's own error names the layer and both shapes
        compared += 1
        # the same weights in another float dtype (an fp32 copy of a bf16-built model) are the same base
        dtypes = [tensor.dtype] + ([torch.float32, torch.bfloat16, torch.float16] if tensor.is_floating_point() else [])
        if not any(resume.fingerprint(tensor.to(d)) == prints[full] for d in dict.fromkeys(dtypes)):
            # a half-precision copy of an fp32-built model lost bits: it cannot be told apart from another base
            (unsure if tensor.dtype in (torch.bfloat16, torch.float16) else differing).append(full)
    if unsure and not differing:
        rank_zero_warn(
            f"LoRA.merge: {len(unsure)} of the {compared} frozen weights of base_state_dict (first {unsure[:3]}) are "
            "half precision (bfloat16/float16) and could not be checked against "
            "the base the adapters were trained on. Pass the weights in the dtype the model was built in to check them."
        )
    if differing:
        raise ValueError(
            f"LoRA.merge: base_state_dict is not the base these adapters were trained on: {len(differing)} of its "
            f"{compared} frozen weights differ from the model as built, first {differing[:5]}. Nothing was merged. "
            "Pass the state_dict of the model you trained on (the same checkpoint and seed), or "
            "merge(..., allow_base_change=True) to merge onto other weights on purpose."
        )


def _compact_targets(model: nn.Module, adapted: list[str]) -> list[str]:
    """Short names (``["k_proj", "q_proj"]``) if they select exactly ``adapted`` in the plain model, else the full names."""
    lora_cls = _lora_layer_cls()
    layers = [n for n, m in model.named_modules() if isinstance(m, lora_cls)]
    # the module names of the plain model peft will match against: no lora_A/base_layer internals
    plain = [n for n, _ in model.named_modules() if n and not any(n != l and under(n, [l]) for l in layers)]
    short = sorted({n.rpartition(".")[2] for n in adapted})
    if sorted(n for n in plain if name_matches(n, short)) == sorted(adapted):
        return short
    return sorted(adapted)
