"""Pictures of what the engine did: pure functions from results to matplotlib figures.

Each function takes plain data (runs, lengths, snapshots), draws on the ``ax``
it is given or on a new figure, and returns the ``Figure``. Nothing here keeps
state or calls ``plt.show()``: the caller decides where the picture goes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.animation import FuncAnimation
from matplotlib.patches import Patch, Rectangle

from .baselines import StaticBatchRun
from .engine import Engine, StepRecord
from .sampling import SamplingParams

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

def request_color(request_id: str) -> tuple[float, ...]:
    """A stable colour per request, the same in every picture of one run."""
    key = int(request_id) if request_id.isdigit() else sum(map(ord, request_id))
    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]  # no grey: grey means free
    return palette[key % len(palette)]


def plot_block_map(record: StepRecord, ax: Axes | None = None, *, columns: int | None = None,
                   title: str | None = None) -> Figure:
    """The block pool as a grid: each block coloured by the request that owns it.

    A block is filled to the share of its slots that hold tokens, so the
    partly empty last block of each request shows; free blocks are grey.
    The block tables are listed beside the grid.
    """
    n, size = record.num_blocks, record.block_size
    columns = columns or min(n, 16)
    rows = -(-n // columns)
    fig, ax = _figure_and_axes(ax, figsize=(9, 0.6 + 0.45 * rows))
    owner, fill = {}, {}
    for rid, table in record.block_tables.items():
        cached = record.num_cached.get(rid, 0)
        for i, block in enumerate(table):
            owner[block] = rid
            fill[block] = min(size, max(0, cached - i * size)) / size
    for block in range(n):
        r, c = divmod(block, columns)
        ax.add_patch(Rectangle((c, r), 0.94, 0.94, facecolor="#eeeeee", edgecolor="#bbbbbb", linewidth=0.5))
        if block in owner:
            color = request_color(owner[block])
            ax.add_patch(Rectangle((c, r), 0.94, 0.94, facecolor="none", edgecolor=color, linewidth=1.5))
            ax.add_patch(Rectangle((c, r + 0.94 * (1 - fill[block])), 0.94, 0.94 * fill[block],
                                   facecolor=color, edgecolor="none"))
        ax.text(c + 0.47, r + 0.47, str(block), ha="center", va="center", fontsize=6, color="#555555")
    ax.set_xlim(-0.1, columns)
    ax.set_ylim(rows, -0.1)
    ax.set_aspect("equal")
    ax.axis("off")
    used = len(owner)
    ax.set_title(title or f"step {record.step}: {used}/{n} blocks in use, {size} slots each", fontsize=10)
    lines = [f"req {rid}: {table}  ({record.num_cached.get(rid, 0)} tok)"
             for rid, table in sorted(record.block_tables.items(), key=lambda kv: _order(kv[0]))]
    ax.text(columns + 0.4, 0, "block tables\n" + ("\n".join(lines) or "(none running)"),
            va="top", ha="left", fontsize=7, family="monospace")
    return fig


def engine_timeline_segments(history: Sequence[StepRecord]) -> tuple[list[Segment], list[str]]:
    """Per-request state segments over engine steps, and the request ids by row.

    A request is drawn from the step it is first seen: waiting while queued,
    prefill or decode in the steps it computes, preempted while it waits to be
    recomputed, nothing once finished.
    """
    ids = sorted({rid for r in history for rid in r.states}, key=_order)
    row = {rid: i for i, rid in enumerate(ids)}
    segments = []
    for record in history:
        for rid, status in record.states.items():
            if rid in record.scheduled:
                state = "prefill" if rid in record.prefill else "decode"
            elif rid in record.preempted or status == "preempted":
                state = "preempted"
            elif status == "waiting":
                state = "waiting"
            else:
                continue
            segments.append(Segment(row[rid], state, float(record.step), 1.0))
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


def _order(request_id: str) -> tuple[int, str]:
    return (int(request_id), "") if request_id.isdigit() else (1 << 30, request_id)


def animate_block_map(history: Sequence[StepRecord], *, interval: int = 500) -> FuncAnimation:
    """The block map at every recorded step, as an animation.

    ``IPython.display.HTML(anim.to_jshtml())`` turns it into a player that
    works in a static web page, with no kernel behind it.
    """
    if not history:
        raise ValueError("no steps recorded: create the engine with EngineConfig(record=True)")
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.45 * -(-history[0].num_blocks // min(history[0].num_blocks, 16))))
    anim = FuncAnimation(fig, lambda i: (ax.clear(), plot_block_map(history[i], ax=ax)),
                         frames=len(history), interval=interval)
    plt.close(fig)  # the animation keeps the figure; don't also show it as a still
    return anim


class EngineExplorer:
    """Drive an engine by hand in a notebook: step, play, add a request, abort one.

    The slider walks through recorded steps (the block map and the timeline so
    far); stepping past the last one runs the engine. Works with ipywidgets 7.7
    (Colab) and 8.x.
    """

    def __init__(self, engine: Engine, params: SamplingParams | None = None) -> None:
        import ipywidgets as w

        if not engine.config.record:
            raise ValueError("the explorer needs EngineConfig(record=True)")
        self.engine, self.params = engine, params
        self.slider = w.IntSlider(0, 0, max(0, len(engine.history) - 1), description="step")
        self.play = w.Play(interval=600, min=0, max=self.slider.max)
        w.jslink((self.play, "value"), (self.slider, "value"))
        self.step_button = w.Button(description="run one step")
        self.prompt = w.Text(placeholder="a new prompt", layout=w.Layout(width="320px"))
        self.add_button = w.Button(description="add request")
        self.victim = w.Dropdown(options=[], description="abort")
        self.abort_button = w.Button(description="abort it")
        self.out = w.Output()
        self.message = w.HTML()
        self.step_button.on_click(lambda _: self.run_step())
        self.add_button.on_click(lambda _: self.add(self.prompt.value))
        self.abort_button.on_click(lambda _: self.abort(self.victim.value))
        self.slider.observe(lambda change: self.draw(change["new"]), names="value")
        self.widget = w.VBox([w.HBox([self.play, self.slider, self.step_button]),
                              w.HBox([self.prompt, self.add_button, self.victim, self.abort_button]),
                              self.message, self.out])
        self._refresh()

    def run_step(self) -> None:
        self.engine.step()
        self._refresh(last=True)

    def add(self, prompt: str) -> None:
        try:
            rid = self.engine.add_request(prompt, self.params)
            self.message.value = f"added request {rid}"
        except ValueError as err:
            self.message.value = f"<b>refused:</b> {err}"
        self._refresh()

    def abort(self, request_id: str | None) -> None:
        if request_id:
            self.engine.abort(request_id)
            self.message.value = f"aborted request {request_id}"
        self._refresh()

    def draw(self, step: int) -> None:
        from IPython.display import display

        history = self.engine.history
        with self.out:
            self.out.clear_output(wait=True)
            if not history:
                print("no steps yet: press 'run one step'")
                return
            for fig in (plot_block_map(history[step]), plot_engine_timeline(history[:step + 1])):
                display(fig)
                plt.close(fig)

    def _refresh(self, last: bool = False) -> None:
        live = [r.request_id for r in (*self.engine.scheduler.running, *self.engine.scheduler.waiting)]
        self.victim.options = live
        top = max(0, len(self.engine.history) - 1)
        self.slider.max = self.play.max = top
        if last or self.slider.value > top:
            self.slider.value = top
        self.draw(self.slider.value)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
