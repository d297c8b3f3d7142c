"""ActivationCheckpointing(mlp_chunks=k): same training, a smaller backward working set, the MLP run once per pass,
and every layer it leaves whole named with the reason (decided by running the layer)."""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm.activations.token_chunks import ChunkedForward, decide
from lightning_hbm.data import synthetic_batch
from lightning_hbm.memory.torch_tracker import torch_peak_bytes

SEQ = 128


def _fit(module: pl.LightningModule, trainer_factory: Callable, chunks: int, steps: int = 3, quantized: bool = True) -> Any:
    callback = ActivationCheckpointing(mlp_chunks=chunks)
    # the embedding kept in fp32: with the default int8 table the chunked run's LoRA weights differ from the whole
    # recompute's by up to 9.4e-6 after 3 AdamW steps (2.3e-7 with it in fp32), over this test's 1e-6. Not the int8
    # path (measured, session 31): the first step's gradients agree as closely with either table (5.0e-7 of each
    # tensor's largest, 5.3e-7 in fp32). The 9.4e-6 is AdamW's first update of one element (layer 0's
    # up_proj.lora_B) whose gradient, 1.4996e-8 whole vs 1.5192e-8 chunked (rounding: 2e-10 beside the tensor's 1e-2),
    # sits at Adam's eps (1e-8), where lr * g / (|g| + eps) moves most: 3e-3 * (0.60305 - 0.59993) = 9.4e-6. The int8
    # table only changes the values, so that one gradient lands near eps; in fp32 none does.
    plugins = [QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings=False)] if quantized else []
    trainer = trainer_factory(max_steps=steps, plugins=plugins, callbacks=[LoRA(r=4), callback] if quantized else [callback])
    batch = synthetic_batch(batch_size=2, seq_len=SEQ, seed=1, vocab_size=module.hparams.get("vocab_size", 256))
    loader = torch.utils.data.DataLoader([(x, y) for x, y in zip(*batch)], batch_size=2)
    trainer.fit(module, loader)
    return callback, batch


@pytest.fixture
def trained(llama_factory: Callable, trainer_factory: Callable) -> Callable[[int], tuple[Any, Any, dict[str, Tensor]]]:
    """``trained(chunks)``: a tiny transformers Llama after 3 QLoRA steps with that many token chunks."""

    def make(chunks: int) -> tuple[Any, Any, dict[str, Tensor]]:
        module = llama_factory(hidden_size=64, intermediate_size=256, num_hidden_layers=2)
        callback, batch = _fit(module, trainer_factory, chunks)
        return module, callback, {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}

    return make


def test_chunked_training_equals_whole_recompute_and_chunks_only_the_mlps(trained: Callable) -> None:
    _, whole, expected = trained(1)
    module, callback, got = trained(4)
    assert whole.chunked == []
    assert callback.chunked == [f"model.model.layers.{i}.mlp" for i in range(2)]  # not attention, not the norms
    verdicts = {n: f.verdict for n, m in module.named_modules() for f in [m.__dict__.get("forward")] if isinstance(f, ChunkedForward)}
    assert verdicts["model.model.layers.0.self_attn"] == "not called with one tensor of tokens"
    assert verdicts["model.model.layers.0.input_layernorm"].endswith("per token for backward (chunks pay from 2x)")
    assert sorted(got) == sorted(expected)
    for name in expected:  # same arithmetic in other row blocks: float rounding only
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def _counting(module: nn.Module, counts: dict[str, int]) -> None:
    def hook(_m: nn.Module, _i: Any, out: Tensor) -> None:
        counts["rows"] = counts.get("rows", 0) + out.numel() // out.shape[-1]  # tokens, whatever the chunks' shape

    module.register_forward_hook(hook)


def test_the_mlp_runs_once_forward_and_once_in_backward_and_the_peak_drops(llama_factory: Callable, trainer_factory: Callable) -> None:
    # Nesting torch.utils.checkpoint per chunk ran the MLP 2.75 times per step (the block's recompute re-ran the
    # chunks before the last); the saved input is packed before the compute, so the block's recompute stops there.
    peaks, rows = {}, {}
    for chunks in (1, 4):
        module = llama_factory(hidden_size=64, intermediate_size=512, num_hidden_layers=2)
        _fit(module, trainer_factory, chunks, steps=1)
        counts: dict[str, int] = {}
        _counting(module.model.model.layers[1].mlp.gate_proj, counts)
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.0)
        batch = synthetic_batch(batch_size=4, seq_len=256, seed=2, vocab_size=module.hparams["vocab_size"])

        def step() -> None:
            module.loss(batch).backward()  # noqa: B023 - step runs only in this iteration

        peaks[chunks] = torch_peak_bytes(step, module, optimizer)
        counts.clear()
        step()
        rows[chunks] = counts["rows"]
    assert rows[1] == rows[4] == 2 * 4 * 256  # forward + the backward's recompute, 4 x 256 tokens each: nothing twice
    # one MLP's recompute: 1024 tokens x 512 wide x 4 bytes x (gate, up, act, product) = 8 MiB whole, 2 MiB a chunk
    assert peaks[1] - peaks[4] > 3 * 2**20, peaks


class _Widen(nn.Module):
    """A token-wise widening layer (an MLP), with the variations the tests below switch on."""

    def __init__(self, width: int = 8, mix: float = 0.0, dropout: float = 0.0, track: bool = False, fixed: int = 0,
                 across: float = 0.0) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 8 * width), nn.Linear(8 * width, width)
        self.mix, self.drop = mix, nn.Dropout(dropout)
        self.norm = nn.BatchNorm1d(8 * width) if track else None
        self.foreign: nn.Parameter | None = None
        self.fixed, self.across = fixed, across

    def forward(self, x: Tensor) -> Tensor:
        if self.fixed:  # assumes the token count it was built for
            x = x.reshape(x.shape[0], self.fixed, x.shape[-1])
        h = self.up(x)
        if self.mix:
            h = h + self.mix * h.mean(dim=-2, keepdim=True)  # every token sees the others
        if self.across:
            h = h + self.across * h.mean(dim=0, keepdim=True)  # each token sees the same position of the other sequences
        if self.norm is not None:
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        if self.foreign is not None:
            h = h * self.foreign
        return self.down(self.drop(h))


class _Block(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        out = self.layer(x)
        out += x  # in place, as Falcon adds its attention output to the MLP's
        return out


class _Toy(pl.LightningModule):
    def __init__(self, **layer: Any) -> None:
        super().__init__()
        shared = layer.pop("shared", False)
        self.blocks = nn.ModuleList(_Block(_Widen(**layer)) for _ in range(2))
        self.scale = nn.Parameter(torch.ones(64))
        if shared:
            for block in self.blocks:  # read, not registered (a tied weight reached through a plain attribute)
                block.layer.__dict__["foreign"] = self.scale

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        x = batch
        for block in self.blocks:
            x = block(x)
        return x.square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("layer", "reason"),
    [
        (dict(mix=1.0), "mixes tokens"),
        # a little (ConvNeXt's convolution behind a 1e-6 layer scale): within any tolerance, caught bit for bit
        (dict(mix=1e-6), r"mixes tokens \(changing one token's input changed another token's output\)"),
        (dict(dropout=0.1), "draws random numbers"),
        (dict(track=True), "changes its buffers"),
        (dict(shared=True), r"trains 1 parameter\(s\) it does not own"),
        # the chunks run the tokens of several sequences together: mixing across the batch is refused too
        (dict(across=1.0), "mixes tokens"),
        (dict(fixed=16), r"fails on part of its tokens \(RuntimeError: shape '\[2, 16, 8\]' is invalid"),
    ],
    ids=["mixes", "mixes-a-little", "dropout", "buffers", "foreign", "across-sequences", "fixed-tokens"],
)
def test_a_layer_it_cannot_chunk_is_left_whole_with_a_warning_naming_the_block_and_reason(
    trainer_factory: Callable, layer: dict[str, Any], reason: str
) -> None:
    torch.manual_seed(0)
    module = _Toy(**layer)
    callback = ActivationCheckpointing(blocks=["_Block"], mlp_chunks=2)
    trainer = trainer_factory(max_steps=2, callbacks=[callback])
    with pytest.warns(UserWarning, match=rf"mlp_chunks=2\) found no layer .* in 2 block\(s\), e\.g\. blocks\.0 \(layer: {reason}"):
        trainer.fit(module, torch.utils.data.DataLoader(torch.randn(4, 16, 8), batch_size=2))
    assert callback.chunked == []


def test_a_plain_widening_layer_is_chunked_and_trains_as_whole(trainer_factory: Callable) -> None:
    data = torch.randn(4, 16, 8)
    params = {}
    for chunks in (1, 3):  # 3 chunks of 16 tokens: uneven (6, 6, 4)
        torch.manual_seed(0)
        module = _Toy()
        callback = ActivationCheckpointing(blocks=["_Block"], mlp_chunks=chunks)
        trainer_factory(max_steps=2, callbacks=[callback]).fit(module, torch.utils.data.DataLoader(data, batch_size=2))
        params[chunks] = [p.detach().clone() for p in module.parameters()]
    assert callback.chunked == ["blocks.0.layer", "blocks.1.layer"]
    for a, b in zip(params[1], params[3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_backward_recompute_runs_under_the_forwards_autocast(trainer_factory: Callable) -> None:
    # the autograd engine does not carry torch.autocast into the backward: without entering it again the chunks
    # would be recomputed in float32 under bf16-mixed, a different forward than the one whose output trained
    torch.manual_seed(0)
    module = _Toy()
    callback = ActivationCheckpointing(blocks=["_Block"], mlp_chunks=2)
    dtypes: list[torch.dtype] = []
    module.blocks[1].layer.up.register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    trainer = trainer_factory(max_steps=1, precision="bf16-mixed", callbacks=[callback])
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(2, 16, 8), batch_size=2))
    assert callback.chunked == ["blocks.0.layer", "blocks.1.layer"]
    # the step ends with the forward's 2 chunks and the backward's 2 (float32 without entering autocast again)
    assert dtypes[-4:] == [torch.bfloat16] * 4


def test_decide_needs_one_tensor_of_enough_tokens() -> None:
    layer = _Widen()
    x = torch.randn(2, 3, 8)
    assert decide(layer, layer.forward, 4, (x,), {}) == "3 tokens, fewer than mlp_chunks=4"
    assert decide(layer, layer.forward, 2, (x,), {"scale": 1}) == "not called with one tensor of tokens"
    assert decide(layer, layer.forward, 2, (x,), {}) == ""
    dropping, before = _Widen(dropout=0.1), torch.get_rng_state()
    assert decide(dropping, dropping.forward, 2, (x,), {}) == "draws random numbers (dropout in training mode)"
    assert torch.equal(torch.get_rng_state(), before)  # the test put the random state back: the run's stream is intact


def test_decide_on_fake_tensors_runs_the_first_two_chunks_and_the_last_and_decides_as_all_of_them() -> None:
    """On fake tensors (the planner) the chunked pass of the decision runs the first two chunks and the last, as the
    traced forward does (a middle chunk has the second's shape and no values); on real tensors every chunk. The
    verdicts are the same: chunked, and a layer that fails on fewer tokens than it was called with refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Counted(_Widen):
        def forward(self, x: Tensor) -> Tensor:
            calls.append(x.shape[-2])
            return super().forward(x)

    layer, fixed = Counted(), Counted(fixed=16)  # reshapes to the token count it was built for: fails on part of them
    x = torch.randn(2, 16, 8)
    calls: list[int] = []
    assert decide(layer, layer.forward, 8, (x,), {}) == ""
    real_calls, calls = calls, []
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(x)
        assert decide(layer, layer.forward, 8, (fake,), {}) == ""
        fake_calls, calls = calls, []
        assert decide(fixed, fixed.forward, 8, (fake,), {}).startswith("fails on part of its tokens (RuntimeError")
    assert decide(fixed, fixed.forward, 8, (x,), {}).startswith("fails on part of its tokens (RuntimeError")
    # the chunks of 4 tokens come last: all 8 of them, or 3 (after the whole 16 tokens the fake check follows)
    assert real_calls[-9:] == [16] + [4] * 8 and fake_calls[-4:] == [16] + [4] * 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(mlp_chunks=0), r"mlp_chunks=0\): must be an int >= 1"),
        (dict(policy="selective", mlp_chunks=2), r"policy='selective', mlp_chunks=2\): token chunks need policy='full'"),
    ],
)
def test_bad_mlp_chunks_is_refused_with_the_fix(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ActivationCheckpointing(**kwargs)
    with pytest.raises(TypeError, match=r"mlp_chunks=True\): a bool"):
        ActivationCheckpointing(mlp_chunks=True)


@pytest.mark.gpu
def test_dropout_on_cuda_is_seen_by_its_cuda_random_state() -> None:
    layer = _Widen(dropout=0.1).cuda()
    before = torch.cuda.get_rng_state()
    assert decide(layer, layer.forward, 2, (torch.randn(2, 8, 8, device="cuda"),), {}).startswith("draws random numbers")
    assert torch.equal(torch.cuda.get_rng_state(), before)  # the test put the state back


def test_a_chunked_run_resumes_bit_exact(trainer_factory: Callable, tmp_path: Any) -> None:
    data = torch.utils.data.DataLoader(torch.randn(8, 16, 8), batch_size=2)  # 4 steps an epoch

    def fit(epochs: int, ckpt_path: Any = None) -> list[Tensor]:
        torch.manual_seed(0)
        module = _Toy()
        callback = ActivationCheckpointing(blocks=["_Block"], mlp_chunks=2)
        trainer = trainer_factory(max_epochs=epochs, max_steps=-1, callbacks=[callback])
        trainer.fit(module, data, ckpt_path=ckpt_path)
        assert callback.chunked == ["blocks.0.layer", "blocks.1.layer"]  # the resumed run is chunked too
        trainer.save_checkpoint(tmp_path / f"epoch{epochs}.ckpt")
        return [p.detach().clone() for p in module.parameters()]

    straight = fit(2)
    fit(1)
    resumed = fit(2, ckpt_path=tmp_path / "epoch1.ckpt")
    for a, b in zip(straight, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_bf16_4bit_mlp_is_chunked_whatever_rows_the_matmul_kernel_blocks() -> None:
    """The 100M Llama's MLP over nf4-dq in bf16 with LoRA: token-wise (each token's output unchanged, exactly, when
    another token changes), but on a CPU whose matmul kernel blocks fewer rows differently, half the tokens come out one
    bf16 rounding apart (the Dec 2 Intel CPU with AMX). Chunked there too, as on the CPUs where it is exact."""
    import peft
    import transformers as tf

    from lightning_hbm import quantize_model
    from lightning_hbm._compat import peft as peft_compat
    from lightning_hbm.adapters.lora.compute import compute_in_input_dtype
    from lightning_hbm.adapters.lora.forward import lora_forward

    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=1, num_attention_heads=12,
                            vocab_size=100)
    mlp = tf.LlamaForCausalLM(config).model.layers[0].mlp.to(torch.bfloat16)
    quantize_model(mlp, "nf4-dq", "bfloat16")
    peft_compat.mark_quantized(mlp, ["4bit"])
    peft.inject_adapter_in_model(peft.LoraConfig(r=8, target_modules=["gate_proj", "up_proj", "down_proj"]), mlp)
    for name in ("gate_proj", "up_proj", "down_proj"):
        layer = getattr(mlp, name)
        for container in (layer.lora_A, layer.lora_B):
            container["default"].float()
        nn.init.normal_(layer.lora_B["default"].weight, std=0.05)
        assert compute_in_input_dtype(layer) and lora_forward(layer)
    assert decide(mlp, mlp, 2, (torch.randn(2, 512, 768, dtype=torch.bfloat16),), {}) == ""


def _bf16_step_peak(
    llama_factory: Callable, trainer_factory: Callable, intermediate: int = 512
) -> tuple[int, list[str], dict[str, Tensor], Any]:
    """A bf16 QLoRA Llama (hidden 256) with mlp_chunks=4 after one step: MemTracker's peak of a step at 4 x 256
    tokens, the layers chunked, the trainable gradients of that step and the final norm's verdict."""
    module = llama_factory(hidden_size=256, intermediate_size=intermediate, num_hidden_layers=2)
    callback = ActivationCheckpointing(mlp_chunks=4)
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")],
                              callbacks=[LoRA(r=4), callback])
    batch = synthetic_batch(batch_size=2, seq_len=SEQ, seed=1, vocab_size=module.hparams["vocab_size"])
    trainer.fit(module, torch.utils.data.DataLoader([(x, y) for x, y in zip(*batch)], batch_size=2))
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.0)
    big = synthetic_batch(batch_size=4, seq_len=256, seed=2, vocab_size=module.hparams["vocab_size"])

    def step() -> None:
        module.loss(big).backward()

    peak = torch_peak_bytes(step, module, optimizer)
    optimizer.zero_grad(set_to_none=True)
    step()
    grads = {n: p.grad.detach().float().clone() for n, p in module.named_parameters() if p.grad is not None}
    final = module.model.model.norm.__dict__.get("forward")
    return peak, list(callback.chunked), grads, final.verdict if isinstance(final, ChunkedForward) else None


def test_a_bf16_rmsnorm_that_computes_in_fp32_is_chunked_and_the_backward_peak_drops(
    llama_factory: Callable, trainer_factory: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers' LlamaRMSNorm upcasts a bf16 input to fp32: it saves an fp32 copy of its tokens and its backward
    # makes several more at once (the largest part of a Llama block's recompute backward at long context). It saves
    # only 1x its input and output per token, under WIDENING, so the old rule kept it whole.
    from lightning_hbm.activations import token_chunks

    peak, chunked, grads, final_norm = _bf16_step_peak(llama_factory, trainer_factory)
    # and block 1's q/k/v, fed straight by its chunked input_layernorm (run whole, their input remade in chunks);
    # block 0's norm gets no gradient (its input is the frozen embedding's output): it runs plainly, feeding nothing
    layers = ["input_layernorm", "mlp", "post_attention_layernorm"]
    attention = [f"model.model.layers.1.self_attn.{n}_proj" for n in "kqv"]
    assert sorted(chunked) == sorted([f"model.model.layers.{i}.{n}" for i in range(2) for n in layers] + attention)
    assert final_norm == ""  # outside every block too: the final norm (the embedding and rotary table are refused)
    monkeypatch.setattr(token_chunks, "UPCAST", token_chunks.WIDENING)  # the rule before: norms whole
    old_peak, old_chunked, old_grads, old_final = _bf16_step_peak(llama_factory, trainer_factory)
    assert old_chunked == [f"model.model.layers.{i}.mlp" for i in range(2)] and old_final != ""
    # 1024 tokens x 256 wide: one fp32 copy is 1 MiB; the norm's backward held several beside its saved copy
    assert old_peak - peak >= 2 * 2**20, (old_peak, peak)
    assert sorted(grads) == sorted(old_grads)
    for name in grads:  # the same arithmetic per token: the gradients are the whole recompute's
        torch.testing.assert_close(grads[name], old_grads[name], rtol=2e-2, atol=1e-3, msg=name)


def test_an_mlp_fed_by_a_chunked_norm_remakes_its_input_chunks_and_the_norm_output_is_not_kept(
    llama_factory: Callable, trainer_factory: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Llama block's post_attention_layernorm (chunked: bf16 computing in fp32) feeds its chunked MLP. The MLP's
    # backward remakes each chunk of its input from the norm's kept input, so the block's recompute stops there and
    # the norm's output (8 KiB per token at the 8B shape) is neither made nor held while the MLP's backward runs.
    from lightning_hbm.activations import token_chunks

    fused: list[bool] = []
    source = getattr(token_chunks, "_source", lambda x, chunks: None)
    monkeypatch.setattr(token_chunks, "_source", lambda x, chunks: fused.append(source(x, chunks) is not None) or source(x, chunks),
                        raising=False)
    # an MLP 4x wide: its backward is the step's peak, as at the 8B shape
    peak, chunked, grads, _ = _bf16_step_peak(llama_factory, trainer_factory, intermediate=1024)
    monkeypatch.setattr(token_chunks, "_source", lambda x, chunks: None, raising=False)  # before: the MLP kept the norm's output
    old_peak, old_chunked, old_grads, _ = _bf16_step_peak(llama_factory, trainer_factory, intermediate=1024)
    # 1024 tokens x 256 wide in bf16: the norm's output is 0.5 MiB; one remade chunk of it (a quarter) is live instead
    assert old_peak - peak >= 3 * 2**17, (old_peak, peak)
    # the MLPs (the norms' inputs come from an add: not fused); q/k/v are taken only when fed (the next test)
    assert any(fused) and [n for n in chunked if ".self_attn." not in n] == old_chunked
    assert sorted(grads) == sorted(old_grads)
    for name in grads:  # each remade chunk is the forward's, bit for bit: the same gradients exactly
        assert torch.equal(grads[name], old_grads[name]), name


def test_q_k_v_fed_by_the_chunked_input_norm_keep_nothing_and_the_gradients_are_the_same_bits(
    llama_factory: Callable, trainer_factory: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # q/k/v's LoRA kept the chunked input_layernorm's output (lora_A's input) through the whole block backward (8 KiB
    # per token at 8B). Now they run whole in the forward and, in the backward, remake it chunk by chunk from the norm's
    # kept input and take their gradients together, in the order the code before added them: the same bits.
    from lightning_hbm.activations import recompute

    peak, chunked, grads, _ = _bf16_step_peak(llama_factory, trainer_factory, intermediate=1024)
    monkeypatch.setattr(recompute, "inner_candidates", lambda block: [])  # the code before
    old_peak, old_chunked, old_grads, _ = _bf16_step_peak(llama_factory, trainer_factory, intermediate=1024)
    # 1024 tokens x 256 wide in bf16: the norm's output is 0.5 MiB (530,432 B less measured, Dec 5 2026)
    assert old_peak - peak >= 7 * 2**16, (old_peak, peak)
    # block 0's norm gets no gradient (its input is the frozen embedding's output): its q/k/v run as before
    assert sorted(set(chunked) - set(old_chunked)) == [f"model.model.layers.1.self_attn.{n}_proj" for n in "kqv"]
    assert sorted(grads) == sorted(old_grads) and len(grads) == 28
    for name in grads:
        assert torch.equal(grads[name], old_grads[name]), name


class _Pair(nn.Module):
    """Two projections of one input, one of them unused (its backward never runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h: Tensor) -> Tensor:
        self.b(h)
        return self.a(h)


class _FedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer, self.pair = _Widen(), _Pair()

    def forward(self, x: Tensor) -> Tensor:
        return self.pair(self.layer(x)) + x


def test_a_fed_layer_whose_partner_gets_no_gradient_still_trains_as_before(
    trainer_factory: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the layers fed by one chunked layer take their gradients together when the last one's arrives; one that gets
    # none (its output unused) never arrives, and the chunked layer's own backward takes the others' then
    from lightning_hbm.activations import recompute

    data, params, chunked = torch.randn(4, 16, 8), {}, {}
    for fed in (True, False):
        if not fed:
            monkeypatch.setattr(recompute, "inner_candidates", lambda block: [])
        torch.manual_seed(0)
        module = _Toy()
        module.blocks = nn.ModuleList(_FedBlock() for _ in range(2))
        callback = ActivationCheckpointing(blocks=["_FedBlock"], mlp_chunks=2)
        trainer_factory(max_steps=2, callbacks=[callback]).fit(module, torch.utils.data.DataLoader(data, batch_size=2))
        params[fed], chunked[fed] = [p.detach().clone() for p in module.parameters()], callback.chunked
    assert chunked[True] == ["blocks.0.layer", "blocks.0.pair.a", "blocks.0.pair.b", "blocks.1.layer", "blocks.1.pair.a", "blocks.1.pair.b"]
    assert chunked[False] == ["blocks.0.layer", "blocks.1.layer"]
    for a, b in zip(params[True], params[False]):
        assert torch.equal(a, b)
