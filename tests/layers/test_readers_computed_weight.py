"""The probe follows weights by the id of the tensor ``layer.weight`` gives; a weight computed at each read (a
weight_norm's, a parametrization's) is a temporary, and a freed tensor's id is reused by the next one made. Was: now and
then (about one run in four of ``test_hubert_with_its_weight_norm_folded_trains_and_resumes_exactly``), HuBERT's
``pos_conv_embed.conv`` "read directly by HubertFeatureEncoder.forward" (a tensor of that forward got the freed id),
so it was left unquantized and the test failed."""

from __future__ import annotations

import torch
from torch import nn

from lightning_hbm.layers.readers import _Watch


def test_no_tensor_made_while_watching_is_taken_for_a_computed_weight() -> None:
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3), dim=2)
    root = nn.Sequential(conv, nn.Linear(4, 4))
    for _ in range(5):
        watch = _Watch(root, {"0": conv, "1": root[1]})
        made = [torch.zeros(1) for _ in range(200)]  # as a forward makes them, after the watch was set up
        assert not [t for t in made if id(t) in watch.weights]
