"""The output of a BatchNorm conv net as it will train, against the model as built, on the probe batch (issue 53).

A 4-bit mode plans its convolutions on the probe (:mod:`lightning_hbm.precision.sensitivity`) and says what it could
not reach. Every other mode stored them without a measure: ``QuantizedPrecision("int8")`` computing in bfloat16 gave a
MobileNetV3-FPN backbone (BatchNorm statistics calibrated, ``tests/layers/conv_models.py``) a probe output cosine of
0.9585 / 0.968 (two seeds) against the float32 model, under the library's stated 0.98, and nothing said so. Here the
model as built runs the probe once before the surgery (:meth:`OutputCheck.measure`) and the model as it will train
(quantized, adapters in, in the plugin's forward context, on its device) once after it (:meth:`OutputCheck.warning`):
under :data:`~lightning_hbm.precision.sensitivity.CONV_MIN_COSINE`, a warning naming the figure and the fix.

Only for models with convolutions and BatchNorm layers (where the loss was measured; without BatchNorm a warning on
every model would mostly be noise) and modes without the conv plan. The cosine is the plan's: per output row, the mean
(:func:`~lightning_hbm.probe.compare_outputs`). Cost: two eval forwards of the probe batch at fit start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Optional

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.probe import compare_outputs, eval_no_grad, probe_output

log = logging.getLogger(__name__)


def checked(module: nn.Module, conv_names: Sequence[str]) -> bool:
    """Whether ``module``'s output is measured: it has convolutions among the targets and BatchNorm layers."""
    return bool(conv_names) and any(isinstance(m, torch_compat.BatchNormBase) for m in module.modules())


class OutputCheck:
    """The probe batch and the model as built's output on it, kept from the checks to the moment the model is final."""

    def __init__(self, probe: Any, reference: Tensor, conv_names: Sequence[str]) -> None:
        self.probe, self.reference, self.conv_names = probe, reference, list(conv_names)

    @classmethod
    def measure(cls, module: nn.Module, probe: Any, conv_names: Sequence[str]) -> OutputCheck:
        """The model as built (before any change) on ``probe``, in float32, in eval mode."""
        with eval_no_grad(module):
            return cls(probe, probe_output(module, probe).detach().float().cpu(), conv_names)

    def cosine(self, module: nn.Module, context: Callable[[], AbstractContextManager], convert_input: Callable[[Any], Any]) -> Optional[float]:
        """The final model's probe output cosine against the reference, or ``None`` when its parameters are on several
        devices (a model not yet moved as a whole: nothing measured, logged)."""
        devices = {t.device for t in [*module.parameters(), *module.buffers()]}
        if len(devices) != 1:
            log.info("lightning_hbm: the output check skipped: the model is on %s", sorted(map(str, devices)))
            return None
        batch = move_data_to_device(convert_input(self.probe), next(iter(devices)))
        with eval_no_grad(module), context():
            output = probe_output(module, batch).detach().float().cpu()
        return compare_outputs(output, self.reference, lm=False)["quant/cosine_similarity"]

    def warning(self, cosine: float, mode: str, dtype: torch.dtype, target: float) -> Optional[str]:
        """The fit-start warning for a probe output cosine under ``target``, or ``None``."""
        if cosine >= target:
            return None
        first = ", ".join(repr(n) for n in self.conv_names[:3])
        wide = "dtype='float32', " if dtype != torch.float32 else ""
        return (
            f"lightning_hbm: this BatchNorm conv net, stored in {mode} and computing in {str(dtype).removeprefix('torch.')}, "
            f"gives a probe output cosine of {cosine:.4f} against the model as built, under {target} (mean per output "
            f"row, on the probe batch, before training). With BatchNorm statistics like a trained network's the error of "
            f"each convolution grows through the net, the first ones most. Fix: QuantizedPrecision(..., {wide}"
            f"ignore_modules=[{first}]) (the first convolutions unquantized; on a MobileNetV3-FPN backbone in int8, "
            f"two seeds: 0.9585 / 0.968 in bfloat16 -> 0.9894 / 0.9888, 0.982 / 0.991 on images the probe never saw)."
        )


__all__ = ["OutputCheck", "checked"]
