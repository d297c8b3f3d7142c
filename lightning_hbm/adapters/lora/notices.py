"""What ``LoRA`` tells when it has adapted a model: the layers 'all-linear' left out (narrower than r, output heads)
and the task heads trained in full or left frozen, by name, at fit start and in the coverage table."""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_hbm.adapters.lora.config import LoRAConfig
from lightning_hbm.layers import find_layers
from lightning_hbm.naming import under
from lightning_hbm.record import leave_alone, left_alone


def tell_left_out(module: nn.Module, r: int, narrow: list[str], heads_left_out: list[str]) -> None:
    """Name the layers 'all-linear' left out (narrower than r, output heads), in the coverage table and at fit start."""
    for name in narrow:
        layer = module.get_submodule(name)
        if left_alone(layer) is None:  # the coverage table's reason when nothing else changed it
            leave_alone(layer, f"narrower than LoRA r={r}: left out of 'all-linear'", True)
    for name in heads_left_out:
        layer = module.get_submodule(name)
        if left_alone(layer) is None:  # no QuantizedPrecision reason: say why LoRA left it
            leave_alone(layer, "output head: left out of LoRA 'all-linear' (name it in target_modules to adapt it)", True)
    if narrow:
        # an adapter of rank r on a layer narrower than r costs more than the layer itself: train it in full
        rank_zero_info(
            f"lightning_hbm: LoRA r={r} leaves out {len(narrow)} layer(s) narrower than r "
            f"(target_modules='all-linear'): {narrow[:6]}{' ...' if len(narrow) > 6 else ''}; they stay frozen. "
            f"To train them, train them in full (fewer parameters than an adapter of rank r): "
            f"LoRA(modules_to_save={narrow[:6]}); exclude_modules=[...] leaves them out without this line."
        )
    if heads_left_out:  # named: a head left frozen and un-adapted is the biggest silent change to a loss
        rank_zero_info(
            f"lightning_hbm: LoRA target_modules='all-linear' leaves out the output head(s) {heads_left_out} "
            f"(frozen, not adapted, as peft does). To train: LoRA(modules_to_save={heads_left_out}), or name "
            "them in target_modules to adapt them."
        )


def tell_heads(
    module: nn.Module, config: LoRAConfig, task_heads: list[str], heads_quantized: list[str], saved_modules: list[str]
) -> None:
    """Name the task heads trained in full, and warn about ones left frozen (a random head never trains)."""
    for name in saved_modules:
        for _, layer, _ in find_layers(module.get_submodule(name)):
            if left_alone(layer) is None:  # the coverage table: trained, not "frozen"
                leave_alone(layer, f"LoRA modules_to_save ({name}): trained in full precision", True)
    trained = [h for h in task_heads if under(h, saved_modules)]
    if trained and config.modules_to_save is None:
        rank_zero_info(
            f"lightning_hbm: LoRA trains the task head(s) {trained} in full precision (modules_to_save, saved with "
            "the adapter; QuantizedPrecision leaves them unquantized). LoRA(modules_to_save=[]) keeps them frozen; "
            "LoRA(modules_to_save=[...]) chooses the modules yourself."
        )
    if heads_quantized:
        rank_zero_warn(
            f"lightning_hbm: the task head(s) {heads_quantized} of {type(module).__name__} were quantized before "
            "lightning_hbm and cannot be trained: they stay frozen. Load the model without quantizing them (or "
            "QuantizedPrecision(ignore_modules=[...])) to train them."
        )
    # an adapter on a random head is no fix: a reload onto a base checkpoint gets another random head under it
    frozen = [h for h in task_heads if h not in heads_quantized and not under(h, saved_modules)]
    if frozen:
        rank_zero_warn(
            f"lightning_hbm: LoRA(modules_to_save={config.argument('modules_to_save')!r}) leaves the task head(s) {frozen} of "
            f"{type(module).__name__} frozen (at most adapted) and out of the adapter: a newly initialised head stays "
            "random, and a reload gets another random one. Add them: "
            f"LoRA(modules_to_save={sorted({*(config.modules_to_save or ()), *frozen})}), or leave modules_to_save unset."
        )
