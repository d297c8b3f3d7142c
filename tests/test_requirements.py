"""Each dependency floor is stated once (lightning_hbm/requirements.txt), read by pyproject.toml and by the code."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_hbm.requirements import requirement


def test_floors_come_from_one_file_that_pyproject_reads() -> None:
    root = Path(__file__).resolve().parents[1]
    pyproject = (root / "pyproject.toml").read_text()  # text, not tomllib: Python 3.10 is supported
    assert 'dynamic = ["dependencies"]' in pyproject and "\ndependencies = [" not in pyproject
    assert 'dependencies = { file = ["lightning_hbm/requirements.txt"] }' in pyproject
    assert requirement("peft") == "peft>=0.15" and requirement("bitsandbytes") == "bitsandbytes>=0.50"
    assert requirement("torch") == "torch>=2.6"

    from lightning_hbm.callbacks import lora
    from lightning_hbm.precision import bnb

    assert str(lora._PEFT_AVAILABLE.requirement) == requirement("peft")
    # LoRA asks the quantized formats (precision.registry) since the format protocol: bitsandbytes is checked once
    assert str(bnb._BNB_AVAILABLE.requirement) == requirement("bitsandbytes")


def test_unknown_dependency_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match=r"transformers is not a core dependency of lightning_hbm"):
        requirement("transformers")
