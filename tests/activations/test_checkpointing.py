"""ActivationCheckpointing: same gradients, fewer saved bytes, unchanged names, every error message."""

from __future__ import annotations

import copy
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn

from lightning_hbm import ActivationCheckpointing, QuantizedPrecision, applied_transforms, quantize_model
from lightning_hbm.activations import checkpointing
from lightning_hbm.activations import offload as offload_hooks
from lightning_hbm.activations.checkpointing import (
    OffloadSavedTensors,
    host_footprint,
    pinned_footprint,
    pinned_pieces,
)
from lightning_hbm.adapters.lora import LoRA
from lightning_hbm.data import synthetic_batch
from lightning_hbm.layers.blocks import find_blocks
from lightning_hbm.memory.activations import saved_activation_bytes
from lightning_hbm.memory.torch_tracker import torch_peak_bytes
from lightning_hbm.record import checkpoint_setup, checkpointed_blocks

SEQ = 128  # long enough that the blocks' activations dominate the logits of the tiny LM


def _grads(module: pl.LightningModule, batch: Any) -> dict[str, Tensor]:
    module.zero_grad(set_to_none=True)
    module.loss(batch).backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _batch(seq: int = SEQ, batch_size: int = 4) -> Any:
    return synthetic_batch(batch_size=batch_size, seq_len=seq, seed=1)


@pytest.mark.parametrize(
    "kwargs", [dict(policy="full"), dict(policy="selective"), dict(every=2), dict(offload=True)], ids=str
)
def test_gradients_and_state_dict_keys_equal_the_unchanged_model(gpt_factory: Callable, kwargs: dict) -> None:
    reference = gpt_factory(n_layer=4, block_size=SEQ)
    model = gpt_factory(n_layer=4, block_size=SEQ)
    callback = ActivationCheckpointing(**kwargs)
    callback.transform_model(model)
    batch = _batch(seq=64, batch_size=2)
    expected, got = _grads(reference, batch), _grads(model, batch)
    assert sorted(got) == sorted(expected) == sorted(n for n, _ in reference.named_parameters())
    for name in expected:  # plain torch in fp32: recompute gives bit-identical gradients
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    assert list(model.state_dict()) == list(reference.state_dict())
    assert callback.checkpointed == ([f"model.h.{i}" for i in (0, 2)] if kwargs.get("every") else [f"model.h.{i}" for i in range(4)])


def test_full_saves_at_least_60_percent_and_selective_lands_in_between(gpt_factory: Callable) -> None:
    batch = _batch()
    measured = {}
    for policy in (None, "selective", "full"):
        model = gpt_factory(n_layer=4, block_size=SEQ)
        if policy is not None:
            ActivationCheckpointing(policy).transform_model(model)
        measured[policy] = saved_activation_bytes(lambda: model.loss(batch), model)  # noqa: B023 - called at once
    assert measured["full"] <= 0.4 * measured[None], measured
    assert measured["full"] < measured["selective"] < measured[None], measured
    # every=2 checkpoints half the blocks: between full and none as well
    model = gpt_factory(n_layer=4, block_size=SEQ)
    ActivationCheckpointing(every=2).transform_model(model)
    assert measured["full"] < saved_activation_bytes(lambda: model.loss(batch), model) < measured[None]


def test_full_checkpointing_frees_the_inputs_of_an_int8_base(
    llama_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable
) -> None:
    # bitsandbytes' int8 matmul keeps its input outside autograd's saved tensors (ctx.A), so checkpointing could not
    # free it: measured by torch's MemTracker at hidden 256 (4 layers, 4 x 256 tokens), 0.62x of the unchecked peak
    # before lightning_hbm dropped it (_compat.bitsandbytes.drop_int8_kept_input), 0.38x after; nf4-dq 0.37x.
    batch = _batch(seq=256, batch_size=4)
    peaks = {}
    for policy in (None, "full"):
        module = llama_factory(hidden_size=128, intermediate_size=512, num_hidden_layers=4)
        callbacks: list[pl.Callback] = [LoRA(r=8)] + ([ActivationCheckpointing(policy)] if policy else [])
        trainer_factory(max_steps=1, plugins=[QuantizedPrecision("int8", dtype="float32")], callbacks=callbacks).fit(
            module, datamodule=datamodule_factory()
        )
        peaks[policy] = torch_peak_bytes(lambda: module.loss(batch).backward(), module)  # noqa: B023 - called at once
    assert peaks["full"] < 0.5 * peaks[None], peaks


def test_full_checkpointing_frees_the_inputs_of_int8_layers_transformers_built(
    llama_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Any
) -> None:
    # the same leak in a model loaded with transformers' load_in_8bit (bitsandbytes' Linear8bitLt, not built by
    # lightning_hbm): the surgery gives those layers the same hook. Without it: 0.66x of the unchecked peak; with it, under 0.5x.
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    llama_factory(hidden_size=128, intermediate_size=512, num_hidden_layers=4).model.save_pretrained(tmp_path / "llama")
    batch = _batch(seq=256, batch_size=4)
    peaks = {}
    for policy in (None, "full"):
        module = llama_factory(hidden_size=128, intermediate_size=512, num_hidden_layers=4)
        module.model = LlamaForCausalLM.from_pretrained(
            tmp_path / "llama", quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu"
        )
        callbacks: list[pl.Callback] = [LoRA(r=8)] + ([ActivationCheckpointing(policy)] if policy else [])
        trainer_factory(max_steps=1, callbacks=callbacks).fit(module, datamodule=datamodule_factory())
        peaks[policy] = torch_peak_bytes(lambda: module.loss(batch).backward(), module)  # noqa: B023 - called at once
    assert peaks["full"] < 0.5 * peaks[None], peaks


def test_no_checkpointing_without_grad(gpt_factory: Callable) -> None:
    reference, model = gpt_factory(), gpt_factory()
    ActivationCheckpointing().transform_model(model)
    idx = _batch(seq=32)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(idx), reference(idx), rtol=0, atol=0)


def test_block_auto_detection(gpt_factory: Callable, llama_factory: Callable) -> None:
    assert [n for n, _ in find_blocks(gpt_factory(n_layer=3))] == ["model.h.0", "model.h.1", "model.h.2"]
    llama = llama_factory()
    found = find_blocks(llama)
    assert [n for n, _ in found] == ["model.model.layers.0", "model.model.layers.1"]
    assert {type(m).__name__ for _, m in found} == {"LlamaDecoderLayer"}


def test_llama_gradients_equal(llama_factory: Callable) -> None:
    reference, model = llama_factory(), llama_factory()
    callback = ActivationCheckpointing("selective")
    callback.transform_model(model)
    batch = _batch(seq=32)
    expected, got = _grads(reference, batch), _grads(model, batch)
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    assert list(model.state_dict()) == list(reference.state_dict())


def test_blocks_by_class_name_and_path(gpt_factory: Callable) -> None:
    model = gpt_factory(n_layer=3)
    by_class = ActivationCheckpointing(blocks=["MLP"])
    by_class.transform_model(model)
    assert by_class.checkpointed == ["model.h.0.mlp", "model.h.1.mlp", "model.h.2.mlp"]
    model = gpt_factory(n_layer=3)
    by_path = ActivationCheckpointing(blocks=["model.h.1"])
    by_path.transform_model(model)
    assert by_path.checkpointed == ["model.h.1"]
    assert checkpoint_setup(model.model.h[0]) is None


def test_lazy_model_through_trainer(lazy_gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable) -> None:
    model = lazy_gpt_factory()
    callback = ActivationCheckpointing()
    trainer = trainer_factory(max_steps=2, callbacks=[callback])
    trainer.fit(model, datamodule=datamodule_factory())
    assert callback.checkpointed == ["model.h.0", "model.h.1"]  # found after configure_model built them
    assert "ActivationCheckpointing" in applied_transforms(model)
    trainer.validate(model, datamodule=datamodule_factory(), verbose=False)  # not applied twice
    assert applied_transforms(model).count("ActivationCheckpointing") == 1


def test_new_trainer_on_a_checkpointed_model_applies_its_own_settings(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable
) -> None:
    model, datamodule = gpt_factory(), datamodule_factory(seq_len=32, batch_size=4)
    trainer_factory(max_steps=1, callbacks=[ActivationCheckpointing()]).fit(model, datamodule=datamodule)
    callback = ActivationCheckpointing(every=2, offload=True)
    trainer_factory(max_steps=1, callbacks=[callback]).fit(model, datamodule=datamodule)
    assert callback.checkpointed == ["model.h.0"]
    assert "forward" not in vars(model.model.h[1])  # unwrapped: the class's forward again
    assert callback.offload is not None and callback.offload.copies == 1


def test_deepcopy_rebinds_to_the_copy(gpt_factory: Callable) -> None:
    model = gpt_factory()
    ActivationCheckpointing().transform_model(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.model.h[0].mlp.c_fc.weight.zero_()
    idx = _batch(seq=16)[0]
    assert not torch.equal(clone(idx), model(idx))  # the copy runs its own (changed) weights


def test_offload_copies_saved_tensors_and_brings_them_back() -> None:
    x = torch.randn(8, 16, requires_grad=True)
    weight = nn.Parameter(torch.randn(16, 4))
    hooks = OffloadSavedTensors("cpu")
    with hooks:
        y = (x.sin() @ weight).sum()
    # saved: x (for sin), sin(x) (for mm); the parameter is saved by reference, never copied
    assert hooks.copies == 2
    assert hooks.copied_bytes == 2 * x.numel() * 4
    y.backward()
    torch.testing.assert_close(x.grad, (torch.ones(8, 4) @ weight.detach().T) * x.detach().cos())


def test_frozen_embeddings_still_give_block_gradients(gpt_factory: Callable) -> None:
    """The trap: reentrant checkpointing gives nothing to trainable params behind frozen inputs."""
    reference, model = gpt_factory(), gpt_factory()
    for module in (reference, model):
        module.model.wte.requires_grad_(False)
        module.model.wpe.requires_grad_(False)
    ActivationCheckpointing().transform_model(model)
    batch = _batch(seq=32)
    expected, got = _grads(reference, batch), _grads(model, batch)
    assert "model.h.0.ln_1.weight" in got and "model.wte.weight" not in got
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_nf4_lora_gradients_match_without_checkpointing(gpt_factory: Callable, policy: str) -> None:
    """QLoRA behind frozen embeddings: adapters still get the no-checkpoint gradients."""
    reference, model = gpt_factory(), gpt_factory()
    for module in (reference, model):
        quantize_model(module, "nf4", dtype="float32")
        torch.manual_seed(1)  # same adapter init in both models
        LoRA(r=4).transform_model(module)
        with torch.no_grad():  # lora_B starts at zero, which would give lora_A a zero gradient
            for name, param in module.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.02)
    ActivationCheckpointing(policy).transform_model(model)  # type: ignore[arg-type]
    assert not model.model.wte.weight.requires_grad  # inputs of the first checkpointed block need no grad
    batch = _batch(seq=32)
    expected, got = _grads(reference, batch), _grads(model, batch)
    assert sorted(got) == sorted(expected) and all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    assert all(got[n].abs().sum() > 0 for n in got)  # every adapter, the first block's included, got a gradient
    for name in expected:  # same dequantization in forward and recompute: equal up to float reordering
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_trains_with_quantized_precision_lora_and_offload(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, tmp_path: Any
) -> None:
    from peft import get_peft_model_state_dict

    model = gpt_factory()
    callback = ActivationCheckpointing(offload=True)
    trainer = trainer_factory(
        max_steps=2, plugins=[QuantizedPrecision("nf4", dtype="float32")], callbacks=[LoRA(r=4), callback]
    )
    trainer.fit(model, datamodule=datamodule_factory(seq_len=32, batch_size=4))
    assert applied_transforms(model)[-2:] == ["LoRA", "ActivationCheckpointing"]
    adapters = get_peft_model_state_dict(model)  # empty if parameter names had been prefixed
    assert adapters and all("lora_" in k for k in adapters)
    assert any(v.abs().sum() > 0 for k, v in adapters.items() if "lora_B" in k)  # lora_B starts at zero: it trained
    trainer.save_checkpoint(tmp_path / "adapters.ckpt")
    saved = torch.load(tmp_path / "adapters.ckpt", weights_only=False)["lightning_hbm"]["state_dict"]
    assert sorted(saved) == sorted(LoRA.adapter_state_dict(model)) and len(saved) == len(adapters) > 0
    # full checkpointing saves one input per block, the only tensors offloaded: 2 blocks * (4 x 32 x 64) fp32
    assert callback.offload is not None and callback.offload.copies == 2
    assert trainer.callback_metrics["activations/offloaded_bytes"].item() == 2 * 4 * 32 * 64 * 4


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"policy='none'.*'full' or 'selective'"):
        ActivationCheckpointing(policy="none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"every=0.*int >= 1"):
        ActivationCheckpointing(every=0)
    with pytest.raises(TypeError, match=r"blocks='Block'\): wrong type str; pass a list of strs or None"):
        ActivationCheckpointing(blocks="Block")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"offload_device='gpu0'\) is not a torch device: use 'cpu'"):
        ActivationCheckpointing(offload=True, offload_device="gpu0")


def test_bad_blocks_leave_the_model_untouched(gpt_factory: Callable) -> None:
    model = gpt_factory()
    with pytest.raises(ValueError, match=r"\['Bock'\] name no submodule path and no module class of NanoGPT\. Did you mean 'Block'.*'Block'"):
        ActivationCheckpointing(blocks=["Block", "Bock"]).transform_model(model)
    with pytest.raises(ValueError, match=r"nested inside other selected modules: \['model.h.0.mlp'"):
        ActivationCheckpointing(blocks=["Block", "MLP"]).transform_model(model)
    assert all(checkpoint_setup(b) is None for b in model.model.h)


class _NoBlocks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


def test_model_without_repeated_blocks_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"found no repeated blocks in _NoBlocks.*Pass blocks=\[\.\.\.\]"):
        ActivationCheckpointing().transform_model(_NoBlocks())


class _MixerLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mix(self.norm(x)).tanh()


class _AttentionLayer(_MixerLayer):  # another class, as Jamba's attention layers beside its Mamba layers
    pass


def test_hybrid_stack_of_several_layer_classes_is_found_and_checkpointed() -> None:
    """transformers Jamba / Zamba2 keep Mamba and attention layers in one ModuleList (was: "found no repeated blocks")."""
    model = nn.Module()
    model.layers = nn.ModuleList([_MixerLayer(), _AttentionLayer(), _MixerLayer()])
    model.heads = nn.ModuleList([nn.Linear(8, 2), nn.Linear(8, 3)])  # leaves: never blocks
    assert [n for n, _ in find_blocks(model)] == ["layers.0", "layers.1", "layers.2"]
    callback = ActivationCheckpointing()
    callback.transform_model(model)
    assert callback.checkpointed == ["layers.0", "layers.1", "layers.2"]
    # a one-class stack anywhere wins: the mixed list is only the fallback
    model.stack = nn.ModuleList([_MixerLayer(), _MixerLayer()])
    assert [n for n, _ in find_blocks(model)] == ["stack.0", "stack.1"]


def test_hf_gradient_checkpointing_twice_is_an_error(llama_factory: Callable) -> None:
    model = llama_factory()
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match=r"already use transformers' own gradient checkpointing.*gradient_checkpointing_disable"):
        ActivationCheckpointing().transform_model(model)


@pytest.mark.gpu
def test_offload_lowers_peak_cuda_memory(gpt_factory: Callable) -> None:
    batch = [t.cuda() for t in synthetic_batch(batch_size=8, seq_len=1024, seed=0)]
    peaks = {}
    for offload in (False, True):
        model = gpt_factory(n_layer=8, n_embd=256, block_size=1024).cuda()
        ActivationCheckpointing(offload=offload).transform_model(model)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model.loss(batch).backward()
        torch.cuda.synchronize()
        peaks[offload] = torch.cuda.max_memory_allocated() - base
        del model
    assert peaks[True] < peaks[False], peaks


def test_block_names_resolve_against_the_model_as_built(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable
) -> None:
    """blocks=["Linear"] means the user's Linear layers, not peft's inner lora_A/lora_B Linears."""
    model = gpt_factory()
    user_linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    callback = ActivationCheckpointing(blocks=["Linear"])
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4", dtype="float32")], callbacks=[LoRA(r=2), callback])
    trainer.fit(model, datamodule_factory())
    assert callback.checkpointed == user_linears
    assert not any("lora_" in n or "base_layer" in n for n in callback.checkpointed)
    wrapped = checkpointed_blocks(model)
    assert wrapped == user_linears


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without the offload device")
def test_offload_to_a_missing_device_is_refused_before_the_model_changes(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, snapshot: Any
) -> None:
    from lightning_hbm import QuantizedPrecision

    model = gpt_factory()
    before = snapshot(model)
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
                              callbacks=[ActivationCheckpointing(offload=True, offload_device="cuda")])
    with pytest.raises(ValueError, match=r"offload_device='cuda'\): no cuda device here.*offload_device='cpu'"):
        trainer.fit(model, datamodule_factory())
    assert snapshot(model) == before and trainer.global_step == 0


def test_find_blocks_never_nests_a_stack_that_is_itself_a_block() -> None:
    """timm EfficientNet: `blocks` holds stage Sequentials whose items are the blocks (issue 33: both were found)."""

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int) -> None:
            super().__init__()
            self.conv = nn.Conv2d(cin, cout, 3, padding=1)
            self.norm = nn.BatchNorm2d(cout)

        def forward(self, x: Tensor) -> Tensor:
            return self.norm(self.conv(x))

    model = nn.Module()
    model.blocks = nn.Sequential(nn.Sequential(Block(3, 8)), nn.Sequential(Block(8, 16), Block(16, 16)), nn.Sequential(Block(16, 24), Block(24, 24), Block(24, 24)))
    names = [n for n, _ in find_blocks(model)]
    # the stage of one block gives way to it too: one level of blocks everywhere (issue 53: blocks.0 was the stage)
    assert names == ["blocks.0.0", "blocks.1.0", "blocks.1.1", "blocks.2.0", "blocks.2.1", "blocks.2.2"], names
    callback = ActivationCheckpointing()
    callback.transform_model(model)
    assert callback.checkpointed == names
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    model.blocks(x).sum().backward()  # the recompute of one level of blocks runs
    assert x.grad is not None


def test_offload_restores_each_input_once_and_prefetches_the_one_before(gpt_factory: Callable) -> None:
    """Backward restores the last block's input, and prefetches the input packed before it (the next one needed):
    the gradients are those of plain checkpointing, and no input is copied back twice."""
    reference, model = gpt_factory(), gpt_factory()
    ActivationCheckpointing().transform_model(reference)
    callback = ActivationCheckpointing(offload=True)
    callback.transform_model(model)
    hooks = callback.offload
    assert hooks is not None
    restores: list[int] = []
    restore = hooks._restore

    def counted(handle: Any, prefetch: bool) -> torch.Tensor:
        restores.append(int(prefetch))
        return restore(handle, prefetch)

    hooks._restore = counted  # type: ignore[method-assign]  # count the copies back
    batch = _batch(seq=32)
    expected, got = _grads(reference, batch), _grads(model, batch)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    # two blocks: the last one's input restored when needed, the first one's prefetched then
    assert hooks.copies == 2 and restores == [0, 1]
    assert hooks.host_bytes == 0  # CPU to CPU: the same memory, nothing left the device


@pytest.mark.gpu
def test_offload_on_cuda_gives_the_same_gradients_and_frees_the_block_inputs(gpt_factory: Callable) -> None:
    """Untested here (no GPU this session): side-stream copies to pinned memory, the backward prefetch, the same
    gradients as plain checkpointing, and the inputs off the device (host_bytes: pinned, in power-of-two pieces)."""
    torch.manual_seed(0)
    reference, model = gpt_factory().cuda(), gpt_factory().cuda()
    model.load_state_dict(reference.state_dict())
    ActivationCheckpointing().transform_model(reference)
    callback = ActivationCheckpointing(offload=True)
    callback.transform_model(model)
    batch = tuple(t.cuda() for t in _batch(seq=128))
    expected, got = _grads(reference, batch), _grads(model, batch)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)
    assert callback.offload is not None and callback.offload.copies == 2
    assert callback.offload.host_bytes == 2 * pinned_footprint(4 * 128 * 64 * 4)


def test_segformer_is_checkpointed_per_layer_not_per_stage() -> None:
    """transformers SegFormer keeps each stage's layers in a ModuleList inside its SegformerStage (issue 53: each whole
    stage was wrapped, so a 40-layer stage kept all 40 layers' recompute alive at once). A stage of one layer beside
    stages that gave way to their layers gives way to its layer too."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = SegformerConfig(num_encoder_blocks=3, depths=[1, 2, 3], sr_ratios=[4, 2, 1], hidden_sizes=[8, 16, 32],
                             num_attention_heads=[1, 2, 4], decoder_hidden_size=16, num_labels=3)
    model = SegformerForSemanticSegmentation(config)
    layers = [n for n, m in model.named_modules() if type(m).__name__ == "SegformerLayer"]
    assert len(layers) == 6
    callback = ActivationCheckpointing()
    callback.transform_model(model)
    assert [n for n in callback.checkpointed if n.startswith("segformer.")] == layers
    pixels = torch.randn(1, 3, 32, 32)
    model(pixel_values=pixels, labels=torch.randint(0, 3, (1, 32, 32))).loss.backward()  # the recompute runs


def test_partial_offload_moves_the_first_blocks_inputs_and_keeps_the_gradients(gpt_factory: Callable) -> None:
    """offload=k: only the first k checkpointed blocks' inputs go to the offload target (the rest stay on the device),
    the gradients are those of plain checkpointing, and the last offloaded input is not held in flight once a block
    that keeps its input runs (it would stay on the device through the backward's peak)."""
    reference, model = gpt_factory(n_layer=4), gpt_factory(n_layer=4)
    ActivationCheckpointing().transform_model(reference)
    callback = ActivationCheckpointing(offload=1)
    callback.transform_model(model)
    hooks = callback.offload
    assert hooks is not None and callback.offloaded == ["model.h.0"] and len(callback.checkpointed) == 4
    in_flight: list[bool] = []
    block = model.model.h[1]
    block.register_forward_pre_hook(lambda m, a: in_flight.append(hooks._in_flight is not None))
    batch = _batch(seq=32)
    expected, got = _grads(reference, batch), _grads(model, batch)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    assert hooks.copies == 1 and hooks.copied_bytes == 4 * 32 * 64 * 4  # block 0's input only (fp32, hidden 64)
    assert hooks._in_flight is None and in_flight == [True]  # held until block 1 (which keeps its input) started
    every = ActivationCheckpointing(offload=4)  # as many as the blocks: every one, as offload=True
    every.transform_model(gpt_factory(n_layer=4))
    assert every.offloaded == every.checkpointed
    none = ActivationCheckpointing(offload=0)
    assert none.offload is None and none.offload_blocks == 0


def test_partial_offload_refuses_bad_counts_before_the_model_changes(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, snapshot: Any
) -> None:
    with pytest.raises(ValueError, match=r"offload=-1\): a number of blocks must be >= 0.*True for every block"):
        ActivationCheckpointing(offload=-1)
    with pytest.raises(TypeError, match=r"offload=2\.5\): wrong type float; pass True or False or an int"):
        ActivationCheckpointing(offload=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"offload='2'\): wrong type str; pass True or False or an int"):
        ActivationCheckpointing(offload="2")  # type: ignore[arg-type]
    model = gpt_factory()  # two blocks
    before = snapshot(model)
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
                              callbacks=[LoRA(r=2), ActivationCheckpointing(offload=3)])
    with pytest.raises(ValueError, match=r"offload=3\): the model has 2 checkpointed blocks.*offload=2 or offload=True"):
        trainer.fit(model, datamodule_factory())
    assert snapshot(model) == before and trainer.global_step == 0


def test_pinned_pieces_are_powers_of_two_within_two_mib_of_the_copy() -> None:
    """torch's pinned allocator rounds a request up to a power of two: one 6.8 GiB block input pinned 8 GiB. Stored in
    power-of-two pieces, a copy over 2 MiB pins less than 2 MiB more than its bytes."""
    mib, gib = 1 << 20, 1 << 30
    assert pinned_pieces(0) == [] and pinned_footprint(0) == 0
    assert pinned_pieces(1) == [1] and pinned_pieces(3) == [4] and pinned_pieces(3 * mib // 2) == [2 * mib]
    assert pinned_pieces(2 * mib) == [2 * mib] and pinned_pieces(2 * mib + 1) == [4 * mib]
    assert pinned_pieces(7 * gib) == [4 * gib, 2 * gib, gib]
    for nbytes in (int(6.8 * gib), 223_076 * 4096 * 2, 3 * mib + 5):
        pieces = pinned_pieces(nbytes)
        assert all(p & (p - 1) == 0 for p in pieces) and pieces == sorted(pieces, reverse=True)
        assert nbytes <= pinned_footprint(nbytes) < nbytes + 2 * mib
    assert pinned_footprint(int(6.8 * gib)) < 7 * gib  # was 8 GiB: the next power of two


def test_pinned_pieces_round_trip_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offload's host copy in pieces (the CUDA path without pinning or streams) gives back the same tensor."""
    monkeypatch.setattr(offload_hooks, "PIECE_BYTES", 64)  # read where the offload hooks live
    tensor = torch.randn(8, 124, dtype=torch.bfloat16)  # 1,984 B: pieces of 1024, 512, 256, 128, 64 B
    copy = checkpointing._Pieces(tensor, torch.device("cpu"), pin=False)
    assert [p.numel() * 2 for p in copy.pieces] == [1024, 512, 256, 128, 64]
    copy.fill(tensor)
    restored = copy.restore(torch.device("cpu"))
    assert restored.shape == tensor.shape and torch.equal(restored, tensor)
    assert host_footprint(tensor) == 1984
    odd = torch.randn(999)  # 3,996 B: rounded up to 4,032 (63 x 64), one piece per bit
    assert [p.numel() * 4 for p in checkpointing._Pieces(odd, torch.device('cpu'), pin=False).pieces] == [2048, 1024, 512, 256, 128, 64]
    transposed = torch.randn(100, 10).T  # dense in another order: pieces in memory order (session 25)
    assert host_footprint(transposed) == 4032
    strided = torch.randn(100, 20)[:, ::2]  # gaps: split only dense copies, a gapped one is one power-of-two tensor
    assert host_footprint(strided) == 4096


@pytest.mark.gpu
def test_offload_on_cuda_pins_the_block_inputs_in_pieces_without_rounding(gpt_factory: Callable) -> None:
    """Not yet run on GPU: block inputs of 5 MiB (one request would pin 8 MiB) are pinned as 4 + 2 MiB pieces on the
    side stream and come back as one tensor each; the gradients are plain checkpointing's, and the pinned allocator's
    own count of the bytes handed out during the forward equals ``host_bytes``, which the planner predicts."""
    torch.manual_seed(0)
    reference, model = gpt_factory(n_embd=640, n_head=4).cuda(), gpt_factory(n_embd=640, n_head=4).cuda()
    model.load_state_dict(reference.state_dict())
    ActivationCheckpointing().transform_model(reference)
    callback = ActivationCheckpointing(offload=True)
    callback.transform_model(model)
    batch = tuple(t.cuda() for t in _batch(seq=128, batch_size=16))
    block_input = 16 * 128 * 640 * 4  # 5 MiB of fp32 hidden states per block
    expected = _grads(reference, batch)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    active = torch.cuda.host_memory_stats().get("active_bytes.current", 0)
    loss = model.loss(batch)
    torch.cuda.synchronize()
    pinned = torch.cuda.host_memory_stats()["active_bytes.current"] - active
    loss.backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)
    assert callback.offload is not None and callback.offload.copies == 2
    assert callback.offload.host_bytes == 2 * pinned_footprint(block_input) == 2 * 6 * 2**20 == pinned
