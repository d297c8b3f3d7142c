"""Session 38, h2 (issue 55, item 3): the probe step's waits the watcher of session 37 could not see. A step polling a
flag that ``on_fit_start`` sets (``while not ready: time.sleep(...)``) or blocked in a call of C's (``select``,
``socket.recv``) for what ``on_fit_start`` starts has no frame of Python's waits: it waited out its own bound each of
the probe's three attempts (forever without one), then "could not run one step". Now seen as idle (its CPU time still,
Linux saying it sleeps), stopped after ``PROBE_WAIT_S`` and said as Python's waits are; a busy step as long (a matmul
in C, a transform in Python) is left alone."""

from __future__ import annotations

import platform
import select
import signal
import socket
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers import readers
from lightning_hbm.surgery import probe_step

_HERE = "tests/surgery/test_probe_step_waits_s38.py"
_BOUND_S = 6.0  # each wait's own bound: the old code waited it out three times (the test then fails on its asserts)


class _Waits(pl.LightningModule):
    """A step that waits, in a call of C's, for what ``on_fit_start`` starts: a flag it polls (``sleep``), or bytes on a
    socket (``select``, ``recv``) a thread started there sends."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        self.how, self.ready, self.timed_out, self.trained = how, False, 0, 0
        self.ours, self.theirs = socket.socketpair()
        self.ours.settimeout(_BOUND_S)

    def on_fit_start(self) -> None:
        self.ready = True
        threading.Thread(target=self.theirs.sendall, args=(b"x" * 8,), daemon=True).start()

    def teardown(self, stage: str) -> None:
        self.ours.close()
        self.theirs.close()

    def _wait(self) -> bool:
        if self.how == "sleep":
            until = time.monotonic() + _BOUND_S
            while not self.ready and time.monotonic() < until:
                time.sleep(0.05)
            return self.ready
        if self.how == "select":
            return bool(select.select([self.ours], [], [], _BOUND_S)[0]) and bool(self.ours.recv(1))
        try:
            return bool(self.ours.recv(1))
        except socket.timeout:
            return False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if not self._wait():
            self.timed_out += 1
            raise RuntimeError("what on_fit_start starts is not up")
        self.trained += 1
        return self.net(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class _Busy(_Waits):
    """A healthy step busy longer than ``PROBE_WAIT_S``: a matmul in C (NumPy's, GIL released: the thread has no frame
    of Python's waits either, as a blocked ``recv``), a transform in Python, or matmuls in a pool of its own threads."""

    def __init__(self, how: str, seconds: float) -> None:
        super().__init__(how)
        self.seconds, self.a = seconds, np.random.default_rng(0).standard_normal((300, 300))

    def _wait(self) -> bool:
        if self.how == "pool":  # the transform in the step's own threads: the step waits on them, in Python's waits
            with ThreadPoolExecutor(2) as pool:
                return all(pool.map(self._busy, [self.seconds / 2] * 4))
        return self._busy(self.seconds)

    def _busy(self, seconds: float) -> bool:
        until, a = time.monotonic() + seconds, self.a.copy()
        while time.monotonic() < until:
            if self.how == "transform":
                sorted(str(i) for i in range(2000))
            else:
                a = np.tanh(a @ a)
        return True


def _fit(module: pl.LightningModule, tmp_path: Any, steps: int = 2) -> list[str]:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4")], callbacks=[LoRA(r=4)],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(torch.randn(8, 16), batch_size=4))
    assert trainer.global_step == steps
    return [str(w.message) for w in caught if "in the probe step" in str(w.message) or "could not run one step" in str(w.message)]


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """``SIGINT`` as Python sets it (a test runner may have set another handler)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("how", ["sleep", "select", "recv"])
def test_a_probe_step_waiting_in_c_for_on_fit_start_is_stopped_and_said(how: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, python_sigint: None) -> None:
    """Was: each of the probe's three attempts waited out its bound (18 s here; forever without one), then "could not
    run one step ... Make training_step run on the first training batch". Now stopped after PROBE_WAIT_S at the line
    it waited at, said once; the fit trains both steps with LoRA, the model's source deciding."""
    monkeypatch.setattr(probe_step, "PROBE_WAIT_S", 1.0)
    module = _Waits(how)
    said = _fit(module, tmp_path)
    assert module.timed_out == 0 and module.trained == 2  # no bound waited out
    assert len(said) == 1, said
    assert "_Waits.training_step waited 1 s at " in said[0] and _HERE in said[0], said
    assert "It was stopped there" in said[0] and "the fit goes on" in said[0] and "setup()" in said[0]
    assert readers.observation(module) is None and any("lora_" in name for name, _ in module.named_parameters())


@pytest.mark.parametrize("how", ["matmul", "transform", "pool"])
def test_a_busy_probe_step_longer_than_the_wait_is_left_alone(how: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, python_sigint: None) -> None:
    """A step busy 1.5 s (three times PROBE_WAIT_S here) in a matmul of C's, a transform of Python's, or matmuls in its
    own thread pool (the step waits on them in Python's waits: was stopped, session 37) is a healthy step: never
    stopped, nothing said, the probe step observed."""
    monkeypatch.setattr(probe_step, "PROBE_WAIT_S", 0.5)
    module = _Busy(how, seconds=1.5)
    said = _fit(module, tmp_path, steps=1)
    assert not said and module.trained == 2  # the probe step, run through, and the one step
    assert readers.observation(module) is not None


class _Unstoppable(_Waits):
    """A step blocked in a call of C's that does not return on a signal (glibc's ``pthread_mutex_lock``: as a C
    library retrying its wait after ``EINTR`` does), until what it waits for comes ``came_after`` s later."""

    def __init__(self, came_after: float) -> None:
        super().__init__("mutex")
        import ctypes

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.mutex = ctypes.create_string_buffer(64)  # zeros: PTHREAD_MUTEX_INITIALIZER of glibc, a normal mutex
        self.came_after = came_after

    def _wait(self) -> bool:
        if not self.ready:
            assert self.libc.pthread_mutex_lock(self.mutex) == 0
            threading.Timer(self.came_after, self.libc.pthread_mutex_unlock, args=(self.mutex,)).start()
            self.libc.pthread_mutex_lock(self.mutex)  # a normal mutex locked again blocks, a signal or not
        return True


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not hasattr(time, "pthread_getcpuclockid"), reason="glibc's normal mutex")
def test_a_probe_step_that_a_signal_does_not_stop_is_said_with_what_to_do(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, python_sigint: None) -> None:
    """Where the stop cannot land (a call of C's that does not return on ``SIGINT``), the user is told at once, with
    what to do, not left to guess; once the call returns, the stop lands and the fit goes on, said."""
    monkeypatch.setattr(probe_step, "PROBE_WAIT_S", 1.0)
    monkeypatch.setattr(probe_step, "_STOP_GRACE_S", 1.0, raising=False)  # absent before: the test fails on its asserts
    module = _Unstoppable(came_after=4.0)
    said = _fit(module, tmp_path)
    assert len(said) == 2 and module.trained == 2, said
    assert "_Unstoppable.training_step waited 1 s at " in said[0] and _HERE in said[0]
    assert "does not return on a signal" in said[0] and "stop the run" in said[0] and "setup()" in said[0]
    assert "LIGHTNING_HBM_PROBE_STEP=0" in said[0] and "It was stopped there" in said[1]
