"""Session 37, h3: ``ConvAccuracy.samples`` counts the samples of a batch of per-sample images (issue 53 item 2)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_hbm.probe_batch import samples


def test_samples_of_per_sample_images_are_the_images_not_their_channels() -> None:
    images = tuple(torch.zeros(3, 8, 8) for _ in range(5))
    assert samples(images) == 5  # was 3: the first image's channels
    assert samples(((images, tuple({"boxes": torch.zeros(1, 4)} for _ in range(5))),)) == 5  # a detection collate as args
    assert samples([torch.zeros(3, 8, 8), torch.zeros(3, 16, 12)]) == 2  # images of their own sizes
    assert samples({"pixel_values": torch.zeros(6, 3, 8, 8)}) == 6  # a batch: as before
    assert samples((torch.zeros(7, 3, 8, 8), torch.zeros(7, dtype=torch.long))) == 7
    assert samples((torch.zeros(8, 3, 8, 8), torch.zeros(8, 3, 8, 8))) == 8  # a tuple of batched tensors of one shape
    assert samples((torch.zeros(2, 3, 8, 8), torch.zeros(2, 1, 8, 8))) == 2  # images and masks, few of them
    assert samples((torch.zeros(4, 1, 64), torch.zeros(4, 1, 64))) == 4  # audio, [B, 1, T]
    assert samples([torch.zeros(2, 16), torch.zeros(2, 16)]) == 2  # rank 2: not images
    assert samples((torch.zeros(()), 3)) == 0 and samples(("a", 1)) == 0


def test_batches_of_per_sample_images_alone_are_not_joined_along_the_channels() -> None:
    """A batch that is a tuple of per-sample images and nothing else (a loader with ``collate_fn=tuple``): every image
    of 3 channels, they shared their first dimension and joined image by image into images of 6, 9, ... channels."""
    from lightning_hbm.probe_batch import _join

    assert _join([tuple(torch.zeros(3, 8, 8) for _ in range(4))] * 2) is None
    pairs = _join([(torch.zeros(2, 3, 8, 8), torch.zeros(2, 1, 8, 8))] * 2)  # images and masks: joined, as before
    assert pairs is not None and pairs[0].shape == (4, 3, 8, 8) and pairs[1].shape == (4, 1, 8, 8)
    audio = _join([(torch.zeros(4, 1, 64), torch.zeros(4, 1, 64))] * 2)
    assert audio is not None and audio[0].shape == (8, 1, 64)


class _Images(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(i))


def test_the_conv_check_of_a_batch_of_per_sample_images_alone_is_measured(tmp_path: Any) -> None:
    """A loader with ``collate_fn=tuple`` (the batch: per-sample images, nothing else) and a forward taking them: the
    probe ran ``forward(first image)``, as for an (inputs, targets) pair, and the check was lost ("not measured at fit
    start": the model as built could not run on the probe batch)."""
    from tests.test_attack_s36 import _Detector, conv_check_of_one_step

    class Detector(_Detector):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch).square().mean()

    measured, caught = conv_check_of_one_step(tmp_path, Detector, DataLoader(_Images(), batch_size=4, collate_fn=tuple))
    assert not [w for w in caught if "not measured" in str(w.message)]
    assert measured is not None and measured.cosine > 0.99 and measured.samples == 4


def test_the_conv_check_of_a_detection_collate_says_how_many_images_it_measured(tmp_path: Any) -> None:
    """The check measured the first batch of 4 per-sample images and said 3 samples (the channels)."""
    from tests.test_attack_s36 import _Boxes, _Detector, _per_sample, conv_check_of_one_step

    measured, _ = conv_check_of_one_step(tmp_path, _Detector, DataLoader(_Boxes(), batch_size=4, collate_fn=_per_sample))
    assert measured is not None and measured.samples == 4
