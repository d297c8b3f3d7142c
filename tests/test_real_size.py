"""Real sizes: the largest tensors of real LLMs through every path that turns a size into an index or reads values.

Every other test model is tiny, which hid a crash on every real LLM: the fingerprint's float32 ``linspace``
rounded its last index up to ``numel`` above 2**24 elements (IndexError on SmolLM2's 49152 x 576 embedding).
Here: index math up to and past 2**31 elements (computed, nothing allocated), fingerprints and CRCs of real
allocations (``torch.empty`` pages are only mapped when touched, so a 1 GiB tensor costs what is read), the
planner's counts on fake tensors, and the headline: a model with a 49152 x 576 embedding and output head trains,
checkpoints and resumes bit-exact with ``QuantizedPrecision("nf4-dq")`` + ``LoRA``.
"""

from __future__ import annotations

import copy
import math
import zlib
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import lightning.pytorch as pl
import pytest
import torch

from lightning_hbm import FusedLoss, LoRA, QuantizedPrecision
from lightning_hbm.activations.loss import LazyLogits
from lightning_hbm.data import synthetic_batch
from lightning_hbm.memory import parameter_count
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import Candidate, predict
from lightning_hbm.resume import checksum, fingerprint, spread_indices, verify

# [vocab, hidden]: the largest tensor of each model (its embedding, and its output head when untied)
SMOLLM2_135M = (49152, 576)  # 28.3M elements: past 2**24, where float32 stops counting exactly
LLAMA2_7B = (32000, 4096)  # 131M: past 2**31 / 64, where int32 index x sample-number products overflow
LLAMA3_8B = (128256, 4096)  # 525M, 1 GiB in bf16
LLAMA3_70B = (128256, 8192)  # 1.05e9
LLAMA3_405B = (128256, 16384)  # 2.10e9, just under 2**31
REAL_SHAPES = [SMOLLM2_135M, LLAMA2_7B, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B]


# ------------------------------------------------------------------------- index math, nothing allocated


@pytest.mark.parametrize("n", [math.prod(s) for s in REAL_SHAPES] + [2**24 + 1, 2**31 + 7, 2**32 + 3, 2**40 + 11])
def test_spread_indices_are_exact_int64_and_inside(n: int) -> None:
    index = spread_indices(n, 64)
    assert index.dtype == torch.int64
    # Python ints are exact at any size: the reference
    assert index.tolist() == [i * (n - 1) // 63 for i in range(64)]
    assert index[0] == 0 and index[-1] == n - 1
    assert bool((index[1:] > index[:-1]).all())


def test_the_float32_linspace_it_replaced_lands_on_numel() -> None:
    # why spread_indices exists: the old index of the last sample is the tensor's length itself
    n = math.prod(SMOLLM2_135M)
    assert torch.linspace(0, n - 1, steps=64).long()[-1] == n
    assert spread_indices(n, 64)[-1] == n - 1


@pytest.mark.parametrize(("n", "k", "expected"), [(0, 64, []), (1, 64, [0]), (3, 64, [0, 1, 2]), (10, 1, [0]), (10, 2, [0, 9])])
def test_spread_indices_small_cases(n: int, k: int, expected: list[int]) -> None:
    assert spread_indices(n, k).tolist() == expected


# ------------------------------------------------------------------- fingerprints and CRCs of real allocations


@pytest.mark.parametrize(
    ("shape", "dtype"), [(SMOLLM2_135M, torch.float32), (LLAMA2_7B, torch.bfloat16), (LLAMA3_8B, torch.bfloat16)]
)
def test_fingerprint_of_a_real_size_tensor_reads_its_last_element(shape: tuple[int, int], dtype: torch.dtype) -> None:
    tensor = torch.empty(shape, dtype=dtype)  # pages are mapped when touched: the fingerprint reads 64 elements
    flat = tensor.view(-1)
    flat[-1] = 0
    before = fingerprint(tensor)
    flat[-1] = 1
    assert fingerprint(tensor) != before
    flat[-1] = 0
    assert fingerprint(tensor) == before
    assert fingerprint(torch.empty(shape, dtype=dtype, device="meta")) is None


@pytest.mark.slow
def test_fingerprint_past_2_31_elements() -> None:
    tensor = torch.empty(2**31 + 7, dtype=torch.uint8)  # 2 GiB of address space, 64 pages touched
    tensor[-1] = 0
    before = fingerprint(tensor)
    tensor[-1] = 1
    assert fingerprint(tensor) != before
    del tensor


@pytest.mark.slow
def test_checksum_of_a_1_gib_tensor_covers_its_last_byte() -> None:
    tensor = torch.empty(LLAMA3_8B, dtype=torch.bfloat16)
    tensor.view(-1)[-1] = 0
    before = checksum(tensor)
    assert before == zlib.crc32(tensor.view(-1).view(torch.uint8).numpy())
    tensor.view(-1)[-1] = 1
    assert checksum(tensor) != before
    del tensor


# ---------------------------------------------------------------------------- the planner, fake tensors only


@pytest.mark.slow
def test_planner_counts_an_8b_shaped_model_exactly() -> None:
    vocab, hidden = LLAMA3_8B
    factory = partial(LlamaLM, vocab_size=vocab, hidden_size=hidden, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=32, num_key_value_heads=8)
    with torch.device("meta"):
        meta = factory()
    total = parameter_count(meta)
    assert total > 2 * vocab * hidden  # embedding + head dominate: 1.05e9 parameters
    predicted = predict(factory, synthetic_batch(1, 8, vocab), Candidate("bf16-true"))
    assert predicted.total_params == total
    # bf16 weights, and AdamW's two bf16 states plus one fp32 step count per tensor: counted in Python ints
    assert predicted.categories["parameters"] == 2 * total
    assert predicted.categories["optimizer_states"] == 4 * total + 4 * len(list(meta.parameters()))


# ------------------------------------------------------- the headline: a real-size embedding and head, trained


VOCAB, HIDDEN = SMOLLM2_135M
EMBEDDING, HEAD = "model.model.embed_tokens.weight", "model.lm_head.weight"
MODES = {"adapters": False, "full": True}  # LoRA(full_checkpoint=...)


@pytest.fixture(scope="module")
def smollm2_shaped() -> LlamaLM:
    """SmolLM2-135M's embedding and untied output head (49152 x 576 each), one narrow layer; built once, copied per run."""
    torch.manual_seed(0)
    return LlamaLM(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=9, num_key_value_heads=3)


def _fit(base: LlamaLM, root: Path, epochs: int, full_checkpoint: bool = False, ckpt_path: Optional[Path] = None,
         save_to: Optional[Path] = None) -> LlamaLM:
    model = copy.deepcopy(base)
    torch.manual_seed(1)  # LoRA's initialization draws from the global RNG: the same in every run
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        default_root_dir=root,
        # fp32 compute: exact comparisons; the head too is quantized, so 4-bit packing reads 28M values
        # the embedding kept as built (not the int8 default): these tests read a 28.3M-element float tensor's values
        # (CRCs, fingerprints past 2**24 elements); the int8 table's own path is tests/layers/test_embedding*.py
        plugins=[QuantizedPrecision("nf4-dq", dtype="float32", quantize_head=True, quantize_embeddings=False)],
        callbacks=[LoRA(r=4, target_modules="all-linear", full_checkpoint=full_checkpoint)],
    )
    # one batch per epoch, token ids over the whole vocabulary; whole epochs, so a resume replays the same batches
    batches = [synthetic_batch(2, 16, VOCAB, seed=0)]
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return model


@pytest.fixture(scope="module")
def straight_model(smollm2_shaped: LlamaLM, tmp_path_factory: pytest.TempPathFactory) -> LlamaLM:
    """The model after two uninterrupted epochs: 4-bit base and head, trained adapters."""
    return _fit(smollm2_shaped, tmp_path_factory.mktemp("straight"), epochs=2)


@pytest.fixture(scope="module")
def straight(straight_model: LlamaLM) -> dict[str, torch.Tensor]:
    """Its adapters, copied."""
    return {k: v.detach().clone() for k, v in LoRA.adapter_state_dict(straight_model).items()}


@pytest.fixture(scope="module")
def halfway(smollm2_shaped: LlamaLM, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``halfway(mode)``: the checkpoint after one epoch, adapter-only or full, saved once per module."""
    saved: dict[str, Path] = {}

    def get(mode: str) -> Path:
        if mode not in saved:
            root = tmp_path_factory.mktemp(mode)
            _fit(smollm2_shaped, root, epochs=1, full_checkpoint=MODES[mode], save_to=root / "half.ckpt")
            saved[mode] = root / "half.ckpt"
        return saved[mode]

    return get


@pytest.mark.slow
def test_a_49152_x_576_embedding_trains_checkpoints_and_resumes_with_qlora(
    smollm2_shaped: LlamaLM, straight: dict[str, torch.Tensor], halfway: Callable[[str], Path], tmp_path: Path
) -> None:
    path = halfway("adapters")
    meta = torch.load(path, weights_only=False)["lightning_hbm"]
    # adapter-only: the frozen base is rebuilt on resume and must match fingerprints taken before quantization
    assert {EMBEDDING, HEAD} <= set(meta["omitted"])
    assert meta["fingerprints"][EMBEDDING] == fingerprint(smollm2_shaped.state_dict()[EMBEDDING])
    assert meta["fingerprints"][HEAD] == fingerprint(smollm2_shaped.state_dict()[HEAD])

    resumed = LoRA.adapter_state_dict(_fit(smollm2_shaped, tmp_path, epochs=2, ckpt_path=path))
    assert set(resumed) == set(straight) and any("lora_B" in k for k in resumed)
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=0, msg=name)
    assert any(v.abs().sum() > 0 for k, v in resumed.items() if "lora_B" in k)  # the adapters really trained


@pytest.mark.slow
def test_a_base_changed_in_its_last_embedding_element_is_refused(
    smollm2_shaped: LlamaLM, halfway: Callable[[str], Path], tmp_path: Path
) -> None:
    other = copy.deepcopy(smollm2_shaped)
    with torch.no_grad():
        other.state_dict()[EMBEDDING].view(-1)[-1] += 1.0  # element 28,311,551: where the float32 index ran off the end
    with pytest.raises(ValueError, match=rf"adapters trained on another frozen base: 1 base tensor.*{EMBEDDING}"):
        _fit(other, tmp_path, epochs=2, ckpt_path=halfway("adapters"))


@pytest.mark.slow
def test_a_full_checkpoint_carries_crcs_of_the_real_size_tensors(
    smollm2_shaped: LlamaLM, halfway: Callable[[str], Path], tmp_path: Path
) -> None:
    path = halfway("full")
    checkpoint = torch.load(path, weights_only=False)
    meta = checkpoint["lightning_hbm"]
    # the embedding as built, and the 4-bit head's packed bytes (half its 28.3M values), each with a CRC of all its bytes
    assert meta["checksums"][EMBEDDING] == checksum(smollm2_shaped.state_dict()[EMBEDDING])
    assert meta["state_dict"][HEAD].numel() == VOCAB * HIDDEN // 2 and meta["checksums"][HEAD] is not None
    verify({**checkpoint, "lightning_hbm": dict(meta)}, path)  # the file as saved passes

    checkpoint["state_dict"][EMBEDDING].view(-1).view(torch.uint8)[-1] ^= 1
    damaged = tmp_path / "damaged.ckpt"
    torch.save(checkpoint, damaged)
    del checkpoint, meta
    with pytest.raises(ValueError, match=rf"is damaged: tensor '{EMBEDDING}' does not match the checksum"):
        _fit(smollm2_shaped, tmp_path, epochs=2, full_checkpoint=True, ckpt_path=damaged)


@pytest.mark.slow
def test_fused_loss_on_the_real_size_4bit_head_equals_the_unfused_loss(straight_model: LlamaLM) -> None:
    # FusedLoss dequantizes the 4-bit 49152 x 576 head once and runs its logits chunk by chunk
    fused = copy.deepcopy(straight_model)
    FusedLoss(chunk_size=8).transform_model(fused)
    batch = synthetic_batch(2, 16, VOCAB, seed=1)
    with torch.no_grad():  # the fused model's logits are lazy: the full [tokens, 49152] tensor is never built
        assert isinstance(fused(batch[0]), LazyLogits) and not isinstance(straight_model(batch[0]), LazyLogits)
    losses, grads = [], []
    for module in (straight_model, fused):
        module.zero_grad(set_to_none=True)
        loss = module.loss(batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
        module.zero_grad(set_to_none=True)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    assert grads[0].keys() == grads[1].keys() and any("lora_B" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-7, msg=name)
