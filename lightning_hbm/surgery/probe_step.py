"""The probe step: the user's step run once on the model as built, to see which layers its code reads directly.

Before the first check, :func:`_observe` runs the stage's step once (no gradient, no optimizer step) and records who
reads which layer's weight (:func:`lightning_hbm.layers.readers.observe`); ``LIGHTNING_HBM_PROBE_STEP=0``
(:data:`PROBE_SWITCH`) leaves it to the model's source, and a step still running after :data:`PROBE_PATIENCE_S` is
said with the ways out (:func:`_said_if_slow`); one waiting :data:`PROBE_WAIT_S` (for what ``on_fit_start`` starts: it
runs before that hook), in one of Python's waits or idle in a call of C's (a polling loop's ``time.sleep``, ``select``,
``socket.recv``), is stopped there and said, the source deciding
(:func:`_stopped_if_waiting`). After the change, :func:`_guard` guards the paths the probe step did not take where the
source reads a layer now changed. :func:`lightning_hbm.surgery.engine.run_surgery` decides whether to run it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_hbm.layers import base_layer, find_layers, is_adapted, read_weight, readers, source_readers, stored_in
from lightning_hbm.layers.embedding import QuantizedEmbedding
from lightning_hbm.memory.storage import parameter_bytes, parameter_count, quantized_format
from lightning_hbm.naming import name_list, name_matches

#: ``LIGHTNING_HBM_PROBE_STEP=0`` turns the probe step off (issue 55): the user's step never runs an extra time
PROBE_SWITCH = "LIGHTNING_HBM_PROBE_STEP"
_PROBE_ON, _PROBE_OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def probe_step_on() -> bool:
    """Whether ``LIGHTNING_HBM_PROBE_STEP`` (unset: on) lets the probe step run.

    Raises:
        ValueError: a value it does not know (``""``, ``"2"``, a typo of ``off``): was read as "on" without a word,
            so a user who meant to turn the probe off had it run (session 31). Raised at fit start, before any change.
    """
    value = os.environ.get(PROBE_SWITCH)
    if value is None or value.strip().lower() in _PROBE_ON:
        return True
    if value.strip().lower() in _PROBE_OFF:
        return False
    raise ValueError(
        f"{PROBE_SWITCH}={value!r} is not one of {', '.join(_PROBE_ON)} (run the probe step, the default when unset) "
        f"or {', '.join(_PROBE_OFF)} (skip it). Set one of these, or unset it (unset {PROBE_SWITCH}); nothing was changed."
    )


class SharedProbe:
    """A probe batch (called for it, as a function returning the batch is) whose step's answer the caller may share
    between models set up alike: :meth:`observe` runs the probe step, or adopts the one it saw on such a model (the
    planner: :mod:`lightning_hbm.planner.tracing`, one cut model set up for several candidates)."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __call__(self) -> Any:
        return self.batch

    def observe(self, module: nn.Module, batch: Any, layers: dict[str, nn.Module], step: str) -> Optional[readers.Observation]:
        return readers.observe(module, batch, layers, step)


def _observe(module: nn.Module, batch: Any, step: str = "training_step") -> None:
    """The probe step: who reads which layer's weight, seen on the model as built (before the first check)."""
    if readers.observation(module) is not None:
        return
    layers = {name: base_layer(layer) for name, layer, _ in find_layers(module)}
    if not layers:
        return
    if not probe_step_on():
        # no observation: weight_readers falls back to the source scan, which keeps every layer whose weight the
        # model's code reads anywhere in the compute dtype (a read it cannot see, through a loop variable or code
        # without source, would get the packed weight: the reason the probe exists)
        rank_zero_info(
            f"lightning_hbm: {PROBE_SWITCH}=0: {step} was not run before changing the model; layers whose weight the "
            "model's source reads are kept in the compute dtype (a read the source does not show is not guarded)"
        )
        return
    drawn = batch() if callable(batch) else batch
    if drawn is None:  # the stage reads no batch (an empty loader, limit_*_batches=0): nothing to run; the source decides
        return
    observe = batch.observe if isinstance(batch, SharedProbe) else readers.observe
    seen = None  # stopped where it waited for what on_fit_start starts: the source decides (said)
    with _said_if_slow(type(module).__qualname__, step), _stopped_if_waiting(type(module).__qualname__, step):
        seen = observe(module, drawn, layers, step)
    if seen is not None:  # said once per model, at the surgery (fit start): the user's code ran one more time
        _unrun_step_reads(module, seen, layers)
        rank_zero_info(
            f"lightning_hbm: ran {seen.ran} once before changing the model, to see which layers its code reads "
            "directly (no gradient, no optimizer step; the model's values, the data order and the RNGs as they were). "
            f"{PROBE_SWITCH}=0 skips it: the model's source then decides, and a layer read where the source does not "
            "show it is named by hand (QuantizedPrecision(ignore_modules=[...]), LoRA(exclude_modules=[...]))"
        )


def _unrun_step_reads(module: nn.Module, seen: readers.Observation, layers: dict[str, nn.Module]) -> None:
    """The plain ``nn.Linear`` layers whose weight the source of the LightningModule's own methods (``training_step``,
    its helpers: not ``forward``) reads on a path the probe step did not take, served as the reads the step saw are
    (``seen``, in place; :mod:`lightning_hbm.layers.read_weight`: stored quantized, the weight read computes from the
    storage and runs the adapter).

    A guard (:func:`_guard`) watches a reader's ``forward``; these run outside any forward, so nothing watched them: a
    ``training_step`` reading ``self.head.weight`` only under bfloat16 (the probe step runs the model as built, in
    float32; the fit computes in bfloat16) got the packed 4-bit weight, and the fit stopped at its first step on a
    shape error naming neither the layer nor a fix (session 37). Other layers are left as they were: a quantized
    convolution's or embedding's weight reads as the dequantized weight already."""
    if not isinstance(module, pl.LightningModule):
        return
    for reader, method, name in source_readers(module):
        if reader or method.rpartition(".")[2] == "forward" or name in seen.reads or not read_weight.servable(layers.get(name, nn.Identity())):
            continue
        seen.reads[name] = readers.Read(f"{method} (its source, on a path the probe step did not take)", "source", False)
        read_weight.mark_served(layers[name], seen.reads[name].reader, name)
        seen.served = seen.served | {name}


#: seconds after which a probe step still running is said to the user (a step on fake tensors takes well under one)
PROBE_PATIENCE_S = 60.0


@contextmanager
def _said_if_slow(model: str, step: str) -> Iterator[None]:
    """A warning if the probe step is still running after :data:`PROBE_PATIENCE_S`: it runs in the strategy's setup,
    before ``on_fit_start`` (the model must be changed before the optimizers exist), so a step that waits for
    something ``on_fit_start`` starts never returns (issue 55). The user then sees why, and the two ways out."""
    message = (
        f"lightning_hbm: {model}.{step} has been running for {PROBE_PATIENCE_S:.0f} s in the probe step (run once before "
        "the model is changed, to see which layers its code reads directly). The probe step runs before on_fit_start: a "
        "step that waits for something on_fit_start starts never returns. Start it in setup() instead, or set "
        f"{PROBE_SWITCH}=0 (the model's source then decides which layers are read directly)."
    )
    timer = threading.Timer(PROBE_PATIENCE_S, rank_zero_warn, args=(message,))
    timer.daemon = True  # never keeps the process alive
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


#: seconds the probe step may wait (in one of Python's waits: an ``Event``, a queue, a lock, a future, a child process;
#: or in a call of C's that sleeps: ``time.sleep`` of a polling loop, ``select``, ``socket.recv``) before it is stopped
#: there: a step on fake tensors does not wait, and one that waits for what ``on_fit_start`` starts would wait forever
#: (the probe step runs before it)
PROBE_WAIT_S = 10.0
#: the modules whose frames are a wait: ``Event.wait``, ``Queue.get``, ``Future.result``, ``Thread.join`` end in threading's
_WAIT_MODULES = ("threading", "queue", "selectors", "subprocess", "socket", "ssl")
_WAIT_PACKAGES = ("multiprocessing.", "concurrent.futures.", "asyncio.")
#: under this share of one core between two looks, a thread Linux says sleeps is idle: in a call of C's that waits
#: (``time.sleep``, ``select``, ``recv``). A busy step (a matmul, a data transform) uses its core: 25-40 % of one even
#: on the dev machine's 2 cores shared by 9 processes (session 38), an idle one 0.0 %
_IDLE_SHARE = 0.05
#: over this share of one core used by the process's other threads between two looks, the probing thread's wait is for
#: work going on (a transform in the step's thread pool: ``pool.map``), not a wait for what ``on_fit_start`` starts
_BUSY_OTHERS_SHARE = 0.10
#: looks in a row that see no wait before the probing thread's wait starts again from 0 (a busy step: every look)
_MISSES = 3
#: seconds the probing thread has to unwind once stopped; still there after it: a call of C's that does not return on a
#: signal, said with the ways out
_STOP_GRACE_S = 3.0


def _waiting_at(frame: Optional[FrameType], idle: bool = False) -> Optional[str]:
    """``file:line`` where the thread whose innermost frame is ``frame`` waits: the caller of the wait of Python's
    ``frame`` is in, or, the thread ``idle`` (:class:`_Idle`: in a call of C's that sleeps, which has no frame of its
    own), the line of ``frame`` itself; ``None`` if it does not wait."""

    def waits(f: FrameType) -> bool:
        name = str(f.f_globals.get("__name__", ""))
        return name in _WAIT_MODULES or name.startswith(_WAIT_PACKAGES)

    if frame is None:
        return None
    if not waits(frame):
        return f"{frame.f_code.co_filename}:{frame.f_lineno}" if idle else None
    while frame is not None and waits(frame):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


class _Idle:
    """Whether a thread, and the process's other threads, were idle since the last call: the thread's CPU time
    (``pthread_getcpuclockid``) grew by under :data:`_IDLE_SHARE` of the time that passed and Linux says it sleeps
    (``/proc``'s state ``S``) where it can say; the other threads' (the process's less the thread's) by under
    :data:`_BUSY_OTHERS_SHARE`, none of them running where Linux can say. The thread is never idle where its CPU time cannot be read (Python's waits alone are
    seen then; the others' figure then counts its time too)."""

    def __init__(self, ident: int, native: Optional[int]) -> None:
        self.clock: Optional[int] = None
        self.cpu, self.process, self.wall = 0.0, time.process_time(), time.monotonic()
        self.stat = f"/proc/self/task/{native}/stat"
        try:
            self.clock = time.pthread_getcpuclockid(ident)
            self.cpu = time.clock_gettime(self.clock)
        except (AttributeError, OSError):  # not on this platform
            self.clock = None

    def __call__(self) -> tuple[bool, bool]:
        try:
            cpu = time.clock_gettime(self.clock) if self.clock is not None else None
        except OSError:  # the thread ended
            cpu = None
        wall, process = time.monotonic(), time.process_time()
        elapsed, mine = wall - self.wall, 0.0 if cpu is None else cpu - self.cpu
        idle = cpu is not None and mine < _IDLE_SHARE * elapsed and self._sleeping()
        others = process - self.process - mine < _BUSY_OTHERS_SHARE * elapsed and not self._others_running()
        self.cpu, self.process, self.wall = cpu or 0.0, process, wall
        return idle, others

    def _sleeping(self) -> bool:
        return _state(self.stat) in ("S", "")  # not R (runnable: busy), nor D (disk); "": no /proc, the CPU time says

    def _others_running(self) -> bool:
        """Whether Linux says another thread of the process (not this one, not the watcher) runs or waits for a core
        (state ``R``): a busy thread on a loaded machine gets little CPU time, but is ``R`` (``False`` without /proc)."""
        try:
            threads = os.listdir("/proc/self/task")
        except OSError:
            return False
        mine = {self.stat, f"/proc/self/task/{threading.get_native_id()}/stat"}
        return any(_state(f"/proc/self/task/{tid}/stat") == "R" for tid in threads if f"/proc/self/task/{tid}/stat" not in mine)


def _state(stat: str) -> str:
    """A thread's state letter in its ``/proc`` ``stat`` file (``R``, ``S``, ``D``, ...), ``""`` where it cannot be read."""
    try:
        with open(stat) as lines:
            return lines.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


class _WaitWatch:
    """Looks at the probing thread every 0.1 s; once it has waited :data:`PROBE_WAIT_S` (in one of Python's waits, or
    idle in a call of C's: :func:`_waiting_at`; the process's other threads idle too: :class:`_Idle`), stops it there with a ``KeyboardInterrupt`` (a ``SIGINT`` to that
    thread, which wakes a blocked lock, ``sleep``, ``select`` or ``recv``), where that is safe: the probing thread is
    the main one and ``SIGINT`` is Python's own (a user's handler is never called by lightning_hbm); else says it at
    once. A thread still there :data:`_STOP_GRACE_S` after the stop is in a call that does not return on a signal: said."""

    def __init__(self, model: str, step: str) -> None:
        self.model, self.step, self.where, self.sent, self.done = model, step, "", False, False
        self.ident, self.lock, self.stop = threading.get_ident(), threading.Lock(), threading.Event()
        self.native = getattr(threading, "get_native_id", lambda: None)()
        self.interruptible = (
            threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_kill")
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )  # fmt: skip
        self.thread = threading.Thread(target=self._look, name="lightning_hbm-probe-wait", daemon=True)

    def _look(self) -> None:
        since: Optional[float] = None
        idle, missed = _Idle(self.ident, self.native), 0
        while not self.stop.wait(0.1):
            mine, others = idle()  # a wait for the step's own busy threads (a transform in a pool) is no wait here
            where = _waiting_at(sys._current_frames().get(self.ident), mine) if others else None
            missed = 0 if where is not None else missed + 1
            if missed >= _MISSES:  # a look or two may catch a polling loop awake, or queued for a core on a loaded machine
                since = None
            if where is None:
                continue
            since = time.monotonic() if since is None else since
            if time.monotonic() - since < PROBE_WAIT_S:
                continue
            with self.lock:
                if self.done:
                    return
                self.where, self.sent = where, self.interruptible
                if self.sent:
                    signal.pthread_kill(self.ident, signal.SIGINT)
            if not self.sent or not self.stop.wait(_STOP_GRACE_S):
                rank_zero_warn(self.message(stopped=False))
            return

    def finish(self) -> bool:
        """No interrupt from now on; whether one was sent."""
        with self.lock:
            self.done = True
        self.stop.set()
        return self.sent

    def message(self, stopped: bool) -> str:
        head = (
            f"lightning_hbm: {self.model}.{self.step} waited {PROBE_WAIT_S:g} s at {self.where} in the probe step (run "
            "once before the model is changed, to see which layers its code reads directly). The probe step runs "
            "before on_fit_start (the model is changed before the optimizers exist): what on_fit_start starts is not "
            "there yet. "
        )
        if stopped:
            return head + (
                "It was stopped there, and the model's source decided which layers its code reads directly, as with "
                f"{PROBE_SWITCH}=0; the fit goes on. To have the probe step run: start what the step waits for in "
                f"setup() (it runs before the probe step); to skip it without the wait: {PROBE_SWITCH}=0."
            )
        if self.sent:
            return head + (
                f"It was sent a stop (SIGINT) and still waits there {_STOP_GRACE_S:g} s later: a call in C that does not "
                "return on a signal. If what it waits for never comes, it never returns: stop the run (kill it), then "
                f"start what the step waits for in setup() (it runs before the probe step), or set {PROBE_SWITCH}=0."
            )
        return head + f"A step that waits for it never returns. Start it in setup() instead, or set {PROBE_SWITCH}=0."


@contextmanager
def _stopped_if_waiting(model: str, step: str) -> Iterator[_WaitWatch]:
    """The probe step stopped, said, where it waits :data:`PROBE_WAIT_S` (:class:`_WaitWatch`): a step that waits for
    something ``on_fit_start`` starts hung the fit (issue 55). The block's ``KeyboardInterrupt`` of that stop is taken
    here (a user's Ctrl-C goes on); the step's contexts have put everything back as it unwound."""
    watch = _WaitWatch(model, step)
    watch.thread.start()
    try:
        yield watch
        if watch.finish():  # sent as the step returned: the interrupt lands in this sleep
            time.sleep(1.0)
    except KeyboardInterrupt:
        if not watch.sent:
            raise
        warnings.warn(watch.message(stopped=True), UserWarning, stacklevel=3)
    finally:
        watch.finish()


def _guard(module: nn.Module) -> None:
    """Guards on the paths the probe step did not take, where the model's source reads a layer now changed."""
    if readers.observation(module) is None:
        return
    changed: dict[str, tuple[nn.Module, torch.Tensor, Optional[torch.Tensor]]] = {}
    for name, layer, _ in find_layers(module):
        base = base_layer(layer)
        if isinstance(base, QuantizedEmbedding):
            continue  # its .weight serves the dequantized table: a read (CLIP's .weight.shape) gets the right values
        storage = stored_in(base)  # a quantized convolution: its storage's weight is what a reader would get
        holder = storage if storage is not None else base
        weight = getattr(holder, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        quantized = not weight.is_floating_point() or quantized_format(holder) is not None
        if quantized or is_adapted(layer):
            # the guard watches the stored weight, but "inside the layer" is the layer a parent calls (peft's layer
            # or the quantized convolution): a quantized convolution's own forward reads its storage's weight
            # without calling the storage (issue 53: timm PatchEmbed, RecurrentGemma's conv_1d were refused)
            changed[name] = (layer, weight, readers.see_as(holder, weight) if quantized else None)
    readers.guard_unobserved(module, source_readers(module), changed)  # once per model


def _tell_unrun(module: nn.Module) -> None:
    """Say, once per model, the layers changed that the probe step never ran (:func:`readers.unrun_layers`): adapters
    there are never trained (a warning: their parameters, gradients' and optimizer's memory are spent for nothing, and
    the user believes them trained), quantized layers hold memory the step does not use (an info line: quantized, they
    take the least they can; only the user can leave them out of the model)."""
    seen = readers.observation(module)
    if seen is None or seen.told or not seen.unrun or seen.step != "training_step":
        return
    seen.told = True
    adapted: dict[str, int] = {}
    quantized: dict[str, int] = {}
    ran: list[str] = []
    for name, layer, _ in find_layers(module):
        if is_adapted(layer) and name in seen.unrun:
            adapted[name] = parameter_count(layer, trainable=True)
        elif is_adapted(layer):
            ran.append(name)
        elif name in seen.unrun and any(quantized_format(sub) is not None for sub in layer.modules()):
            quantized[name] = parameter_bytes(layer)
    how = f"the probe step ran {seen.ran}"
    if adapted:
        rank_zero_warn(
            f"lightning_hbm: {len(adapted)} adapter(s) sit on layers the training step never runs ({how}, before the model "
            f"was changed; neither these layers nor their parent modules ran): {name_list(adapted)}. They hold "
            f"{sum(adapted.values()):,} trainable parameters that get no gradient: never trained, they stay at their initial "
            "value (no effect), their memory spent for nothing (e.g. a decoder's cross-attention run without encoder "
            f"states). Leave them out: LoRA(exclude_modules={_exclusion(list(adapted), ran)!r}), or target_modules without "
            "them. If later batches run them, ignore this."
        )
    if quantized:
        rank_zero_info(
            f"lightning_hbm: {len(quantized)} quantized layer(s) are never run by the training step ({how}): "
            f"{name_list(quantized)}; they hold {sum(quantized.values()) / 2**20:.2f} MiB stored, unused by training. If "
            "the model never needs them in this fit, removing them from the model before fit frees it."
        )


def _exclusion(unrun: list[str], ran: list[str]) -> list[str]:
    """The shortest names (the last two parts of each, ``encoder_attn.q_proj``) selecting every ``unrun`` layer and
    none of ``ran``; the full names where those would select a layer that ran."""
    short = sorted({".".join(name.split(".")[-2:]) for name in unrun})
    return short if not any(name_matches(name, short) for name in ran) else sorted(unrun)
