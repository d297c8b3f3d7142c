"""What the probe step costs at fit start: the real SmolLM2-135M with LoRA + nf4, probe on vs ``LIGHTNING_HBM_PROBE_STEP=0``.

Issue 55 asks to skip the probe step (the user's ``training_step`` run once on fake tensors before the first check,
:mod:`lightning_hbm.surgery.probe_step`) "when nothing needs it"; this gives the figure to weigh that against. One
process, the two arms interleaved round by round (round 0 pays first imports and is left out): a plain LightningModule
around ``AutoModelForCausalLM.from_pretrained(smollm2_path())``, ``Trainer(max_steps=1)`` with
``QuantizedPrecision("nf4", dtype=...)`` + ``LoRA(r=16)``, batch 1 x 128. Timed: ``Trainer.fit`` (surgery, checks,
quantization, adapters, one step), wall and CPU seconds, and the probe step alone (a counter around
``readers.observe``). Printed per arm: the median of the rounds, and the ratio off / on; and whether both arms
quantized and adapted the same layers and gave the same first loss.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/probe_step_cost.py --rounds 4
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers import readers
from lightning_hbm.memory.storage import quantized_format
from lightning_hbm.pretrained import smollm2_path

BATCH, SEQ = 1, 128
OBSERVED: list[tuple[float, float]] = []  # wall and CPU seconds of the probe step (readers.observe) in the current fit


class CausalLM(pl.LightningModule):
    """What a user writes around a transformers causal LM: nothing about memory."""

    def __init__(self, path: str) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path)
        self.model.config.use_cache = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


def _counted_observe() -> None:
    original = readers.observe

    def observe(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            OBSERVED.append((time.perf_counter() - start, time.process_time() - cpu))

    readers.observe = observe  # type: ignore[assignment]  # the probe step looks it up on the module at each call


def one_fit(path: str, dtype: str, batch: torch.Tensor, probe: bool) -> dict[str, Any]:
    os.environ["LIGHTNING_HBM_PROBE_STEP"] = "1" if probe else "0"
    OBSERVED.clear()
    module = CausalLM(path)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[QuantizedPrecision("nf4", dtype=dtype)], callbacks=[LoRA(r=16)],
    )  # fmt: skip
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, torch.utils.data.DataLoader([batch[0]] * BATCH, batch_size=BATCH))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    quantized = sorted(n for n, m in module.named_modules() if quantized_format(m) is not None)
    adapted = sorted(n for n, _ in module.named_modules() if n.endswith("lora_A"))
    said = sorted({str(w.message)[:100] for w in caught if "lightning_hbm" in str(w.message)})
    return dict(wall=wall, cpu=cpu, probe=sum(w for w, _ in OBSERVED), probe_cpu=sum(c for _, c in OBSERVED), loss=float(trainer.callback_metrics["loss"]),
                quantized=quantized, adapted=adapted, said=said)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds of both arms (round 0 left out)")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    path = str(smollm2_path())
    torch.manual_seed(0)
    batch = torch.randint(0, 49152, (BATCH, SEQ))
    _counted_observe()
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for r in range(args.rounds):
        for probe in (True, False) if r % 2 == 0 else (False, True):  # the order alternates round by round
            got = one_fit(path, args.dtype, batch, probe)
            print(f"round {r} probe {'on ' if probe else 'off'}: fit {got['wall']:.2f} s wall, {got['cpu']:.2f} s CPU, "
                  f"probe step {got['probe']:.2f} s wall, {got['probe_cpu']:.2f} s CPU, loss {got['loss']:.6f}, {len(got['quantized'])} quantized, "
                  f"{len(got['adapted'])} adapted", flush=True)
            if r:
                runs[probe].append(got)
    on, off = runs[True], runs[False]
    for key in ("wall", "cpu", "probe", "probe_cpu"):
        a, b = statistics.median(g[key] for g in on), statistics.median(g[key] for g in off)
        print(f"median {key}: on {a:.2f} s, off {b:.2f} s, off / on {b / a:.3f}" if a else f"median {key}: on {a:.2f}, off {b:.2f}")
    same = on[0]["quantized"] == off[0]["quantized"] and on[0]["adapted"] == off[0]["adapted"]
    print(f"same layers quantized and adapted: {same}; same first loss: {on[0]['loss'] == off[0]['loss']}")
    print(f"said (on): {on[0]['said']}\nsaid (off): {off[0]['said']}")
    if not same:
        print("only with the probe on quantized:", sorted(set(on[0]["quantized"]) - set(off[0]["quantized"])))
        print("only with the probe off quantized:", sorted(set(off[0]["quantized"]) - set(on[0]["quantized"])))


if __name__ == "__main__":
    main()
