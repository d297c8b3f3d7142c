"""The former names of the layer-mode settings (issue 54), read on the plugin (``plugin.pinned_plan``,
``plugin.measures_plan``), warn at the user's line: Python shows a ``DeprecationWarning`` only where it is attributed
to the running script (``__main__``), and the plugin's ``__getattr__`` forwarded the read to the config, whose warning
was attributed to lightning_hbm's own line, so hidden (session 30 review)."""

from __future__ import annotations

import warnings

import pytest

from lightning_hbm import QuantizedPrecision


@pytest.mark.parametrize(("old", "new"), [("pinned_plan", "pinned_layer_modes"), ("measures_plan", "measures_layer_modes")])
def test_a_former_name_read_on_the_plugin_warns_at_the_callers_line(old: str, new: str) -> None:
    plugin = QuantizedPrecision("int8-dynamic", layer_modes={"fc": "int8-dynamic"} if old == "pinned_plan" else None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        value = getattr(plugin, old)
    assert value == getattr(plugin, new)
    deprecated = [w for w in seen if issubclass(w.category, DeprecationWarning)]
    assert len(deprecated) == 1 and new in str(deprecated[0].message)
    assert deprecated[0].filename == __file__  # was lightning_hbm/precision/plugin.py: hidden by Python's filters
