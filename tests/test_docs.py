"""README.md and docs/*.md: every relative link reaches an existing file (and heading), CI runs the README's test
command, and the ```python snippets run."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pytest
import torch

from lightning_hbm.layers import kinds as layer_registry
from lightning_hbm.precision import registry

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    # GitHub's heading slugs: lower case, punctuation dropped, spaces to hyphens (code fences skipped)
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


def test_docs_exist_and_link_each_other() -> None:
    assert len(PAGES) > 10, PAGES
    readme_targets = {(ROOT / t.split("#")[0]).resolve() for t in _links(ROOT / "README.md")}
    assert set(PAGES[1:]) <= readme_targets, "every docs/*.md page is linked from the README's table"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_heading(page: Path) -> None:
    for target in _links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.relative_to(ROOT)}: link {target!r} points to a missing file"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{page.relative_to(ROOT)}: link {target!r}: no such heading"


def test_ci_runs_the_readme_test_command() -> None:
    readme_block = re.search(r"^# \d+\. run the tests\n(.+)$", (ROOT / "README.md").read_text(), re.MULTILINE)
    assert readme_block, "README's quickstart block lost its test command"
    command = readme_block.group(1).strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci_lines[-1] == command, (ci_lines[-1], command)


# ```python blocks run, page by page, top to bottom in one namespace (as a reader follows a page). A block preceded by
# `<!-- no-run: why -->` is not run (it needs a GPU, a command line or an earlier run's files): keep them few.
BLOCK = re.compile(r"(?:<!-- no-run: (?P<why>.+?) -->\n)?^```python\n(?P<code>.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(page: Path) -> list[tuple[int, str, Optional[str]]]:
    text = page.read_text()
    return [(text[: m.start("code")].count("\n") + 1, m.group("code"), m.group("why")) for m in BLOCK.finditer(text)]


SNIPPET_PAGES = [p for p in PAGES if any(why is None for _, _, why in _blocks(p))]


@pytest.fixture
def doc_names(gpt_factory: Callable[..., Any], llama_factory: Callable[..., Any], datamodule_factory: Callable[..., Any],
              trainer_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[Path], dict[str, Any]]:
    """``doc_names(page)``: the names the snippets take as given. ``model`` is a tiny NanoGPT, or on the pages about
    Hugging Face models (``HF_PAGES``) a tiny transformers Llama in a LightningModule whose weights are saved at ``path``;
    ``data``/``datamodule``/``batch`` feed it; ``Trainer`` (also ``pl.Trainer``) runs 2 quiet CPU steps. Snippets run in
    tmp_path; modes and layer kinds they register are dropped."""
    monkeypatch.setattr(registry, "_MODES", dict(registry._MODES))
    monkeypatch.setattr(layer_registry, "_KINDS", dict(layer_registry._KINDS))
    monkeypatch.chdir(tmp_path)

    def Trainer(**kwargs: Any) -> Any:  # noqa: N802 (the name the snippets use)
        return trainer_factory(**{"max_steps": 2, **kwargs})

    def make(page: Path) -> dict[str, Any]:
        data = datamodule_factory()
        names = {"Trainer": Trainer, "pl": SimpleNamespace(Trainer=Trainer), "torch": torch, "model": gpt_factory(),
                 "MyModule": gpt_factory, "data": data, "datamodule": data, "batch": next(iter(data.train_dataloader()))}
        if page.name in HF_PAGES:
            names["model"] = llama_factory()
            names["path"] = str(tmp_path / "hf_model")
            names["model"].model.save_pretrained(names["path"])
        return names

    return make


HF_PAGES = {"adapters.md"}


def _slow_if_it_trains(page: Path) -> Any:
    heavy = any(s in code for _, code, why in _blocks(page) if why is None for s in (".fit(", "plan("))
    return pytest.param(page, marks=[pytest.mark.slow] if heavy else [], id=page.relative_to(ROOT).as_posix())


@pytest.mark.parametrize("page", [_slow_if_it_trains(p) for p in SNIPPET_PAGES])
def test_python_snippets_run(page: Path, doc_names: Callable[[Path], dict[str, Any]]) -> None:
    ran, names = 0, doc_names(page)
    for line, code, why in _blocks(page):
        if why is not None:
            continue
        exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), names)  # noqa: S102 (our own docs)
        ran += 1
    assert ran


def test_few_snippets_are_left_out() -> None:
    blocks = [b for p in PAGES for b in _blocks(p)]
    skipped = [why for _, _, why in blocks if why is not None]
    assert len(blocks) >= 15 and len(skipped) <= 4, (len(blocks), skipped)
