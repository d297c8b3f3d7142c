"""What each precision mode costs in output quality, and what it saves in weight bytes.

For every mode, the model is quantized at fit start (``Trainer.fit`` with ``max_steps=0``) and
:class:`lightning_hbm.QuantizationQuality` compares its outputs on a fixed probe batch with the
full-precision (fp32) model's: cosine similarity, relative error, KL divergence (language model),
worst/mean weight SQNR. Weight bytes are the exact storage of the Linear weights (quantization
constants included) per weight parameter. ``--time`` adds the forward+backward time of each
mode as a ratio to the unquantized model in the compute dtype, Linear weights frozen in both (same
process, same inputs).

Models:

* ``llama``: the test ``LlamaLM`` (transformers Llama, random weights), on byte-level text.
* ``onet``: MTCNN's ONet with its real pretrained weights, which the ``facenet-pytorch`` wheel
  ships inside the package (nothing downloaded at run time). Only its weights are read (the
  package's own import needs torchvision): ``pip install --no-deps facenet-pytorch==2.6.0``.
  Its Linear layers (1152x256 and three heads) are small, but they hold trained weights with
  trained outliers, which random Gaussian weights do not have. Inputs: smooth random 48x48
  images (no image data set is available offline), normalized as MTCNN does.

Run::

    python benchmarks/quantization_quality.py                      # CPU, both models
    python benchmarks/quantization_quality.py --device cuda --time # GPU (int8-dynamic uses torch._int_mm)
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import time
import warnings
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hbm import QuantizationQuality, QuantizedPrecision, quantize_model
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.memory import module_parameter_tensors, unique_bytes
from lightning_hbm.models import LlamaLM

MODES = ["none", "int8-dynamic", "int8", "nf4-dq", "nf4", "fp4"]


class ONet(nn.Module):
    """MTCNN's output network (facenet-pytorch's layer names, so its state_dict loads as is)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.prelu1 = nn.Conv2d(3, 32, 3), nn.PReLU(32)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2, self.prelu2 = nn.Conv2d(32, 64, 3), nn.PReLU(64)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3, self.prelu3 = nn.Conv2d(64, 64, 3), nn.PReLU(64)
        self.pool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv4, self.prelu4 = nn.Conv2d(64, 128, 2), nn.PReLU(128)
        self.dense5, self.prelu5 = nn.Linear(1152, 256), nn.PReLU(256)
        self.dense6_1, self.dense6_2, self.dense6_3 = nn.Linear(256, 2), nn.Linear(256, 4), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.pool3(self.prelu3(self.conv3(x)))
        x = self.prelu4(self.conv4(x))
        x = self.prelu5(self.dense5(x.permute(0, 3, 2, 1).contiguous().view(x.shape[0], -1)))
        # face logits, box regression, landmarks: one output row per image
        return torch.cat([self.dense6_1(x), self.dense6_2(x), self.dense6_3(x)], dim=1)


class ONetModule(pl.LightningModule):
    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.net = ONet()
        self.net.load_state_dict(weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def onet_weights() -> Optional[dict[str, torch.Tensor]]:
    spec = importlib.util.find_spec("facenet_pytorch")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "onet.pt")
    return torch.load(path, map_location="cpu", weights_only=True)


def smooth_images(n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 6, 6, generator=generator) * 255
    images = F.interpolate(low, size=(48, 48), mode="bilinear", align_corners=False)
    return (images - 127.5) * 0.0078125  # MTCNN's normalization


def weight_bytes_per_param(model: nn.Module, names: list[str]) -> float:
    tensors, count = [], 0
    for name in names:
        layer = model.get_submodule(name)
        # the weight with its quantization constants, wherever the layer keeps them (not the bias)
        tensors += [t for t in module_parameter_tensors(layer) if t is not layer.bias]
        count += layer.in_features * layer.out_features
    return unique_bytes(tensors) / count


def quality(
    make: Callable[[], pl.LightningModule], mode: str, dtype: str, device: str, data: Any, probe: Optional[Any]
) -> tuple[dict[str, float], float]:
    model = make()
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    callback = QuantizationQuality(probe_batch=probe, probe_samples=64 if probe is not None else 4, on_validation=False)
    precision: Any = QuantizedPrecision(mode, dtype=dtype) if mode != "none" else {"bfloat16": "bf16-true", "float32": "32-true"}[dtype]
    trainer_kwargs = dict(plugins=[precision]) if mode != "none" else dict(precision=precision)
    trainer = pl.Trainer(
        accelerator=device, devices=1, max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[callback], **trainer_kwargs,
    )
    if isinstance(data, DataLoader):
        trainer.fit(model, data)
    else:
        trainer.fit(model, datamodule=data)
    return callback.metrics, weight_bytes_per_param(model, names)


def step_time_ratio(make: Callable[[], pl.LightningModule], mode: str, dtype: str, device: str, batch: Any, reps: int) -> float:
    """Forward+backward time of ``mode`` / time of the unquantized model in ``dtype`` (same process).

    Both have frozen Linear weights (no weight gradients), everything else trainable.
    """

    def run(quantize: Optional[str]) -> float:
        model = make().to(device)
        if quantize is not None:
            quantize_model(model, quantize, dtype, device=device)
        else:
            # the same trainable set as the quantized model: Linear weights frozen (QLoRA vs LoRA-on-bf16)
            model.to(getattr(torch, dtype))
            for layer in model.modules():
                if type(layer) is nn.Linear:
                    layer.weight.requires_grad_(False)
        inputs = batch.to(device)
        if inputs.is_floating_point():
            inputs = inputs.to(getattr(torch, dtype)).requires_grad_()

        def step() -> None:
            model(inputs).float().square().mean().backward()

        step()  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps

    return run(mode) / run(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama", "onet"], choices=["llama", "onet"])
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--hidden", type=int, default=256, help="Llama hidden size (intermediate = 2.6875 x hidden)")
    parser.add_argument("--time", action="store_true", help="also report forward+backward time vs unquantized")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: stable ratios on a shared machine)")
    args = parser.parse_args()
    if args.device == "cpu":
        # On a busy 2-core machine, 2 OpenMP threads spin-wait: elementwise ops became ~50x slower
        # in our runs, which swamps any ratio. One thread gives ratios that repeat.
        torch.set_num_threads(args.threads)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("lightning_hbm").setLevel(logging.ERROR)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    cases: list[tuple[str, Callable[[], pl.LightningModule], Any, Optional[Any], torch.Tensor]] = []
    if "llama" in args.models:
        hidden = args.hidden

        def make_llama() -> pl.LightningModule:
            torch.manual_seed(0)
            return LlamaLM(hidden_size=hidden, intermediate_size=int(hidden * 2.6875), num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2)

        datamodule = ByteTextDataModule(seq_len=128, batch_size=4, train_samples=16, max_bytes=300_000)
        tokens = datamodule.example_batch()[0]
        cases.append((f"LlamaLM (random, hidden={hidden}, 4 layers)", make_llama, datamodule, None, tokens))
    if "onet" in args.models:
        weights = onet_weights()
        if weights is None:
            print("onet: skipped, facenet-pytorch is not installed (pip install --no-deps facenet-pytorch==2.6.0)")
        else:
            images = smooth_images(64)
            cases.append(("MTCNN ONet (pretrained, facenet-pytorch 2.6.0)", lambda: ONetModule(weights), DataLoader(TensorDataset(images), batch_size=8), (images,), images))

    threads = f" threads={torch.get_num_threads()}" if args.device == "cpu" else ""
    print(f"device={args.device}{threads} compute dtype={args.dtype} torch={torch.__version__}; reference: the fp32 model")
    for title, make, data, probe, batch in cases:
        print(f"\n{title}")
        header = f"{'mode':<14}{'cosine':>10}{'rel. error':>12}{'KL':>11}{'SQNR min dB':>13}{'W bytes/param':>15}"
        print(header + (f"{'time vs ' + args.dtype:>18}" if args.time else ""))
        for mode in args.modes:
            metrics, bytes_per_param = quality(make, mode, args.dtype, args.device, data, probe)
            kl = metrics.get("quant/kl_divergence")
            row = (
                f"{mode:<14}{metrics['quant/cosine_similarity']:>10.5f}{metrics['quant/relative_error']:>12.4f}"
                f"{(f'{kl:.2e}' if kl is not None else '-'):>11}{metrics.get('quant/weight_sqnr_db_min', float('nan')):>13.1f}"
                f"{bytes_per_param:>15.3f}"
            )
            if args.time and mode != "none":
                row += f"{step_time_ratio(make, mode, args.dtype, args.device, batch, args.reps):>18.2f}"
            print(row)


if __name__ == "__main__":
    main()
