"""Make every chapter follow the repository URL set in _config.yml.

    python .ci/sync_repo_url.py          # rewrite the notebooks in place
    python .ci/sync_repo_url.py --check  # exit 1 if any notebook disagrees

Two places in each chapter name the repository: the Colab badge and the
setup cell's ``pip install "enginelib @ git+URL"``.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent
GITHUB = re.compile(r"https://github\.com/([^/\s\"')]+)/([^/\s\"')]+?)(?:\.git)?/?$")


def repository() -> tuple[str, str]:
    """(url, branch) from _config.yml."""
    repo = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    return repo["url"].rstrip("/"), repo.get("branch", "main")


def colab_url(path: Path) -> str:
    url, branch = repository()
    owner, name = GITHUB.match(url).groups()
    return f"https://colab.research.google.com/github/{owner}/{name}/blob/{branch}/{path.relative_to(ROOT).as_posix()}"


def synced(text: str, path: Path) -> str:
    """``text`` with every badge link and install URL pointing at the configured repository."""
    url, _ = repository()
    text = re.sub(r"https://colab\.research\.google\.com/github/[^\s)\"']+", colab_url(path), text)
    return re.sub(r"enginelib @ git\+[^\s\"']+", f"enginelib @ git+{url}", text)


def main(check: bool) -> int:
    stale = []
    for path in sorted((ROOT / "book").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        changed = False
        for cell in nb.cells:
            new = synced(cell.source, path)
            changed |= new != cell.source
            cell.source = new
        if changed:
            stale.append(path.name)
            if not check:
                nbformat.write(nb, path)
    print(("out of date: " if check else "rewrote: ") + (", ".join(stale) or "none"))
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv))
