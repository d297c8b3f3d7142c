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

    from lightning_hbm.adapters import lora
    from lightning_hbm.precision import bnb

    assert str(lora._PEFT_AVAILABLE.requirement) == requirement("peft")
    # LoRA asks the quantized formats (precision.registry) since the format protocol: bitsandbytes is checked once
    assert str(bnb._BNB_AVAILABLE.requirement) == requirement("bitsandbytes")


def test_unknown_dependency_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match=r"transformers is not a core dependency of lightning_hbm"):
        requirement("transformers")


def test_lightning_floor_loads_checkpoints_without_running_their_pickle(tmp_path: Path) -> None:
    """lightning>=2.6 with torch>=2.6: a checkpoint whose pickle would run code is refused, not run."""
    import inspect
    import pickle

    import lightning
    import torch
    from lightning.fabric.utilities.cloud_io import _load
    from packaging.version import Version

    assert requirement("lightning") == "lightning>=2.6" and requirement("torch") == "torch>=2.6"
    assert Version(lightning.__version__) >= Version("2.6") and Version(torch.__version__.split("+")[0]) >= Version("2.6")
    assert inspect.signature(_load).parameters["weights_only"].default is None  # 2.4/2.5: False

    class Payload:
        def __reduce__(self) -> tuple:
            return (exec, ("import pathlib; pathlib.Path(%r).write_text('ran')" % str(tmp_path / "pwned"),))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Payload()}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        _load(path)  # what Trainer.fit(ckpt_path=...) calls, weights_only left to torch
    assert not (tmp_path / "pwned").exists()
