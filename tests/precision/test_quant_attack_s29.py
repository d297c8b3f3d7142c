"""Session 29 attacks on the fit-start accuracy check and the probe's metrics (issue 53: never warn a healthy model,
never miss a broken one): masks beyond float16's range, and the selections followed (session 28) on real shapes."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.precision.accuracy import centred_cosine
from lightning_hbm.probe import PREFIX, compare_outputs


class MaskedHead(nn.Module):
    """A conv classifier whose forward masks the classes not allowed with -1e9 (as many heads do): float16 rounds the
    mask to -inf, the same mask."""

    def __init__(self, finfo: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.finfo = finfo
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(x))
        allowed = torch.arange(12, device=x.device) < 8
        if self.finfo:  # as transformers masks: the lowest value of the dtype computed in (float16's: -65504)
            return logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
        return torch.where(allowed, logits, -1e9)  # masked_fill(-1e9) refuses float16 (overflow); where rounds to -inf


def test_a_mask_beyond_float16s_range_is_agreement_in_cosine_and_relative_error() -> None:
    # was: cosine NaN and relative error inf for a float16 output that is the reference plus rounding
    torch.manual_seed(0)
    reference = torch.randn(4, 10, 32)
    reference[..., :5] = -1e9
    computed = (reference + 0.01 * torch.randn_like(reference)).half()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = compare_outputs(computed, reference, lm=True)
    assert 0.999 < got[PREFIX + "cosine_similarity"] <= 1.0 and 0 < got[PREFIX + "relative_error"] < 0.01
    assert 0 < got[PREFIX + "kl_divergence"] < 1e-3
    flipped = computed.clone()
    flipped[0, 0, 0] = float("inf")  # +inf where the reference masks with -1e9: not the same mask
    assert compare_outputs(flipped, reference, lm=False)[PREFIX + "relative_error"] == float("inf")
    finfo = reference.clone()
    finfo[..., :5] = torch.finfo(torch.float32).min  # transformers' torch.finfo(dtype).min: float32's as built,
    computed = (reference + 0.01 * torch.randn_like(reference)).half()  # float16's (-65504) as computed
    computed[..., :5] = torch.finfo(torch.float16).min
    got = compare_outputs(computed, finfo, lm=False)  # was: NaN and NaN
    assert 0.999 < got[PREFIX + "cosine_similarity"] <= 1.0 and 0 < got[PREFIX + "relative_error"] < 0.01
    assert 0.999 < centred_cosine(computed.float(), finfo, torch.finfo(torch.float16).max) <= 1.0  # was: 1.7e-16
    overflowing = reference.clone()
    overflowing[..., :5] = -1e5  # a value of the output's own, -inf in float16: not a mask, no figure (its loss is inf)
    assert compare_outputs(overflowing.half(), overflowing, lm=False)[PREFIX + "relative_error"] == float("inf")


@pytest.mark.parametrize("finfo", [False, True])
def test_a_healthy_float16_conv_net_masking_with_minus_1e9_is_measured_and_not_warned(finfo: bool) -> None:
    # was: cosine NaN and "its output on the probe batch has 32 values that are inf or NaN where the model as built
    # gives finite ones: its loss and gradients would be too" (the -1e9 mask, -inf in float16: the same mask); with
    # torch.finfo(dtype).min (float32's as built, float16's as computed): cosine 0.0000, warned
    model = MaskedHead(finfo).eval()
    plugin = QuantizedPrecision("int8", dtype="float16", probe_batch=torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin.convert_module(copy.deepcopy(model))
    measured = plugin.quantization.conv_accuracy
    said = [str(w.message) for w in seen if "lightning_hbm" in str(w.message)]
    assert measured is not None and measured.nonfinite == 0 and 0.99 < measured.cosine <= 1.0 and not measured.warned, said


def test_a_float16_conv_net_whose_own_output_overflows_is_still_warned() -> None:
    # -1e5 as built is no mask: float16 gives -inf, its loss would be inf; the check must still say so
    model = MaskedHead().eval()
    model.forward = lambda x: model.head(model.body(x)) * 0 - 1e5  # type: ignore[method-assign]
    plugin = QuantizedPrecision("int8", dtype="float16", probe_batch=torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)))
    with pytest.warns(UserWarning, match=r"96 values that are inf or NaN where the model as built gives finite ones"):
        plugin.convert_module(model)


class SegNet(nn.Module):
    """A SegNet-style encoder-decoder: max pooling keeps the position of each maximum, the decoder puts its values
    back there (``max_unpool2d``)."""

    def __init__(self) -> None:
        super().__init__()

        def conv(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

        self.e1, self.e2, self.d2, self.d1, self.out = conv(3, 16), conv(16, 32), conv(32, 16), conv(16, 16), nn.Conv2d(16, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.e1(x)
        x, first = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
        x = self.e2(x)
        x, second = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
        x = self.d2(torch.nn.functional.max_unpool2d(x, second, 2))
        return self.out(self.d1(torch.nn.functional.max_unpool2d(x, first, 2)))


def _segnet() -> SegNet:
    torch.manual_seed(0)
    model = SegNet()
    for norm in model.modules():
        if isinstance(norm, nn.BatchNorm2d):
            norm.momentum = None
    model.train()
    with torch.no_grad():  # BatchNorm statistics calibrated on data (cumulative averages), as a trained net's
        for i in range(4):
            model(torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(100 + i)))
    return model.eval()


def test_max_pooling_indices_a_segnet_unpools_at_are_followed() -> None:
    # int8 convolutions move a near-tie in a few pooling windows: the value was unpooled at another pixel and the
    # output, compared pixel by pixel, read 0.9955 (the same convolutions with upsampling instead: 0.9998): the index
    # moves, not the quantization. Followed: 0.9999, both pools' indices given the model as built's
    plugin = QuantizedPrecision("int8", dtype="float32", probe_batch=torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plugin.convert_module(_segnet())
    measured = plugin.quantization.conv_accuracy
    assert measured is not None and (measured.followed, measured.selections) == (2, 2) and measured.cosine > 0.999 and not measured.warned


class CountingDetector(nn.Module):
    """Convolution heads, then the cells whose score passes 0.5, counted by their own mask (``int(keep.sum())``) and
    filled from the mask indexed: given the mask followed, the two counts differ."""

    def __init__(self, finfo: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.finfo = finfo
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(16, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cells = self.head(self.body(x)).flatten(2).transpose(1, 2).reshape(-1, 5)
        scores = cells[:, 0].sigmoid()
        keep = scores > 0.5
        out = cells.new_zeros(int(keep.sum()), 5)
        out[:, :4] = cells[keep][:, 1:]
        out[:, 4] = scores[keep]
        return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_detector_whose_forward_fails_given_the_picks_followed_is_measured_with_its_own(dtype: str) -> None:
    # following gave the model as built's mask to cells[keep] while its own count sized the output: a size mismatch,
    # and the check warned a healthy int8 detector "its forward on the probe batch failed as the plugin computes it
    # ... make the forward run with ... the compute dtype", measuring nothing. Now measured at its heads, as before
    # following, and the log says why the selections were not followed
    plugin = QuantizedPrecision("int8", dtype=dtype, probe_batch=torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin.convert_module(CountingDetector().eval())
    measured = plugin.quantization.conv_accuracy
    assert not [w for w in seen if "lightning_hbm" in str(w.message)]
    assert measured is not None and measured.measured_at is not None and measured.cosine > 0.999 and not measured.warned
    assert measured.unfollowed is not None and measured.unfollowed.startswith("none: the forward failed when given the model as built's picks (RuntimeError")


@pytest.mark.slow  # about 1 s: three forwards of a tiny Qwen2-MoE
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qwen2_moe_in_half_precision_is_given_the_experts_the_float32_model_routed_to(dtype: torch.dtype) -> None:
    # held (session 29): transformers' Qwen2-MoE routes by topk of the router's probabilities, then sorts the tokens
    # per expert; in 16 bits a near-tie picks another expert (own routes diverge); followed, every selection is the
    # float32 model's and the logits stay close
    transformers = pytest.importorskip("transformers")
    from lightning_hbm.probe import diverging, following, recording_selections

    config = transformers.Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(config).eval()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), recording_selections([], budget=1 << 24) as reference:
        want = model(input_ids=ids).logits
    low = copy.deepcopy(model).to(dtype)
    with torch.no_grad(), recording_selections([]) as own:
        low(input_ids=ids)
    with torch.no_grad(), following([], reference) as followed:
        got = low(input_ids=ids).logits.float()
    assert diverging(reference, own) is not None and followed.stopped is None and followed.differed > 0
    assert diverging(reference, followed.selections) is None
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), 0) > 0.9999


def _offset_picks(x: torch.Tensor) -> torch.Tensor:
    picks = x.topk(2, dim=-1)[1]
    picks += torch.arange(x.shape[0])[:, None] * x.shape[1]  # in place on the picks: flat indices
    return x.flatten()[picks.flatten()]


def test_a_forward_changing_the_picks_followed_in_place_leaves_the_record_as_recorded() -> None:
    # the picks followed were the record's own tensor on the host: a forward adding an offset in place changed the
    # record, and a second forward following it was given the changed picks (index 6 out of bounds for size 4)
    from lightning_hbm.probe import following, recording_selections

    with recording_selections([], budget=1 << 20) as reference:
        want = _offset_picks(torch.tensor([[0.9, 0.5, 0.51, 0.1], [0.2, 0.3, 0.31, 0.0]]))
    recorded = reference[0].route[0].clone()
    for _ in range(2):
        with following([], reference) as followed:
            got = _offset_picks(torch.tensor([[0.9, 0.51, 0.5, 0.95], [0.2, 0.31, 0.3, 0.0]]))
        assert followed.differed == 1 and torch.equal(reference[0].route[0], recorded)
        assert got.tolist() == pytest.approx([0.9, 0.5, 0.3, 0.31]) and want.tolist() == pytest.approx([0.9, 0.51, 0.31, 0.3])
