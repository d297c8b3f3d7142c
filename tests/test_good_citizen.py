"""Installing lightning_hbm leaves every other Trainer as Lightning made it; a Trainer that uses it still pickles."""

from __future__ import annotations

import copy
import io
import json
import os
import re
import subprocess
import sys
import warnings
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from lightning.pytorch.trainer.connectors import callback_connector

from lightning_hbm import ActivationCheckpointing, HBMProfiler, LoRA, QuantizedPrecision

ROOT = Path(__file__).resolve().parents[1]
_GROUP = "lightning.pytorch.callbacks_factory"


def _pyproject(pattern: str) -> str:
    """The first group of ``pattern`` in pyproject.toml (text, not tomllib: Python 3.10 is supported)."""
    found = re.search(pattern, (ROOT / "pyproject.toml").read_text(), re.S)
    assert found, pattern
    return found.group(1)


def _declared_entry_point() -> str:
    return _pyproject(r'\[project\.entry-points\."lightning\.pytorch\.callbacks_factory"\]\s*lightning_hbm = "([^"]+)"')


def _fresh_install_path(tmp_path: Path) -> Path:
    """A folder that, first on ``sys.path``, makes the interpreter see what ``pip install -e .`` of this checkout
    installs (scripts/install.sh, on CI): lightning_hbm's metadata with pyproject.toml's entry point. It shadows
    whatever an older install of this environment registered (importlib.metadata keeps the first distribution of a
    name), so the tests below check this checkout, not the environment's install."""
    info = tmp_path / "metadata" / "lightning_hbm-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lightning_hbm\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[{_GROUP}]\nlightning_hbm = {_declared_entry_point()}\n")
    return info.parent


def test_the_callbacks_factory_entry_point_gives_only_plugin_alone_trainers_a_callback(trainer_factory: Callable) -> None:
    """QuantizedPrecision alone gets ``PluginAttach`` (its checkpoint checks run before Lightning restores); a plain
    Trainer or one that has a lightning_hbm callback gets nothing. The entry point is a standard-library module of its
    own, installed beside the package; the target older installs registered gives the same function."""
    assert _declared_entry_point() == "lightning_hbm_factory:plugin_callbacks"
    assert '"lightning_hbm_factory"' in _pyproject(r"\npy-modules = (\[[^\]]*\])")  # a fresh install maps it
    installed = {ep.value for ep in entry_points(group=_GROUP) if ep.name == "lightning_hbm"}
    assert installed <= {_declared_entry_point(), "lightning_hbm._factory:plugin_callbacks"}, installed
    import lightning_hbm_factory
    from lightning_hbm import _factory

    assert _factory.plugin_callbacks is lightning_hbm_factory.plugin_callbacks
    kinds = lambda trainer: [type(cb).__name__ for cb in trainer.callbacks]  # noqa: E731
    assert "PluginAttach" not in kinds(trainer_factory())
    assert kinds(trainer_factory(plugins=[QuantizedPrecision("nf4-dq")])).count("PluginAttach") == 1
    assert "PluginAttach" not in kinds(trainer_factory(plugins=[QuantizedPrecision("nf4-dq")], callbacks=[LoRA()]))


def test_a_plain_trainer_imports_nothing_of_the_package(tmp_path: Path) -> None:
    """Issue 55: Lightning loads the entry point in every ``Trainer.__init__``; it imported the package."""
    code = (
        f"import sys; sys.path[:0] = [{str(_fresh_install_path(tmp_path))!r}, {str(ROOT)!r}]\n"
        "import lightning.pytorch as pl; pl.Trainer(logger=False)\n"
        "print(sorted(m for m in sys.modules if 'lightning_hbm' in m and 'editable' not in m))"
    )
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "['lightning_hbm_factory']"


def test_the_older_target_loads_the_factory_from_its_file_when_the_install_does_not_map_it() -> None:
    """An editable install made before the top-level module existed maps only ``lightning_hbm`` and names
    ``lightning_hbm._factory``: that target still gives the factory (read from its file beside the package)."""
    code = (
        "import sys\n"
        "class Unmapped:\n"
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        if name == 'lightning_hbm_factory': raise ModuleNotFoundError(name)\n"
        f"sys.meta_path.insert(0, Unmapped); sys.path.insert(0, {str(ROOT)!r})\n"
        "from lightning_hbm._factory import plugin_callbacks\n"
        "print(plugin_callbacks.__module__, sys.modules['lightning_hbm_factory'].__file__, plugin_callbacks())"
    )
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["lightning_hbm_factory", str(ROOT / "lightning_hbm_factory.py"), "[]"]


@pytest.mark.parametrize("error", [AttributeError, ImportError])
def test_a_failing_factory_is_one_warning_and_the_trainer_fits(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, monkeypatch: pytest.MonkeyPatch, error: type
) -> None:
    """Issue 55: a broken or stale lightning_hbm (``AttributeError: module 'lightning_hbm.surgery' has no attribute
    'plugin_callbacks'``, an ``ImportError``) made every plain ``Trainer()`` fail. A plain Trainer now runs nothing of
    the package (no warning); one with a lightning_hbm plugin gets one warning and fits."""
    import lightning_hbm.surgery

    def broken() -> list[Any]:
        raise error("a stale lightning_hbm")

    monkeypatch.setattr(lightning_hbm.surgery, "plugin_callbacks", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer_factory()
    with pytest.warns(UserWarning, match=rf"callbacks factory failed \({error.__name__}: a stale lightning_hbm\).*Reinstall") as caught:
        trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")])
    assert sum("callbacks factory failed" in str(w.message) for w in caught) == 1
    trainer.fit(gpt_factory(), datamodule_factory())
    assert trainer.global_step == 1


_PLAIN_FIT = """
import json, sys, warnings
sys.path[:0] = [{metadata!r}, {stale!r}, {root!r}]  # this checkout installed, a broken or older lightning_hbm first
{body}
import lightning.pytorch as pl, torch
from lightning.pytorch.demos.boring_classes import BoringModel
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(BoringModel())
print(json.dumps([[type(c).__name__ for c in trainer.callbacks], trainer.global_step, [str(w.message) for w in caught if "lightning_hbm" in str(w.message)]]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stale", ["broken", "older"])
def test_a_plain_trainer_fits_with_a_broken_or_older_lightning_hbm_first_on_the_path(tmp_path: Path, stale: str) -> None:
    """Issue 55: a lightning_hbm package that fails at import, or an older copy without the factory's target (imported
    by the user), stopped every plain Trainer. The entry point is a module of its own that imports nothing of the
    package and looks at nothing of it for a Trainer without a lightning_hbm plugin: the plain fit is untouched."""
    package = tmp_path / "stale" / "lightning_hbm"
    (package / "surgery").mkdir(parents=True)
    (package / "surgery" / "__init__.py").write_text("")  # an older surgery: no plugin_callbacks
    if stale == "broken":
        (package / "__init__.py").write_text("raise ImportError('a broken lightning_hbm install')\n")
        body = ""
    else:
        (package / "__init__.py").write_text("")
        body = "import lightning_hbm.surgery"
    code = _PLAIN_FIT.format(metadata=str(_fresh_install_path(tmp_path)), stale=str(package.parent), root=str(ROOT), body=body)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kinds, steps, warned = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "PluginAttach" not in kinds and steps == 2 and warned == []


def test_a_plain_trainer_has_the_callbacks_lightning_gives_it(trainer_factory: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    installed = [type(cb) for cb in trainer_factory(enable_checkpointing=True, enable_progress_bar=True).callbacks]
    monkeypatch.setattr(callback_connector, "_load_external_callbacks", lambda group: [])  # Lightning without any plugin package
    bare = [type(cb) for cb in trainer_factory(enable_checkpointing=True, enable_progress_bar=True).callbacks]
    assert installed == bare


def test_a_plain_trainer_keeps_its_plugin_objects_and_pickles(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable
) -> None:
    trainer = trainer_factory(max_steps=1, precision="bf16-true")
    trainer.fit(gpt_factory(), datamodule_factory())
    plugin = trainer.strategy.precision_plugin
    assert "convert_module" not in vars(plugin) and "connect" not in vars(plugin)
    assert not [k for k in vars(plugin) if "lightning_hbm" in k]
    torch.save(trainer, io.BytesIO())
    copy.deepcopy(trainer)


@pytest.mark.parametrize("precision", ["nf4-dq", "bf16-true"])
def test_a_trainer_with_every_feature_pickles_and_deep_copies_after_fit(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path, precision: str
) -> None:
    plugins: dict[str, Any] = (
        {"plugins": [QuantizedPrecision(precision, dtype="float32")]} if precision == "nf4-dq" else {"precision": precision}
    )
    callbacks = [LoRA(r=2), ActivationCheckpointing(), HBMProfiler(every_n_steps=1, dirpath=str(tmp_path), summary=False)]
    trainer = trainer_factory(max_steps=2, callbacks=callbacks, **plugins)
    model = gpt_factory()
    trainer.fit(model, datamodule_factory())
    buffer = io.BytesIO()
    torch.save(trainer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(trainer)
    for other in (loaded, copied):
        assert [type(cb) for cb in other.callbacks] == [type(cb) for cb in trainer.callbacks]
        batch = next(iter(datamodule_factory().train_dataloader()))
        # the copy computes what the original computes: same loss, and gradients through the checkpointed blocks
        loss = other.lightning_module.loss(batch)
        torch.testing.assert_close(loss, model.loss(batch))
        loss.backward()
        assert all(p.grad is not None for n, p in other.lightning_module.named_parameters() if "lora_" in n)


@pytest.mark.parametrize("profiler", [False, True], ids=["library", "with-profiler"])
def test_a_fitted_model_is_collected(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path, profiler: bool
) -> None:
    """Issue 55: 200 fits in one process left 200 models alive (the plugin -> Trainer map held the Trainer strongly,
    and the Trainer holds the plugin: its weak key never died)."""
    import gc
    import weakref

    def fit() -> tuple[weakref.ref, weakref.ref]:
        callbacks: list[Any] = [LoRA(r=2), ActivationCheckpointing()]
        if profiler:
            callbacks.append(HBMProfiler(summary=False, dirpath=str(tmp_path)))
        trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=callbacks)
        model = gpt_factory()
        trainer.fit(model, datamodule_factory())
        return weakref.ref(model), weakref.ref(trainer)

    model, trainer = fit()
    gc.collect()
    assert model() is None and trainer() is None
