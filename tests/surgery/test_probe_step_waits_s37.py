"""Session 37, h9 (issue 55, item 3): "a ``training_step`` that waits for something started in ``on_fit_start`` hangs
forever (the probe runs before ``on_fit_start``)". The probe step runs in the strategy's setup, where the model must
be changed before the optimizers exist, so it cannot run after that hook; a step that waits there in one of Python's
waits for ``PROBE_WAIT_S`` is now stopped (a ``KeyboardInterrupt`` to the main thread where ``SIGINT`` is Python's own),
said with where it waited, and the fit goes on with the model's source deciding, as ``LIGHTNING_HBM_PROBE_STEP=0``.
Was: the step waited (forever, or each of the probe's three attempts until its own timeout) and the advice was wrong."""

from __future__ import annotations

import signal
import threading
import warnings
from typing import Any, Iterator

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers import readers
from lightning_hbm.surgery import probe_step

_WAIT_LINE = "tests/surgery/test_probe_step_waits_s37.py"


class _Waits(pl.LightningModule):
    """A step that waits for a service ``on_fit_start`` starts (here an Event, bounded so that the test ends on main)."""

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        self.started, self.timeout = threading.Event(), timeout
        self.timed_out, self.trained = 0, 0

    def on_fit_start(self) -> None:
        self.started.set()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if not self.started.wait(timeout=self.timeout):
            self.timed_out += 1
            raise RuntimeError("the service on_fit_start starts is not up")
        self.trained += 1
        return self.net(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _fit(module: _Waits, tmp_path: Any) -> list[str]:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4")], callbacks=[LoRA(r=4)],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(torch.randn(8, 16), batch_size=4))
    return [str(w.message) for w in caught if "in the probe step" in str(w.message)]


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """``SIGINT`` as Python sets it (a test runner may have set another handler)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_probe_step_waiting_for_on_fit_start_is_stopped_and_said(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, python_sigint: None) -> None:
    """Was: the probe step's three attempts each waited out the step's timeout (24 s here; a wait without one hung the
    fit), then "could not run one step ... Make training_step run on the first training batch". Now stopped after
    PROBE_WAIT_S, said once with the line it waited at; the step never timed out, the fit trained both steps with LoRA,
    the model's source deciding (no observation)."""
    monkeypatch.setattr(probe_step, "PROBE_WAIT_S", 1.0, raising=False)  # absent before: the test fails on what it asserts
    module = _Waits(timeout=8.0)
    said = _fit(module, tmp_path)
    assert module.timed_out == 0 and module.trained == 2
    assert len(said) == 1, said
    assert "_Waits.training_step waited 1 s at " in said[0] and _WAIT_LINE in said[0]
    assert "before on_fit_start" in said[0] and "It was stopped there" in said[0] and "the fit goes on" in said[0]
    assert "setup()" in said[0] and "LIGHTNING_HBM_PROBE_STEP=0" in said[0]
    assert readers.observation(module) is None and any("lora_" in name for name, _ in module.named_parameters())


def test_a_users_sigint_handler_is_never_called_the_wait_is_said(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a ``SIGINT`` handler of the user's, the probe step is not stopped (the handler would run: a graceful
    shutdown of theirs); the wait is said while it lasts (was: only after 60 s, with no line)."""
    monkeypatch.setattr(probe_step, "PROBE_WAIT_S", 0.5, raising=False)  # absent before: the test fails on what it asserts
    called: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: called.append(signum))
    try:
        module = _Waits(timeout=2.0)
        said = _fit(module, tmp_path)
    finally:
        signal.signal(signal.SIGINT, before)
    assert not called and module.trained == 2
    assert len(said) == 1 and "_Waits.training_step waited 0.5 s at " in said[0] and _WAIT_LINE in said[0]
    assert "never returns" in said[0]


def test_a_probe_step_waiting_without_a_timeout_no_longer_hangs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, python_sigint: None) -> None:
    """The issue's case: the step takes from a queue (no timeout) that a thread started in ``on_fit_start`` fills. Was:
    hung forever (here until the test's own safety, 20 s, filled the queue); now stopped after PROBE_WAIT_S."""
    import queue

    monkeypatch.setattr(probe_step, "PROBE_WAIT_S", 1.0, raising=False)  # absent before: the test fails on what it asserts

    class _Queued(_Waits):
        def __init__(self) -> None:
            super().__init__(timeout=0.0)
            self.items: queue.Queue[float] = queue.Queue()

        def on_fit_start(self) -> None:
            threading.Thread(target=lambda: [self.items.put(1.0) for _ in range(2)], daemon=True).start()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            scale = self.items.get()
            self.trained += 1
            return self.net(batch).square().mean() * scale

    module, fired = _Queued(), threading.Event()
    safety = threading.Timer(20.0, lambda: (fired.set(), [module.items.put(1.0) for _ in range(3)]))  # ends on the parent too
    safety.start()
    try:
        said = _fit(module, tmp_path)
    finally:
        safety.cancel()
    assert not fired.is_set()
    assert module.trained == 2 and len(said) == 1 and "_Queued.training_step waited 1 s at " in said[0] and _WAIT_LINE in said[0]
