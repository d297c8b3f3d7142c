"""Adapter export and merge (issue 34): the adapter folder written as a unit; merge refuses another base."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Callable

import pytest
import torch

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.adapters.lora import export
from lightning_hbm.data import synthetic_batch
from lightning_hbm.surgery import run_surgery


def _adapted(llama_factory: Callable, alpha: float, seed: int, plugin: object = None) -> torch.nn.Module:
    """A tiny Llama through the surgery (so the model as built is recorded), lora_B random as if trained."""
    model = llama_factory()
    run_surgery(model, plugin, [LoRA(r=4, alpha=alpha, target_modules=["q_proj", "v_proj"])])
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if ".lora_B." in name:
            param.data.normal_(0, 0.05)
    return model.eval()


def _reloaded_logits(llama_factory: Callable, path: Path, idx: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(llama_factory().model, str(path)).eval()
    with torch.no_grad():
        return peft_model(input_ids=idx, use_cache=False).logits


def test_a_failed_export_over_a_previous_adapter_leaves_it_intact(
    llama_factory: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: a full disk left the new adapter_config.json (alpha 64) beside the old weights; peft loaded the pair."""
    idx, _ = synthetic_batch(2, 16, seed=1)
    old = _adapted(llama_factory, alpha=8, seed=1)
    path = LoRA.save_adapter(old, tmp_path / "adapter")
    (path / "README.md").write_text("mine")  # a file of the user's beside the adapter
    with torch.no_grad():
        want = old(idx)
    torch.testing.assert_close(_reloaded_logits(llama_factory, path, idx), want, rtol=1e-6, atol=1e-6)

    def full_disk(tensors: dict, filename: str, metadata: dict) -> None:
        Path(filename).write_bytes(b"\0" * 100)  # a partial weights file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export, "save_file", full_disk)
    new = _adapted(llama_factory, alpha=64, seed=2)
    with pytest.raises(OSError, match=r"could not write .*adapter.*No space left on device.*previous adapter there is untouched"):
        LoRA.save_adapter(new, path)
    assert json.loads((path / "adapter_config.json").read_text())["lora_alpha"] == 8
    torch.testing.assert_close(_reloaded_logits(llama_factory, path, idx), want, rtol=1e-6, atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temporary folder left beside it

    monkeypatch.undo()  # the disk has room again: the new adapter replaces the old one, the user's file stays
    LoRA.save_adapter(new, path)
    assert json.loads((path / "adapter_config.json").read_text())["lora_alpha"] == 64
    assert (path / "README.md").read_text() == "mine"
    with torch.no_grad():
        torch.testing.assert_close(_reloaded_logits(llama_factory, path, idx), new(idx), rtol=1e-6, atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_save_adapter_onto_a_file_is_refused(llama_factory: Callable, tmp_path: Path) -> None:
    (tmp_path / "adapter").write_text("x")
    with pytest.raises(ValueError, match=r"adapter is a file, not a folder"):
        LoRA.save_adapter(_adapted(llama_factory, alpha=8, seed=1), tmp_path / "adapter")


def test_merge_refuses_another_base(llama_factory: Callable) -> None:
    """Was: merge(base_state_dict=<another model's weights>) merged silently."""
    model = _adapted(llama_factory, alpha=8, seed=1, plugin=QuantizedPrecision("nf4", dtype="float32"))  # QLoRA
    # another base: the same model with one weight changed (a fine-tuned checkpoint, another seed)
    other_sd = {k: v.clone() for k, v in llama_factory().model.state_dict().items()}
    other_sd["model.layers.0.mlp.up_proj.weight"] += 1e-3
    with pytest.raises(
        ValueError,
        match=r"base_state_dict is not the base these adapters were trained on: 1 of its \d+ frozen weights differ .*"
        r"first \['model\.model\.layers\.0\.mlp\.up_proj\.weight'\]\. Nothing was merged\..*allow_base_change=True",
    ):
        LoRA.merge(model, base_state_dict=other_sd)
    # the right base (also as a bf16 copy) merges; allow_base_change=True merges onto the other one on purpose
    base_sd = llama_factory().model.state_dict()
    merged = LoRA.merge(model, base_state_dict=base_sd, dtype="float32")
    assert torch.equal(merged["model.model.layers.0.mlp.up_proj.weight"], base_sd["model.layers.0.mlp.up_proj.weight"])
    # a bf16 copy of the fp32 base cannot be told apart from another base: said, not refused
    with pytest.warns(UserWarning, match=r"half precision .* could not be checked"):
        LoRA.merge(model, base_state_dict={k: v.to(torch.bfloat16) for k, v in base_sd.items()})
    forced = LoRA.merge(model, base_state_dict=other_sd, dtype="float32", allow_base_change=True)
    assert torch.equal(forced["model.model.layers.0.mlp.up_proj.weight"], other_sd["model.layers.0.mlp.up_proj.weight"])


def test_an_export_keeps_the_folders_links_mode_and_target(llama_factory: Callable, tmp_path: Path) -> None:
    """Issue 55: the export replaced the whole folder: links became copies, a symlinked folder (latest -> run-17) was
    replaced by a real folder, and the folder's mode became 0700 (a team's 02775 folder lost its access)."""
    import os
    import stat

    run = tmp_path / "run-17"
    run.mkdir()
    os.chmod(run, 0o2775)
    (run / "notes.txt").write_text("mine")
    (run / "link.txt").symlink_to(run / "notes.txt")
    latest = tmp_path / "latest"
    latest.symlink_to(run)
    LoRA.save_adapter(_adapted(llama_factory, alpha=8, seed=1), latest)
    assert latest.is_symlink() and (run / "adapter_config.json").is_file() and (run / export.MANIFEST).is_file()
    assert stat.S_IMODE(run.stat().st_mode) == 0o2775
    assert (run / "link.txt").is_symlink() and (run / "link.txt").read_text() == "mine"
    assert not [p for p in run.iterdir() if p.name.endswith(".partial")]
    manifest = json.loads((run / export.MANIFEST).read_text())["files"]
    assert set(manifest) >= {"adapter_config.json", "adapter_model.safetensors"}
    assert all((run / name).stat().st_size == size for name, size in manifest.items())


def test_an_export_into_a_read_only_folder_names_it(llama_factory: Callable, tmp_path: Path) -> None:
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    folder = tmp_path / "adapter"
    folder.mkdir()
    os.chmod(folder, 0o555)
    try:
        with pytest.raises(PermissionError, match=rf"cannot write into {folder}"):
            LoRA.save_adapter(_adapted(llama_factory, alpha=8, seed=1), folder)
    finally:
        os.chmod(folder, 0o755)


@pytest.mark.parametrize("where", ["folder", "new-folder-under-it"])
def test_an_export_onto_a_read_only_filesystem_names_the_folder_not_free_space(
    llama_factory: Callable, read_only_mount: Path, where: str
) -> None:
    """Issue 55: a read-only folder was told to "free space on that disk"; on a read-only filesystem the raw
    ``OSError: [Errno 30] Read-only file system: '.../.lightning_hbm_export.lock'`` came out."""
    folder = read_only_mount / "folder" if where == "folder" else read_only_mount / "new" / "adapter"  # (conftest)
    with pytest.raises(PermissionError, match=rf"cannot write into {folder} \(Read-only file system\): save into a folder you can write to"):
        LoRA.save_adapter(_adapted(llama_factory, alpha=8, seed=1), folder)
    assert sorted(p.name for p in (read_only_mount / "folder").iterdir()) == ["notes.txt"]


def test_concurrent_exports_into_one_folder_all_succeed(llama_factory: Callable, tmp_path: Path) -> None:
    """Was: 3 of 160 concurrent exports failed with misleading messages (an exists()/is_dir() race)."""
    from concurrent.futures import ThreadPoolExecutor

    model = _adapted(llama_factory, alpha=8, seed=1)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: LoRA.save_adapter(model, tmp_path / "adapter"), range(8)))
    names = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", export.MANIFEST} <= names
    assert not [n for n in names if n.endswith(".partial")]


def test_the_calibrated_correction_in_the_exports(llama_factory: Callable, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """QuantizedPrecision(correction_rank=...): merge() adds it to the dequantized base; save_adapter() leaves it out
    (the adapter for the full-precision base, said) unless with_correction=True, which folds it into the adapter for
    the plain quantized base (rank r_lora + r on q/v, a correction-only adapter on the other layers): same output."""
    from peft import PeftModel

    idx, _ = synthetic_batch(2, 16, seed=1)
    probe, _ = synthetic_batch(4, 64, seed=2)  # 256 tokens: more than any layer's inputs
    plugin = QuantizedPrecision("nf4", dtype="float32", probe_batch=probe, correction_rank=4)
    model = _adapted(llama_factory, alpha=8, seed=1, plugin=plugin)  # adapters on q_proj and v_proj only
    with torch.no_grad():
        want = model(idx)
    with pytest.warns(UserWarning, match="DEQUANTIZED"):
        merged = LoRA.merge(model, dtype="float32")
    plain = llama_factory().eval()
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(idx), want, rtol=1e-4, atol=1e-4)

    with caplog.at_level("INFO"):
        full = LoRA.save_adapter(model, tmp_path / "for-full-precision")
    assert "calibrated corrections" in caplog.text and "with_correction=True" in caplog.text
    assert json.loads((full / "adapter_config.json").read_text())["rank_pattern"] == {}

    folded = LoRA.save_adapter(model, tmp_path / "for-quantized", with_correction=True)
    config = json.loads((folded / "adapter_config.json").read_text())
    assert set(config["rank_pattern"].values()) == {4, 8}  # corrections alone; adapter + correction on q/v
    assert {"q_proj", "k_proj", "down_proj"} <= set(config["target_modules"])
    base = llama_factory()
    QuantizedPrecision("nf4", dtype="float32").convert_module(base)  # the plain quantized base, no correction
    reloaded = PeftModel.from_pretrained(base.model, str(folded)).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=idx, use_cache=False).logits, want, rtol=1e-4, atol=1e-4)
    base = llama_factory()
    QuantizedPrecision("nf4", dtype="float32").convert_module(base)
    without = PeftModel.from_pretrained(base.model, str(full)).eval()  # the correction mattered: it is not there
    with torch.no_grad():
        assert (without(input_ids=idx, use_cache=False).logits - want).abs().max() > 1e-2


def test_a_folder_whose_save_did_not_complete_is_refused_before_loading(
    llama_factory: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 55: ``save_adapter`` writes a manifest last, but nothing checked it: a save cut short between two files
    (new config beside old weights) or a truncated weights file loaded, or failed inside peft. ``LoRA.check_adapter_folder``
    refuses such a folder, naming the file and the fix; a complete one is returned as is."""
    import os

    model = _adapted(llama_factory, alpha=8, seed=1)
    path = LoRA.save_adapter(model, tmp_path / "adapter")
    assert LoRA.check_adapter_folder(path) == path and LoRA.check_adapter_folder(str(path)) == path

    replace = os.replace

    def cut_short(src: object, dst: object) -> None:  # the disk fills after the first file is in place
        if Path(str(dst)).name == "adapter_model.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device")
        replace(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(export.os, "replace", cut_short)
    with pytest.raises(OSError, match="some files were replaced"):
        LoRA.save_adapter(_adapted(llama_factory, alpha=64, seed=2), path)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=rf"has no {export.MANIFEST}: a LoRA.save_adapter into it did not complete.*Save the adapter again"):
        LoRA.check_adapter_folder(path)

    LoRA.save_adapter(model, path)
    weights = path / "adapter_model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size // 2)
    with pytest.raises(ValueError, match=rf"adapter_model.safetensors has {size // 2:,} bytes, not the {size:,} its save wrote"):
        LoRA.check_adapter_folder(path)
    weights.unlink()
    with pytest.raises(ValueError, match=r"adapter_model.safetensors is missing"):
        LoRA.check_adapter_folder(path)
    (path / export.MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match=rf"{export.MANIFEST} cannot be read \(JSONDecodeError"):
        LoRA.check_adapter_folder(path)


def test_save_adapter_of_a_bare_transformers_model(tmp_path: Path) -> None:
    """Was: LoRA().transform_model(LlamaForCausalLM) then save_adapter raised "holds several Hugging Face models
    ['', 'model']" (the model and its inner LlamaModel counted as two); now the model itself is the root, as
    ``layers.hf_models`` says, and peft reloads the adapter onto a fresh base."""
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)

    def base() -> LlamaForCausalLM:
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()

    model = base()
    LoRA(r=2, alpha=4, target_modules=["q_proj", "v_proj"]).transform_model(model)
    for name, param in model.named_parameters():
        if ".lora_B." in name:
            param.data.normal_(0, 0.05)
    path = LoRA.save_adapter(model, tmp_path / "adapter")
    assert json.loads((path / "adapter_config.json").read_text())["target_modules"] in (["q_proj", "v_proj"], ["v_proj", "q_proj"])
    idx = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        want = model(input_ids=idx, use_cache=False).logits
        got = PeftModel.from_pretrained(base(), str(path)).eval()(input_ids=idx, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_save_adapter_names_a_submodule_that_is_not_there(llama_factory: Callable, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"submodule='nope' is not a submodule of LlamaLM"):
        LoRA.save_adapter(_adapted(llama_factory, alpha=8, seed=1), tmp_path / "adapter", submodule="nope")
    assert not (tmp_path / "adapter").exists()


def test_the_export_for_the_quantized_base_says_which_base_it_fits(
    llama_factory: Callable, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Session 38 (issue 52 attack): the with_correction adapter of a GPTQ run, reloaded by plain peft onto a base
    rounded to nearest (bitsandbytes' own quantization), was off by 0.09 on logits of scale 0.6, and nothing said the
    adapter needs the run's own quantized weight (same rounding, same probe). The export now says it."""
    from peft import PeftModel

    idx, _ = synthetic_batch(2, 16, seed=1)
    probe, _ = synthetic_batch(4, 64, seed=2)
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=probe, rounding="gptq", correction_rank=4)
    model = _adapted(llama_factory, alpha=8, seed=1, plugin=plugin)
    with torch.no_grad():
        want = model(idx)
    with caplog.at_level("INFO"):
        folded = LoRA.save_adapter(model, tmp_path / "for-quantized", with_correction=True)
    assert "exactly as this run quantized it" in caplog.text and "rounding='gptq' the same probe_batch" in caplog.text
    logits = {}
    for label, settings in {"same": {"rounding": "gptq", "probe_batch": probe}, "nearest": {}}.items():
        base = llama_factory()
        QuantizedPrecision("nf4-dq", dtype="float32", **settings).convert_module(base)  # type: ignore[arg-type]
        with torch.no_grad():
            logits[label] = PeftModel.from_pretrained(base.model, str(folded)).eval()(input_ids=idx, use_cache=False).logits
    torch.testing.assert_close(logits["same"], want, rtol=1e-4, atol=1e-4)  # the base the message names: exact
    assert (logits["nearest"] - want).abs().max() > 1e-2  # another quantization of W: other outputs (why it is said)
