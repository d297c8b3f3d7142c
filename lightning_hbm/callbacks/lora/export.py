"""A trained LoRA out of the model: its weights, peft's adapter format, a merged plain state_dict."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from safetensors.torch import save_file
from torch import nn

from lightning_hbm.callbacks.lora.base import ADAPTER_NAME, _lora_layer_cls, _matches, _under
from lightning_hbm.naming import name_list
from lightning_hbm.precision.registry import format_of, to_dtype


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights of ``module`` (adapters + ``modules_to_save``), under their own names.

    Tied parameters appear under every name, as in ``module.state_dict()``.
    """
    return {n: p.detach() for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}

def _hf_root(module: nn.Module, submodule: Optional[str]) -> str:
    if submodule is not None:
        try:
            module.get_submodule(submodule)
        except AttributeError as err:
            raise ValueError(f"submodule={submodule!r} is not a submodule of {type(module).__name__}.") from err
        return submodule
    # the outermost Hugging Face model inside the LightningModule: peft's format is relative to it
    found = [n for n, m in module.named_modules() if hasattr(getattr(m, "config", None), "model_type")]
    outer = [n for n in found if not any(_under(n, [o]) and n != o for o in found)]
    if len(outer) > 1:
        raise ValueError(f"{type(module).__name__} holds several Hugging Face models {outer}: pass submodule=NAME.")
    return outer[0] if outer else ""

def save_adapter(
    module: nn.Module,
    path: Union[str, Path],
    submodule: Optional[str] = None,
    base_model_name_or_path: Optional[str] = None,
) -> Path:
    """Write the adapter in peft's format (``adapter_config.json`` + ``adapter_model.safetensors``).

    Names are made relative to ``submodule`` (default: the Hugging Face model inside ``module``,
    e.g. ``model`` of :class:`~lightning_hbm.models.LlamaLM`; the module itself if there is
    none), so ``peft.PeftModel.from_pretrained(base, path)`` loads it onto that base model.
    ``adapter_config.json`` gets ``target_modules`` as short names (``["q_proj", "v_proj"]``) when
    they select exactly the adapted layers (else the full names), ``task_type`` ``"CAUSAL_LM"``
    for a ``...ForCausalLM`` model and ``base_model_name_or_path`` (default: the folder the model
    was loaded from, ``config._name_or_path``), so ``peft.AutoPeftModelForCausalLM.from_pretrained(path)``
    finds the base by itself. Returns ``path``.
    """
    config = getattr(module, "peft_config", {}).get(ADAPTER_NAME)
    if config is None:
        raise ValueError(
            f"{type(module).__name__} has no LoRA adapter: train it with the LoRA callback (or call "
            "LoRA(...).transform_model(module)) before save_adapter."
        )
    root = _hf_root(module, submodule)
    prefix = root + "." if root else ""
    lora_cls = _lora_layer_cls()
    adapted, tensors, saved = [], {}, set()
    for name, sub in module.named_modules():
        if isinstance(sub, lora_cls) and name.startswith(prefix):
            adapted.append(name[len(prefix) :])
    for name, param in adapter_state_dict(module).items():
        if not name.startswith(prefix):
            raise ValueError(f"Trainable parameter {name!r} lies outside submodule {root!r}; pass submodule=''.")
        rel = name[len(prefix) :]
        if ".lora_" not in rel:
            saved.add(rel.rsplit(".", 1)[0])
        # peft's file format drops the adapter name: ...q_proj.lora_A.weight
        key = "base_model.model." + rel.replace(f".{ADAPTER_NAME}.", ".")
        tensors[key] = param.contiguous().cpu()
    hf_model = module.get_submodule(root) if root else module
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(getattr(hf_model, "config", None), "_name_or_path", None) or None
    export = dataclasses.replace(
        config,
        target_modules=_compact_targets(hf_model, adapted),
        modules_to_save=sorted(saved) or None,
        inference_mode=True,
        base_model_name_or_path=base_model_name_or_path,
        task_type="CAUSAL_LM" if type(hf_model).__name__.endswith("ForCausalLM") else config.task_type,
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    export.save_pretrained(str(path))
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path

@torch.no_grad()
def merge(
    module: nn.Module,
    dtype: str = "bfloat16",
    base_state_dict: Optional[dict[str, torch.Tensor]] = None,
) -> dict[str, torch.Tensor]:
    """A plain state_dict of the model as the user built it, adapters folded into the weights.

    The LoRA update ``B @ A * alpha / r`` is added in fp32 to a base weight and the result is cast to
    ``dtype`` (bf16 by default); ``module`` itself is not changed. Which base weight:

    - ``base_state_dict`` given (the original full-precision weights, e.g.
      ``AutoModelForCausalLM.from_pretrained(path).state_dict()``, keys relative to the Hugging Face
      model or to ``module``): the update goes onto them, and quantized layers without an adapter
      come back exactly. Use this after QLoRA: the adapters were trained to correct the 4-bit base,
      but on SmolLM2 the fp32 base + adapter beats the 4-bit one (held-out loss 2.064 vs 2.143).
    - not given: a quantized base is dequantized (by its precision format's ``dequantize``)
      and its 4-bit rounding error is baked into the merged weights (a warning says so). Never
      re-quantized.
    """
    out_dtype = to_dtype(dtype)
    lora_cls = _lora_layer_cls()
    root = _hf_root(module, None) if base_state_dict is not None else ""
    dequantized: list[str] = []

    def original(name: str, key: str, layer: nn.Module) -> torch.Tensor:
        """The full-precision ``key`` of layer ``name`` from ``base_state_dict``."""
        rel = name[len(root) + 1 :] if root and name.startswith(root + ".") else None
        tensor = base_state_dict.get(f"{name}.{key}")
        if tensor is None and rel is not None:
            tensor = base_state_dict.get(f"{rel}.{key}")
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
        if fmt is None:
            return layer.weight.float()
        if base_state_dict is not None:
            return original(name, "weight", layer)
        dequantized.append(name)
        return fmt.dequantize(layer).float()  # e.g. int8 values times their per-row scales

    merged: dict[str, torch.Tensor] = {}
    done: list[str] = []
    for name, sub in module.named_modules():
        if _under(name, done):
            continue
        prefix = name + "." if name else ""
        if isinstance(sub, lora_cls):
            base = sub.get_base_layer()
            weight = dense(name, base)
            if ADAPTER_NAME in sub.lora_A:
                weight = weight + sub.get_delta_weight(ADAPTER_NAME).float()
            merged[prefix + "weight"] = weight
            if getattr(base, "bias", None) is not None:
                merged[prefix + "bias"] = base.bias
            done.append(name)
            continue
        if format_of(sub) is not None:
            merged[prefix + "weight"] = dense(name, sub)
            if sub.bias is not None:
                merged[prefix + "bias"] = sub.bias
            done.append(name)
            continue
        for pname, param in sub._parameters.items():
            if param is not None:
                merged[prefix + pname] = param
        for bname, buf in sub._buffers.items():
            if buf is not None and bname not in sub._non_persistent_buffers_set:
                merged[prefix + bname] = buf
    if dequantized:
        rank_zero_warn(
            f"LoRA.merge: {len(dequantized)} layer(s) merged into their DEQUANTIZED base weights "
            f"({name_list(dequantized)}): the quantization error is baked into the merged model. Pass "
            "base_state_dict=<the original full-precision state_dict> to merge onto the original weights instead."
        )
    elif base_state_dict is not None:
        rank_zero_info("LoRA.merge: adapters merged onto the original full-precision weights (base_state_dict).")
    return {k: v.detach().to(out_dtype) if v.is_floating_point() else v.detach().clone() for k, v in merged.items()}


def _compact_targets(model: nn.Module, adapted: list[str]) -> list[str]:
    """Short names (``["k_proj", "q_proj"]``) if they select exactly ``adapted`` in the plain model, else the full names."""
    lora_cls = _lora_layer_cls()
    layers = [n for n, m in model.named_modules() if isinstance(m, lora_cls)]
    # the module names of the plain model peft will match against: no lora_A/base_layer internals
    plain = [n for n, _ in model.named_modules() if n and not any(n != l and _under(n, [l]) for l in layers)]
    short = sorted({n.rpartition(".")[2] for n in adapted})
    if sorted(n for n in plain if _matches(n, short)) == sorted(adapted):
        return short
    return sorted(adapted)
