"""LiveStorageTracker: storage resizes (FSDP2's way of freeing and refilling a unit's gathered parameters)."""

from __future__ import annotations

import torch

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.memory import LiveStorageTracker


def test_a_storage_resized_to_zero_is_released_and_grown_again_is_allocated() -> None:
    """FSDP2 frees a unit's gathered parameters with ``untyped_storage().resize_(0)`` after its forward and allocates
    them again with ``resize_(n)`` for the backward: no dispatch mode sees either. Before session 33 the tracker kept
    the freed bytes live (the 2-rank run's peak counted every block gathered at once, and a refill at a new address
    twice: 1,777,744 and 1,826,896 B in two runs of the same step)."""
    gathered = torch.empty(1000)  # 4,000 B, alive before the step (as FSDP2's all-gather outputs are)
    storage = gathered.untyped_storage()
    tracker = LiveStorageTracker(track_peak=True)
    tracker.seed([gathered], "parameters")
    # torch's own MemTracker, run earlier in the same process, leaves the native method in the class dict on exit
    held = torch.UntypedStorage.__dict__.get("resize_")
    with tracker:
        storage.resize_(0)  # reshard after the forward
        assert tracker.live_bytes == 0 and tracker.live_storages() == {}
        other = torch.ones(250)  # 1,000 B, may take the freed address
        storage.resize_(4000)  # all-gather again for the backward: a new allocation
        assert tracker.live_bytes == 5000 == tracker.peak_bytes
        assert sorted(r.phase for r in tracker.live_records().values()) == ["forward", "forward"]
        storage.resize_(0)
        assert tracker.live_bytes == 1000
        assert sorted(r.nbytes for r in tracker.peak_records.values()) == [1000, 4000]  # the live set at the peak
        del other
        assert tracker.live_bytes == 0
    assert torch.UntypedStorage.__dict__.get("resize_") is held  # the wrapper only while a tracker is entered
    storage.resize_(400)  # outside: not followed
    assert tracker.live_bytes == 0
    del gathered, storage
    assert tracker.live == {}


def test_the_release_of_a_resized_storage_leaves_a_new_storage_at_its_old_address_alone() -> None:
    """A storage resized away from an address, then freed, must not release what lives at that address now."""
    tracker = LiveStorageTracker(track_peak=True)
    with tracker:
        moved = torch.empty(64)
        storage = moved.untyped_storage()
        old = tracker.live_bytes
        storage.resize_(1024)  # grows: moves to a new address
        assert tracker.live_bytes == old - 256 + 1024
        newcomer = torch.empty(64)
        alive = tracker.live_bytes
        del moved, storage  # the storage dies: its weak reference's callback for the first address runs
        assert tracker.live_bytes == alive - 1024
        assert newcomer.untyped_storage().data_ptr() in {key[1] for key in tracker.live}


def test_resize_listeners_are_called_with_the_storage_before_and_the_method_is_put_back() -> None:
    seen: list[tuple[int, int, int]] = []

    def listener(storage: torch.UntypedStorage, data_ptr: int, nbytes: int) -> None:
        seen.append((data_ptr, nbytes, storage.nbytes()))

    before = torch.UntypedStorage.resize_
    held = torch.UntypedStorage.__dict__.get("resize_")  # torch's MemTracker, run before in this process, leaves one
    storage = torch.empty(8).untyped_storage()
    pointer = storage.data_ptr()
    torch_compat.add_resize_listener(listener)
    try:
        storage.resize_(0)
        storage.resize_(16)
    finally:
        torch_compat.remove_resize_listener(listener)
    assert seen == [(pointer, 32, 0), (0, 0, 16)]
    assert torch.UntypedStorage.resize_ is before and torch.UntypedStorage.__dict__.get("resize_") is held


def test_the_step_picture_follows_the_resizes_the_tracker_follows() -> None:
    """``StepRecorder`` (the profiler's picture) replays the tracker's live bytes: a resize releases the storage's entry
    and a growth adds one, so its peak is the tracker's (under FSDP2 it drew 1,846,352 B for 1,658,960 before)."""
    from torch import nn

    from lightning_hbm.profiling.timeline import StepRecorder

    tracker = LiveStorageTracker(track_peak=True)
    module = nn.Linear(4, 4)
    tracker.seed(module.parameters(), "parameters")
    gathered = torch.empty(1000)  # 4,000 B made before the step, empty once the forward is over
    storage = gathered.untyped_storage()
    storage.resize_(0)
    tracker.__enter__()
    recorder = StepRecorder(tracker, module)
    recorder.start()
    try:
        storage.resize_(4000)  # gathered for the forward
        storage.resize_(0)  # resharded
        out = module(torch.ones(8, 4))
        storage.resize_(4000)  # gathered again
        del out
        storage.resize_(0)
    finally:
        recorded = recorder.stop()
        tracker.__exit__(None, None, None)
    live, peak = 0, 0
    for event in recorded.events:
        live += recorded.entries[event].record.nbytes if event >= 0 else -recorded.entries[~event].record.nbytes
        peak = max(peak, live)
    assert peak == tracker.peak_bytes and live == tracker.live_bytes
    assert sum(1 for e in recorded.entries if e.record.nbytes == 4000) == 2  # each gather an entry of its own
