"""Coverage round three (session 38, issue 53): encoder, seq2seq, audio and vision-language models nobody here tried,
through the default recipe (``benchmarks/coverage_s38.py``, the table in benchmarks/README.md). What broke, each a test:

* every CTC model (transformers ``*ForCTC``: WavLM, Wav2Vec2-Conformer, Data2VecAudio, ...) could not be planned:
  torch's CTC loss has no fake kernel (its ``log_alpha`` is ``[batch, time, 2 x the longest target + 1]``, a shape
  read from the target lengths), so the trace stopped (WavLM: "No candidate could be planned") or ran the whole model
  for real on zeros (Wav2Vec2-Conformer: 61 % under MemTracker's peak). Now its outputs are made from the target
  lengths' real twin (or, without one, the longest the targets allow, named);
* Blip-2 (its Q-Former in ``_keep_in_fp32_modules``, biased Linears, stored quantized and computed in fp32) did not
  resume: each bias was in the state dict twice (``x.bias`` and the mode's layer's ``x.quantized.bias``), and the
  checkpoint, whose frozen base is omitted under ``x.bias``, "does not hold" the second;
* Musicgen (one output head per codebook, ``lm_heads`` a ``ModuleList``): ``FusedLoss()`` refused it naming the wrong
  fix ("Name the Linear that produces the logits: [fc1, k_proj, ...]"); now it says what the heads are and to leave
  FusedLoss out (the model then trains with LoRA and checkpointing, ``benchmarks/coverage_s38.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_hbm.planner.realvalues import RealValues
from tests import families_s38 as families

transformers = pytest.importorskip("transformers")


def _ctc_on_fakes(lengths_have_twins: bool) -> tuple[torch.Tensor, RealValues]:
    fake_mode = FakeTensorMode()
    real_values = RealValues(fake_mode)
    # made outside the fake mode
    real_targets, real_lengths, real_inputs = torch.randint(1, 20, (2, 6)), torch.tensor([3, 5]), torch.full((2,), 50)
    with fake_mode:  # made before RealValues is entered: no twins (as a head's output, computed from the weights)
        log_probs = torch.empty(50, 2, 20).requires_grad_()
        targets, lengths = torch.empty(2, 6, dtype=torch.long), torch.empty(2, dtype=torch.long)
        input_lengths = torch.empty(2, dtype=torch.long)
        real_values.add(input_lengths, real_inputs)
        if lengths_have_twins:
            real_values.add(targets, real_targets)
            real_values.add(lengths, real_lengths)
        with real_values:
            loss = F.ctc_loss(log_probs.log_softmax(-1), targets, input_lengths, lengths, reduction="mean")
            loss.backward()
        assert log_probs.grad is not None and log_probs.grad.shape == (50, 2, 20)
    return loss, real_values


def test_ctc_loss_runs_on_fake_tensors_from_the_target_lengths() -> None:
    """Was: ``DynamicOutputShapeException: aten._ctc_loss.Tensor`` (no fake kernel; the log-probabilities have no twin)."""
    loss, real_values = _ctc_on_fakes(lengths_have_twins=True)
    assert loss.shape == () and real_values.selections == {}
    _, bounded = _ctc_on_fakes(lengths_have_twins=False)
    assert "aten._ctc_loss" in bounded.selections and "(6)" in bounded.selections["aten._ctc_loss"], bounded.selections


def _task(name: str) -> Any:
    return families.Task(name)


def test_a_ctc_model_plans_on_fake_tensors_to_the_byte() -> None:
    """WavLM for CTC: was "No candidate could be planned ... aten._ctc_loss.Tensor"; now no fallback, MemTracker's peak."""
    from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
    from lightning_hbm.planner import Candidate, plan
    from lightning_hbm.planner.reference import memtracker_peak

    candidate = Candidate.from_trainer(QuantizedPrecision(), [LoRA(r=8, alpha=16), ActivationCheckpointing()])
    batch = families.FAMILIES["wavlm"].batch(1)
    predicted = plan(lambda: _task("wavlm"), batch, candidates=[candidate]).find(candidate)
    assert predicted.fallbacks == (), predicted.fallbacks
    assert predicted.peak == pytest.approx(memtracker_peak(lambda: _task("wavlm"), batch, candidate), rel=0.03)


def test_blip2_with_its_qformer_computed_in_fp32_resumes_bit_exact(tmp_path: Any) -> None:
    """Was: "Checkpoint ... does not hold these tensors of the model after lightning_hbm's changes:
    ['model.qformer.encoder.layer.0.attention.attention.query.base_layer.quantized.bias', ...]"."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision, coverage_of
    from lightning_hbm.layers.linear import Fp32ComputeLinear
    from tests.test_any_model import Recorder

    def fit(root: Any, ckpt_path: Any = None) -> tuple[Any, Recorder]:
        torch.manual_seed(0)
        module, recorder = _task("blip2"), Recorder()
        trainer = pl.Trainer(
            accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root, plugins=[QuantizedPrecision()],
            callbacks=[LoRA(r=8, alpha=16), ActivationCheckpointing(), recorder,
                       ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1, every_n_epochs=1, enable_version_counter=False)],
        )  # fmt: skip
        with pytest.warns(UserWarning):  # the zero query tokens leave the Q-Former's first layer without gradient: named
            trainer.fit(module, DataLoader([families.FAMILIES["blip2"].batch(1)], batch_size=None), ckpt_path=ckpt_path)
        return module, recorder

    straight, recorder = fit(tmp_path / "straight")
    qformer = straight.model.model.qformer if hasattr(straight.model, "model") else straight.model.qformer
    fp32 = [m for m in qformer.modules() if isinstance(m, Fp32ComputeLinear)]
    assert fp32 and all(m.bias is not None and m.storage().bias is None for m in fp32)  # one bias, held by the layer
    linear = {r.kind: r for r in coverage_of(straight) or []}["Linear"]
    assert linear.quantized == linear.params, linear  # the Q-Former stored quantized too
    resumed, again = fit(tmp_path / "resumed", ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    assert again.losses == recorder.losses[1:]
    want, got = recorder.after_epoch[1], LoRA.adapter_state_dict(resumed)
    assert set(want) == set(got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


def test_a_list_of_output_heads_is_refused_with_the_fix() -> None:
    from lightning_hbm import FusedLoss

    module = _task("musicgen")
    with pytest.raises(ValueError, match=r"the output head\(s\) \['model.lm_heads'\] of Task are lists of Linear heads \(2 in "
                       r"model.lm_heads: one output each, e.g. one per codebook\).*Leave FusedLoss out of the Trainer's callbacks"):
        FusedLoss().check_model(module)
