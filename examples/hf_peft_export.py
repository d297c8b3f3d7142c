"""A Hugging Face model, unchanged, trained with QLoRA in Lightning; the adapter exported in peft's format.

1. The "pretrained" model: ``AutoModelForCausalLM.from_config`` (a small Llama config, random
   weights, nothing downloaded), saved with ``save_pretrained`` the way a hub checkpoint would be.
2. A LightningModule that loads it with ``from_pretrained`` and calls it: no line of the model is
   changed, no peft or bitsandbytes code in the module.
3. ``QuantizedPrecision("nf4-dq")`` + ``LoRA`` train it (QLoRA); ``LoRA.save_adapter`` writes
   ``adapter_config.json`` + ``adapter_model.safetensors``.
4. Plain peft loads the adapter onto a fresh copy of the pretrained model
   (``PeftModel.from_pretrained``), as any downstream user would, and the adapter weights match.

    python examples/hf_peft_export.py --steps 30 --out /tmp/hf_qlora
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.data import VOCAB_SIZE, ByteTextDataModule


class HFCausalLM(pl.LightningModule):
    """Any ``AutoModelForCausalLM`` checkpoint, trained on (input_ids, targets) batches."""

    def __init__(self, pretrained: str, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = AutoModelForCausalLM.from_pretrained(pretrained)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        logits = self.model(input_ids=idx, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def save_pretrained_base(path: Path, seed: int = 0) -> Path:
    """Stand-in for a downloaded checkpoint: a small Llama from a config, saved in HF format."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def main(steps: int = 30, out: str = "lightning_logs/hf_peft_export") -> dict[str, object]:
    """Train, export, reload with peft. Returns losses, the adapter path and the reload check."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    out_dir = Path(out)
    base_path = save_pretrained_base(out_dir / "base")
    pl.seed_everything(0, verbose=False)
    module = HFCausalLM(str(base_path))
    data = ByteTextDataModule(seq_len=64, batch_size=8, train_samples=8 * steps, max_bytes=300_000)
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps,
        plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")],
        callbacks=[LoRA(r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=out_dir,
    )
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: dict, batch: object, batch_idx: int) -> None:
            losses.append(float(outputs["loss"]))

    trainer.callbacks.append(Record())
    trainer.fit(module, datamodule=data)

    # the adapter, relative to the HF model inside the LightningModule (`module.model`)
    adapter_path = LoRA.save_adapter(module, out_dir / "adapter")

    # What a downstream user does, with peft alone: fresh pretrained base + the adapter file.
    from peft import PeftModel

    LoRA.check_adapter_folder(adapter_path)  # its last save completed (peft does not read lightning_hbm's manifest)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), str(adapter_path))
    trained = {n.replace(".default", ""): p for n, p in LoRA.adapter_state_dict(module).items()}
    loaded = {n.replace(".default", ""): p for n, p in reloaded.named_parameters() if "lora_" in n}
    matched = 0
    for name, param in trained.items():
        key = "base_model.model." + name.removeprefix("model.")
        torch.testing.assert_close(loaded[key].float().cpu(), param.float().cpu())
        matched += 1
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; adapter written to {adapter_path}")
    print(f"peft reloaded it: {matched} LoRA tensors equal to the trained ones")
    return {"losses": losses, "adapter_path": adapter_path, "matched": matched, "trained": len(trained)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="lightning_logs/hf_peft_export")
    args = parser.parse_args()
    main(args.steps, args.out)
