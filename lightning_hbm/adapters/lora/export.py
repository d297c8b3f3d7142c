"""A trained LoRA out of the model: its weights and peft's adapter format (the folder written by :mod:`.folder`; the
merged plain state_dict: :mod:`.merge`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Optional, Union, cast

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from safetensors.torch import save_file
from torch import nn

from lightning_hbm import resume
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.adapters.lora import variants
from lightning_hbm.adapters.lora.base import ADAPTER_NAME, adapted_layers, adapter_state_dict, full_tensor, hf_root, is_sharded
from lightning_hbm.adapters.lora.folder import MANIFEST, check_adapter_folder, write_folder
from lightning_hbm.adapters.lora.merge import merge
from lightning_hbm.adapters.lora.quantized_base import BASE_RECORD, base_record
from lightning_hbm.adapters.lora.weight_delta import WeightDeltaForward
from lightning_hbm.layers import task_heads, task_type
from lightning_hbm.layers.correction import correction_of
from lightning_hbm.layers.embedding import QuantizedEmbedding, TiedHead
from lightning_hbm.naming import name_list, name_matches, under
from lightning_hbm.surgery.record import as_built

is_quantized = variants.is_quantized  # its home: variants needs it, and export imports variants


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
    whole update: a ``ValueError``). That adapter fits the run's quantized weights only (the corrections were fitted
    to them): the folder gets :data:`~.quantized_base.BASE_RECORD` (each quantized layer's mode, rounding, correction
    rank and a fingerprint of its storage), and ``LoRA.check_quantized_base(base, path)`` refuses, before loading, a
    base quantized otherwise (another probe batch, bitsandbytes' own rounding, another block size).

    A model sharded by ``QuantizedFSDPStrategy`` (FSDP2: its adapters, corrections and packed weights are DTensor shards)
    is read whole: call ``save_adapter`` on **every** rank (after ``trainer.fit``, as the script runs on each), each
    gathers the same tensors in the same order, and rank 0 alone writes the folder, the one a single device writes of
    the same weights (the quantized-base record fingerprints the whole rounded storage); the other ranks write nothing
    and return once it is written, and a failure on rank 0 raises on every rank. Called on rank 0 only, it waits for
    the others (the collectives' timeout).
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
    root = hf_root(module, submodule)
    prefix = root + "." if root else ""
    adapted = {name[len(prefix) :]: sub for name, sub in adapted_layers(module).items() if name.startswith(prefix)}
    tensors, saved = _peft_tensors(module, root, config.bias)
    hf_model = module.get_submodule(root) if root else module
    saved |= _trained_statistics(module, root, hf_model, saved, tensors)
    _warn_unsaved_heads(hf_model, saved, list(adapted))
    _warn_weight_deltas(adapted)
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(getattr(hf_model, "config", None), "_name_or_path", None) or None
    ranks, alphas = variants.export_patterns(adapted, ADAPTER_NAME, config.r, config.lora_alpha)
    targets = list(adapted) + _corrections(module, prefix, adapted, tensors, config, ranks, alphas, with_correction)
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

    base = base_record(hf_model) if with_correction else None  # what the base must be (quantized_base.py)

    def write(folder: Path) -> None:
        export.save_pretrained(str(folder))
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        if base is not None:
            (folder / BASE_RECORD).write_text(json.dumps(base, indent=1))

    path = Path(path)
    if is_sharded(module):  # FSDP2: every rank gathered the tensors above, rank 0 writes
        _write_on_rank_zero(path, write)
    else:
        write_folder(path, write)
    return path


def _write_on_rank_zero(path: Path, write: Callable[[Path], Any]) -> None:
    """A sharded model's folder: rank 0 writes it, every rank learns how that went (one broadcast, so no rank waits
    on another that failed); a failure on rank 0 raises on every rank. Was (session 39): every rank raised on the
    sharded tensors, nothing written."""
    import torch.distributed as dist

    failure: Optional[Exception] = None
    if dist.get_rank() == 0:
        try:
            write_folder(path, write)
        except Exception as err:
            failure = err
    said: list[Optional[str]] = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    dist.broadcast_object_list(said, src=0)
    if failure is not None:
        raise failure
    if said[0] is not None:
        raise RuntimeError(
            f"LoRA.save_adapter: rank 0 could not write the adapter into {path} ({said[0]}). Under a sharded run rank 0 "
            f"alone writes it (this is rank {dist.get_rank()}): fix the cause there and save again, on every rank."
        )


def _peft_tensors(module: nn.Module, root: str, bias: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The trained tensors of ``module`` under peft's file keys (relative to the model ``root``), and the modules
    trained in full (peft's ``modules_to_save``)."""
    prefix = root + "." if root else ""
    tensors: dict[str, torch.Tensor] = {}
    saved: set[str] = set()
    storages: set[int] = set()
    for name, param in adapter_state_dict(module).items():
        if not name.startswith(prefix):
            raise ValueError(f"Trainable parameter {name!r} lies outside submodule {root!r}; pass submodule=''.")
        rel = name[len(prefix) :]
        trained_bias = bias != "none" and rel.endswith(".bias")  # peft's bias="all"/"lora_only": saved as is
        if ".lora_" not in rel and not trained_bias:
            # a parametrized weight's factors (weight_norm's ...parametrizations.weight.original0) belong to their layer
            saved.add(re.sub(r"\.parametrizations\.[^.]+$", "", rel.rsplit(".", 1)[0]))
        # peft's file format drops the adapter name: ...q_proj.lora_A.weight, and DoRA's ...q_proj.lora_magnitude_vector
        key = "base_model.model." + rel.replace(f".{ADAPTER_NAME}.", ".")
        key = key[: -len(".weight")] if key.endswith(".lora_magnitude_vector.weight") else key
        tensor = full_tensor(param).contiguous().cpu()  # FSDP2's shard: the whole tensor (every rank gathers)
        # a tied weight trained in full (modules_to_save=["lm_head"] of a tie_word_embeddings model trains the
        # embedding too) is under both names: each its own copy, as safetensors refuses shared memory (it raised
        # after the fit, nothing saved); peft loads both modules, the same trained weight
        tensors[key] = tensor.clone() if tensor.untyped_storage().data_ptr() in storages else tensor
        storages.add(tensor.untyped_storage().data_ptr())
    return tensors, saved


def _trained_statistics(module: nn.Module, root: str, hf_model: nn.Module, saved: set[str], tensors: dict[str, torch.Tensor]) -> set[str]:
    """Add to ``tensors`` the persistent buffers of the modules trained in full (peft's own file holds a
    ``modules_to_save`` module's whole state_dict: a BatchNorm's running statistics), and the whole state of each
    normalization whose running statistics training updated (``num_batches_tracked`` differs from the model as built),
    which become ``modules_to_save``: returned, and said. Without them the folder held no statistic, and a base loading
    it normalised with its own (session 37: a transformers ResNet trained 3 steps reloaded by peft, logits off by 2.5
    on a scale of 1.5; equal with them)."""
    record = as_built(module)
    prints = record["fingerprints"] if record else {}
    prefix = root + "." if root else ""
    updated = set()
    for name, sub in hf_model.named_modules():
        tracked = getattr(sub, "num_batches_tracked", None)
        key = f"{prefix}{name}.num_batches_tracked"
        # a BatchNorm's, an InstanceNorm's with track_running_stats (timm's BatchNormAct2d, SyncBatchNorm alike)
        if not isinstance(tracked, torch.Tensor) or not isinstance(getattr(sub, "running_mean", None), torch.Tensor):
            continue
        if prints.get(key) not in (None, resume.fingerprint(tracked)):
            updated.add(name)
    added = sorted(name for name in updated if not under(name, sorted(saved)))
    for name in sorted(saved | updated):
        sub = hf_model.get_submodule(name)
        persistent = sub.state_dict(keep_vars=True)
        state = persistent if name in added else {k: b for k, b in sub.named_buffers() if k in persistent}
        for key, value in state.items():
            whole = full_tensor(value.detach())  # a normalization's weight sharded by FSDP2: every rank gathers
            tensors.setdefault(f"base_model.model.{name}.{key}", whole.contiguous().cpu().clone())
    if added:
        rank_zero_info(
            f"LoRA.save_adapter: the running statistics of {len(added)} normalization layer(s) ({name_list(added)}) "
            "were updated by training: saved with the adapter as modules_to_save, so a base loading it normalises as "
            "the trained model does."
        )
    return set(added)


def _corrections(
    module: nn.Module,
    prefix: str,
    adapted: dict[str, nn.Module],
    tensors: dict[str, torch.Tensor],
    config: Any,
    ranks: dict[str, int],
    alphas: dict[str, float],
    with_correction: bool,
) -> list[str]:
    """``with_correction=True``: the calibrated corrections folded in (:func:`_fold_corrections`); else said to be left
    out when the model carries any. Returns the new targets (corrected layers without an adapter)."""
    if with_correction:
        return _fold_corrections(module, prefix, adapted, tensors, config, ranks, alphas)
    if any(correction_of(sub) is not None for sub in module.modules()):
        rank_zero_info(
            "LoRA.save_adapter: the calibrated corrections (QuantizedPrecision(correction_rank=...)) are not in the "
            "adapter: it is the one for the full-precision base. save_adapter(..., with_correction=True) folds them in, "
            "for the plain quantized base."
        )
    return []


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
    tied = {id(head.__dict__["embedding"]): head_name for head_name, head in module.named_modules() if isinstance(head, TiedHead)}
    left_out: dict[str, str] = {}
    for name, sub in module.named_modules():
        correction = correction_of(sub)
        if correction is None or not name.startswith(prefix):
            continue
        rel = name[len(prefix) :].removesuffix(".base_layer")  # under peft's wrapper when the layer is adapted
        lora = adapted.get(rel)
        key = "base_model.model." + rel
        right = full_tensor(correction.right.detach()).float().cpu()  # FSDP2: sharded like the weight
        left = full_tensor(correction.left.detach()).float().cpu()
        if isinstance(sub, QuantizedEmbedding):
            if id(sub) in tied:  # a peft reload's tied head multiplies with the base table, never with peft's delta
                left_out[rel] = tied[id(sub)]
                continue
            # peft's embedding LoRA: delta = (B A)^T with A [r, vocab], B [dim, r], so A = L^T and B = R^T
            tensors[key + ".lora_embedding_A"], tensors[key + ".lora_embedding_B"] = left.t().contiguous(), right.t().contiguous()
            ranks[re.escape(rel)], alphas[re.escape(rel)] = correction.rank, float(correction.rank)  # scaling 1
            added.append(rel)
            continue
        if isinstance(sub, torch_compat.ConvNd):  # a convolution's [r, in x kernel] and [out, r] as peft's conv LoRA:
            # a rank-r convolution with the layer's kernel, then a 1x1 one (lightning_hbm.precision.conv_correction)
            right = right.reshape(right.shape[0], -1, *sub.kernel_size)
            left = left.reshape(*left.shape, *(1,) * len(sub.kernel_size))
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
    if left_out:
        rank_zero_warn(
            f"LoRA.save_adapter(with_correction=True): the calibrated correction of the input embedding(s) "
            f"{name_list(list(left_out))} is left out of the adapter: their head(s) {name_list(list(left_out.values()))} "
            "share the table (tied), and a peft reload's tied head multiplies with the base's table, never with an "
            "adapter's embedding delta, so the adapter would give the lookup one table and the head another. The adapter "
            "computes the run's model less that correction; LoRA.merge(model) includes it (a merged state_dict)."
        )
    # session 38: a GPTQ run's adapter reloaded onto a nearest-rounded base (bitsandbytes' own) was off by 15 % of the
    # logits' scale, unsaid: the correction is fitted to this run's quantized weight, not to any quantization of W
    rank_zero_info(
        "LoRA.save_adapter(with_correction=True): the adapter is for the base quantized exactly as this run quantized "
        "it (the same mode and layer modes; with rounding='gptq' the same probe_batch, given explicitly): the folded "
        "corrections fit that quantized weight only. Reloaded onto a base quantized otherwise (bitsandbytes' own "
        "nearest rounding of a GPTQ run, another block size) it computes other outputs: "
        "LoRA.check_quantized_base(base, path) refuses such a base before loading (the folder records the run's "
        f"quantized base in {BASE_RECORD}). Save without with_correction for the full-precision base."
    )
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



def _compact_targets(model: nn.Module, adapted: list[str]) -> list[str]:
    """Short names (``["k_proj", "q_proj"]``) if they select exactly ``adapted`` in the plain model, else the full names."""
    layers = list(adapted_layers(model))
    # the module names of the plain model peft will match against: no lora_A/base_layer internals
    plain = [n for n, _ in model.named_modules() if n and not any(n != l and under(n, [l]) for l in layers)]
    short = sorted({n.rpartition(".")[2] for n in adapted})
    if sorted(n for n in plain if name_matches(n, short)) == sorted(adapted):
        return short
    return sorted(adapted)


# imported from here before session 36, now at home in base.py (adapter_state_dict), folder.py and merge.py
__all__ = ["MANIFEST", "adapter_state_dict", "check_adapter_folder", "is_quantized", "merge", "save_adapter", "write_folder"]
