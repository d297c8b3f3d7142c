"""Session 36, h5: session 35's code attacked by running (the fit-start conv check's joined batches, the probe batch
drawn leaving no trace, ``gather_range``, ``MemoryProfile``); each test here failed on main before its fix."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import transformers as tf
from torch.utils.data import DataLoader, Dataset

from lightning_hbm import QuantizedPrecision


class _Boxes(Dataset):
    """Images with their boxes, as a detection dataset gives them (one box each)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        image = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(i))
        return image, {"boxes": torch.tensor([[4.0, 4.0, 30.0, 30.0]]), "labels": torch.tensor([1])}


def _per_sample(items: list[Any]) -> tuple[Any, ...]:
    """torchvision's detection ``collate_fn``: a tuple of images and a tuple of targets, one per sample."""
    return tuple(zip(*items))


class _Detector(pl.LightningModule):
    """A transformers ResNet taking a batch as a detection collate gives it: the images stacked in the forward."""

    def __init__(self) -> None:
        super().__init__()
        config = tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1], num_labels=10)
        self.model = tf.ResNetForImageClassification(config)

    def forward(self, images: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.model(pixel_values=torch.stack(list(images))).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def conv_check_of_one_step(tmp_path: Any, make_model: Callable[[], pl.LightningModule], loader: DataLoader) -> tuple[Any, list[Any]]:
    """One int8 training step of ``make_model()`` (built after seeding) on ``loader``: the fit-start conv check's
    measure (``Quantization.conv_accuracy``) and the warnings the fit gave."""
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("int8")],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(make_model(), loader)
    return trainer.precision_plugin.quantization.conv_accuracy, list(caught)  # type: ignore[attr-defined]


def test_the_conv_check_measures_a_detection_collates_per_sample_images(tmp_path: Any) -> None:
    """Joined sample by sample, batches of per-sample images became images of 6, 9, ... channels and the check's
    forward failed: the check was lost ("not measured at fit start") where session 34 measured the first batch. A
    batch whose tensors do not share their first dimension is not joined: measured on the first batch, as before."""
    measured, caught = conv_check_of_one_step(tmp_path, _Detector, DataLoader(_Boxes(), batch_size=4, collate_fn=_per_sample))
    assert not [w for w in caught if "not measured" in str(w.message)]
    assert measured is not None and measured.cosine > 0.99 and not measured.warned


def test_batches_whose_tensors_do_not_share_the_batch_dimension_are_not_joined() -> None:
    from lightning_hbm.probe_batch import _join

    images = [(tuple(torch.zeros(3, 8, 8) for _ in range(4)), tuple(torch.zeros(1, 4) for _ in range(4))) for _ in range(2)]
    assert _join(images) is None  # per-sample images: they would join along the channels
    assert _join([{"x": torch.zeros(2, 4), "anchors": torch.zeros(5, 4)}] * 2) is None  # a tensor of the batch, not per sample
    assert _join([{"x": torch.zeros(2, 4), "y": torch.zeros(2)}] * 2)["x"].shape == (4, 4)  # still joined


class _Numbered(Dataset):
    """Images numbered by their first pixel; ``rng``: an augmentation drawn from the dataset's own NumPy generator."""

    def __init__(self, rng: bool = False) -> None:
        import numpy as np

        self.rng = np.random.default_rng(5) if rng else None

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        image = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(i))
        if self.rng is not None:
            image[1] += float(self.rng.random())
        image[0, 0, 0] = i
        return image


class _Bucketing(torch.utils.data.Sampler[list[int]]):
    """A batch sampler drawing its batches' order from a generator of its own (length bucketing's layout)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __len__(self) -> int:
        return 10

    def __iter__(self) -> Any:
        order = torch.randperm(40, generator=self.generator).tolist()
        return iter([order[k : k + 4] for k in range(0, 40, 4)])


class _Seen(pl.LightningModule):
    """A small conv net recording what each training batch holds (``on_train_batch_start``: the probe step never calls it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
        self.seen: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.seen.append((batch[:, 0, 0, 0].long().tolist(), [round(v, 2) for v in batch[:, 1, 0, 0].float().tolist()]))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _trained(loader: Any, plugins: Any, tmp_path: Any) -> list[Any]:
    torch.manual_seed(0)
    model = _Seen()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=plugins,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader())
    return model.seen


def test_a_batch_sampler_with_its_own_generator_trains_the_same_order(tmp_path: Any) -> None:
    """The conv check's 32 samples were drawn from the batch sampler's own generator, not put back: epoch 0 trained
    another order than the same seed without lightning_hbm (issue 55's rule)."""
    loader = lambda: DataLoader(_Numbered(), batch_sampler=_Bucketing(torch.Generator().manual_seed(3)))  # noqa: E731
    plain, ours = _trained(loader, None, tmp_path), _trained(loader, [QuantizedPrecision("int8")], tmp_path)
    assert [order for order, _ in ours] == [order for order, _ in plain]


def test_a_dataset_drawing_from_its_own_numpy_generator_trains_the_same_draws(tmp_path: Any) -> None:
    loader = lambda: DataLoader(_Numbered(rng=True), batch_size=4)  # noqa: E731
    plain, ours = _trained(loader, None, tmp_path), _trained(loader, [QuantizedPrecision("int8")], tmp_path)
    assert [order for order, _ in ours] == [order for order, _ in plain]
    for (_, got), (_, want) in zip(ours, plain):  # the plugin hands the batch on in bfloat16
        assert got == pytest.approx(want, abs=0.02)


def _llama_loop(zero_grad_last: bool) -> tuple[list[dict[str, Any]], list[Any]]:
    """MemoryProfile's own loop (its docstring's) on a small transformers Llama; ``zero_grad_last``: the usual
    PyTorch order, gradients zeroed after ``optimizer.step()``."""
    from lightning_hbm.profiling.memory_profile import MemoryProfile

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = tf.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profile = MemoryProfile(every_n_steps=10, detailed_steps=[1], summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            batch = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
            profile.start_step(step, step, model, [optimizer], batch)
            loss = model(input_ids=batch, labels=batch).loss
            profile.forward_ended("zero_grad", model, [optimizer])
            if not zero_grad_last:
                optimizer.zero_grad()
            profile.enter_phase("backward")
            loss.backward()
            profile.enter_phase("optimizer")
            optimizer.step()
            if zero_grad_last:
                optimizer.zero_grad()
            profile.end_step(model, [optimizer])
    return profile.rows, [w for w in caught if "MemoryProfile.end_step" in str(w.message)]


def test_memory_profile_without_a_trainer_counts_the_gradients_of_the_documented_loop() -> None:
    """MemoryProfile's docstring zeroed the gradients after ``optimizer.step()``: the step peak's gradients (0.34 MiB
    here, as HBMProfiler measures the same model in a Trainer) were counted as 'other', unsaid. The documented loop
    now zeroes them as Lightning does, and a loop that zeroes them before ``end_step`` is warned, once."""
    import lightning_hbm.profiling.memory_profile as memory_profile

    doc = memory_profile.__doc__ or ""
    assert doc.index("optimizer.zero_grad()") < doc.index("loss.backward()")  # the example's order
    rows, said = _llama_loop(zero_grad_last=False)
    params = sum(p.numel() * 4 for p in tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).parameters())
    assert not said and all(row["gradients"] == params for row in rows)
    rows, said = _llama_loop(zero_grad_last=True)
    assert len(said) == 1 and "counted as 'other'" in str(said[0].message) and "Fix: call optimizer.zero_grad() after the forward" in str(said[0].message)


class _Named(Dataset):
    """Images with their file names, as an image folder dataset with paths gives them (collated: a list of str)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"pixel_values": torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(i)), "path": f"img_{i}.png"}


class _NamedNet(_Seen):
    def forward(self, pixel_values: torch.Tensor, path: list[str]) -> torch.Tensor:  # type: ignore[override]
        return self.net(pixel_values)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.seen.append(batch["path"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        return self(**batch).square().mean()


def test_the_conv_check_joins_batches_that_carry_a_name_per_sample(tmp_path: Any) -> None:
    """A list of file names (one string per sample) stopped the join at the first batch: the check measured the
    first 4 images, not 32, unsaid. Joined as lists now; the batches trained as they were."""
    from lightning_hbm.probe_batch import _join

    first, last = {"x": torch.zeros(4, 2), "path": ["a", "b", "c", "d"]}, {"x": torch.ones(2, 2), "path": ["e", "f"]}
    joined = _join([first, last])  # an uneven last batch too
    assert joined["path"] == ["a", "b", "c", "d", "e", "f"] and joined["x"].shape == (6, 2)
    other = [{"x": torch.zeros(2, 2), "split": [split]} for split in ("train", "val")]
    assert _join(other) is None  # not one per sample, and they differ: as before
    torch.manual_seed(0)
    model = _NamedNet()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("int8")],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(_Named(), batch_size=4))
    measured = trainer.precision_plugin.quantization.conv_accuracy  # type: ignore[attr-defined]
    assert measured is not None and measured.samples == 32
    assert model.seen == [[f"img_{i}.png" for i in range(4)], [f"img_{i}.png" for i in range(4, 8)]]


class _OnePass(torch.utils.data.IterableDataset):
    """A stream read once (a queue, a socket): a second ``iter`` goes on where the first stopped."""

    def __init__(self) -> None:
        self.items = iter(range(40))

    def __iter__(self) -> Any:
        for i in self.items:
            image = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(i))
            image[0, 0, 0] = i
            yield image


class _Stateful(DataLoader):
    """A loader Lightning saves and restores (torchdata's ``StatefulDataLoader``'s methods)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_stateful_loader_over_a_stream_gives_the_conv_check_its_first_batch_only(tmp_path: Any) -> None:
    """Read in a new pass (it may be restored elsewhere), a stateful loader over a stream read once lost the conv
    check's 32 samples (and the probe step's 4) to training, which trained 1 batch of 10; 8 of 10 in session 36 (the
    probe step's and the measures' draws). Session 37: the pass drawn from is handed to the loop, dropped if Lightning
    restores the loader first (tests/test_nothing_lost_s37.py): 10 of 10, in order."""
    plain = _trained(lambda: _Stateful(_OnePass(), batch_size=4), None, tmp_path)
    ours = _trained(lambda: _Stateful(_OnePass(), batch_size=4), [QuantizedPrecision("int8")], tmp_path)
    assert len(plain) == 10 and [order for order, _ in ours] == [order for order, _ in plain]  # was 1, then 8
