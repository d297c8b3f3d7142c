"""Resume is owned by ``lightning_hbm.resume`` (issue 54 item 2): one resume verifies its checkpoint once, through the
one caller of ``verify`` inside the package; no module outside it opens a checkpoint file or takes the checkpoint a
Trainer is resuming; the checked IO packs with what the surgery handed down, calling nothing back up."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from lightning_hbm import CheckedCheckpointIO, LoRA, QuantizedPrecision
from lightning_hbm.resume import sealing

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_hbm"
PROBE = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def _plugin() -> QuantizedPrecision:
    # a plugin that reads its saved parts on resume: the GPTQ CRC, the smoothing exponents and the settings
    return QuantizedPrecision("int8-dynamic-smooth", dtype="float32", smoothing=0.5, rounding="gptq", probe_batch=PROBE)


def _count_verifications(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every call of ``resume.sealing.verify``, under whatever name a module of the package holds it."""
    calls: list[Any] = []
    verify = sealing.verify

    def counting(checkpoint: dict[str, Any], path: Any) -> None:
        calls.append(path)
        verify(checkpoint, path)

    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "lightning_hbm" and getattr(module, "verify", None) is verify:
            monkeypatch.setattr(module, "verify", counting)
    return calls


def test_one_resume_verifies_its_checkpoint_once(
    tmp_path: Path, trainer_factory: Callable, llama_factory: Callable, datamodule_factory: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = trainer_factory(max_steps=1, plugins=[_plugin()], callbacks=[LoRA(r=2)])
    first.fit(llama_factory(), datamodule_factory())
    path = tmp_path / "q.ckpt"
    first.save_checkpoint(path)
    calls = _count_verifications(monkeypatch)
    # the checked IO, the load hook, the surgery and the plugin (its saved rounding CRC and exponents) all read it
    trainer = trainer_factory(max_steps=2, plugins=[_plugin()], callbacks=[LoRA(r=2)])
    trainer.fit(llama_factory(), datamodule_factory(), ckpt_path=path)
    assert trainer.global_step == 2
    assert calls == [path]


def test_a_damaged_checkpoint_is_still_refused_on_its_one_verification(
    tmp_path: Path, trainer_factory: Callable, llama_factory: Callable, datamodule_factory: Callable
) -> None:
    first = trainer_factory(max_steps=1, plugins=[_plugin()], callbacks=[LoRA(r=2)])
    first.fit(llama_factory(), datamodule_factory())
    path = tmp_path / "q.ckpt"
    first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["lightning_hbm"]["gptq_digest"] = "deadbeef"  # an edited file: its digest no longer matches
    torch.save(checkpoint, path)
    trainer = trainer_factory(max_steps=2, plugins=[_plugin()], callbacks=[LoRA(r=2)])
    with pytest.raises(ValueError, match=r"q.ckpt is damaged: its 'lightning_hbm' part .* does not match its digest"):
        trainer.fit(llama_factory(), datamodule_factory(), ckpt_path=path)


def _uses(tree: ast.AST) -> list[tuple[str, int]]:
    """``(what, line)`` for each use of a name that reads or verifies a checkpoint."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr == "load") or (
            isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "load" for a in node.names)
        ):
            found.append(("torch.load", node.lineno))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("lightning.fabric.utilities.cloud_io", "lightning_fabric.utilities.cloud_io")):
            found.append(("cloud_io", node.lineno))  # Lightning's file reader (``_load``, ``pl_load``)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in ("verify", "loaded_checkpoint", "pending_checkpoint", "load_checkpoint"):
                found.append((name, node.lineno))
            elif name == "pending" and isinstance(func, ast.Attribute) and getattr(func.value, "id", None) == "resume":
                found.append(("resume.pending", node.lineno))
    return found


# who may do what: verify in the one owner; the file read in resume; the checkpoint a Trainer resumes taken by resume
# (through _compat's accessor), and handed by the surgery engine to run_surgery, which gives it back to resume
ALLOWED = {
    "verify": ("resume/pending.py",),
    "torch.load": ("resume/",),
    "cloud_io": ("resume/",),
    # a checkpoint IO's or a strategy's reader, called: the checked IO wraps the inner one (a strategy's own
    # ``load_checkpoint`` is defined, not called, and reads through ``resume.read_file``)
    "load_checkpoint": ("resume/",),
    "loaded_checkpoint": ("resume/", "_compat/"),
    "resume.pending": ("resume/", "surgery/engine.py"),
    "pending_checkpoint": ("surgery/engine.py",),
}


def test_only_resume_opens_verifies_or_takes_a_checkpoint() -> None:
    wrong, verifies = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for what, line in _uses(ast.parse(path.read_text(), rel)):
            if what == "verify":
                verifies.append(f"{rel}:{line}")
            if not rel.startswith(ALLOWED[what]):
                wrong.append(f"{rel}:{line} {what}")
    assert wrong == [], "outside its owner (lightning_hbm.resume hands the checkpoint's parts out)"
    assert len(verifies) == 1, verifies  # resume.pending.opened


@pytest.mark.parametrize(("source", "what"), [
    ("from lightning.fabric.utilities.cloud_io import _load as pl_load\n", "cloud_io"),
    ("def f(trainer, path):\n    return trainer.strategy.checkpoint_io.load_checkpoint(path)\n", "load_checkpoint"),
    ("import torch\ncheckpoint = torch.load('x.ckpt')\n", "torch.load"),
])
def test_each_way_of_reading_a_checkpoint_is_found(source: str, what: str) -> None:
    """The check above sees every way a module could open a checkpoint file itself (issue 54: none outside resume/)."""
    assert what in [found for found, _ in _uses(ast.parse(source))]


def test_the_checked_io_holds_no_way_back_up_into_the_surgery() -> None:
    io = CheckedCheckpointIO()
    assert sorted(vars(io)) == ["inner", "refuse_non_finite", "trainer"]


def test_the_load_hooks_hold_nothing_of_the_surgery() -> None:
    """Issue 54 item 2: the hooks were handed the engine's ``check_resume`` and ``_changed``; they get the check from
    resume (``resume.check_resume``) and what the surgery did from the model's record."""
    from torch import nn

    from lightning_hbm import resume, surgery
    from lightning_hbm._compat import torch as torch_compat

    model = nn.Linear(2, 2)
    resume.add_resume_hooks(model)
    hooks = [h for h in torch_compat.load_state_dict_pre_hooks(model) if type(h).__module__ == "lightning_hbm.resume.hooks"]
    assert len(hooks) == 1
    held = [value for value in vars(hooks[0]).values() if callable(value)]
    assert held == []
    assert not hasattr(surgery, "check_resume")  # resume's own, not the engine's
