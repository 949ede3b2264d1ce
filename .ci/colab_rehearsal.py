"""Rehearse the book in an environment built the way Colab's GPU runtime is.

    python .ci/colab_rehearsal.py                      # build or reuse _build/colab-venv, rehearse
    python .ci/colab_rehearsal.py --execute book/01_model.ipynb   # also run a chapter there
    python .ci/colab_rehearsal.py --as-synced          # use the setup cells .ci/sync_notebooks.py would write
    COLAB_VENV=~/.cache/colab-venv python .ci/colab_rehearsal.py   # keep the venv (4-5 GB) elsewhere

The environment: Python 3.13 (pyenv's), and Colab's versions from .ci/colab-pins.txt (torch, ipywidgets
7.7.1, IPython 7.34, matplotlib, numpy, ...), with the pins as a pip constraints file so that nothing
installed later moves them. torch is PyPI's 2.11.0 wheel, the CUDA build Colab runs, with its nvidia
libraries (the CUDA build cannot even be imported without them; there is no GPU here, so
``torch.cuda.is_available()`` is False). The venv is reused when its stamp matches the pins.

Then, against a local clone of this repository (HEAD plus the working tree's changes):
1. each chapter's setup cell (each distinct one once) runs in the venv's Python with ``google.colab`` faked and the
   repository URL swapped for ``git+file://<clone>``; afterwards ``import enginelib`` works in that
   same process and Colab's versions are untouched;
2. a setup cell whose install fails raises an error that shows pip's output and says what to do;
3. the widget code runs under ipywidgets 7.7.1: EngineExplorer's callbacks drive a tiny engine,
   and BlockMapPlayer (when enginelib.viz.player exists) builds its HTML;
4. optionally, a chapter runs top to bottom there with nbclient.
Exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / ".ci" / "colab-pins.txt"
# What the book touches in Colab's image (the rest of the pins only constrain).
INSTALL = ["torch", "numpy", "matplotlib", "ipython", "ipykernel", "ipywidgets", "widgetsnbextension",
           "jupyter_client", "nbformat", "tokenizers", "safetensors", "Jinja2", "tqdm", "transformers",
           "accelerate"]
KEPT = ["torch", "ipywidgets", "ipython", "matplotlib", "numpy"]  # must survive the setup cell
EXTRA = ["nbclient"]  # ours, to execute a chapter; Colab runs notebooks itself


@dataclass
class Report:
    """Each check's name, outcome and time, printed as a summary at the end."""
    rows: list[tuple[str, bool, float, str]] = field(default_factory=list)

    def check(self, name: str, ok: bool, seconds: float, detail: str = "") -> bool:
        self.rows.append((name, ok, seconds, detail))
        print(f"[{'ok' if ok else 'FAIL'}] {name} ({seconds:.1f} s){': ' + detail if detail else ''}", flush=True)
        return ok

    def summary(self) -> int:
        failed = [r for r in self.rows if not r[1]]
        print("\n== Colab rehearsal summary")
        for name, ok, seconds, detail in self.rows:
            print(f"  {'ok  ' if ok else 'FAIL'} {seconds:7.1f} s  {name}" + (f"  ({detail.splitlines()[0]})" if detail else ""))
        print(f"  {len(self.rows) - len(failed)} passed, {len(failed)} failed")
        return 1 if failed else 0


def pins() -> dict[str, str]:
    """name (lower case) -> version, from .ci/colab-pins.txt."""
    found = {}
    for line in PINS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            found[name.strip().lower()] = version.strip()
    return found


def find_python(explicit: str | None) -> Path:
    """Python 3.13: --python, $COLAB_PYTHON, or pyenv's newest 3.13.x."""
    if explicit or os.environ.get("COLAB_PYTHON"):
        return Path(explicit or os.environ["COLAB_PYTHON"])
    found = sorted(Path.home().glob(".pyenv/versions/3.13.*/bin/python3.13"))
    if not found:
        raise SystemExit("no Python 3.13: install it (pyenv install 3.13) or pass --python / set COLAB_PYTHON")
    return found[-1]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


def build_venv(python: Path, venv: Path, report: Report) -> Path:
    """The Colab-like venv at ``venv`` (reused if its stamp matches); returns its python."""
    vpy = venv / "bin" / "python"
    want = pins()
    stamp = hashlib.sha256(json.dumps([str(python), want, INSTALL, EXTRA]).encode()).hexdigest()
    stamp_file = venv / ".colab-rehearsal-stamp"
    start = time.perf_counter()
    if vpy.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        report.check("reuse the Colab-like venv", True, time.perf_counter() - start, str(venv))
        return vpy
    shutil.rmtree(venv, ignore_errors=True)
    made = run([str(python), "-m", "venv", str(venv)])
    if made.returncode:
        raise SystemExit(f"could not create {venv}:\n{made.stderr}")
    specs = [f"{n}=={want[n.lower()]}" for n in INSTALL] + EXTRA
    pip = run([str(vpy), "-m", "pip", "install", "-q", "--progress-bar", "off", "-c", str(PINS), *specs])
    ok = pip.returncode == 0
    if ok:
        stamp_file.write_text(stamp)
    size = run(["du", "-sh", str(venv)]).stdout.split("\t")[0]
    report.check("build the Colab-like venv (pip install " + " ".join(specs) + ")", ok,
                 time.perf_counter() - start, f"{size} on disk" if ok else pip.stdout + pip.stderr)
    if not ok:
        raise SystemExit(report.summary())
    return vpy


def clone(work: Path) -> Path:
    """A clone of HEAD with the working tree's changes committed on top (in the clone only)."""
    repo = work / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    files = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    for name in filter(None, files.split("\0")):
        src, dst = ROOT / name, repo / name
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        elif not src.exists() and dst.exists():
            dst.unlink()
    git = ["git", "-C", str(repo), "-c", "user.name=rehearsal", "-c", "user.email=rehearsal@localhost"]
    subprocess.run([*git, "add", "-A"], check=True)
    if run([*git, "diff", "--cached", "--quiet"]).returncode:
        subprocess.run([*git, "commit", "-q", "-m", "working tree"], check=True)
    return repo


def setup_cells(as_synced: bool) -> dict[str, str]:
    """chapter name -> its setup cell's source (as committed, or as the sync script would write it)."""
    import nbformat

    sync = None
    if as_synced:
        spec = importlib.util.spec_from_file_location("sync_notebooks", ROOT / ".ci" / "sync_notebooks.py")
        sync = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sync)
    cells = {}
    for path in sorted((ROOT / "book").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if sync:
            sync.sync(nb, path)
        cells[path.name] = nb.cells[0].source
    return cells


# Runs in the venv: Colab's kernel has google.colab imported; the setup cell runs; then the same
# process imports enginelib and reports the versions that must not have moved.
IN_COLAB = """
import importlib.metadata as md, json, sys, types
sys.modules["google.colab"] = types.ModuleType("google.colab")
source = open(sys.argv[1]).read()
try:
    exec(compile(source, "setup-cell", "exec"), {})
    error = None
except Exception as err:
    error = f"{type(err).__name__}: {err}"
result = {"error": error, "versions": {n: md.version(n) for n in json.loads(sys.argv[2])}}
if error is None:
    import enginelib, enginelib.viz, torch
    result["enginelib"] = enginelib.__file__
    result["torch_runtime"] = torch.__version__
    result["cuda"] = torch.cuda.is_available()
    import os
    result["reader_files"] = sorted(os.listdir("myengine")) if os.path.isdir("myengine") else None
print("RESULT" + json.dumps(result))
"""


def local_raw(source: str, repo: Path) -> str:
    """A setup cell's raw-file URL (the reader's engine files) pointed at the local clone."""
    return re.sub(r"https://raw\.githubusercontent\.com/[^/\s\"']+/[^/\s\"']+/[^/\s\"']+", f"file://{repo}", source)


def in_colab(vpy: Path, source: str, work: Path) -> dict:
    """Run a setup cell in a fresh venv process that believes it is in Colab."""
    cell = work / "cell.py"
    cell.write_text(source)
    out = run([str(vpy), "-c", IN_COLAB, str(cell), json.dumps(KEPT)], cwd=work)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
    if line is None:
        return {"error": f"the process died:\n{out.stdout}{out.stderr}", "versions": {}}
    return json.loads(line[len("RESULT"):])


def rehearse_setup_cells(vpy: Path, repo: Path, work: Path, cells: dict[str, str], report: Report) -> None:
    """Each distinct setup cell, in a fresh runtime (enginelib uninstalled first). Chapters whose cells
    are identical (the sync script makes them so) share one run: a second would test nothing new."""
    want = pins()
    url = f"git+file://{repo}"
    groups: dict[str, list[str]] = {}
    for name, source in cells.items():
        groups.setdefault(source, []).append(name)
    for source, names in groups.items():
        label = names[0] if len(names) == 1 else f"{len(names)} identical setup cells ({', '.join(names)})"
        start = time.perf_counter()
        run([str(vpy), "-m", "pip", "uninstall", "-y", "-q", "enginelib"])  # a fresh runtime
        local, n = re.subn(r"git\+https://[^\s\"']+", url, source)
        local = local_raw(local, repo)
        if n == 0:
            report.check(f"{label}: setup cell", False, 0.0, "no `git+https://` install URL in the first cell")
            continue
        result = in_colab(vpy, local, work)
        moved = {k: v for k, v in result["versions"].items() if v != want[k.lower()]}
        want_files = sorted(p.name for p in (repo / "book" / "myengine").glob("*.py"))
        got_files = result.get("reader_files")
        ok = result["error"] is None and not moved and "enginelib" in result and got_files == want_files
        detail = result["error"] or (f"versions moved: {moved}" if moved else
                                     f"the reader's files {got_files}, not {want_files}" if got_files != want_files else
                                     f"import enginelib ok; torch {result['torch_runtime']}, cuda={result['cuda']}; "
                                     f"the reader's engine fetched: {', '.join(got_files)}")
        report.check(f"{label}: the setup cell installs enginelib, Colab's versions kept", ok,
                     time.perf_counter() - start, detail)


def rehearse_failing_install(vpy: Path, work: Path, source: str, report: Report) -> None:
    """A setup cell pointed at a repository that does not exist must fail helpfully."""
    start = time.perf_counter()
    bad = re.sub(r"git\+https://[^\s\"']+", f"git+file://{work}/no-such-repository", source)
    error = in_colab(vpy, bad, work)["error"] or ""
    needed = {"says what failed": "Could not install enginelib",
              "shows pip's output": "no-such-repository",
              "says what to do": "Restart",
              "gives the command": "pip install"}
    missing = [what for what, text in needed.items() if text not in error]
    report.check("a failing install raises a helpful error", bool(error) and not missing,
                 time.perf_counter() - start,
                 (f"missing: {missing}; got: " if missing else "") + error[:2000])


WIDGETS = """
import contextlib, io, ipywidgets, IPython, torch
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers
from enginelib import Engine, EngineConfig, SamplingParams
from enginelib.model import ModelConfig, Transformer
from enginelib.model.tokenizer import Tokenizer
from enginelib.viz import EngineExplorer

print("ipywidgets", ipywidgets.__version__, "IPython", IPython.__version__)
assert ipywidgets.__version__ == WANT_WIDGETS, ipywidgets.__version__
torch.manual_seed(0)
model = Transformer(ModelConfig.tiny())
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.2)
model = model.eval().requires_grad_(False)
vocab = model.cfg.vocab_size
backend = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
engine = Engine(model, Tokenizer(backend, eos_token_id=vocab - 1),
                EngineConfig(num_blocks=8, block_size=4, record=True))
drawn = io.StringIO()  # outside a kernel, the explorer's Output widget prints what it would draw
redirect = contextlib.redirect_stdout(drawn)
redirect.__enter__()
explorer = EngineExplorer(engine, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
explorer.add("t1 t2 t3")
explorer.add("t4 t5")
explorer.run_step()
explorer.run_step()
assert explorer.slider.max == 1 and explorer.slider.value == 1, (explorer.slider.max, explorer.slider.value)
explorer.slider.value = 0                      # the slider's observer redraws step 0
explorer.abort(explorer.victim.options[0])
assert len(explorer.victim.options) == 1, explorer.victim.options
explorer.add(" ".join(["t1"] * 40))            # more than the pool holds: refused, engine unharmed
assert "refused" in explorer.message.value, explorer.message.value
while engine.has_unfinished_requests():
    explorer.run_step()
assert engine.pool.num_used == 0
redirect.__exit__(None, None, None)
figures = drawn.getvalue().count("Figure(")
assert figures >= 2, drawn.getvalue()[-2000:]  # a block map and a timeline, at least once
print("explorer:", len(engine.history), "steps driven through its callbacks,", figures, "figures drawn")
try:
    from enginelib.viz.player import BlockMapPlayer
except ModuleNotFoundError as err:
    if err.name != "enginelib.viz.player":
        raise
    print("player: enginelib.viz.player not found, skipped")
else:
    player = BlockMapPlayer(engine.history, title="rehearsal")
    html = player._repr_html_()
    assert html == player.html and len(html) > 1000 and "<script" in html, len(html)
    print("player:", len(html), "characters of HTML")
"""


def rehearse_widgets(vpy: Path, work: Path, report: Report) -> None:
    start = time.perf_counter()
    code = WIDGETS.replace("WANT_WIDGETS", repr(pins()["ipywidgets"]))
    out = run([str(vpy), "-c", code], cwd=work, env={**os.environ, "ENGINELIB_THREADS": "1"})
    report.check("widgets under Colab's ipywidgets: EngineExplorer callbacks, BlockMapPlayer HTML",
                 out.returncode == 0, time.perf_counter() - start,
                 (out.stdout + out.stderr).strip()[-3000:])


EXECUTE = """
import sys, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, timeout=1800, kernel_name="colab-rehearsal", resources={"metadata": {"path": sys.argv[2]}}).execute()
print("executed", sum(c.cell_type == "code" for c in nb.cells), "code cells")
"""


def rehearse_chapter(vpy: Path, repo: Path, chapter: str, report: Report) -> None:
    """Run one chapter top to bottom on the venv's kernel (installed from the clone by step 1)."""
    start = time.perf_counter()
    path = repo / chapter
    env = {**os.environ, "ENGINELIB_THREADS": os.environ.get("ENGINELIB_THREADS", "1")}
    env.pop("PYTHONPATH", None)
    # a kernel named for the venv, so nbclient cannot pick up another Python's "python3"
    run([str(vpy), "-m", "ipykernel", "install", "--prefix", str(vpy.parent.parent), "--name", "colab-rehearsal"])
    out = run([str(vpy), "-c", EXECUTE, str(path), str(path.parent)], cwd=repo, env=env)
    report.check(f"execute {chapter} with Python 3.13 + Colab's torch (nbclient)", out.returncode == 0,
                 time.perf_counter() - start, (out.stdout + out.stderr).strip()[-3000:])


def rehearse_alone(vpy: Path, repo: Path, work: Path, chapter: str, report: Report) -> None:
    """Open a chapter alone, as Colab does: its notebook in an empty folder, its setup cell run as in Colab
    (installing enginelib and fetching the reader's engine files of earlier chapters), then top to bottom."""
    import nbformat

    start = time.perf_counter()
    alone = work / "alone"
    alone.mkdir()
    nb = nbformat.read(repo / chapter, as_version=4)
    setup = re.sub(r"git\+https://[^\s\"']+", f"git+file://{repo}", local_raw(nb.cells[0].source, repo))
    nb.cells[0].source = ('import sys, types\nsys.modules["google.colab"] = types.ModuleType("google.colab")\n' + setup)
    path = alone / Path(chapter).name
    nbformat.write(nb, path)
    env = {**os.environ, "ENGINELIB_THREADS": os.environ.get("ENGINELIB_THREADS", "1")}
    env.pop("PYTHONPATH", None)
    run([str(vpy), "-m", "ipykernel", "install", "--prefix", str(vpy.parent.parent), "--name", "colab-rehearsal"])
    out = run([str(vpy), "-c", EXECUTE, str(path), str(alone)], cwd=alone, env=env)
    fetched = sorted(p.name for p in (alone / "myengine").glob("*.py")) if (alone / "myengine").is_dir() else []
    report.check(f"open {chapter} alone (an empty folder, the setup cell as in Colab) and run it", out.returncode == 0,
                 time.perf_counter() - start, f"reader's files: {fetched}\n" + (out.stdout + out.stderr).strip()[-3000:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path(os.environ.get("COLAB_VENV", ROOT / "_build" / "colab-venv")),
                        help="where the venv lives (default: $COLAB_VENV or _build/colab-venv)")
    parser.add_argument("--python", help="a Python 3.13 (default: pyenv's)")
    parser.add_argument("--execute", metavar="CHAPTER", action="append", default=[],
                        help="also run this chapter (e.g. book/01_model.ipynb) in the venv")
    parser.add_argument("--alone", metavar="CHAPTER", action="append", default=[],
                        help="also open this chapter alone in an empty folder, its setup cell run as in Colab")
    parser.add_argument("--as-synced", action="store_true",
                        help="rehearse the setup cells .ci/sync_notebooks.py would write, not the committed ones")
    args = parser.parse_args(argv)
    report = Report()
    start = time.perf_counter()
    vpy = build_venv(find_python(args.python), args.venv.resolve(), report)
    with tempfile.TemporaryDirectory(prefix="colab-rehearsal-") as tmp:
        work = Path(tmp)
        repo = clone(work)
        cells = setup_cells(args.as_synced)
        rehearse_setup_cells(vpy, repo, work, cells, report)
        rehearse_failing_install(vpy, work, next(iter(cells.values())), report)
        rehearse_widgets(vpy, work, report)
        for chapter in args.execute:
            rehearse_chapter(vpy, repo, chapter, report)
        for chapter in args.alone:
            rehearse_alone(vpy, repo, work, chapter, report)
    print(f"\nColab rehearsal took {time.perf_counter() - start:.0f} s")
    return report.summary()


if __name__ == "__main__":
    sys.exit(main())
