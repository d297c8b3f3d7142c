"""Quantized convolutions (issue 33): coverage and bytes per parameter of every conv family, and the output cosine.

Models: torchvision's resnet18 and timm's efficientnet_b0 at their real layouts and sizes (hand-written in
``tests/layers/conv_models.py``: neither library imports beside the CPU torch tested here), diffusers'
``UNet2DConditionModel`` (a small config), transformers' Whisper encoder and Wav2Vec2 (small configs). Random weights,
float32 compute. As in a Trainer, one step of the model as built runs first (``lightning_hbm.layers.readers``:
which weights its forward reads directly). Per mode: the share of the conv + linear parameters stored quantized, their
storage bytes per parameter (constants included, exact on CPU), and the cosine of the output against the unquantized
model, centred on the reference's mean (a randomly initialised EfficientNet's outputs are nearly one constant).

    python benchmarks/conv_quantization.py [--modes nf4 nf4-dq int8 int8-dynamic]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import quantize_model
from lightning_hbm.layers import base_layer, coverage, find_layers, readers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_models import EfficientNetB0, ResNet18  # noqa: E402


def unet() -> tuple[nn.Module, Any, Callable[[nn.Module], torch.Tensor]]:
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(64, 128, 256),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=128,
        attention_head_dim=8, norm_num_groups=32,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    batch = {"sample": torch.randn(1, 4, 32, 32, generator=g), "timestep": torch.tensor([50]),
             "encoder_hidden_states": torch.randn(1, 8, 128, generator=g)}
    return model, batch, lambda m: m(**batch).sample


def whisper() -> tuple[nn.Module, Any, Callable[[nn.Module], torch.Tensor]]:
    from transformers import WhisperConfig, WhisperModel

    config = WhisperConfig(d_model=256, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=1024, decoder_ffn_dim=1024, num_mel_bins=80, max_source_positions=100)
    model = WhisperModel(config).encoder
    x = torch.randn(1, 80, 200, generator=torch.Generator().manual_seed(1))
    return model, x, lambda m: m(x).last_hidden_state


def wav2vec2() -> tuple[nn.Module, Any, Callable[[nn.Module], torch.Tensor]]:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    model = Wav2Vec2Model(Wav2Vec2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024))
    x = torch.randn(1, 16000, generator=torch.Generator().manual_seed(1))
    return model, x, lambda m: m(x).last_hidden_state


def image(factory: Callable[[], nn.Module]) -> Callable[[], tuple[nn.Module, Any, Callable[[nn.Module], torch.Tensor]]]:
    def build() -> tuple[nn.Module, Any, Callable[[nn.Module], torch.Tensor]]:
        x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
        return factory(), x, lambda m: m(x)

    return build


FAMILIES: dict[str, Callable[[], tuple[nn.Module, Any, Callable[[nn.Module], Any]]]] = {
    "ResNet18": image(ResNet18), "EfficientNet-B0": image(EfficientNetB0), "diffusers UNet2DCondition": unet,
    "Whisper encoder": whisper, "Wav2Vec2": wav2vec2,
}  # fmt: skip


def measure(name: str, modes: list[str]) -> None:
    torch.manual_seed(0)
    reference, batch, run = FAMILIES[name]()
    reference.eval()
    with torch.no_grad():
        want = run(reference)
    for mode in modes:
        model = copy.deepcopy(reference)
        readers.observe(model, batch, {n: base_layer(layer) for n, layer, _ in find_layers(model)})
        quantize_model(model, mode, dtype="float32")
        rows = {r.kind: r for r in coverage(model, quantizing=True, adapting=False)}
        kinds = [rows[k] for k in ("Conv", "Linear") if k in rows]
        params = sum(r.params for r in kinds)
        conv = rows.get("Conv")
        with torch.no_grad():
            got, mean = run(model).flatten().float(), want.float().mean()
            cosine = F.cosine_similarity(got - mean, want.flatten().float() - mean, dim=0).item()
        print(
            f"| {name} | {mode} | {params:,} | {conv.params if conv else 0:,} | {sum(r.quantized for r in kinds) / params:.1%} "
            f"| {sum(r.bytes for r in kinds) / params:.3f} | {cosine:.5f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["nf4", "nf4-dq", "int8", "int8-dynamic"])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    args = parser.parse_args()
    print("| model | mode | conv + linear params | of which conv | stored quantized | B/param (conv + linear) | output cosine |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.families:
        measure(name, args.modes)


if __name__ == "__main__":
    main()
