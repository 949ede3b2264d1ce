"""Pictures of what the engine did: pure functions from results to matplotlib figures.

Each function takes plain data (runs, lengths, snapshots), draws on the ``ax``
it is given or on a new figure, and returns the ``Figure``. Nothing here keeps
state or calls ``plt.show()``: the caller decides where the picture goes.
The block-map player (``player.BlockMapPlayer``, HTML, no kernel) and the
live explorer (``explorer.EngineExplorer``, ipywidgets) build on these.
"""
from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap, to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from enginelib.baselines.generate import StaticBatchRun
from enginelib.core.record import StepRecord

# One colour per request state, shared by every timeline in the book.
STATE_COLORS = {
    "waiting": "#d9d9d9",   # queued: not in the batch yet
    "prefill": "#ff7f0e",   # its prompt goes through the model (the batch's first step)
    "decode": "#1f77b4",    # generating one token per step
    "idle": "#f4b6b6",      # finished, but its seat (and compute) is held until the batch ends
    "preempted": "#d62728",  # evicted to free blocks; waits to be recomputed
}
STATE_LABELS = {
    "waiting": "waiting (queued)",
    "prefill": "prefill (prompt + first token)",
    "decode": "decode (one token per step)",
    "idle": "finished, seat still held",
    "preempted": "preempted (blocks freed)",
}


@dataclass(frozen=True)
class Segment:
    """One bar of a timeline: request ``row`` was in ``state`` from ``start`` for ``width``."""

    row: int
    state: str
    start: float
    width: float


def static_timeline_segments(runs: StaticBatchRun | Sequence[StaticBatchRun],
                             unit: Literal["step", "time"] = "step") -> list[Segment]:
    """Cut consecutive static batches into per-request state segments.

    Batches run one after another, so batch ``k`` starts when batch ``k-1``
    ends. In ``"step"`` units each batch step is 1 wide; in ``"time"`` units
    a step lasts from the previous entry of ``step_times`` to its own (seconds).
    Step 0 of a batch is its prefill (it also yields each request's first
    token); a request that has ``n`` tokens decodes in steps ``1..n-1`` and then
    sits idle until the batch's last step.
    """
    if isinstance(runs, StaticBatchRun):
        runs = [runs]
    if unit not in ("step", "time"):
        raise ValueError(f"unit must be 'step' or 'time', got {unit!r}")
    segments: list[Segment] = []
    row, offset = 0, 0.0
    for run in runs:
        # edges[s] .. edges[s + 1] is step s of this batch, on the global clock.
        local = (np.arange(run.num_steps + 1, dtype=float) if unit == "step"
                 else np.array([0.0, *run.step_times]))
        edges = offset + local
        for gen in run.generations:
            n = len(gen.token_ids)
            if n == 0 or n > run.num_steps:
                raise ValueError(f"request {row} has {n} tokens but its batch ran {run.num_steps} steps")
            spans = [("waiting", 0.0, edges[0]), ("prefill", edges[0], edges[1]),
                     ("decode", edges[1], edges[n]), ("idle", edges[n], edges[-1])]
            segments += [Segment(row, state, float(a), float(b - a)) for state, a, b in spans if b > a]
            row += 1
        offset = float(edges[-1])
    return segments


def plot_static_timeline(runs: StaticBatchRun | Sequence[StaticBatchRun], ax: Axes | None = None, *,
                         unit: Literal["step", "time"] = "step", title: str | None = None) -> Figure:
    """Gantt chart of static batches: one row per request, bars coloured by state.

    It shows the straggler problem at a glance: pink bars are seats held by
    finished requests, grey bars are requests queued behind a whole batch.
    """
    segments = static_timeline_segments(runs, unit)
    rows = 1 + max(s.row for s in segments)
    fig, ax = _figure_and_axes(ax, figsize=(9, 0.5 + 0.28 * rows))
    _draw_segments(ax, segments, [f"req {i}" for i in range(rows)])
    ax.set_xlabel("engine step" if unit == "step" else "time (s)")
    ax.set_title(title or "Static batching: each batch runs until its longest request ends")
    return fig


def _draw_segments(ax: Axes, segments: Sequence[Segment], row_labels: Sequence[str]) -> None:
    """Gantt bars, one row per request (the first at the top), coloured by state, with a legend."""
    for state, color in STATE_COLORS.items():
        mine = [s for s in segments if s.state == state]
        if mine:
            ax.barh([s.row for s in mine], [s.width for s in mine], left=[s.start for s in mine],
                    height=0.8, color=color, edgecolor="white", linewidth=0.5, label=STATE_LABELS[state])
    rows = len(row_labels)
    ax.set_yticks(range(rows), row_labels, fontsize=8 if rows > 16 else 9)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlim(0, max(s.start + s.width for s in segments))
    ax.set_ylabel("request")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)


def plot_padding(prompt_lengths: Sequence[int], ax: Axes | None = None, *,
                 labels: Sequence[Sequence[str]] | None = None, title: str | None = None) -> Figure:
    """Draw a left-padded batch as a grid: one row per prompt, real tokens vs padding.

    Left padding makes every prompt end in the same column, so the batch's
    next token is always written to the same place for every row.
    ``labels`` (optional) gives each prompt's token strings, written in its cells.
    """
    if not prompt_lengths or min(prompt_lengths) < 1:
        raise ValueError("give at least one prompt, each with at least one token")
    if labels is not None and [len(x) for x in labels] != list(prompt_lengths):
        raise ValueError("labels must hold one string per token of each prompt")
    width = max(prompt_lengths)
    grid = np.array([[0] * (width - n) + [1] * n for n in prompt_lengths])
    longest = max((len(t) for row in labels for t in row), default=0) if labels is not None else 0
    column = max(0.55, 0.08 * longest + 0.15)  # inches: wide enough for the longest token label
    fig, ax = _figure_and_axes(ax, figsize=(max(4.0, 1.8 + column * width), 0.6 + 0.5 * len(prompt_lengths)))
    ax.imshow(grid, cmap=ListedColormap(["#e6e6e6", "#1f77b4"]), vmin=0, vmax=1, aspect="auto")
    if labels is not None:
        for r, (n, row) in enumerate(zip(prompt_lengths, labels)):
            for j, text in enumerate(row):
                ax.text(width - n + j, r, text.replace("\n", "\\n"), ha="center", va="center",
                        color="white", fontsize=8)
    ax.set_xticks(range(width))
    ax.set_yticks(range(len(prompt_lengths)), [f"prompt {i} ({n})" for i, n in enumerate(prompt_lengths)])
    ax.set_xticks(np.arange(-0.5, width), minor=True)
    ax.set_yticks(np.arange(-0.5, len(prompt_lengths)), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("column of the padded batch")
    ax.set_title(title or "Left padding: prompts end together")
    ax.legend(handles=[Patch(color="#1f77b4", label="real token"), Patch(color="#e6e6e6", label="padding")],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return fig


def _figure_and_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    """Draw on the caller's axes, or on a fresh figure's."""
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    return fig, ax


# --- Part II: the engine's block map and timeline -----------------------------------------

FREE_COLOR = "#eeeeee"


def request_color(request_id: str) -> tuple[float, ...]:
    """A stable colour per request, the same in every picture of one run (and in the player)."""
    key = int(request_id) if request_id.isdigit() else sum(map(ord, request_id))
    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]  # no grey: grey means free
    return palette[key % len(palette)]


def ink_for(color: str | tuple[float, ...]) -> str:
    """White or near-black, whichever contrasts more with ``color`` (WCAG luminance): labels stay legible."""
    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    lum = sum(w * linear(c) for w, c in zip((0.2126, 0.7152, 0.0722), to_rgb(color)))
    dark = 0.0137  # luminance of #222222
    return "#ffffff" if (1.05 / (lum + 0.05)) >= ((lum + 0.05) / (dark + 0.05)) else "#222222"


def sort_ids(ids: Iterable[str]) -> list[str]:
    """Request ids in arrival order ("2" before "10")."""
    return sorted(ids, key=_order)


def busiest_frame(history: Sequence[StepRecord]) -> int:
    """The index of a step worth showing first: the most blocks in use, nearest the middle of the run."""
    if not history:
        raise ValueError("no steps recorded: create the engine with EngineConfig(record=True)")
    used = [len({b for t in r.block_tables.values() for b in t}) for r in history]
    middle = (len(history) - 1) / 2
    return max(range(len(history)), key=lambda i: (used[i], -abs(i - middle)))


def plot_block_map(record: StepRecord, ax: Axes | None = None, *, columns: int | None = None,
                   title: str | None = None, tables_ax: Axes | None = None) -> Figure:
    """The block pool as a grid: each block coloured by the request that owns it.

    A block is filled to the share of its slots that hold tokens, so the
    partly empty last block of each request shows; free blocks are grey.
    Block ids are written in white or black, whichever reads on the colour
    behind them; a legend names the colours and the block tables are listed,
    in full, on ``tables_ax`` (a new figure gets one beside the grid; on a
    caller's ``ax`` without one, they are written to the right of the grid).
    """
    n, size = record.num_blocks, record.block_size
    columns = columns or min(n, 16)
    rows = -(-n // columns)
    running = sort_ids(record.block_tables)
    if ax is None:
        lines = sum(1 + len(str(t)) // 40 for t in record.block_tables.values())
        fig, (ax, tables_ax) = plt.subplots(1, 2, figsize=(10, 1.3 + max(0.5 * rows, 0.16 * lines)),
                                            layout="constrained", width_ratios=[2.4, 1])
    fig = ax.figure
    owner, fill = {}, {}
    for rid in running:
        cached = record.num_cached.get(rid, 0)
        for i, block in enumerate(record.block_tables[rid]):
            owner.setdefault(block, rid)
            fill.setdefault(block, min(size, max(0, cached - i * size)) / size)
    for block in range(n):
        r, c = divmod(block, columns)
        ax.add_patch(Rectangle((c, r), 0.94, 0.94, facecolor=FREE_COLOR, edgecolor="#bbbbbb", linewidth=0.5))
        ink = "#222222"
        if block in owner:
            color = request_color(owner[block])
            ax.add_patch(Rectangle((c, r), 0.94, 0.94, facecolor="none", edgecolor=color, linewidth=1.5))
            ax.add_patch(Rectangle((c, r + 0.94 * (1 - fill[block])), 0.94, 0.94 * fill[block],
                                   facecolor=color, edgecolor="none"))
            ink = ink_for(color) if fill[block] >= 0.5 else ink  # the id sits mid-block
        ax.text(c + 0.47, r + 0.47, str(block), ha="center", va="center", color=ink,
                fontsize=9 if columns <= 16 else 8, fontweight="bold")
    ax.set_xlim(-0.1, columns)
    ax.set_ylim(rows, -0.1)
    ax.set_aspect("equal")
    ax.set_anchor("W")  # the grid to the left, the block tables in the room on its right
    ax.axis("off")
    ax.set_title(title or f"step {record.step}: {len(owner)}/{n} blocks in use, {size} slots each", fontsize=10)
    handles = [Patch(facecolor=request_color(rid), label=f"req {rid}") for rid in running]
    handles.append(Patch(facecolor=FREE_COLOR, edgecolor="#bbbbbb", label="free"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 0), ncol=min(len(handles), 8),
              fontsize=8, frameon=False, handlelength=1.2, columnspacing=1.0)
    lines = [textwrap.fill(f"req {rid} ({record.num_cached.get(rid, 0)} tok): {record.block_tables[rid]}",
                           width=44, subsequent_indent="    ") for rid in running]
    text = "block tables\n" + ("\n".join(lines) or "(none running)")
    if tables_ax is None:
        ax.text(columns + 0.4, 0, text, va="top", ha="left", fontsize=8, family="monospace")
    else:
        tables_ax.axis("off")
        tables_ax.text(0, 1, text, va="top", ha="left", fontsize=8, family="monospace",
                       transform=tables_ax.transAxes)
    return fig


def request_state(record: StepRecord, request_id: str) -> str | None:
    """What a request was doing in a step, as a timeline colour key (None: not drawn, e.g. finished).

    Prefill or decode in the steps it computes, preempted while it waits to be
    recomputed, waiting while queued.
    """
    if request_id in record.scheduled:
        return "prefill" if request_id in record.prefill else "decode"
    status = record.states.get(request_id)
    if request_id in record.preempted or status == "preempted":
        return "preempted"
    return "waiting" if status == "waiting" else None


def engine_timeline_segments(history: Sequence[StepRecord]) -> tuple[list[Segment], list[str]]:
    """Per-request state segments over engine steps, and the request ids by row.

    A request is drawn from the step it is first seen (see ``request_state``),
    and not at all once finished.
    """
    ids = sort_ids({rid for r in history for rid in r.states})
    segments = [Segment(row, state, float(record.step), 1.0)
                for record in history for row, rid in enumerate(ids)
                if rid in record.states and (state := request_state(record, rid)) is not None]
    return segments, ids


def plot_engine_timeline(history: Sequence[StepRecord], *, title: str | None = None) -> Figure:
    """Gantt chart of an engine run (one row per request) above the tokens computed per step."""
    if not history:
        raise ValueError("no steps recorded: create the engine with EngineConfig(record=True)")
    segments, ids = engine_timeline_segments(history)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 1.6 + 0.28 * len(ids)), sharex=True, layout="constrained",
                                      gridspec_kw={"height_ratios": [max(2, len(ids) * 0.28), 1.2]})
    _draw_segments(top, segments, [f"req {rid}" for rid in ids])
    top.set_title(title or "Continuous batching: requests join and leave at every step")
    steps = [r.step for r in history]
    prefill = [sum(n for rid, n in r.scheduled.items() if rid in r.prefill) for r in history]
    decode = [sum(n for rid, n in r.scheduled.items() if rid not in r.prefill) for r in history]
    bottom.bar(steps, prefill, width=0.9, align="edge", color=STATE_COLORS["prefill"], label="prefill tokens")
    bottom.bar(steps, decode, width=0.9, align="edge", bottom=prefill, color=STATE_COLORS["decode"],
               label="decode tokens")
    bottom.set_ylabel("tokens\nper step")
    bottom.set_xlabel("engine step")
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return fig


def plot_engine_step(history: Sequence[StepRecord], index: int, *, title: str | None = None) -> Figure:
    """One step of a run: the block map on top, the whole run's timeline below with the step marked.

    The still that stands for the live explorer where no kernel runs.
    """
    if not history:
        raise ValueError("no steps recorded: create the engine with EngineConfig(record=True)")
    record = history[index]
    segments, ids = engine_timeline_segments(history)
    rows = -(-record.num_blocks // min(record.num_blocks, 16))
    fig = plt.figure(figsize=(10, 2.2 + 0.5 * rows + 0.25 * len(ids)), layout="constrained")
    grid = fig.add_gridspec(2, 2, width_ratios=[2.4, 1], height_ratios=[1.3 + 0.5 * rows, 0.6 + 0.25 * len(ids)])
    top, tables, bottom = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    plot_block_map(record, ax=top, title=title, tables_ax=tables)
    _draw_segments(bottom, segments, [f"req {rid}" for rid in ids])
    bottom.axvspan(record.step, record.step + 1, facecolor="none", edgecolor="black", linewidth=1.5)
    bottom.set_xlabel(f"engine step (the box marks step {record.step})")
    return fig


# --- Part III: chunked prefill (chapter 10) -------------------------------------------------

@dataclass(frozen=True)
class StepMix:
    """Per recorded step: its number and the tokens it computed for prefills (or chunks of one) and decodes."""

    steps: list[int]
    prefill: list[int]
    decode: list[int]

    @property
    def total(self) -> list[int]:
        return [p + d for p, d in zip(self.prefill, self.decode)]


def step_mix(history: Sequence[StepRecord]) -> StepMix:
    """Split each step's tokens into prefill and decode work, as ``StepRecord.prefill`` says."""
    if not history:
        raise ValueError("no steps recorded: create the engine with EngineConfig(record=True)")
    return StepMix([r.step for r in history],
                   [sum(n for rid, n in r.scheduled.items() if rid in r.prefill) for r in history],
                   [sum(n for rid, n in r.scheduled.items() if rid not in r.prefill) for r in history])


def plot_step_mix(history: Sequence[StepRecord], budget: int | None = None, ax: Axes | None = None, *,
                  title: str | None = None) -> Figure:
    """Stacked bars per step: decode tokens at the bottom, prefill (or prefill-chunk) tokens on top.

    A step's cost grows with its tokens, so this is also a picture of how long
    each step takes: one tall bar is one long stall for every running request.
    ``budget`` (the scheduler's ``max_num_batched_tokens``) is drawn as a dashed line.
    Decodes go at the bottom so that a few of them stay visible under a tall prefill.
    """
    mix = step_mix(history)
    fig, ax = _figure_and_axes(ax, figsize=(9, 3.2))
    ax.bar(mix.steps, mix.decode, width=0.85, color=STATE_COLORS["decode"], label="decode tokens (1 per request)")
    ax.bar(mix.steps, mix.prefill, width=0.85, bottom=mix.decode, color=STATE_COLORS["prefill"],
           label="prefill tokens (a prompt or a chunk of one)")
    if budget is not None:
        if budget < 1:
            raise ValueError(f"budget must be a positive number of tokens, got {budget}")
        ax.axhline(budget, color="#222222", linestyle="--", linewidth=1.2, label=f"token budget ({budget})")
    ax.set_xlim(min(mix.steps) - 0.7, max(mix.steps) + 0.7)
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens computed in the step")
    ax.set_title(title or "What each step computed")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return fig


def token_gaps(token_times: Mapping[str, Sequence[float]], start: float | None = None
               ) -> dict[str, tuple[list[float], list[float]]]:
    """Per request: the time of each token after its first (seconds after ``start``) and its gap to the previous one.

    ``start`` defaults to the earliest token time, so the picture begins at 0.
    Requests with fewer than two tokens have no gap and are left out.
    """
    if start is None:
        firsts = [times[0] for times in token_times.values() if times]
        if not firsts:
            raise ValueError("no token times given: pass {request_id: metrics.token_times} "
                             "of requests that produced tokens")
        start = min(firsts)
    gaps = {}
    for rid, times in token_times.items():
        if any(b < a for a, b in zip(times, times[1:])):
            raise ValueError(f"request {rid}'s token times go backwards: pass them in the order they were produced")
        if len(times) > 1:
            gaps[rid] = ([t - start for t in times[1:]], [b - a for a, b in zip(times, times[1:])])
    return gaps


def plot_token_gaps(token_times: Mapping[str, Sequence[float]], ax: Axes | None = None, *,
                    start: float | None = None, marks: Mapping[str, float] | None = None,
                    title: str | None = None) -> Figure:
    """Each request's wait for its next token (ms), drawn over the time it waited.

    This is what a streaming reader feels: a low flat line is a steady stream,
    a tall step is a freeze, as wide as it lasted. ``token_times`` maps request
    ids to their token times (``RequestMetrics.token_times``); ``marks`` names
    moments to draw as vertical lines (absolute times, like the token times).
    Requests that decode in the same steps wait the same: their lines coincide,
    so each is drawn a little thinner than the one before, and all stay visible.
    """
    gaps = token_gaps(token_times, start)
    start = start if start is not None else min(times[0] for times in token_times.values() if times)
    fig, ax = _figure_and_axes(ax, figsize=(9, 3.2))
    ids = sort_ids(gaps)
    for k, rid in enumerate(ids):
        at, gap = gaps[rid]
        edges = [at[0] - gap[0], *at]  # the gap to token i spans [time of token i-1, time of token i]
        ax.plot(edges, [1e3 * g for g in (*gap, gap[-1])], drawstyle="steps-post", color=request_color(rid),
                linewidth=1.0 + 2.5 * (len(ids) - 1 - k) / max(1, len(ids) - 1), label=f"req {rid}")
    for (label, when), style in zip((marks or {}).items(), ["--", ":", "-."] * 4):
        ax.axvline(when - start, color="#222222", linestyle=style, linewidth=1.2, label=label)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time since the first token (s)")
    ax.set_ylabel("wait for the\nnext token (ms)")
    ax.set_title(title or "How long each request waited for each token")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return fig


def plot_budget_tradeoff(budgets: Sequence[int], ttft: Sequence[float], itl_p99: Sequence[float],
                         ax: Axes | None = None, *, unchunked: tuple[float, float] | None = None,
                         title: str | None = None) -> Figure:
    """The token budget's trade-off: the long request's TTFT against the others' p99 inter-token gap.

    One point per budget (seconds in, milliseconds and seconds drawn), joined in
    budget order and labelled; ``unchunked`` is the ``(ttft, itl_p99)`` point of
    the run without chunking. Lower left is better on both counts; where each
    budget lands is what the run measured.
    """
    if not budgets or not len(budgets) == len(ttft) == len(itl_p99):
        raise ValueError(f"give one ttft and one itl_p99 per budget: got {len(budgets)} budgets, "
                         f"{len(ttft)} ttft and {len(itl_p99)} itl_p99 values")
    order = sorted(range(len(budgets)), key=lambda i: budgets[i])
    xs, ys = [1e3 * itl_p99[i] for i in order], [ttft[i] for i in order]
    fig, ax = _figure_and_axes(ax, figsize=(7, 4.2))
    ax.plot(xs, ys, marker="o", color=STATE_COLORS["decode"], label="chunked prefill, by token budget")
    for i, x, y in zip(order, xs, ys):
        ax.annotate(f"{budgets[i]}", (x, y), textcoords="offset points", xytext=(6, 6), fontsize=9)
    if unchunked is not None:
        ax.plot([1e3 * unchunked[1]], [unchunked[0]], marker="s", linestyle="none", markersize=8,
                color=STATE_COLORS["preempted"], label="no chunking")
    every_x = xs + ([1e3 * unchunked[1]] if unchunked is not None else [])
    every_y = ys + ([unchunked[0]] if unchunked is not None else [])
    ax.set_xlim(0, 1.1 * max(every_x))  # room for the labels, right of and above the points
    ax.set_ylim(0, 1.12 * max(every_y))
    ax.set_xlabel("others' p99 gap between tokens (ms)  (left: steadier streams)")
    ax.set_ylabel("long prompt's time to first token (s)\n(down: sooner)")
    ax.set_title(title or "The token budget trades the long prompt's TTFT for the others' decode latency")
    ax.legend(loc="upper right", fontsize=8)
    return fig


def _order(request_id: str) -> tuple[int, str]:
    return (int(request_id), "") if request_id.isdigit() else (1 << 30, request_id)
