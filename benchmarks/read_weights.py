"""Bytes and output cosine of a small Swin-like model whose attention reads its layers' weights directly.

torchvision's ``ShiftedWindowAttention`` passes ``self.qkv.weight`` / ``self.proj.weight`` to a function
(``tests/layers/swin_models.py`` follows its forward path). Before session 22 those layers were kept in the compute
dtype ("weight read directly"); now they are stored in the mode (``lightning_hbm/layers/read_weight.py``). Arms, on the
same seeded model (every Linear but the attention's is quantized in both quantized arms):

- ``fp32``: nothing quantized (the reference of the cosine);
- ``nf4-dq, attention kept (before)``: ``quantize_model`` on the model never observed: the source scan keeps
  ``qkv``/``proj`` in fp32, as the probe's read did before;
- ``nf4-dq, attention stored (now)``: the probe step first (as ``fit`` runs it), then ``quantize_model``.

Printed per arm: parameter bytes (``lightning_hbm.memory.parameter_bytes``: packed weights + constants), the bytes of the
attention's ``qkv``/``proj`` alone, and the cosine of the logits against fp32 on 16 random images.

    OMP_NUM_THREADS=1 python benchmarks/read_weights.py [--dim 96]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))

from swin_models import SmallSwin, batch, read_layers  # noqa: E402

from lightning_hbm import quantize_model  # noqa: E402
from lightning_hbm.layers import base_layer, find_layers, readers  # noqa: E402
from lightning_hbm.memory import parameter_bytes  # noqa: E402


def arm(model: SmallSwin, name: str) -> SmallSwin:
    model = copy.deepcopy(model)
    if name == "fp32":
        return model
    if name.endswith("(now)"):
        readers.observe(model, batch(), {n: base_layer(layer) for n, layer, _ in find_layers(model)})
    quantize_model(model, "nf4-dq", dtype="float32", quantize_head=True)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=96)
    args = parser.parse_args()
    torch.manual_seed(0)
    reference = SmallSwin(dim=args.dim, heads=4)
    images, _ = batch(7, size=16)
    with torch.no_grad():
        want = reference(images)
    print(f"SmallSwin(dim={args.dim}): {sum(p.numel() for p in reference.parameters()):,} parameters, nf4-dq, fp32 compute")
    print("| arm | parameter bytes | qkv/proj bytes | logits cosine vs fp32 |")
    print("|---|---:|---:|---:|")
    for name in ("fp32", "nf4-dq, attention kept (before)", "nf4-dq, attention stored (now)"):
        model = arm(reference, name)
        with torch.no_grad():
            cosine = F.cosine_similarity(model(images).flatten(), want.flatten(), dim=0).item()
        attention = sum(parameter_bytes(model.get_submodule(n)) for n in read_layers(model))
        print(f"| {name} | {parameter_bytes(model):,} | {attention:,} | {cosine:.4f} |")


if __name__ == "__main__":
    main()
