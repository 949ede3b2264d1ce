"""A block-map player that needs no kernel: one self-contained HTML+JavaScript snippet.

``BlockMapPlayer(engine.history)`` as the last expression of a notebook cell
shows the engine's block pool step by step: play/pause, step back and forward,
a slider, a hover tooltip per block, the block tables in full and the run's
timeline below, all kept in sync. Everything is inline (SVG, the frames as
JSON, a small script): no CDN, no network, no widget state. So it works the
same in the built book, in Colab's output frame, in JupyterLab and in the
classic Notebook.

Python draws the picture of one step (``start``) into the HTML, so a renderer
that runs no scripts (an untrusted notebook, GitHub) still shows a block map;
where scripts run, the script takes over and redraws from the frames.

Test hooks: the root carries ``data-enginelib-player``, ``data-frame`` (index
into the history) and ``data-step`` (the engine step shown); the frames are in
``script[data-enginelib-frames]``; each block is ``[data-block]``; each
block-table line is ``[data-line]`` (``req 0: [3, 4, 7]``); the controls are
``[data-action=back|play|forward]`` and ``[data-role=slider]``.

Prefix caching (chapter 9) adds two looks. A block held by more than one
request (reference count > 1) gets a thick dark outline and a "×N" badge
(``[data-role=badge]`` and ``[data-role=badge-label]``, shown only then). A *free but cached* block (no owner,
but it still holds a hashed full block, kept for reuse until evicted) is grey
with a dashed outline; its fill bar stays empty, as for any free block.
"""
from __future__ import annotations

import html
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.colors import to_hex

from enginelib.core.record import StepRecord
from enginelib.viz.figures import (
    STATE_COLORS,
    STATE_LABELS,
    busiest_frame,
    ink_for,
    request_color,
    request_state,
    sort_ids,
)

FREE_FILL, FREE_EDGE, DARK = "#f2f2f2", "#c4c4c4", "#222222"
CACHED_FILL, CACHED_EDGE, CACHED_DASH = "#cfcfcf", "#555555", "4 2"  # free, but holding a cached block
SHARED_WIDTH, OWNED_WIDTH = 4.5, 2.5  # outline of a block held by several requests, by one
TIMELINE_STATES = ("waiting", "prefill", "decode", "preempted")
LABEL_WIDTH, ROW, TRACK_WIDTH = 64, 16, 600  # timeline: request labels, px per request, px for all steps


class BlockMapPlayer:
    """The block pool at every recorded step, as an HTML player (see the module docstring)."""

    def __init__(self, history: Sequence[StepRecord], *, title: str | None = None, start: int | None = None):
        if not history:
            raise ValueError("the history is empty: create the engine with EngineConfig(record=True) "
                             "and run some steps before building a BlockMapPlayer(engine.history)")
        if any(not isinstance(r, StepRecord) for r in history):
            raise TypeError("BlockMapPlayer takes engine.history, a sequence of StepRecord")
        if len({(r.num_blocks, r.block_size) for r in history}) != 1:
            raise ValueError("every step of the history must come from one pool (same num_blocks and block_size)")
        self.history = list(history)
        self.title = title
        n = len(self.history)
        if start is None:
            start = busiest_frame(self.history)
        elif not -n <= start < n:
            raise ValueError(f"start={start} is outside the history (it has {n} steps: 0..{n - 1})")
        self.start = start % n
        self.id = "enginelib-player-" + uuid.uuid4().hex[:12]
        self.requests = sort_ids({rid for r in self.history for rid in r.states})
        self.html = self._render()

    def _repr_html_(self) -> str:
        return self.html

    # --- the data the script reads -------------------------------------------------------

    def frames(self) -> list[dict[str, Any]]:
        """One JSON-able dict per step: the StepRecord's fields, plus ref counts/hashes when recorded."""
        out = []
        for r in self.history:
            frame = {"step": r.step, "scheduled": r.scheduled, "prefill": sorted(r.prefill),
                     "preempted": list(r.preempted), "states": r.states,
                     "block_tables": r.block_tables, "num_cached": r.num_cached}
            for name in ("ref_counts", "block_hashes"):  # optional: later chapters (prefix caching) record them
                per_block = _per_block(getattr(r, name, None))
                if per_block is not None:
                    frame[name] = per_block
            out.append(frame)
        return out

    def data(self) -> dict[str, Any]:
        first = self.history[0]
        colors = {rid: to_hex(request_color(rid)) for rid in self.requests}
        return {"num_blocks": first.num_blocks, "block_size": first.block_size, "start": self.start,
                "requests": [{"id": rid, "color": c, "ink": ink_for(c)} for rid, c in colors.items()],
                "frames": self.frames()}

    # --- the markup ----------------------------------------------------------------------

    def _render(self) -> str:
        record = self.history[self.start]
        payload = json.dumps(self.data(), separators=(",", ":")).replace("</", "<\\/")
        n = len(self.history)
        title = html.escape(self.title or f"The block pool, step by step ({record.num_blocks} blocks of "
                            f"{record.block_size} slots)")
        controls = (
            f'<div class="ep-controls" data-role="controls" style="display:none">'
            f'<button type="button" data-action="back" title="step back">&#9664;&#9646;</button>'
            f'<button type="button" data-action="play" title="play / pause">&#9654; play</button>'
            f'<button type="button" data-action="forward" title="step forward">&#9646;&#9654;</button>'
            f'<input type="range" data-role="slider" min="0" max="{n - 1}" value="{self.start}" '
            f'aria-label="step"></div>')
        return (
            f'<div id="{self.id}" class="enginelib-player" data-enginelib-player="1" data-frame="{self.start}" '
            f'data-step="{record.step}" data-frames="{n}" style="{_ROOT_STYLE}">'
            f'<style>{_CSS.replace("#ID", "#" + self.id)}</style>'
            f'<div style="font-weight:600;font-size:15px;margin-bottom:4px">{title}</div>'
            f'<div style="display:flex;flex-wrap:wrap;align-items:center;gap:12px">{controls}'
            f'<span data-role="step" style="font-size:14px">{self._step_label(self.start)}</span></div>'
            f'<div style="display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start;margin-top:6px">'
            f'<div style="overflow-x:auto;max-width:100%">{self._map_svg(record)}</div>'
            f'<div style="min-width:240px;max-width:420px;flex:1">{self._legend()}'
            f'<div style="font-weight:600;margin:6px 0 2px">block tables</div>'
            f'<div data-enginelib-tables style="font-family:monospace;font-size:13px">{self._tables(record)}</div>'
            f'</div></div>'
            f'<div style="overflow-x:auto;max-width:100%;margin-top:10px">{self._timeline_svg()}</div>'
            f'<div class="ep-tip" data-role="tooltip"></div>'
            f'<script type="application/json" data-enginelib-frames>{payload}</script>'
            f'<script>{_script(self.id)}</script></div>')

    def _step_label(self, index: int) -> str:
        record = self.history[index]
        used = len({b for t in record.block_tables.values() for b in t})
        refs, hashes = _marks(record)
        shared = sum(n > 1 for n in refs.values())
        cached_free = sum(refs.get(b, 0) == 0 for b in hashes)
        extra = "".join(f", {n} {what}" for n, what in ((shared, "shared"), (cached_free, "free but cached")) if n)
        return (f"step {record.step} ({index + 1}/{len(self.history)}): "
                f"{used}/{record.num_blocks} blocks in use, {len(record.block_tables)} requests running{extra}")

    def _grid(self) -> tuple[int, int]:
        """Columns and the side of one block cell in px (blocks stay >= 26 px: ids in 12 px text)."""
        n = self.history[0].num_blocks
        return (16, 40) if n <= 128 else (24, 30)

    def _map_svg(self, record: StepRecord) -> str:
        columns, cell = self._grid()
        side, n = cell - 4, record.num_blocks
        rows = -(-n // columns)
        width, height = min(n, columns) * cell, rows * cell
        owners = _owners(record)
        refs, hashes = _marks(record)
        badge_w, badge_h = round(side * 0.55), round(side * 0.32)
        parts = [f'<svg data-role="map" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
                 f'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" role="img" '
                 f'aria-label="block map">']
        for block in range(n):
            y, x = divmod(block, columns)
            look = self._block_look(record, block, owners.get(block, []), side, refs, hashes)
            badge = "inline" if look.refs > 1 else "none"  # drawn always, shown only for a shared block
            parts.append(
                f'<g data-block="{block}" transform="translate({x * cell + 2},{y * cell + 2})">'
                f'<rect data-role="bg" width="{side}" height="{side}" rx="3" fill="{look.background}" '
                f'stroke="{FREE_EDGE}"/>'
                f'<rect data-role="fill" y="{side - look.height:.1f}" width="{side}" height="{look.height:.1f}" '
                f'fill="{look.fill}"/>'
                f'<rect data-role="edge" width="{side}" height="{side}" rx="3" fill="none" stroke="{look.edge}" '
                f'stroke-width="{look.edge_width}" stroke-dasharray="{look.dash}"/>'
                f'<text x="{side / 2}" y="{side / 2}" dy="0.35em" text-anchor="middle" font-size="12" '
                f'font-weight="600" fill="{look.ink}">{block}</text>'
                f'<rect data-role="badge" x="{side - badge_w}" y="0" width="{badge_w}" height="{badge_h}" rx="2" '
                f'fill="{DARK}" display="{badge}"/>'
                f'<text data-role="badge-label" x="{side - badge_w / 2}" y="{badge_h / 2}" dy="0.35em" '
                f'text-anchor="middle" font-size="{badge_h - 2}" font-weight="700" fill="#ffffff" '
                f'display="{badge}">×{look.refs}</text>'
                f'<title>{html.escape(look.tip)}</title></g>')
        parts.append("</svg>")
        return "".join(parts)

    def _block_look(self, record: StepRecord, block: int, owners: list[tuple[str, int]], side: int,
                    refs: dict[int, int], hashes: dict[int, str]) -> "_Look":
        """How one block is drawn (the script's ``show`` draws the same for every other step)."""
        count = refs.get(block, len(owners))
        tip = _tooltip(record, block, owners, count, hashes.get(block))
        if not owners:
            if count == 0 and block in hashes:  # kept for reuse until the pool needs the room
                return _Look(CACHED_FILL, "none", CACHED_EDGE, 1.5, CACHED_DASH, DARK, 0.0, 0, tip)
            return _Look(FREE_FILL, "none", "none", 0, "none", DARK, 0.0, 0, tip)
        rid, index = owners[0]
        tokens = _tokens(record, rid, index)
        color = to_hex(request_color(rid))
        ink = ink_for(color) if tokens / record.block_size >= 0.5 else DARK  # the id sits mid-block
        shared = count > 1
        return _Look(FREE_FILL, color, DARK if shared else color, SHARED_WIDTH if shared else OWNED_WIDTH,
                     "none", ink, side * tokens / record.block_size, count, tip)

    def _legend(self) -> str:
        size = self.history[0].block_size
        return ('<div style="font-size:13px;line-height:1.6">'
                f'<span class="ep-sw" style="background:{FREE_FILL};border:1px solid {FREE_EDGE}"></span> free block'
                ' &nbsp; <span class="ep-sw" style="background:linear-gradient(to top,#1f77b4 60%,'
                f'{FREE_FILL} 60%);border:2px solid #1f77b4"></span> a request\'s block, filled to the share of '
                f'its {size} slots that hold tokens; colour = request (below)<br>'
                f'<span class="ep-sw" style="background:#1f77b4;border:3px solid {DARK}"></span>'
                f'<span class="ep-badge">×2</span> shared: held by 2 (or N) requests at once (prefix caching); '
                f'the colour is its first holder\'s<br>'
                f'<span class="ep-sw" style="background:{CACHED_FILL};border:1.5px dashed {CACHED_EDGE}"></span> '
                'free but cached: no request holds it, but its tokens are kept for reuse, until the pool needs '
                'the room (least recently used first)</div>')

    def _tables(self, record: StepRecord) -> str:
        lines = []
        for rid in sort_ids(record.block_tables):
            color = to_hex(request_color(rid))
            lines.append(f'<div data-request="{html.escape(rid)}" class="ep-line">'
                         f'<span class="ep-sw" style="background:{color}"></span> '
                         f'<span data-line>{html.escape(_table_line(rid, record.block_tables[rid]))}</span>'
                         f' <span style="color:#666">({record.num_cached.get(rid, 0)} tokens)</span></div>')
        return "".join(lines) or '<div style="color:#666">(no request running)</div>'

    def _timeline_svg(self) -> str:
        """One row per request, coloured by state at each step; a cursor marks the step shown."""
        n, rows = len(self.history), len(self.requests)
        width = LABEL_WIDTH + TRACK_WIDTH
        height = rows * ROW + 22
        w = TRACK_WIDTH / n
        parts = [f'<svg data-enginelib-timeline width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
                 f'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="11" '
                 f'data-left="{LABEL_WIDTH}" data-step-width="{w:.4f}" style="cursor:pointer">']
        for row, rid in enumerate(self.requests):
            y = row * ROW
            parts.append(f'<text x="{LABEL_WIDTH - 6}" y="{y + ROW / 2}" dy="0.35em" text-anchor="end" '
                         f'fill="{DARK}">req {html.escape(rid)}</text>')
            states = [request_state(r, rid) for r in self.history]
            begin = 0
            for i in range(1, n + 1):  # merge runs of one state into one bar
                if i == n or states[i] != states[begin]:
                    if states[begin] is not None:
                        parts.append(f'<rect x="{LABEL_WIDTH + begin * w:.2f}" y="{y + 2}" width="{(i - begin) * w:.2f}" '
                                     f'height="{ROW - 4}" fill="{STATE_COLORS[states[begin]]}"/>')
                    begin = i
        for i in sorted({0, n // 2, n - 1}):
            parts.append(f'<text x="{LABEL_WIDTH + (i + 0.5) * w:.1f}" y="{rows * ROW + 15}" text-anchor="middle" '
                         f'fill="{DARK}">{self.history[i].step}</text>')
        parts.append(f'<rect data-role="cursor" x="{LABEL_WIDTH + self.start * w:.2f}" y="0" '
                     f'width="{max(w, 2):.2f}" height="{rows * ROW}" fill="rgba(0,0,0,0.12)" stroke="#000" '
                     f'stroke-width="1.5"/></svg>')
        legend = " &nbsp; ".join(f'<span class="ep-sw" style="background:{STATE_COLORS[s]}"></span> '
                                 f'{html.escape(STATE_LABELS[s])}' for s in TIMELINE_STATES)
        return "".join(parts) + f'<div style="font-size:12px">timeline (click to jump): {legend}</div>'


def _per_block(values: Mapping[int, Any] | Sequence[Any] | None) -> dict[str, Any] | None:
    """Normalise an optional per-block record (a mapping block -> value, or a list by block) for JSON.

    Hashes too long for a JavaScript number become hex strings."""
    if values is None:
        return None
    items = values.items() if isinstance(values, Mapping) else enumerate(values)
    return {str(b): (format(v, "x") if isinstance(v, int) and abs(v) >= 1 << 53 else v)  # JS numbers: 53 bits
            for b, v in items if v is not None}


@dataclass(frozen=True)
class _Look:
    background: str   # the block's own square: free, or free but cached
    fill: str         # the bar filled to the tokens it holds, in its (first) owner's colour
    edge: str         # outline colour
    edge_width: float
    dash: str         # outline dashes ("none": solid)
    ink: str          # colour of the block id
    height: float     # px of the fill bar
    refs: int         # reference count; a "×N" badge when > 1
    tip: str


def _marks(record: StepRecord) -> tuple[dict[int, int], dict[int, str]]:
    """Reference counts and hashes by block, where the record has them (empty dicts where not)."""
    refs = _per_block(getattr(record, "ref_counts", None)) or {}
    hashes = _per_block(getattr(record, "block_hashes", None)) or {}
    return {int(b): int(n) for b, n in refs.items()}, {int(b): str(h) for b, h in hashes.items()}


def _owners(record: StepRecord) -> dict[int, list[tuple[str, int]]]:
    """Block -> [(request id, its index in that request's table)]; shared blocks list every owner."""
    owners: dict[int, list[tuple[str, int]]] = {}
    for rid in sort_ids(record.block_tables):
        for index, block in enumerate(record.block_tables[rid]):
            owners.setdefault(block, []).append((rid, index))
    return owners


def _tokens(record: StepRecord, rid: str, index: int) -> int:
    """How many of the block's slots hold this request's tokens."""
    return min(record.block_size, max(0, record.num_cached.get(rid, 0) - index * record.block_size))


def _table_line(rid: str, table: Sequence[int]) -> str:
    return f"req {rid}: [{', '.join(map(str, table))}]"


def _tooltip(record: StepRecord, block: int, owners: list[tuple[str, int]], refs: int,
             block_hash: str | None) -> str:
    head = f"block {block}"
    if not owners:
        head += ": free, but cached (kept for reuse, evictable)" if block_hash is not None and refs == 0 else ": free"
    elif refs > 1:
        head += f": shared by {refs} requests"
    lines = [head]
    lines += [f"req {rid}, logical block {i} of its table, {_tokens(record, rid, i)}/{record.block_size} tokens"
              for rid, i in owners]
    if getattr(record, "ref_counts", None):
        lines.append(f"ref count: {refs}")
    if block_hash is not None:
        lines.append(f"hash: {block_hash}")
    return "\n".join(lines)


_ROOT_STYLE = ("position:relative;font-family:sans-serif;color:#222;background:#fff;padding:8px;"
               "border:1px solid #ddd;border-radius:6px;max-width:100%;box-sizing:border-box")

_CSS = """
#ID .ep-sw{display:inline-block;width:12px;height:12px;vertical-align:-1px;border-radius:2px}
#ID .ep-badge{display:inline-block;background:#222;color:#fff;font-size:10px;font-weight:700;
  padding:0 3px;border-radius:2px;margin:0 4px 0 2px;vertical-align:1px;line-height:13px}
#ID .ep-line{white-space:normal;overflow-wrap:anywhere;padding-left:1.6em;text-indent:-1.6em}
#ID .ep-controls button{font-size:14px;padding:2px 10px;margin-right:4px;cursor:pointer}
#ID .ep-controls input{width:260px;vertical-align:middle}
#ID .ep-tip{position:absolute;display:none;pointer-events:none;background:#222;color:#fff;font-size:13px;
  padding:5px 8px;border-radius:4px;white-space:pre;z-index:10}
"""

# The script mirrors BlockMapPlayer._block_look/_tables/_tooltip for every other step.
_JS = r"""
(function () {
  var root = document.getElementById("%ID%");
  if (!root || root.getAttribute("data-live")) return;
  root.setAttribute("data-live", "1");
  var data = JSON.parse(root.querySelector("script[data-enginelib-frames]").textContent);
  var size = data.block_size, frames = data.frames, N = frames.length, FREE = "%FREE%", DARK = "%DARK%";
  var CACHED = "%CACHED%", CACHED_EDGE = "%CACHED_EDGE%", DASH = "%DASH%";
  var req = {};
  data.requests.forEach(function (r) { req[r.id] = r; });
  var blocks = Array.prototype.slice.call(root.querySelectorAll("[data-block]"));
  var tables = root.querySelector("[data-enginelib-tables]"), label = root.querySelector("[data-role=step]");
  var slider = root.querySelector("[data-role=slider]"), playBtn = root.querySelector("[data-action=play]");
  var timeline = root.querySelector("[data-enginelib-timeline]"), cursor = root.querySelector("[data-role=cursor]");
  var tip = root.querySelector("[data-role=tooltip]");
  var left = +timeline.getAttribute("data-left"), stepWidth = +timeline.getAttribute("data-step-width");
  var current = data.start, timer = null, tips = [];
  root.querySelector("[data-role=controls]").style.display = "";
  Array.prototype.forEach.call(root.querySelectorAll("[data-block] title"), function (t) { t.remove(); });

  function tokens(f, rid, i) { return Math.min(size, Math.max(0, (f.num_cached[rid] || 0) - i * size)); }
  function el(tag, text, style) {
    var e = document.createElement(tag); if (text) e.textContent = text; if (style) e.style.cssText = style; return e;
  }
  function show(i) {
    current = i = Math.max(0, Math.min(N - 1, i));
    var f = frames[i], owners = {}, used = 0, running = 0, shared = 0, cachedFree = 0;
    data.requests.forEach(function (r) {
      (f.block_tables[r.id] || []).forEach(function (b, j) { (owners[b] = owners[b] || []).push([r.id, j]); });
    });
    blocks.forEach(function (g) {
      var b = +g.getAttribute("data-block"), own = owners[b] || [], side = +g.querySelector("rect").getAttribute("width");
      var fill = g.querySelector("[data-role=fill]"), edge = g.querySelector("[data-role=edge]");
      var bg = g.querySelector("[data-role=bg]"), badge = g.querySelector("[data-role=badge]");
      var text = g.querySelector("text"), hash = f.block_hashes ? f.block_hashes[b] : undefined;
      var refs = f.ref_counts && f.ref_counts[b] !== undefined ? f.ref_counts[b] : own.length;
      var head = "block " + b;
      bg.setAttribute("fill", FREE); edge.setAttribute("stroke-dasharray", "none");
      var badgeLabel = g.querySelector("[data-role=badge-label]"), showBadge = refs > 1 && own.length;
      badge.setAttribute("display", showBadge ? "inline" : "none");
      badgeLabel.setAttribute("display", showBadge ? "inline" : "none");
      if (own.length) {
        used++;
        var r = req[own[0][0]], share = tokens(f, own[0][0], own[0][1]) / size;
        fill.setAttribute("fill", r.color); fill.setAttribute("y", side * (1 - share));
        fill.setAttribute("height", side * share);
        edge.setAttribute("stroke", refs > 1 ? DARK : r.color);
        edge.setAttribute("stroke-width", refs > 1 ? %SHARED_WIDTH% : %OWNED_WIDTH%);
        text.setAttribute("fill", share >= 0.5 ? r.ink : DARK);
        if (refs > 1) {
          shared++; head += ": shared by " + refs + " requests";
          badgeLabel.textContent = "\u00D7" + refs;
        }
      } else {
        fill.setAttribute("height", 0); fill.setAttribute("fill", "none"); text.setAttribute("fill", DARK);
        if (refs === 0 && hash !== undefined) {
          cachedFree++; head += ": free, but cached (kept for reuse, evictable)";
          bg.setAttribute("fill", CACHED); edge.setAttribute("stroke", CACHED_EDGE);
          edge.setAttribute("stroke-width", 1.5); edge.setAttribute("stroke-dasharray", DASH);
        } else {
          head += ": free"; edge.setAttribute("stroke", "none"); edge.setAttribute("stroke-width", 0);
        }
      }
      var lines = [head];
      own.forEach(function (o) {
        lines.push("req " + o[0] + ", logical block " + o[1] + " of its table, " + tokens(f, o[0], o[1]) + "/" +
                   size + " tokens");
      });
      if (f.ref_counts) lines.push("ref count: " + refs);
      if (hash !== undefined) lines.push("hash: " + hash);
      tips[b] = lines.join("\n");
    });
    tables.textContent = "";
    data.requests.forEach(function (r) {
      var t = f.block_tables[r.id];
      if (!t) return;
      running++;
      var line = el("div"), sw = el("span", "", "background:" + r.color);
      line.className = "ep-line"; line.setAttribute("data-request", r.id); sw.className = "ep-sw";
      var words = el("span", "req " + r.id + ": [" + t.join(", ") + "]");
      words.setAttribute("data-line", "");
      line.appendChild(sw); line.appendChild(document.createTextNode(" ")); line.appendChild(words);
      line.appendChild(el("span", " (" + (f.num_cached[r.id] || 0) + " tokens)", "color:#666"));
      tables.appendChild(line);
    });
    if (!running) tables.appendChild(el("div", "(no request running)", "color:#666"));
    label.textContent = "step " + f.step + " (" + (i + 1) + "/" + N + "): " + used + "/" + data.num_blocks +
      " blocks in use, " + running + " requests running" + (shared ? ", " + shared + " shared" : "") +
      (cachedFree ? ", " + cachedFree + " free but cached" : "");
    cursor.setAttribute("x", left + i * stepWidth);
    slider.value = i;
    root.setAttribute("data-frame", i); root.setAttribute("data-step", f.step);
  }
  function pause() { clearInterval(timer); timer = null; playBtn.textContent = "\u25B6 play"; }
  function play() {
    if (current >= N - 1) show(0);
    playBtn.textContent = "\u23F8 pause";
    timer = setInterval(function () { if (current >= N - 1) pause(); else show(current + 1); }, 500);
  }
  root.querySelector("[data-action=back]").onclick = function () { pause(); show(current - 1); };
  root.querySelector("[data-action=forward]").onclick = function () { pause(); show(current + 1); };
  playBtn.onclick = function () { if (timer) pause(); else play(); };
  slider.oninput = function () { pause(); show(+slider.value); };
  timeline.addEventListener("click", function (e) {
    var box = timeline.getBoundingClientRect(), x = (e.clientX - box.left) * timeline.viewBox.baseVal.width / box.width;
    if (x >= left) { pause(); show(Math.floor((x - left) / stepWidth)); }
  });
  blocks.forEach(function (g) {
    g.addEventListener("mousemove", function (e) {
      var box = root.getBoundingClientRect();
      tip.textContent = tips[+g.getAttribute("data-block")];
      tip.style.left = (e.clientX - box.left + 14) + "px"; tip.style.top = (e.clientY - box.top + 14) + "px";
      tip.style.display = "block";
    });
    g.addEventListener("mouseleave", function () { tip.style.display = "none"; });
  });
  show(current);
})();
"""



def _script(player_id: str) -> str:
    """The script, with the player's id and the same colours and widths as the Python drawing."""
    values = {"%ID%": player_id, "%FREE%": FREE_FILL, "%DARK%": DARK, "%CACHED%": CACHED_FILL,
              "%CACHED_EDGE%": CACHED_EDGE, "%DASH%": CACHED_DASH, "%SHARED_WIDTH%": str(SHARED_WIDTH),
              "%OWNED_WIDTH%": str(OWNED_WIDTH)}
    script = _JS
    for key, value in values.items():
        script = script.replace(key, value)
    return script


__all__ = ["BlockMapPlayer"]
