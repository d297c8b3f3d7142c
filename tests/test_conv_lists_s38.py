"""Session 38, h1: the fit-start conv check reads a batch's lists by running the model, not by their shapes (issues 53/55).

``probe_batch.per_sample_images`` takes a list or tuple of rank-3 float tensors of at most 4 leading channels for
per-sample ``C x H x W`` images (torchvision's detection collate). A Conv1d net's ``(x [4, 16, 32], y)`` batch, a list of
``[B, L, D]`` features, read as such: their batches were not joined, the check measured 4 samples, not 32, and counted 1
(the forward's argument tuple read as a list of one image), unwarned. Now the first batch joined with itself as batched
tensors is run through the model's forward (``measures.lists_batched``): kept where the forward takes it as it takes the
batch; per-sample images so joined have twice the channels and the first convolution refuses them (read as images, as
before). Where the check measures fewer samples than it asked of a loader that had more, it warns with the figure.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_hbm.precision.accuracy import CHECK_SAMPLES
from lightning_hbm.precision.measures import lists_batched
from lightning_hbm.probe_batch import doubled, samples
from tests.test_attack_s36 import _Boxes, _Detector, _per_sample, conv_check_of_one_step


class _Conv1dNet(pl.LightningModule):
    """A Conv1d denoiser: ``[B, C, L]`` signals in, the same out, trained against a float target of that shape."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv1d(32, 16, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self(batch[0]) - batch[-1]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class _SequenceConv(_Conv1dNet):
    """A ``[B, L, D]`` sequence model with a depthwise Conv1d mixing along ``L`` (a Conformer's, a Mamba's block)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(24, 24, 3, padding=1, groups=24), nn.Conv1d(24, 24, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.transpose(1, 2)).transpose(1, 2)


def _signals(*shape: int) -> torch.Tensor:
    return torch.randn(64, *shape, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("batch", ["pair", "alone"])
def test_a_conv1d_nets_batches_are_joined_and_measured_to_32_samples(tmp_path: Any, batch: str) -> None:
    """Batches of 4: ``(x [4, 16, 32], y [4, 16, 32])`` and ``[x]`` read as 2 and 1 per-sample images: the check measured
    the first 4 signals and said 1 sample (main: ``samples == 1``)."""
    x = _signals(16, 32)
    data = TensorDataset(x, x + 0.1 * torch.randn_like(x)) if batch == "pair" else TensorDataset(x)
    measured, caught = conv_check_of_one_step(tmp_path, _Conv1dNet, DataLoader(data, batch_size=4))
    assert measured is not None and measured.samples == CHECK_SAMPLES and measured.cosine > 0.99
    assert not [w for w in caught if "samples, not the" in str(w.message)]


def test_a_list_of_sequences_b_l_d_is_joined_and_measured_to_32_samples(tmp_path: Any) -> None:
    measured, caught = conv_check_of_one_step(tmp_path, _SequenceConv, DataLoader(TensorDataset(_signals(16, 24)), batch_size=4))
    assert measured is not None and measured.samples == CHECK_SAMPLES
    assert not [w for w in caught if "samples, not the" in str(w.message)]


class _Images(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(i))


class _ListDetector(_Detector):
    """A forward taking ``list[Tensor[C, H, W]]``, as torchvision's Faster R-CNN, RetinaNet and SSD do."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch).square().mean()


def test_per_sample_images_are_still_read_as_images_and_the_short_check_warns_with_its_figure(tmp_path: Any) -> None:
    """A ``collate_fn=tuple`` batch of 4 images a forward stacks: still 4 samples, not joined along the channels; the
    check measured 4 where it asks 32 of a loader of 40, and says so with its figure (main: said only in ``samples``)."""
    measured, caught = conv_check_of_one_step(tmp_path, _ListDetector, DataLoader(_Images(), batch_size=4, collate_fn=tuple))
    assert measured is not None and measured.samples == 4 and measured.cosine > 0.99 and not measured.warned
    said = [str(w.message) for w in caught if "samples, not the" in str(w.message)]
    assert len(said) == 1, said
    assert f"output cosine {measured.cosine:.4f} on 4 samples, not the {CHECK_SAMPLES}" in said[0]
    assert "per-sample images" in said[0] and "probe_batch=" in said[0]


def test_a_detection_collate_is_still_read_as_images(tmp_path: Any) -> None:
    measured, caught = conv_check_of_one_step(tmp_path, _Detector, DataLoader(_Boxes(), batch_size=4, collate_fn=_per_sample))
    assert measured is not None and measured.samples == 4 and not measured.warned
    assert [w for w in caught if "on 4 samples, not the 32" in str(w.message)]


def test_lists_are_told_apart_by_running_the_forward() -> None:
    signals = [torch.randn(4, 16, 32), torch.randn(4, 16, 32)]
    assert lists_batched(_Conv1dNet(), signals)
    images = tuple(torch.rand(3, 32, 32) for _ in range(4))
    assert not lists_batched(_ListDetector(), images)  # twice the channels: the first convolution refuses them
    assert doubled(images)[0].shape == (6, 32, 32) and doubled(signals)[0].shape == (8, 16, 32)


class _Pooled(nn.Module):
    """A forward whose output does not grow with the batch (a mean over it): nothing tells, read as images."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean()


def test_a_forward_whose_output_does_not_scale_with_the_batch_keeps_the_images_reading() -> None:
    assert not lists_batched(_Pooled(), [torch.randn(4, 16, 32)])


def test_samples_of_lists_found_batched_count_their_first_dimension() -> None:
    pair = [torch.zeros(4, 16, 32), torch.zeros(4, 16, 32)]
    assert samples(pair) == 2 and samples(pair, images=False) == 4


def _torchvision_detector() -> Any:
    try:
        from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn

        model = fasterrcnn_mobilenet_v3_large_fpn(weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64)
        model.eval()
        with torch.no_grad():
            model([torch.rand(3, 64, 64)])
    except Exception as error:  # noqa: BLE001 - absent, or not loadable beside this torch (torchvision::nms missing)
        pytest.skip(f"torchvision's Faster R-CNN does not run here ({type(error).__name__}: {error})")
    return model


def test_torchvisions_faster_rcnn_takes_its_images_as_per_sample_images() -> None:
    model = _torchvision_detector()
    assert not lists_batched(model, [torch.rand(3, 64, 64) for _ in range(4)])


def test_a_loader_that_runs_out_before_32_samples_is_measured_whole_without_a_word(tmp_path: Any) -> None:
    """Fewer than asked because the loader holds no more: all its samples measured, nothing to fix, no warning."""
    measured, caught = conv_check_of_one_step(tmp_path, _Conv1dNet, DataLoader(TensorDataset(_signals(16, 32)[:12]), batch_size=4))
    assert measured is not None and measured.samples == 12
    assert not [w for w in caught if "samples, not the" in str(w.message)]
