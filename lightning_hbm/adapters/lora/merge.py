"""``LoRA.merge``: a plain state_dict of the model as the user built it, the adapters folded into its weights.

One merge in steps: the base it may merge onto is checked (:func:`_check_merge_base`), each layer's tensors are
computed (:func:`_layer_tensors`: its base weight from :class:`_BaseWeights`, plus its adapter's update, under the
keys the model as built holds), the other modules' own tensors copied, heads tied to a quantized embedding added, and
what was dequantized said (:func:`_tell_merged`).
"""

from __future__ import annotations

import copy
from typing import Any, Optional, cast

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_hbm import resume
from lightning_hbm.adapters.lora import variants
from lightning_hbm.adapters.lora.base import ADAPTER_NAME, adapted_layers, adapter_state_dict, gathered, hf_root, is_sharded
from lightning_hbm.layers import base_layer, is_adapted, stored_in
from lightning_hbm.layers.correction import correction_weight
from lightning_hbm.layers.embedding import TiedHead
from lightning_hbm.layers.weight_norm import WeightNorm, weight_norm_of
from lightning_hbm.naming import name_list, under
from lightning_hbm.precision.registry import format_of, to_dtype
from lightning_hbm.surgery.record import as_built


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

    A model sharded by ``QuantizedFSDPStrategy`` (FSDP2) is merged whole: call ``merge`` on every rank (a collective:
    each rank gathers the whole model, as it held it before sharding, for the merge); each gets the merged state_dict
    (save it from rank 0). Before session 40 it raised (bitsandbytes' dequantize on a DTensor shard).
    """
    sharded = is_sharded(module)
    with gathered(module):  # FSDP2: the whole model on every rank meanwhile; nothing otherwise
        merged = _merged(module, dtype, base_state_dict, allow_base_change)
        # a tensor of the model's own (a norm's weight in the merged dtype) must outlive the gathered storage
        return {k: v.clone() for k, v in merged.items()} if sharded else merged


def _merged(
    module: nn.Module, dtype: str, base_state_dict: Optional[dict[str, torch.Tensor]], allow_base_change: bool
) -> dict[str, torch.Tensor]:
    """:func:`merge` on a model whose tensors are whole."""
    out_dtype = to_dtype(dtype)
    root = _check_merge_base(module, base_state_dict, allow_base_change)
    weights = _BaseWeights(base_state_dict, root)
    merged: dict[str, torch.Tensor] = {}
    done: list[str] = []  # the layers merged: their submodules (a peft layer's base_layer, lora_A, ...) are in them
    for name, sub in module.named_modules():
        if under(name, done):
            continue
        prefix = name + "." if name else ""
        if is_adapted(sub) or format_of(sub) is not None or stored_in(sub) is not None:
            merged.update(_layer_tensors(prefix, name, sub, weights))
            done.append(name)
        else:
            merged.update(_own_tensors(prefix, sub))
    merged.update(_tied_head_weights(module, merged))
    _tell_merged(weights)
    _warn_tied_apart(module, merged)
    return {k: v.detach().to(out_dtype) if v.is_floating_point() else v.detach().clone() for k, v in merged.items()}


def _check_merge_base(module: nn.Module, base_state_dict: Optional[dict[str, torch.Tensor]], allow_base_change: bool) -> str:
    """Refuse a ``base_state_dict`` the adapters do not belong on, before anything is merged; returns the name of the
    Hugging Face model its keys may be relative to (``""`` without a ``base_state_dict``)."""
    if base_state_dict is None:
        return ""
    init = getattr(getattr(module, "peft_config", {}).get(ADAPTER_NAME), "init_lora_weights", True)
    if init in variants.REWRITES_BASE:
        raise ValueError(
            f"LoRA.merge(base_state_dict=...): the adapters were initialised with init_lora_weights={init!r}, which "
            "rewrote the base to W - B0 A0 (B0 A0: the initial adapters), so they belong on that residual, not on the "
            "original weights given. Call LoRA.merge(model) without base_state_dict: it merges onto the residual base "
            "the model holds."
        )
    try:
        root = hf_root(module, None)
    except ValueError:  # several Hugging Face models with adapters (merge takes no submodule=): keys relative to
        root = ""  # ``module``, which name each model's (h10, session 37: refused, naming a submodule= merge has not)
    if not allow_base_change:
        _check_base(module, base_state_dict, root)
    return root


class _BaseWeights:
    """The full-precision base weight of each merged layer: from ``base_state_dict`` when given (keys relative to the
    LightningModule or to the Hugging Face model ``root``), else the model's own, dequantized (named in
    :attr:`dequantized`, for the warning)."""

    def __init__(self, base_state_dict: Optional[dict[str, torch.Tensor]], root: str) -> None:
        self.base_state_dict, self.root = base_state_dict, root
        self.dequantized: list[str] = []

    def original(self, name: str, key: str, layer: nn.Module) -> torch.Tensor:
        """The full-precision ``key`` of layer ``name`` from ``base_state_dict``."""
        root = self.root
        rel = name[len(root) + 1 :] if root and name.startswith(root + ".") else None
        tensor = cast(dict[str, torch.Tensor], self.base_state_dict).get(f"{name}.{key}")  # called only with one
        if tensor is None and rel is not None:
            tensor = cast(dict[str, torch.Tensor], self.base_state_dict).get(f"{rel}.{key}")
        if tensor is None:
            raise ValueError(
                f"base_state_dict has no {name}.{key}" + (f" (nor {rel}.{key})" if rel else "")
                + ": pass the state_dict of the original model (keys relative to it or to the LightningModule)."
            )
        shape = (layer.out_features, layer.in_features) if key == "weight" and hasattr(layer, "out_features") else None
        if shape is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"base_state_dict[{name}.{key}] has shape {tuple(tensor.shape)}, the layer {shape}.")
        return tensor.float()

    def weight(self, name: str, layer: nn.Module) -> torch.Tensor:
        """The fp32 base weight of ``layer`` (named ``name``: the peft layer's name for an adapted one)."""
        fmt = format_of(layer)
        if fmt is None and stored_in(layer) is None:
            return _eval_weight(layer)
        if self.base_state_dict is not None:
            norm = _weight_norm(layer)
            if norm is None:
                return self.original(name, "weight", layer)
            return norm.weight(self.original(name, norm.g, layer), self.original(name, norm.v, layer))  # a folded weight_norm's
        self.dequantized.append(name)
        if fmt is None:  # a quantized convolution: its weight reads back dequantized, in the conv's shape
            return cast(torch.Tensor, layer.weight).float()
        weight = fmt.dequantize(layer, torch.float32).float()  # e.g. int8 values times their per-row scales
        correction = correction_weight(layer)  # QuantizedPrecision(correction_rank=...): part of the base trained on
        return weight if correction is None else weight + correction.to(weight.device)


def _layer_tensors(prefix: str, name: str, layer: nn.Module, weights: _BaseWeights) -> dict[str, torch.Tensor]:
    """The merged tensors of one layer (adapted, quantized or stored elsewhere): its base weight plus its adapter's
    update (``W + delta``; DoRA's rescaled direction), under the keys the model as built holds, and its bias."""
    base = base_layer(layer)  # a peft LoRA layer's base layer, else the layer itself
    weight = weights.weight(name, base)
    if is_adapted(layer) and ADAPTER_NAME in cast(Any, layer).lora_A:
        weight = variants.merged_weight(layer, ADAPTER_NAME, weight)
    tensors = _as_built_weight(prefix, base, weight)
    if getattr(base, "bias", None) is not None:  # an embedding stored quantized has none
        tensors[prefix + "bias"] = cast(torch.Tensor, base.bias)
    return tensors


def _own_tensors(prefix: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers ``module`` holds itself (not its submodules'), as its state_dict keys."""
    tensors = {prefix + n: p for n, p in module._parameters.items() if p is not None}
    persistent = {prefix + n: b for n, b in module._buffers.items() if b is not None and n not in module._non_persistent_buffers_set}
    return {**tensors, **persistent}


def _tell_merged(weights: _BaseWeights) -> None:
    """Say onto which base the adapters were merged: dequantized weights (warned: the quantization error is baked in),
    or the original ones given."""
    if weights.dequantized:
        rank_zero_warn(
            f"LoRA.merge: {len(weights.dequantized)} layer(s) merged into their DEQUANTIZED base weights "
            f"({name_list(weights.dequantized)}): the quantization error is baked into the merged model. Pass "
            "base_state_dict=<the original full-precision state_dict> to merge onto the original weights instead."
        )
    elif weights.base_state_dict is not None:
        rank_zero_info("LoRA.merge: adapters merged onto the original full-precision weights (base_state_dict).")


def _warn_tied_apart(module: nn.Module, merged: dict[str, torch.Tensor]) -> None:
    """Warn where an adapted layer's base weight is tied to another module's (``lm_head`` named as a target of a
    ``tie_word_embeddings`` model: its adapter trained the head, not the embedding) and the merged values differ: a
    model built with the weights tied holds one of the two (``load_state_dict`` copies both into the one tensor, the
    last wins), so its outputs are not the adapted model's (session 37: logits off by 0.64 on a tiny Llama, silently;
    peft's own merge warns)."""
    holders: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(name)
    apart = []
    for name, layer in adapted_layers(module).items():
        weight = getattr(base_layer(layer), "weight", None)
        others = [n for n in holders.get(id(weight), []) if not under(n, [name]) and n in merged]
        key = f"{name}.weight"
        apart += [f"{key} and {n}" for n in others if key in merged and not torch.equal(merged[key], merged[n])]
    if apart:
        rank_zero_warn(
            f"LoRA.merge: {'; '.join(apart)} share one tied weight in the model as built, and the adapter makes them "
            "differ in the merged state_dict: a model built with them tied (tie_word_embeddings=True) holds one of the "
            "two after load_state_dict, and computes another model than the adapted one. Load the merged state_dict "
            "into the model with its weights untied (from_pretrained(..., tie_word_embeddings=False)), or leave the "
            "tied layer out of target_modules."
        )


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

