"""The built book in a real browser: Debian's headless Chromium, driven by selenium.

It builds the site (`jupyter-book build . -W` into `_build/`, seconds: nothing is
executed), serves it on localhost with the network cut off (as a reader offline),
and checks that every page in `_toc.yml` loads without console errors from our
content and shows its figures; that chapter 5's block-map player steps, and
shows the block tables of its frames. A small fixture book (one notebook with
two players and an explorer, from a tiny engine) checks the player against the
engine's own step records and the explorer's still.

Needs `chromium`, `chromium-driver` (apt) and `selenium` (pip). Without them the
tests skip, except under CI (`CI` set), where they fail.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sysconfig
import threading
import time
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "_build" / "screenshots"
IN_CI = bool(os.environ.get("CI"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

# Console errors that come from the book's tooling, not from our content; each is harmless.
TOOLING_ERRORS = {
    "Identifier 'THEBE_JS_URL' has already been declared":
        "Jupyter Book 1 writes sphinx-thebe's settings script twice into every page; thebe is unused here",
    "Got invalid theme mode":
        "pydata-sphinx-theme reports with console.error that no light/dark choice is stored yet",
    "/favicon.ico - Failed to load resource":
        "the browser asks for /favicon.ico and the book has none",
}


def need(reason: str) -> None:
    """Skip on a developer's machine, fail in CI: CI must run the browser test."""
    if IN_CI:
        pytest.fail(reason + " (CI is set, so this is a failure)")
    pytest.skip(reason)


# --- the browser, the build and a local server ------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
    except ImportError:
        need("selenium is not installed: pip install selenium")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        need("Chromium or its driver is missing: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1600", "--hide-scrollbars",
                # Offline, as a reader without network: every host but localhost fails to resolve.
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def build_book(path: Path) -> Path:
    """`jupyter-book build PATH -W`; returns the html folder."""
    jb = Path(sysconfig.get_path("scripts")) / "jupyter-book"
    result = subprocess.run([str(jb) if jb.exists() else "jupyter-book", "build", str(path), "-W"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"jupyter-book build failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return path / "_build" / "html"


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep pytest's output for failures
        pass


@contextmanager
def serve(directory: Path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def open_page(driver, url: str) -> tuple[list[dict], list[dict]]:
    """Load a page; return its console errors from our content, and the others (third-party URLs, tooling)."""
    driver.get_log("browser")  # drop what earlier pages left
    driver.get(url)
    wait_for(lambda: driver.execute_script("return document.readyState") == "complete", "the page to load")
    time.sleep(0.3)  # let deferred scripts run
    severe = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    origin = url.split("/", 3)[:3]
    local = [e for e in severe if not re.match(r"https?://", e["message"])
             or e["message"].split("/", 3)[:3] == origin]
    ours = [e for e in local if not any(known in e["message"] for known in TOOLING_ERRORS)]
    return ours, [e for e in severe if e not in ours]


def wait_for(condition, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# --- checking a player -----------------------------------------------------------------------

def check_player(driver, root, shot_prefix: str) -> dict:
    """Step a player every way a reader can; the drawing and the block tables must follow its frames.

    Returns the frames data (so a caller can also check it against step records).
    """
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    data = json.loads(root.find_element(By.CSS_SELECTOR, "script[data-enginelib-frames]").get_attribute("textContent"))
    frames, order = data["frames"], [r["id"] for r in data["requests"]]
    n = len(frames)
    check_frames_are_consistent(data)
    assert root.get_attribute("data-live") == "1", "the player's script did not run"
    assert n >= 3, "a player worth testing has a few steps"

    def shown() -> int:
        return int(root.get_attribute("data-frame"))

    def drawing() -> str:
        return root.find_element(By.CSS_SELECTOR, "svg[data-role=map]").get_attribute("innerHTML")

    def check_shows(i: int) -> None:
        wait_for(lambda: shown() == i, f"the player to show frame {i}", 5)
        frame = frames[i]
        lines = [e.text for e in root.find_elements(By.CSS_SELECTOR, "[data-line]")]
        assert lines == [f"req {rid}: [{', '.join(map(str, frame['block_tables'][rid]))}]"
                         for rid in order if rid in frame["block_tables"]], f"block tables at frame {i}"
        assert root.get_attribute("data-step") == str(frame["step"])
        assert f"step {frame['step']} " in root.find_element(By.CSS_SELECTOR, "[data-role=step]").text
        # the drawing: each block's fill colour is its owner's (first table that lists it), or none
        owner = {}
        for rid in order:
            for b in frame["block_tables"].get(rid, []):
                owner.setdefault(b, rid)
        colors = {r["id"]: r["color"] for r in data["requests"]}
        fills = driver.execute_script(
            "return Array.from(arguments[0].querySelectorAll('[data-block]')).map(g => "
            "[+g.dataset.block, +g.querySelector('[data-role=fill]').getAttribute('height'), "
            "g.querySelector('[data-role=fill]').getAttribute('fill')])", root)
        assert len(fills) == data["num_blocks"]
        for block, height, fill in fills:
            if block in owner:
                assert fill == colors[owner[block]] and height > 0, f"block {block} at frame {i}"
            else:
                assert height == 0, f"free block {block} drawn filled at frame {i}"

    def screenshot(step) -> None:
        driver.execute_script("document.activeElement.blur(); arguments[0].scrollIntoView({block: 'center'})", root)
        root.screenshot(str(SHOTS / f"{shot_prefix}_step_{step}.png"))

    def changed(a: int, b: int) -> bool:
        keys = ("block_tables", "num_cached")
        return any(frames[a][k] != frames[b][k] for k in keys)

    start = shown()
    assert start == data["start"]
    check_shows(start)
    before = drawing()
    SHOTS.mkdir(parents=True, exist_ok=True)
    screenshot(frames[start]["step"])

    # the step buttons
    button = "back" if start == n - 1 else "forward"
    root.find_element(By.CSS_SELECTOR, f"[data-action={button}]").click()
    nxt = start - 1 if button == "back" else start + 1
    check_shows(nxt)
    if changed(start, nxt):
        assert drawing() != before, "stepping did not change the drawing: the player is frozen"

    # the slider, with the keyboard as a reader would
    slider = root.find_element(By.CSS_SELECTOR, "[data-role=slider]")
    slider.send_keys(Keys.HOME)
    check_shows(0)
    slider.send_keys(Keys.RIGHT)
    check_shows(1)

    # a click on the timeline jumps there
    timeline = root.find_element(By.CSS_SELECTOR, "svg[data-enginelib-timeline]")
    left, step_width = float(timeline.get_attribute("data-left")), float(timeline.get_attribute("data-step-width"))
    target = (3 * n) // 4
    x = left + (target + 0.5) * step_width - timeline.rect["width"] / 2
    ActionChains(driver).move_to_element_with_offset(timeline, int(x), 0).click().perform()
    check_shows(target)

    # play moves on by itself, pause stops it
    root.find_element(By.CSS_SELECTOR, "[data-action=back]").click()
    at = shown()
    play = root.find_element(By.CSS_SELECTOR, "[data-action=play]")
    play.click()
    wait_for(lambda: shown() != at, "play to advance the player", 5)
    play.click()
    paused = shown()
    time.sleep(0.8)
    assert shown() == paused, "pause did not stop the player"
    check_shows(paused)

    # hover over a used block: the tooltip names its owner and its tokens
    busy = max(range(n), key=lambda i: len(frames[i]["block_tables"]))
    root.find_element(By.CSS_SELECTOR, "[data-role=slider]").send_keys(Keys.HOME)
    for _ in range(busy):
        root.find_element(By.CSS_SELECTOR, "[data-action=forward]").click()
    check_shows(busy)
    rid, table = next((r, t) for r, t in frames[busy]["block_tables"].items() if t)
    ActionChains(driver).move_to_element(root.find_element(By.CSS_SELECTOR, f"[data-block='{table[0]}']")).perform()
    tip = root.find_element(By.CSS_SELECTOR, "[data-role=tooltip]")
    wait_for(tip.is_displayed, "the tooltip", 3)
    assert f"block {table[0]}" in tip.text and "logical block 0" in tip.text and f"/{data['block_size']} tokens" in tip.text
    ActionChains(driver).move_to_element(timeline).perform()  # the tooltip off the screenshot
    if busy != start:
        screenshot(frames[busy]["step"])
    else:
        root.find_element(By.CSS_SELECTOR, "[data-action=forward]" if busy < n - 1 else "[data-action=back]").click()
        screenshot(root.get_attribute("data-step"))
    return data


def check_frames_are_consistent(data: dict) -> None:
    """What any step of a paged pool must satisfy: blocks in range, each held by one table, tokens fit."""
    for frame in data["frames"]:
        seen: set[int] = set()
        shared = frame.get("ref_counts") is not None  # prefix caching may share blocks
        for rid, table in frame["block_tables"].items():
            assert all(0 <= b < data["num_blocks"] for b in table)
            assert shared or not seen & set(table), f"a block in two tables at step {frame['step']}"
            seen |= set(table)
            assert frame["num_cached"][rid] <= len(table) * data["block_size"]


# --- the fixture book: a tiny engine's players and explorer ----------------------------------

@pytest.fixture(scope="module")
def fixture_book(tmp_path_factory):
    """A one-notebook Jupyter Book with the repository's _config.yml; returns (html folder, history)."""
    import torch

    from enginelib.model import ModelConfig, Transformer
    from enginelib.model.sampling import SamplingParams
    from enginelib.viz.explorer import EngineExplorer
    from enginelib.viz.player import BlockMapPlayer
    from tests.test_player import run_tiny_engine

    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny())
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    engine = run_tiny_engine(model.eval().requires_grad_(False))
    first = BlockMapPlayer(engine.history, title="fixture: the first player")
    second = BlockMapPlayer(engine.history, title="fixture: a second player on the same page", start=0)
    explorer = EngineExplorer(engine, SamplingParams(temperature=0, max_tokens=4))

    def cell(source: str, data: dict):
        c = nbformat.v4.new_code_cell(source)
        c.outputs = [nbformat.v4.new_output("display_data", data=data)]
        return c

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# Player fixture\n\nTwo players and an explorer, from a tiny engine."),
        cell("BlockMapPlayer(engine.history)", {"text/html": first.html, "text/plain": "BlockMapPlayer"}),
        cell("BlockMapPlayer(engine.history, start=0)", {"text/html": second.html, "text/plain": "BlockMapPlayer"}),
        cell("EngineExplorer(engine)", explorer._repr_mimebundle_()),
    ])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    book = tmp_path_factory.mktemp("fixture_book")
    nbformat.write(nb, book / "player.ipynb")
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["title"] = "player fixture"
    (book / "_config.yml").write_text(yaml.safe_dump(config))
    (book / "_toc.yml").write_text("format: jb-book\nroot: player\n")
    return build_book(book), engine.history


def test_fixture_players_step_and_show_the_engine_history(browser, fixture_book):
    from selenium.webdriver.common.by import By

    html, history = fixture_book
    with serve(html) as base:
        ours, others = open_page(browser, f"{base}/player.html")
        print("\n".join(f"not from our content: {e['message']}" for e in others))
        assert not ours, f"console errors: {ours}"
        first, second = browser.find_elements(By.CSS_SELECTOR, "[data-enginelib-player]")
        assert first.get_attribute("id") != second.get_attribute("id")
        second_at = second.get_attribute("data-frame")
        data = check_player(browser, first, "fixture_player")
        assert second.get_attribute("data-frame") == second_at, "stepping one player moved the other"
        # the frames the page shows are the engine's own step records
        for frame, record in zip(data["frames"], history, strict=True):
            assert (frame["step"], frame["block_tables"], frame["num_cached"], frame["states"]) == \
                   (record.step, record.block_tables, record.num_cached, record.states)
        check_player(browser, second, "fixture_player_second")


def test_fixture_explorer_shows_its_still_and_no_empty_widget(browser, fixture_book):
    from selenium.webdriver.common.by import By

    html, _ = fixture_book
    page = (html / "player.html").read_text()
    assert WIDGET_VIEW not in page, "the built page must not hold a widget view (an empty box without a kernel)"
    assert "embed-amd" not in page and "require.min.js" not in page, "no ipywidgets JavaScript from a CDN"
    with serve(html) as base:
        open_page(browser, f"{base}/player.html")
        outputs = browser.find_elements(By.CSS_SELECTOR, ".cell_output")
        images = outputs[-1].find_elements(By.TAG_NAME, "img")
        assert len(images) == 1, "the explorer's output shows its still"
        assert browser.execute_script("return arguments[0].naturalWidth", images[0]) >= 800


# --- the book itself --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def site():
    return build_book(ROOT)


def toc_pages() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [toc["root"]] + [c["file"] for part in toc["parts"] for c in part["chapters"]]


def expected_outputs(notebook: Path) -> tuple[int, int]:
    """(image outputs, player outputs) the page should show, choosing each output's mime type as myst-nb does."""
    from myst_nb.core.render import get_mime_priority

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    overrides = config.get("sphinx", {}).get("config", {}).get("nb_mime_priority_overrides", [])
    priority = get_mime_priority("html", [tuple(o) for o in overrides])
    images = players = 0
    for cell in nbformat.read(notebook, as_version=4).cells:
        for out in cell.get("outputs", []):
            chosen = next((m for m in priority if m in out.get("data", {})), None)
            images += bool(chosen and chosen.startswith("image/"))
            players += chosen == "text/html" and "data-enginelib-player" in out["data"]["text/html"]
    return images, players


@pytest.mark.parametrize("page", toc_pages())
def test_every_page_loads_without_errors_and_shows_its_figures(browser, site, page):
    from selenium.webdriver.common.by import By

    with serve(site) as base:
        ours, third_party = open_page(browser, f"{base}/{page}.html")
        assert not ours, f"console errors from our content on {page}: {ours}"
        for entry in third_party:  # e.g. MathJax from its CDN, unreachable offline; see TOOLING_ERRORS
            print(f"{page}: not from our content: {entry['message']}")
        assert browser.find_element(By.CSS_SELECTOR, "article h1").text, f"{page}: no title"
        assert not browser.find_elements(By.CSS_SELECTOR, f"script[type='{WIDGET_VIEW}']"), "an empty widget box"
        notebook = ROOT / f"{page}.ipynb"
        if not notebook.exists():
            return
        images, players = expected_outputs(notebook)
        shown = browser.find_elements(By.CSS_SELECTOR, ".cell_output img")
        assert len(shown) == images, f"{page}: {len(shown)} figures on the page, {images} image outputs"
        broken = [i.get_attribute("src")[:60] for i in shown
                  if not browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", i)]
        assert not broken, f"{page}: images that did not load: {broken}"
        found = browser.find_elements(By.CSS_SELECTOR, "[data-enginelib-player]")
        assert len(found) == players, f"{page}: {len(found)} players on the page, {players} in the notebook"
        assert all(p.get_attribute("data-live") == "1" for p in found), f"{page}: a player's script did not run"


def test_chapter_5_player_steps_and_matches_its_frames(browser, site):
    from selenium.webdriver.common.by import By

    _, players = expected_outputs(ROOT / "book" / "05_paged_kv_cache.ipynb")
    if not players:
        need("chapter 5 shows no BlockMapPlayer yet")
    for old in SHOTS.glob("ch05_player_step_*.png"):
        old.unlink()
    with serve(site) as base:
        open_page(browser, f"{base}/book/05_paged_kv_cache.html")
        roots = browser.find_elements(By.CSS_SELECTOR, "[data-enginelib-player]")
        assert roots, "the chapter 5 page has no block-map player"
        browser.execute_script("arguments[0].scrollIntoView()", roots[0])
        check_player(browser, roots[0], "ch05_player")
    assert len(list(SHOTS.glob("ch05_player_step_*.png"))) == 2
