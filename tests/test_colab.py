"""Colab, rehearsed: the setup cell and the widgets in an environment built like Colab's GPU runtime
(.ci/colab_rehearsal.py, minutes on a cold run), plus quick checks of the setup cell here."""
from __future__ import annotations

import os
import subprocess
import sys
import types
import urllib.request
from pathlib import Path

import pytest

from .test_book import ROOT, load_ci_module

SHARED_PINS = ROOT.parent / "shared" / "colab-pins.txt"


def test_the_pins_copy_matches_the_shared_pins():
    ours = (ROOT / ".ci" / "colab-pins.txt").read_text()
    assert "torch==" in ours and "ipywidgets==7.7.1" in ours
    if SHARED_PINS.exists():
        assert ours == SHARED_PINS.read_text(), "copy ../shared/colab-pins.txt to .ci/colab-pins.txt"


def run_setup_cell(source: str, monkeypatch, in_colab: bool) -> None:
    if in_colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(compile(source, "setup-cell", "exec"), {})


def test_the_setup_cell_does_nothing_outside_colab(monkeypatch, tmp_path):
    sync = load_ci_module("sync_notebooks")
    calls, fetched = [], []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: calls.append(args) or
                        types.SimpleNamespace(returncode=0, stdout="", stderr=""))
    monkeypatch.setattr(urllib.request, "urlretrieve", lambda url, dest: fetched.append((url, dest)))
    run_setup_cell(sync.setup_source("https://invalid.invalid/nothing"), monkeypatch, in_colab=False)
    assert calls == [] and fetched == [], "outside Colab the setup cell must not run pip or fetch files"
    (tmp_path / "myengine").mkdir()
    (tmp_path / "myengine" / "block_pool.py").write_text("# the reader's own edit\n")
    run_setup_cell(sync.setup_source("https://invalid.invalid/nothing"), monkeypatch, in_colab=True)
    assert calls and "enginelib @ git+https://invalid.invalid/nothing" in calls[0][0], calls
    # in Colab it fetches the reader's engine files it lacks, and leaves the reader's own edits alone
    names = {dest for _, dest in fetched}
    assert "myengine/engine.py" in names and "myengine/block_pool.py" not in names, fetched
    assert all(url == f"https://invalid.invalid/nothing/book/{dest}" for url, dest in fetched), fetched


def test_the_setup_cell_fetches_from_the_repositorys_raw_files():
    sync = load_ci_module("sync_notebooks")
    source = sync.setup_source("https://github.com/someone/some-book")
    assert "https://raw.githubusercontent.com/someone/some-book/" in source
    assert all(f"'{p.name}'" in source for p in (ROOT / "book" / "myengine").glob("*.py"))


def test_a_failing_install_says_what_happened_and_what_to_do(monkeypatch, tmp_path):
    sync = load_ci_module("sync_notebooks")
    source = sync.setup_source(f"file://{tmp_path}/no-such-repository")
    with pytest.raises(RuntimeError) as err:
        run_setup_cell(source, monkeypatch, in_colab=True)
    message = str(err.value)
    assert "Could not install enginelib" in message
    assert "no-such-repository" in message  # pip's own output, not swallowed
    assert "Runtime > Restart" in message and f'!pip install "enginelib @ git+file://{tmp_path}' in message
    assert "#run-a-chapter-in-colab" in message


def pyenv_313() -> list[Path]:
    return sorted(Path.home().glob(".pyenv/versions/3.13.*/bin/python3.13"))


@pytest.mark.slow
def test_colab_rehearsal():
    """Build (or reuse) the Colab-like venv; rehearse the setup cells, the widgets and one chapter
    ($COLAB_REHEARSAL_EXECUTE, default chapter 1; set it empty to skip)."""
    if not pyenv_313() and not os.environ.get("COLAB_PYTHON"):
        if os.environ.get("CI"):
            pytest.fail("CI needs Python 3.13 for the Colab rehearsal: pyenv install 3.13, or set COLAB_PYTHON")
        pytest.skip("no Python 3.13 (pyenv) for the Colab rehearsal")
    chapters = os.environ.get("COLAB_REHEARSAL_EXECUTE", "book/01_model.ipynb").split()
    # a chapter opened alone (an empty folder, as Colab opens it): it fetches the earlier chapters' engine files
    alone = os.environ.get("COLAB_REHEARSAL_ALONE", "book/09_prefix_caching.ipynb").split()
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "colab_rehearsal.py"),
                           *(arg for chapter in chapters for arg in ("--execute", chapter)),
                           *(arg for chapter in alone for arg in ("--alone", chapter))],
                          cwd=ROOT, capture_output=True, text=True)
    print(done.stdout[-20000:], done.stderr[-5000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
