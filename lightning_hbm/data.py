"""Data every machine has: Python's own standard-library sources, as byte-level tokens.

No download, no tokenizer: token ids are bytes (vocabulary 256). The text is real (English
comments and Python code), so a small language model shows a real falling loss within a few
dozen steps.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

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
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.max_bytes = max_bytes
        self.seed = seed
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

    def train_dataloader(self) -> DataLoader:
        data = self._tokens()
        split = int(data.numel() * 0.95)
        dataset = ByteWindows(data[:split], self.seq_len, self.train_samples, self.seed)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        data = self._tokens()
        split = int(data.numel() * 0.95)
        dataset = ByteWindows(data[split:], self.seq_len, self.val_samples, self.seed + 1)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False, num_workers=0)

    def example_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One training batch (used as a probe batch and by the planner)."""
        return next(iter(self.train_dataloader()))


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


__all__ = ["MAX_BATCH_BYTES", "VOCAB_SIZE", "ByteTextDataModule", "ByteWindows", "stdlib_text", "synthetic_batch"]
