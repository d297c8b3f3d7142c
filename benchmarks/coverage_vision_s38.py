"""Coverage round three (issue 53, session 38): vision, detection and diffusion classes nobody here tried, each from
a tiny config, under the library's default (``QuantizedPrecision()``: nf4-dq, bf16 compute; ``LoRA()``;
``ActivationCheckpointing()``), BatchNorm statistics calibrated on smooth images (``tests/layers/conv_models.calibrate``).

Per model: (1) 2 training steps through the Trainer; (2) a run resumed from the step-1 checkpoint against the straight
run: the step-2 loss and every adapter, bit for bit; (3) the fit-start output check (min_cosine 0.98: its figure, warned
or quiet) and the coverage table's layers left wide with their reasons; (4) ``plan()`` with the very plugin and
callbacks against torch's MemTracker (``memtracker_peak``), its fallbacks named.

    PYTHONPATH=.:/tmp/h2site OMP_NUM_THREADS=1 python benchmarks/coverage_vision_s38.py [--models NAME ...]

(torchvision 0.28 and timm in a throw-away folder: ``pip install --target /tmp/h2site --no-deps torchvision==0.28.0
timm``; ``torchvision::nms`` is defined first, as ``conv_check_heldout.py --schema-shim`` does, with a Python kernel
for the detectors that call it in training.)
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

if "--no-shim" not in sys.argv:  # before lightning: torchmetrics imports torchvision where it is installed
    _SHIM = torch.library.Library("torchvision", "DEF")
    for _op in ("nms", "qnms"):
        _SHIM.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

    def _nms(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
        order, keep = scores.argsort(descending=True), []
        boxes = dets.float()
        area = (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)
        alive = torch.ones(len(boxes), dtype=torch.bool)
        for i in order.tolist():
            if not alive[i]:
                continue
            keep.append(i)
            lt, rb = torch.maximum(boxes[i, :2], boxes[:, :2]), torch.minimum(boxes[i, 2:], boxes[:, 2:])
            inter = (rb - lt).clamp(min=0).prod(1)
            alive &= inter / (area[i] + area - inter).clamp(min=1e-9) <= iou_threshold
        return torch.tensor(keep, dtype=torch.long)

    _SHIM.impl("nms", _nms, "CPU")

import lightning.pytorch as pl  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision, coverage_of  # noqa: E402
from lightning_hbm.data import ResumableDataLoader  # noqa: E402
from lightning_hbm.planner import plan  # noqa: E402
from lightning_hbm.planner.reference import memtracker_peak  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_models import images  # noqa: E402

CLASSES = 10


class Spec:
    """A model: how to build it, a batch of it (seeded), its forward on the batch's inputs (a tuple batch: its first
    element, as ``lightning_hbm.probe.forward_on`` calls ``forward``) and its loss on the batch."""

    def __init__(self, build: Callable[[], nn.Module], batch: Callable[[int], Any], forward: Callable[[nn.Module, Any], Any],
                 loss: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        self.build, self.batch, self.forward, self.loss = build, batch, forward, loss


def _mean_square(out: Any) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().square().mean() for t in leaves)  # type: ignore[return-value]


def classifier(build: Callable[[], nn.Module], size: int = 64) -> Spec:
    def batch(seed: int) -> Any:
        return images(4, seed=seed, size=size), torch.randint(0, CLASSES, (4,), generator=torch.Generator().manual_seed(seed))

    def loss(model: nn.Module, b: Any) -> torch.Tensor:
        out = model(b[0])
        outs = out if isinstance(out, tuple) else (out,)  # DeiT distilled in training: (head, distillation head)
        return sum(F.cross_entropy(o.float(), b[1]) for o in outs)  # type: ignore[return-value]

    return Spec(build, batch, lambda m, x: m(x), loss)


def dense(build: Callable[[], nn.Module], shape: tuple[int, ...] = (4, 3, 64, 64), call: Callable[[nn.Module, torch.Tensor], Any] | None = None) -> Spec:
    call = call or (lambda m, x: m(x))

    def batch(seed: int) -> Any:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        return images(shape[0], seed=seed, size=shape[-1]) if len(shape) == 4 and shape[1] == 3 else x

    return Spec(build, batch, call, lambda m, b: _mean_square(call(m, b)))


def detector(build: Callable[[], nn.Module], size: int = 64) -> Spec:
    def batch(seed: int) -> Any:
        g = torch.Generator().manual_seed(seed)
        xs = images(2, seed=seed, size=size)
        targets = []
        for _ in range(2):
            lo = torch.rand(3, 2, generator=g) * size * 0.5
            boxes = torch.cat([lo, lo + 8 + torch.rand(3, 2, generator=g) * size * 0.4], 1).round()
            target = {"boxes": boxes, "labels": torch.randint(1, 3, (3,), generator=g)}
            if getattr(build, "keypoints", False):
                target["keypoints"] = torch.cat([boxes[:, None, :2] + 4, torch.ones(3, 1, 1)], 2).expand(3, 17, 3).clone()
            targets.append(target)
        return list(xs), targets

    def loss(model: nn.Module, b: Any) -> torch.Tensor:
        return sum(model(b[0], b[1]).values())  # type: ignore[return-value]

    return Spec(build, batch, lambda m, x: m(x), loss)


class Net(pl.LightningModule):
    def __init__(self, spec: Spec, calibrated: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.spec, self.model = spec, spec.build()
        if calibrated and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.model.modules()):
            with torch.no_grad():
                self.model.train()
                norms = [m for m in self.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
                for n in norms:
                    n.reset_running_stats()
                    n.momentum = None
                for s in range(4):
                    b = spec.batch(10 + s)
                    spec.loss(self.model, b) if isinstance(b, tuple) and isinstance(b[0], list) else spec.forward(self.model, b[0] if isinstance(b, tuple) else b)
                for n in norms:
                    n.momentum = 0.1
        self.model.train()

    def forward(self, inputs: Any) -> Any:
        return self.spec.forward(self.model, inputs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.spec.loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        torch.manual_seed(trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def default_callbacks() -> list[Any]:
    return [LoRA(), ActivationCheckpointing()]


def fit(spec: Spec, root: Path, ckpt: Any = None) -> tuple[Net, Recorder, QuantizedPrecision, list[str]]:
    net, recorder, plugin = Net(spec), Recorder(), QuantizedPrecision()
    saver = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=-1, enable_version_counter=False)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root, plugins=[plugin],
                         callbacks=[*default_callbacks(), recorder, saver])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(net, ResumableDataLoader([spec.batch(1), spec.batch(2)], batch_size=None), ckpt_path=ckpt)  # resumes mid-epoch
    return net, recorder, plugin, [str(w.message) for w in caught if "lightning_hbm" in (w.filename or "") or "lightning_hbm" in str(w.message) or "QuantizedPrecision" in str(w.message)]


def adapters(net: Net) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items() if ".lora_" in k}


def run(name: str, spec: Spec, root: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name}
    started = time.perf_counter()
    try:
        net, rec, plugin, said = fit(spec, root / "straight")
        row["trains"] = f"yes ({rec.losses[0]:.3g} -> {rec.losses[1]:.3g})" if len(rec.losses) == 2 and all(map(math.isfinite, rec.losses)) else f"no: {rec.losses}"
        measured = plugin.quantization.conv_accuracy
        row["cosine"] = "-" if measured is None else f"{measured.cosine:.4f}{' warned' if measured.warned else ''}"
        row["warnings"] = said
        wide = []
        for r in coverage_of(net) or []:
            for reason, n in r.reasons.items():
                wide.append(f"{r.kind}: {n:,} ({reason})")
        row["wide"] = wide
        try:
            again, rec2, _, _ = fit(spec, root / "resumed", ckpt=root / "straight" / "step=1.ckpt")
            a, b = adapters(net), adapters(again)
            exact = rec2.losses == rec.losses[1:] and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
            row["resume"] = "bit-exact" if exact else f"differs: {rec2.losses} vs {rec.losses[1:]}"
        except Exception as err:  # noqa: BLE001
            row["resume"] = f"fails: {type(err).__name__}: {str(err)[:300]}"
            traceback.print_exc()
    except Exception as err:  # noqa: BLE001
        row["trains"] = f"fails: {type(err).__name__}: {str(err)[:400]}"
        traceback.print_exc()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            planned = plan(lambda: Net(spec, calibrated=False), spec.batch(1), plugin=QuantizedPrecision(), callbacks=default_callbacks())
        if planned.failures:
            row["plan"] = f"fails: {planned.failures[0]}"[:400]
        else:
            chosen = planned.chosen
            measured_peak = memtracker_peak(lambda: Net(spec, calibrated=False), spec.batch(1), chosen.candidate)
            row["plan"] = f"{100 * (chosen.peak - measured_peak) / measured_peak:+.2f} % ({chosen.peak:,} vs {measured_peak:,})" + (
                f"; fallbacks: {list(chosen.fallbacks)}" if chosen.fallbacks else "")
    except Exception as err:  # noqa: BLE001
        row["plan"] = f"fails: {type(err).__name__}: {str(err)[:400]}"
        traceback.print_exc()
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def models() -> dict[str, Spec]:
    import diffusers as df

    found: dict[str, Spec] = {}
    try:
        import timm
        import torchvision as tv
    except (ImportError, RuntimeError):
        timm = tv = None
    if timm is not None:
        tm = timm.models
        found.update({
            "timm ConvNeXt-V2 atto": classifier(lambda: timm.create_model("convnextv2_atto", num_classes=CLASSES)),
            "timm EfficientFormer": classifier(lambda: tm.efficientformer.EfficientFormer(depths=(1, 1, 1, 1), embed_dims=(16, 32, 48, 64), num_vit=1, num_classes=CLASSES), 224),
            "timm EdgeNeXt xx-small": classifier(lambda: timm.create_model("edgenext_xx_small", num_classes=CLASSES)),
            "timm RepVGG-A0": classifier(lambda: timm.create_model("repvgg_a0", num_classes=CLASSES)),
            "timm MobileOne-S0": classifier(lambda: timm.create_model("mobileone_s0", num_classes=CLASSES)),
            "timm RegNetX-200MF": classifier(lambda: timm.create_model("regnetx_002", num_classes=CLASSES)),
            "timm CoAtNet nano": classifier(lambda: timm.create_model("coatnet_nano_rw_224", img_size=64, num_classes=CLASSES)),
            "timm MaxViT pico": classifier(lambda: timm.create_model("maxvit_pico_rw_256", img_size=64, num_classes=CLASSES)),
            "timm Swin-V2": classifier(lambda: tm.swin_transformer_v2.SwinTransformerV2(img_size=32, patch_size=4, window_size=4, embed_dim=24, depths=(1, 1), num_heads=(2, 4), num_classes=CLASSES), 32),
            "timm EVA": classifier(lambda: tm.eva.Eva(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=CLASSES, use_rot_pos_emb=True, swiglu_mlp=True), 32),
            "timm FastViT-T8": classifier(lambda: timm.create_model("fastvit_t8", num_classes=CLASSES)),
            "timm LeViT": classifier(lambda: tm.levit.Levit(img_size=64, embed_dim=(32, 48, 64), key_dim=16, depth=(1, 1, 1), num_heads=(2, 3, 4), num_classes=CLASSES)),
            "timm DeiT distilled": classifier(lambda: tm.deit.VisionTransformerDistilled(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=CLASSES), 32),
        })
    if tv is not None:
        det = tv.models.detection

        def small(cls: Any, **kw: Any) -> Callable[[], nn.Module]:
            return lambda: cls(weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64, **kw)

        keypoints = lambda: det.keypointrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=2, min_size=64, max_size=64, trainable_backbone_layers=5)  # noqa: E731
        keypoints.keypoints = True  # type: ignore[attr-defined]
        found.update({
            "torchvision RetinaNet (ResNet50-FPN)": detector(small(det.retinanet_resnet50_fpn, trainable_backbone_layers=5)),
            "torchvision FCOS (ResNet50-FPN)": detector(small(det.fcos_resnet50_fpn, trainable_backbone_layers=5)),
            "torchvision SSDlite (MobileNetV3)": detector(lambda: det.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3)),
            "torchvision KeypointRCNN": detector(keypoints),
            "torchvision DeepLabV3 (MobileNetV3)": dense(lambda: tv.models.segmentation.deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3), call=lambda m, x: m(x)["out"]),
            "torchvision RAFT small": dense(lambda: tv.models.optical_flow.raft_small(weights=None, num_flow_updates=2), shape=(2, 3, 64, 64),
                                            call=lambda m, x: m(x, x.flip(-1), num_flow_updates=2)[-1]),
            "torchvision R(2+1)D": dense(lambda: tv.models.video.resnet.VideoResNet(tv.models.video.resnet.BasicBlock, [tv.models.video.resnet.Conv2Plus1D] * 4, [1, 1, 1, 1],
                                                                                  tv.models.video.resnet.R2Plus1dStem, num_classes=CLASSES), shape=(2, 3, 4, 32, 32)),
            "torchvision Swin3D": dense(lambda: tv.models.video.swin_transformer.SwinTransformer3d(patch_size=[2, 4, 4], embed_dim=24, depths=[1, 1], num_heads=[2, 4],
                                                                                                  window_size=[2, 4, 4], num_classes=CLASSES), shape=(2, 3, 4, 32, 32)),
        })
    t = torch.tensor([10, 500])
    found.update({
        "diffusers UNet2DModel": dense(lambda: df.UNet2DModel(sample_size=32, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
                                                              down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D")),
                                       shape=(2, 3, 32, 32), call=lambda m, x: m(x, t).sample),
        "diffusers AutoencoderKL": dense(lambda: df.AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                                                                  latent_channels=4, norm_num_groups=8), shape=(2, 3, 32, 32), call=lambda m, x: m(x).sample),
        "diffusers DiT": dense(lambda: df.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
                                                                patch_size=2, num_embeds_ada_norm=1000, norm_num_groups=8),
                               shape=(2, 4, 8, 8), call=lambda m, x: m(x, timestep=t, class_labels=torch.tensor([1, 2])).sample),
        "diffusers ControlNet": dense(lambda: df.ControlNetModel(block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), layers_per_block=1,
                                                                 cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8, conditioning_embedding_out_channels=(16, 32)),
                                      shape=(2, 4, 16, 16), call=lambda m, x: m(x, t, encoder_hidden_states=x.flatten(2)[:, :, :32].transpose(1, 2)[:, :4, :4].repeat(1, 1, 8),
                                                                                controlnet_cond=F.interpolate(x[:, :3], scale_factor=8)).mid_block_res_sample),
    })
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=[])
    parser.add_argument("--root", default=None, help="where each run's checkpoints go (default: a new temporary folder)")
    parser.add_argument("--no-shim", action="store_true")
    args = parser.parse_args()
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="coverage_vision_"))  # never another run's
    specs = models()
    chosen = [n for n in specs if not args.models or any(m.lower() in n.lower() for m in args.models)]
    for name in chosen:
        row = run(name, specs[name], root / name.replace(" ", "_").replace("/", "_"))
        row["warnings"] = [w[:240] for w in row.get("warnings", [])]
        row["wide"] = [w[:160] for w in row.get("wide", [])]
        print(f"ROW {row}", flush=True)


if __name__ == "__main__":
    main()
