"""What the fit-start accuracy check adds to the time to the first step on a model without convolutions (session 32).

Since session 32 the check (``precision/accuracy.py``) runs on every model the plugin quantizes: one forward of the
model as built on the probe batch before the quantization (the reference) and one of the quantized model after it.
Here the real SmolLM2-135M (``smollm2_path()``) in a LightningModule with a ``forward`` (without one the check measures
the call its ``training_step`` makes first, at the same cost), ``Trainer(max_steps=1)`` with
``QuantizedPrecision("nf4-dq")`` + ``LoRA(r=16)`` + ``ActivationCheckpointing()``, batch 1 x 128, in one process,
interleaved: ``on`` as shipped, ``off`` with the check's reference never built (what the library did before for a
model without convolutions). Reported: process CPU seconds of each fit (fit start to the end of the first step), the
median over rounds 1.. (round 0 pays first imports), and the ratio.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/accuracy_check_cost.py --rounds 4
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/accuracy_check_cost.py --rounds 3 --breakdown

``--breakdown`` prints, per fit, the CPU seconds of the check's parts (counters around the functions, no profiler):
the reference forward, the quantized forward, the figure, the per-layer cosines, ``undo_int8_states``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_hbm.precision.accuracy as accuracy
import lightning_hbm.precision.measures as measures
import lightning_hbm.precision.mode_choice as mode_choice
from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm._compat import bitsandbytes as bnb_compat
from lightning_hbm.pretrained import smollm2_path


class CausalLM(pl.LightningModule):
    def __init__(self, path: str) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path)
        self.model.config.use_cache = False

    def forward(self, input_ids: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def first_step(path: str, dtype: str, batch: torch.Tensor, check: bool) -> tuple[float, float]:
    module = CausalLM(path)
    plugin = QuantizedPrecision("nf4-dq", dtype=dtype)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[plugin], callbacks=[LoRA(r=16, alpha=32), ActivationCheckpointing()])  # fmt: skip
    built = mode_choice.Reference
    if not check:
        mode_choice.Reference = lambda *args: None  # type: ignore[assignment,misc]
    start = time.process_time()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, torch.utils.data.DataLoader([batch[0]], batch_size=1))
    finally:
        mode_choice.Reference = built  # type: ignore[misc]
    measured = plugin.quantization.conv_accuracy
    assert (measured is not None) == check, measured
    return time.process_time() - start, measured.cosine if measured is not None else float("nan")


#: CPU seconds of the check's parts in the fit under way (``--breakdown``)
PARTS: collections.Counter[str] = collections.Counter()


def count(owner: Any, name: str, label: str) -> None:
    """``owner.name`` timed into :data:`PARTS` under ``label``."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            PARTS[label] += time.process_time() - start

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--breakdown", action="store_true", help="the CPU seconds of the check's parts, per fit")
    args = parser.parse_args()
    if args.breakdown:
        count(measures.Measures, "record_reference", "reference forward")
        count(accuracy.Reference, "_computed", "quantized forward")
        count(accuracy, "measure", "the figure (measure)")
        count(accuracy, "responsible", "per-layer cosines (responsible)")
        count(bnb_compat, "undo_int8_states", "undo_int8_states")
    path = smollm2_path()
    batch = torch.randint(0, 49152, (1, 128), generator=torch.Generator().manual_seed(0))
    times: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for check in (False, True) if round_ % 2 else (True, False):
            seconds, cosine = first_step(path, args.dtype, batch, check)
            times[check].append(seconds)
            print(f"round {round_} check {'on ' if check else 'off'}: {seconds:.2f} s CPU, output cosine {cosine:.4f}", flush=True)
            for label, spent in PARTS.items() if check else ():
                print(f"    {label:<32} {spent:.2f} s", flush=True)
            PARTS.clear()
    on, off = statistics.median(times[True][1:]), statistics.median(times[False][1:])
    print(f"median (rounds 1-{args.rounds - 1}): on {on:.2f} s, off {off:.2f} s, ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
