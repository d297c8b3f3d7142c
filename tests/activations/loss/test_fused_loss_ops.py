"""FusedLoss and what real heads do to the logits: BART-family ``final_logits_bias``, tensor scales, and the ops that
cannot stay fused (a ``UserWarning`` naming the op and the model, and a profiler ``loss`` term with the full logits)."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import FusedLoss
from lightning_hbm.activations.loss import LazyLogits
from lightning_hbm.memory.torch_tracker import torch_peak_bytes

CANNOT_STAY_FUSED = "cannot stay fused"


class _Wrapper(nn.Module):  # a LightningModule-like holder: FusedLoss finds the HF model's output head inside
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def _seq2seq(family: str = "bart", vocab: int = 600, d_model: int = 32, positions: int = 64) -> _Wrapper:
    """A tiny transformers encoder-decoder (random weights, no dropout) whose ``final_logits_bias`` is not zero."""
    import transformers

    config_cls, model_cls = {
        "bart": (transformers.BartConfig, transformers.BartForConditionalGeneration),
        "mbart": (transformers.MBartConfig, transformers.MBartForConditionalGeneration),
        "marian": (transformers.MarianConfig, transformers.MarianMTModel),
        "pegasus": (transformers.PegasusConfig, transformers.PegasusForConditionalGeneration),
    }[family]
    config = config_cls(vocab_size=vocab, d_model=d_model, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model,
                        max_position_embeddings=positions, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():  # zeros at init: a random bias makes a lost or misplaced bias visible in loss and gradients
        model.final_logits_bias.normal_(generator=torch.Generator().manual_seed(3))
    return _Wrapper(model)


def _batch(vocab: int, tokens: int = 20, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(3, vocab, (batch, tokens), generator=g), torch.randint(3, vocab, (batch, tokens - 4), generator=g)
    y[0, -3:] = -100  # padding
    return x, y


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _losses_and_grads(module: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], extra: tuple = ()) -> tuple:
    module.zero_grad(set_to_none=True)
    for t in extra:
        t.grad = None
    loss = loss_fn(module)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    grads.update({f"extra{i}": t.grad.clone() for i, t in enumerate(extra) if t.grad is not None})
    return loss.detach(), grads


def _assert_equal_runs(ref: tuple, fused: tuple, tol: float) -> None:
    assert _rel(fused[0], ref[0]) <= tol, (fused[0], ref[0])
    assert ref[1].keys() == fused[1].keys() and ref[1]
    # atol: tol x the largest gradient entry. Attention's key bias gets a gradient that is 0 in exact arithmetic
    # (softmax ignores a per-query constant): pure rounding, different in the two runs, with no relative scale.
    atol = tol * max(float(g.abs().max()) for g in ref[1].values())
    for name in ref[1]:
        torch.testing.assert_close(fused[1][name].float(), ref[1][name].float(), rtol=tol, atol=atol, msg=name)


def _fused_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if CANNOT_STAY_FUSED in str(w.message)]


@pytest.mark.parametrize("family", ["bart", "mbart", "marian", "pegasus"])
def test_final_logits_bias_stays_fused_losses_and_gradients_equal_unfused(family: str, caplog: pytest.LogCaptureFixture) -> None:
    """Was: ``lm_logits + final_logits_bias`` computed the full logits every step (one log line said so)."""
    ref = _seq2seq(family)
    fused = copy.deepcopy(ref)
    FusedLoss(chunk_size=7).transform_model(fused)  # 7: several chunks and a ragged last one
    x, y = _batch(ref.model.config.vocab_size)
    loss = lambda m: m.model(input_ids=x, labels=y).loss  # noqa: E731
    with warnings.catch_warnings(record=True) as record, caplog.at_level(logging.INFO, "lightning_hbm.activations.loss"):
        warnings.simplefilter("always")
        runs = [_losses_and_grads(m, loss) for m in (ref, fused)]
        assert isinstance(fused.model(input_ids=x, labels=y).logits, LazyLogits)
    assert not _fused_warnings(record)
    assert any("`add` on the logits of `model.lm_head`" in r.getMessage() and "chunk by chunk" in r.getMessage()
               for r in caplog.records)
    _assert_equal_runs(*runs, tol=1e-5)  # fp32: only the summation order differs


def test_bf16_bart_within_bf16_tolerance() -> None:
    ref = _seq2seq("bart").to(torch.bfloat16)
    fused = copy.deepcopy(ref)
    FusedLoss(chunk_size=9).transform_model(fused)
    x, y = _batch(600)
    loss = lambda m: m.model(input_ids=x, labels=y).loss  # noqa: E731
    _assert_equal_runs(*[_losses_and_grads(m, loss) for m in (ref, fused)], tol=2e-2)


def test_bart_step_peak_is_below_the_unfused_one_by_more_than_the_logits() -> None:
    """torch's MemTracker, one AdamW step of a tiny BART (8k vocabulary, 2 x 256 decoder tokens, fp32): the unfused
    step holds the logits, their biased copy and the log-softmax; the fused one a 128-token chunk at a time."""
    vocab, tokens = 8000, 256
    models = {False: _seq2seq("bart", vocab=vocab, d_model=64, positions=tokens)}
    models[True] = copy.deepcopy(models[False])
    FusedLoss(chunk_size=128).transform_model(models[True])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(3, vocab, (2, tokens), generator=g), torch.randint(3, vocab, (2, tokens), generator=g)
    optims = {f: torch.optim.AdamW(m.parameters()) for f, m in models.items()}

    def step(f: bool) -> torch.Tensor:
        loss = models[f].model(input_ids=x, labels=y).loss
        loss.backward()
        optims[f].step()
        optims[f].zero_grad(set_to_none=True)
        return loss.detach()

    torch.testing.assert_close(step(True), step(False), rtol=1e-5, atol=0)  # also warms up (optimizer states)
    peaks = {f: torch_peak_bytes(lambda f=f: step(f), models[f], optims[f]) for f in (False, True)}
    logits = 2 * tokens * vocab * 4  # 16.4 MB of fp32 logits
    # measured: unfused 61,243,852 B, fused 22,464,976 B: 38.8 MB = 2.37x the logits saved (benchmarks/README.md);
    # before, the fused step materialized the logits at the bias add and peaked as the unfused one
    assert peaks[False] - peaks[True] >= 2.2 * logits, peaks
    assert peaks[True] <= 0.4 * peaks[False], peaks


V = 64


def _plain_lm() -> _Wrapper:
    torch.manual_seed(0)  # a head with a bias: its gradient is compared too
    return _Wrapper(nn.Sequential(nn.Embedding(V, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, V)))
_BIAS = torch.randn(V, generator=torch.Generator().manual_seed(5))
# (op on the logits z [2, 12, V], operands that need a gradient): each must stay lazy and give the unfused values
KEPT_LAZY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "z + bias[V]": lambda z, p: z + _BIAS,
    "bias[1, V] + z": lambda z, p: _BIAS.view(1, V) + z,
    "z - bias[1, 1, V]": lambda z, p: z - _BIAS.view(1, 1, V),
    "bias - z": lambda z, p: _BIAS - z,
    "3 - z, z + 1": lambda z, p: (3 - z) + 1,
    "torch.add(z, bias, alpha=0.5)": lambda z, p: torch.add(z, _BIAS, alpha=0.5),
    "z * scale[V]": lambda z, p: z * (_BIAS.abs() + 0.5),
    "scale * z / scalar tensor": lambda z, p: (_BIAS.abs() + 0.5) * z / torch.tensor(1.7),
    "z.float().div(scale[1, V]).tanh()": lambda z, p: z.float().div(_BIAS.view(1, V).abs() + 0.5).tanh() * 2,
    "z * trainable scale[V] + trainable bias[V]": lambda z, p: z * p[0] + p[1],
    "z / trainable scalar": lambda z, p: z / p[2],
}


@pytest.mark.parametrize("kind", list(KEPT_LAZY))
def test_ops_with_a_tensor_along_the_vocabulary_stay_fused_and_exact(kind: str) -> None:
    ref = _plain_lm()
    fused = copy.deepcopy(ref)
    FusedLoss(heads=["model.3"], chunk_size=5).transform_model(fused)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, V, (2, 12), generator=g), torch.randint(0, V, (2, 12), generator=g)
    y[1, :4] = -100
    extra = (nn.Parameter(torch.rand(V) + 0.5), nn.Parameter(torch.randn(V)), nn.Parameter(torch.tensor(0.8)))
    op = KEPT_LAZY[kind]
    assert isinstance(op(fused.model(x), extra), LazyLogits)
    loss = lambda m: F.cross_entropy(op(m.model(x), extra).reshape(-1, V), y.view(-1), label_smoothing=0.1)  # noqa: E731
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        runs = [_losses_and_grads(m, loss, extra) for m in (ref, fused)]
    assert not _fused_warnings(record)
    _assert_equal_runs(*runs, tol=1e-5)  # trainable operands included (extra0, extra1, extra2)


# Ops on the logits that need every logit of a row (or per-token operands): the full logits, and a warning.
NOT_FUSABLE: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "torch.sort": (lambda z: torch.sort(z, dim=-1, descending=True).values, "sort"),
    "logits @ matrix": (lambda z: z @ torch.eye(z.shape[-1]).flip(0), "matmul"),
    "torch.gather": (lambda z: torch.gather(z, -1, torch.arange(z.shape[-1]).flip(0).expand(z.shape)), "gather"),
    "per-token scale [B, T, 1]": (lambda z: z * torch.linspace(0.5, 1.5, z.shape[1]).view(1, -1, 1), "mul"),
}


@pytest.mark.parametrize("kind", list(NOT_FUSABLE))
def test_an_op_that_cannot_stay_fused_warns_naming_the_op_and_the_model(kind: str) -> None:
    op, name = NOT_FUSABLE[kind]
    ref = _seq2seq("bart")
    fused = copy.deepcopy(ref)
    FusedLoss(chunk_size=7).transform_model(fused)
    x, y = _batch(600)
    loss = lambda m: F.cross_entropy(op(m.model(input_ids=x, decoder_input_ids=y.clamp_min(0)).logits).flatten(0, 1),  # noqa: E731
                                     y.flatten())
    ref_run = _losses_and_grads(ref, loss)
    match = rf"`{name}` on the logits of `model.lm_head` \(BartForConditionalGeneration in _Wrapper\) cannot stay fused"
    with pytest.warns(UserWarning, match=match) as record:
        fused_run = _losses_and_grads(fused, loss)
        _losses_and_grads(fused, loss)  # once per head, not once per step
    (message,) = _fused_warnings(record.list)
    assert "(2, 16, 600) (0.1 MiB)" in message and "`loss` term count these full logits" in message
    _assert_equal_runs(ref_run, fused_run, tol=1e-5)  # computed the ordinary way: the same results


def test_a_materialized_model_shows_its_full_logits_in_the_profiler_loss_term(
    trainer_factory: Callable, datamodule_factory: Callable
) -> None:
    """Through a real Trainer: the warning comes at the first step, and HBMProfiler's ``loss`` term is the full logits
    (was 0: nothing in the loss scope, the logits counted as any activation)."""
    import lightning.pytorch as pl

    from lightning_hbm import HBMProfiler

    vocab = 512

    class SortedLoss(pl.LightningModule):  # a training_step that sorts the logits: not fusable
        def __init__(self) -> None:
            super().__init__()
            self.model = _seq2seq("bart", vocab=vocab, positions=32).model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.model(input_ids=x, decoder_input_ids=x).logits
            return F.cross_entropy(torch.sort(logits, dim=-1).values.flatten(0, 1), y.flatten() % vocab)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    profiler = HBMProfiler(every_n_steps=1, detailed_steps=[1])
    trainer = trainer_factory(max_steps=2, callbacks=[FusedLoss(chunk_size=16), profiler])
    match = r"`sort` on the logits of `model.lm_head` \(BartForConditionalGeneration in SortedLoss\) cannot stay fused"
    with pytest.warns(UserWarning, match=match):
        trainer.fit(SortedLoss(), datamodule=datamodule_factory(batch_size=4, seq_len=32))
    (detailed,) = [row for row in profiler.rows if row["mode"] == "detailed"]
    logits = 4 * 32 * vocab * 4
    assert detailed["loss"] == logits  # measured 262,144 B: the [4, 32, 512] fp32 logits, biased in place of the head's
