"""Data every machine has: Python's own standard-library sources, as byte-level tokens.

No download, no tokenizer: token ids are bytes (vocabulary 256). The text is real (English
comments and Python code), so a small language model shows a real falling loss within a few
dozen steps.
"""

from __future__ import annotations

import itertools
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_hbm.pretrained import resolve

VOCAB_SIZE = 256


def stdlib_text(max_bytes: int = 2_000_000) -> bytes:
    """Concatenated sources of the standard library (sorted, deterministic), at most ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    if len(text) < 10_000:
        raise RuntimeError(f"Found only {len(text)} bytes of Python sources under {root}; cannot build a corpus.")
    return text


class ByteWindows(Dataset):
    """``(input, target)`` windows of ``seq_len`` bytes; the target is the input shifted by one."""

    def __init__(self, data: torch.Tensor, seq_len: int, num_samples: int, seed: int) -> None:
        if data.numel() <= seq_len + 1:
            raise ValueError(f"Need more than seq_len+1={seq_len + 1} tokens, got {data.numel()}.")
        self.data = data
        self.seq_len = seq_len
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, data.numel() - seq_len - 1, (num_samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[index])
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class EpochSampler(RandomSampler):
    """A permutation of ``0..n-1`` drawn from ``seed + epoch`` alone.

    Lightning calls ``set_epoch`` at every epoch start (as for ``DistributedSampler``), so a resumed run draws
    the uninterrupted run's order; torch's ``RandomSampler`` draws from the global RNG, which a resume does not
    restore. A ``RandomSampler`` subclass so that Lightning's DDP sampler keeps shuffling.
    """

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"EpochSampler: num_samples must be an int >= 1, got {num_samples!r}; e.g. len(dataset).")
        super().__init__(range(num_samples))
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(len(self.data_source), generator=generator).tolist())

    def __len__(self) -> int:
        return len(self.data_source)


class _EpochSequentialSampler(SequentialSampler):
    """``SequentialSampler`` that knows its epoch, so a resume tells a new epoch from the saved one."""

    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class _SkipFirst(Sampler):
    """``inner`` without its first ``skip`` items while ``armed`` (indices only: no sample is loaded)."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner, self.skip, self.armed = inner, skip, True

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.inner), self.skip if self.armed else 0, None)

    def __len__(self) -> int:
        return len(self.inner)


class _Pass(Iterator):
    """One pass over a :class:`ResumableDataLoader`, counting the batches it yields. The DataLoader's own iterator
    is built at the first ``next``: after Lightning's ``set_epoch``, which follows its ``iter()``."""

    inner: Optional[Iterator[Any]]
    epoch: Optional[int]

    def __init__(self, loader: "ResumableDataLoader") -> None:
        self.loader, self.inner, self.epoch, self.yielded = loader, None, None, 0

    def __next__(self) -> Any:
        if self.inner is None:
            self.epoch = self.loader._sampler_epoch()
            self.inner = self.loader._start(self.epoch)
            self.yielded = self.loader._skipped
        batch = next(self.inner)
        self.yielded += 1
        return batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getstate__(self) -> dict[str, Any]:  # a DataLoader iterator cannot be pickled (Trainer pickled after fit)
        return {**self.__dict__, "inner": None}


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that Lightning resumes mid-epoch: ``state_dict``/``load_state_dict`` (what Lightning 2.6
    saves for a train dataloader) hold the sampler epoch of the pass under way and the batches it gave.

    After ``load_state_dict`` the next pass of the same epoch skips those batches by their indices (no sample is
    loaded); a pass of another epoch (the checkpoint was at an epoch's end) starts at batch 0. Exact when the
    order depends on the epoch alone: ``shuffle=True`` uses :class:`EpochSampler` (``seed``), and a sampler of
    your own needs ``set_epoch``/``epoch`` (``DistributedSampler`` has them). Map-style datasets only.
    """

    def __init__(self, dataset: Any, batch_size: Optional[int] = 1, shuffle: Optional[bool] = None, sampler: Any = None,
                 batch_sampler: Any = None, *args: Any, seed: int = 0, **kwargs: Any) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                "ResumableDataLoader resumes by sampler indices, which an IterableDataset has none of; give the "
                "dataset its own state_dict/load_state_dict, or use torchdata's StatefulDataLoader."
            )
        if sampler is None and batch_sampler is None:
            sampler = EpochSampler(len(dataset), seed=seed) if shuffle else _EpochSequentialSampler(dataset)
        elif shuffle:
            raise ValueError("ResumableDataLoader: shuffle=True draws its own order; give a sampler or shuffle, not both.")
        super().__init__(dataset, batch_size, False, sampler, batch_sampler, *args, **kwargs)
        self.seed = seed
        self._shuffled = bool(shuffle)
        self._pass: Optional[_Pass] = None
        self._resume: Optional[tuple[Optional[int], int]] = None
        self._skipping = self._skipped = 0

    def _sampler_epoch(self) -> Optional[int]:
        for sampler in (getattr(self.batch_sampler, "sampler", None), self.sampler):
            epoch = getattr(sampler, "epoch", None)
            if callable(getattr(sampler, "set_epoch", None)) and isinstance(epoch, int):
                return epoch
        return None

    def __iter__(self) -> _Pass:  # type: ignore[override]
        self._pass = _Pass(self)
        return self._pass

    def _start(self, epoch: Optional[int]) -> Iterator[Any]:
        """The DataLoader's iterator for a pass of ``epoch``, past the restored batches if it is the saved epoch."""
        saved, self._resume = self._resume, None
        self._skipped = saved[1] if saved is not None and saved[0] == epoch else 0
        self._skipping = self._skipped
        try:
            inner = super().__iter__()
        finally:
            self._skipping = 0
        if isinstance(getattr(inner, "_index_sampler", None), _SkipFirst):
            inner._index_sampler.armed = False  # persistent workers reuse it next epoch: skip only this pass
        return inner

    @property
    def _index_sampler(self) -> Any:
        # torch's iterators read their indices from this property when they are built (torch 1.2 to 2.13)
        sampler = super()._index_sampler
        return _SkipFirst(sampler, self._skipping) if self._skipping else sampler

    def settings(self) -> dict[str, Any]:
        """What decides which samples a batch position holds: a resume with other settings would skip or repeat
        samples, so :meth:`load_state_dict` compares them (issue 55)."""
        return {
            "batch_size": self.batch_size, "samples": len(self.dataset),  # type: ignore[arg-type]  # map-style (checked in __init__)
            "shuffle": self._shuffled, "seed": self.seed if self._shuffled else None, "drop_last": self.drop_last,
            "sampler": type(self.sampler).__name__, "distributed": self._distributed(),
        }  # fmt: skip

    def _distributed(self) -> Optional[dict[str, Any]]:
        """A DistributedSampler's share of the samples: the number of processes, its own shuffle, seed and drop_last
        (a resume on 4 processes of a 2-process checkpoint puts other samples at each batch position)."""
        sampler: Any
        for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if hasattr(sampler, "num_replicas"):
                return {"processes": int(sampler.num_replicas), "shuffle": bool(getattr(sampler, "shuffle", False)),
                        "seed": getattr(sampler, "seed", None), "drop_last": bool(getattr(sampler, "drop_last", False))}  # fmt: skip
        return None

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batches"}`` of the pass under way (a pass not yet started counts 0 batches), and the loader's
        :meth:`settings`."""
        current = self._pass if self._pass is not None and self._pass.inner is not None else None
        if current is None:
            return {"version": 2, "epoch": self._sampler_epoch(), "batches": 0, "loader": self.settings()}
        return {"version": 2, "epoch": current.epoch, "batches": current.yielded, "loader": self.settings()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the pass ``state_dict`` describes at its next batch (on the next ``iter``).

        Raises:
            ValueError: the state is not a ResumableDataLoader's, or it was saved with other loader settings (batch
                size, dataset length, shuffle, seed, drop_last, sampler): resuming would skip or repeat samples.
                Nothing changes before it is raised.
        """
        if isinstance(state_dict, dict) and state_dict.get("version") == 2 and isinstance(state_dict.get("loader"), dict):
            _check_settings(state_dict["loader"], self.settings())
            state_dict = {k: v for k, v in state_dict.items() if k != "loader"}
        elif isinstance(state_dict, dict) and state_dict.get("version") == 1:
            warnings.warn(
                "ResumableDataLoader: this checkpoint's loader state is of version 1, which does not record the loader's "
                "settings: a changed batch size, dataset, shuffle or seed cannot be detected. Resume with the loader the "
                "checkpoint was saved with.", UserWarning, stacklevel=2,
            )  # fmt: skip
        epoch, batches = _check_loader_state({**state_dict, "version": 1} if isinstance(state_dict, dict) else state_dict, len(self))
        if epoch is None and batches:
            warnings.warn(
                f"ResumableDataLoader: the sampler ({type(self.sampler).__name__}) has no set_epoch/epoch, so the "
                f"{batches} restored batches are skipped in the next pass whatever its epoch: right mid-epoch, wrong "
                "if the checkpoint ended an epoch cut short (limit_train_batches). Give the sampler set_epoch/epoch.",
                UserWarning, stacklevel=2,
            )
        self._resume = (epoch, batches)
        sampler: Any  # one with set_epoch where it is called
        for sampler in {id(s): s for s in (self.sampler, getattr(self.batch_sampler, "sampler", None))}.values():
            if epoch is not None and callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)  # workers prefetch indices as soon as their iterator exists


def _check_settings(saved: dict[str, Any], current: dict[str, Any]) -> None:
    # a setting an older checkpoint did not record ("distributed") is not compared
    changed = [f"{key} {saved.get(key)!r} -> {value!r}" for key, value in current.items() if key in saved and saved[key] != value]
    if changed:
        raise ValueError(
            f"ResumableDataLoader.load_state_dict: the checkpoint was saved with another training dataloader "
            f"({', '.join(changed)}; saved -> now): resuming at its batch position would skip or repeat samples. "
            "Resume with the dataloader settings the checkpoint was saved with (and as many processes, devices x "
            "num_nodes, when it was saved by a distributed run), or start the epoch over (resume from "
            "an epoch-end checkpoint, or drop the loader state: Trainer(...).fit(..., ckpt_path=...) with a plain DataLoader)."
        )


def check_resume_loader(
    trainer: Any, checkpoint: Optional[dict[str, Any]], loader: Any, gather: Optional[Any] = None
) -> None:
    """Refuse, at fit start and before the model is changed, a resume whose ``ResumableDataLoader`` state was saved
    with other loader settings (batch size, dataset length, shuffle, seed, sampler) than this run's loader: the check
    :meth:`ResumableDataLoader.load_state_dict` makes in Lightning's fit loop, after the strategy's setup, made before
    the model changes (was: refused with LoRA already in the model, session 31). ``loader``: a function giving this
    run's training dataloader as the loop will iterate it (on several processes, rebuilt with its
    ``DistributedSampler``: ``lightning_compat.loader_as_trained``; was: only the number of processes was compared
    there, any other change refused after the model changed, session 32). ``gather``: every rank's refusal, by rank
    (a collective, ``resume.io.gather_from_ranks``): every rank raises the same error, also when only some ranks'
    loaders differ from the checkpoint's."""
    states = _saved_loader_states(checkpoint)
    if len(states) != 1 or "loader" not in states[0]:
        return  # the same checkpoint on every rank: every rank returns here, or every rank reaches the gather
    current = loader()
    refusal = None
    if isinstance(current, ResumableDataLoader):
        try:
            _check_settings(states[0]["loader"], current.settings())
        except ValueError as err:
            refusal = str(err)
    refusals = gather(refusal) if gather is not None else None
    if refusals is None:  # one process
        if refusal is not None:
            raise ValueError(refusal)
        return
    refused = [(rank, text) for rank, text in enumerate(refusals) if text is not None]
    if not refused:
        return
    if len({text for _, text in refused}) == 1 and len(refused) == len(refusals):
        raise ValueError(refused[0][1])  # every rank's loader differs alike: the message a one-process run gets
    ranks = ", ".join(str(rank) for rank, _ in refused)
    raise ValueError(f"On rank(s) {ranks} of {len(refusals)}: {refused[0][1]} No rank changed the model.")


def _saved_loader_states(checkpoint: Optional[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ResumableDataLoader states (version 2, with their settings) of the checkpoint's training loaders."""
    fit_loop = (((checkpoint or {}).get("loops") or {}).get("fit_loop") or {}).get("state_dict") or {}
    states = fit_loop.get("combined_loader") if isinstance(fit_loop, dict) else None
    return [
        state for state in (states if isinstance(states, list) else [])
        if isinstance(state, dict) and state.get("version") == 2 and isinstance(state.get("loader"), dict)
    ]  # fmt: skip


def check_resume_processes(trainer: Any, checkpoint: Optional[dict[str, Any]]) -> None:
    """Refuse, at fit start and before the model is changed, a resume whose ``ResumableDataLoader`` state was saved by
    another number of processes than this run's (issue 55): Lightning restores the loader's state in its fit loop,
    after the strategy's setup, so :meth:`ResumableDataLoader.load_state_dict` alone refused it with the model already
    changed. Decided here only where this run's share is known before the loader exists: Lightning gives a
    distributed run's loader a ``DistributedSampler`` of ``world_size`` processes (``use_distributed_sampler``, the
    default), and one process none (a state saved by several processes is refused); other cases are left to
    ``load_state_dict``. Every rank reads the same checkpoint, so every rank raises
    the same error."""
    world = int(getattr(trainer, "world_size", 1) or 1)
    connector = getattr(trainer, "_accelerator_connector", None)  # Lightning 2.6: where use_distributed_sampler is kept
    if not checkpoint or (world > 1 and not getattr(connector, "use_distributed_sampler", False)):
        return  # one process: no sampler added (a share saved by several is refused); else the loader's own sampler
    for state in _saved_loader_states(checkpoint):  # (another loader's state: its own load_state_dict decides)
        loader = state["loader"]
        if "distributed" not in loader:
            continue  # saved before the share was recorded: not compared (as load_state_dict)
        shared = loader["distributed"]
        saved = shared.get("processes") if isinstance(shared, dict) else 1
        if saved == world:
            continue
        raise ValueError(
            f"ResumableDataLoader: the checkpoint {getattr(trainer, 'ckpt_path', None)} was saved by {saved} "
            f"process(es) sharing each epoch, this run has {world} (devices x num_nodes"
            f"{', each given its share by a DistributedSampler' if world > 1 else ''}): at the saved batch position (epoch {state.get('epoch')!r}, batch "
            f"{state.get('batches')!r}) each process would hold other samples, so the resumed epoch would skip some "
            f"and train others twice. Nothing was changed. Resume on {saved} process(es), or from a checkpoint saved "
            "at an epoch end with a plain DataLoader, or start a new run from the weights (load them, no ckpt_path)."
        )


def _check_loader_state(state: Any, length: int) -> tuple[Optional[int], int]:
    if not isinstance(state, dict) or state.get("version") != 1 or set(state) != {"version", "epoch", "batches"}:
        raise ValueError(
            f"ResumableDataLoader.load_state_dict: expected {{'version': 1, 'epoch': int or None, 'batches': int}} "
            f"(from ResumableDataLoader.state_dict), got {state!r}; the checkpoint holds another dataloader's state."
        )
    epoch, batches = state["epoch"], state["batches"]
    ok_epoch = epoch is None or (isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0)
    if not ok_epoch or isinstance(batches, bool) or not isinstance(batches, int) or not 0 <= batches <= length:
        raise ValueError(
            f"ResumableDataLoader.load_state_dict: epoch={epoch!r}, batches={batches!r} do not fit this loader of "
            f"{length} batches; resume with the dataloader (dataset, batch_size) the checkpoint was saved with."
        )
    return epoch, batches


class ByteTextDataModule(pl.LightningDataModule):
    """Byte-level language-modelling data from the standard library's sources.

    Args:
        seq_len: tokens per sample.
        batch_size: samples per batch.
        train_samples / val_samples: number of random windows (fixed seed) per split.
        max_bytes: size of the corpus read from disk.
        seed: seed of the window positions.
        tokenizer: ``None`` (bytes, vocabulary 256) or a Hugging Face tokenizer folder (or a name
            :mod:`lightning_hbm.pretrained` finds offline, ``"SmolLM2-135M-Instruct"``): the same text
            as that model's tokens, for fine-tuning a pretrained model.
        shuffle: draw the training windows in a new order every epoch, from ``seed + epoch`` alone.

    The training dataloader is a :class:`ResumableDataLoader`: a checkpoint saved mid-epoch resumes at its next
    batch, in the same order.
    """

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 8,
        train_samples: int = 2048,
        val_samples: int = 64,
        max_bytes: int = 2_000_000,
        seed: int = 0,
        tokenizer: Optional[str] = None,
        shuffle: bool = False,
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.max_bytes = max_bytes
        self.seed = seed
        self.shuffle = shuffle
        self._data: torch.Tensor | None = None

    def _tokens(self) -> torch.Tensor:
        if self._data is None and self.tokenizer is not None:
            from transformers import AutoTokenizer

            text = stdlib_text(self.max_bytes).decode("utf-8", errors="replace")
            ids = AutoTokenizer.from_pretrained(resolve(self.tokenizer))(text).input_ids
            self._data = torch.tensor(ids, dtype=torch.int64)
        if self._data is None:
            self._data = torch.frombuffer(bytearray(stdlib_text(self.max_bytes)), dtype=torch.uint8)
        return self._data

    def train_dataloader(self) -> ResumableDataLoader:
        data = self._tokens()
        split = int(data.numel() * 0.95)
        dataset = ByteWindows(data[:split], self.seq_len, self.train_samples, self.seed)
        return ResumableDataLoader(dataset, batch_size=self.batch_size, shuffle=self.shuffle, seed=self.seed, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        data = self._tokens()
        split = int(data.numel() * 0.95)
        dataset = ByteWindows(data[split:], self.seq_len, self.val_samples, self.seed + 1)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False, num_workers=0)

    def example_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One training batch (used as a probe batch and by the planner)."""
        return next(iter(self.train_dataloader()))


class MidEpochResumeCheck(pl.Callback):
    """Warns at a resume from a mid-epoch checkpoint when a training dataloader has no ``state_dict``: Lightning
    restarts such a loader at batch 0, so the resumed epoch sees its first batches again and never the last ones.

    Every lightning_hbm run gets one (``lightning_hbm.surgery.check_saves``); stateless.
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_if_resume_restarts_data(trainer)


def _stateful(loader: Any) -> bool:
    """What Lightning 2.6 saves and restores a train dataloader by (its ``_Stateful`` protocol)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def warn_if_resume_restarts_data(trainer: pl.Trainer) -> Optional[str]:
    """The warning of :class:`MidEpochResumeCheck` (returned too), or ``None`` when the resume is exact."""
    loop = trainer.fit_loop
    done, total = loop.epoch_loop.batch_progress.current.ready, trainer.num_training_batches
    if not loop.restarting or not 0 < done < total or trainer.train_dataloader is None:
        return None
    plain = [dl for dl in CombinedLoader(trainer.train_dataloader).flattened if not _stateful(dl)]
    if not plain:
        return None
    message = (
        f"Resuming {done} batches into epoch {trainer.current_epoch} ({done} of {total}) with a training dataloader "
        f"that has no state_dict ({', '.join(sorted({type(dl).__name__ for dl in plain}))}): Lightning restarts it at "
        f"batch 0, so this epoch repeats its first {done} batches and the run is not the one it continues. Make the "
        "dataloader stateful (lightning_hbm.data.ResumableDataLoader, or torchdata's StatefulDataLoader), or resume "
        "from checkpoints saved at epoch ends."
    )
    warnings.warn(message, UserWarning, stacklevel=2)
    return message


#: Largest synthetic batch (its int64 tokens): 1 TiB, several times any accelerator's memory. Above it the
#: sizes are a typo (batch_size=10**12), refused before anything is built or allocated.
MAX_BATCH_BYTES = 2**40


def synthetic_batch(
    batch_size: int,
    seq_len: int,
    vocab_size: int = VOCAB_SIZE,
    seed: int = 0,
    device: Union[str, torch.device, None] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(input, target)`` token batch for tests that need no real text.

    ``device="meta"`` allocates nothing (shapes and dtype only, no values): what the planner uses for
    batches larger than its real twins (``lightning_hbm.planner.config``). The sizes are checked first.
    """
    _check_batch_sizes(batch_size, seq_len, vocab_size)
    if torch.device(device or "cpu").type == "meta":
        tokens = torch.empty((batch_size, seq_len + 1), dtype=torch.int64, device="meta")
        return tokens[:, :-1], tokens[:, 1:]
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _check_batch_sizes(batch_size: Any, seq_len: Any, vocab_size: Any) -> None:
    """Positive ints, and a batch that could exist: refused here, before any model or tensor is built."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"synthetic batch: {name} must be an int >= 1, got {value!r}; e.g. {name}=8.")
    nbytes = batch_size * (seq_len + 1) * 8  # int64 tokens; input and target are views of one tensor
    if nbytes > MAX_BATCH_BYTES:
        raise ValueError(
            f"synthetic batch: batch_size={batch_size} x seq_len={seq_len} is {nbytes / 2**40:.3g} TiB of tokens "
            f"alone, more than any accelerator holds (limit {MAX_BATCH_BYTES // 2**40} TiB); give the per-device "
            "batch, e.g. batch_size=8, seq_len=2048."
        )


__all__ = [
    "MAX_BATCH_BYTES", "VOCAB_SIZE", "ByteTextDataModule", "ByteWindows", "EpochSampler", "MidEpochResumeCheck",
    "check_resume_loader", "check_resume_processes",
    "ResumableDataLoader", "stdlib_text", "synthetic_batch", "warn_if_resume_restarts_data",
]
