"""Pictures of ideas: conceptual figures drawn in code, so they are versioned and tested.

``viz`` draws what the engine *did*; this module draws what the book *explains*:
which keys a query may see, how the KV cache fills up, where prefill and decode
sit on a roofline, and how paged attention finds a request's keys. Each
function takes plain numbers or strings, draws on the ``ax`` it is given or on
a new figure, and returns the ``Figure``; none keeps state or calls
``plt.show()``. Colours come from the Okabe-Ito palette, which stays distinct
for the common kinds of colour blindness.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

# Okabe & Ito's colour-blind-safe palette.
ORANGE, SKY, GREEN, YELLOW, BLUE, VERMILLION, PURPLE = (
    "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7")
REQUEST_COLORS = (BLUE, ORANGE, GREEN, PURPLE)  # one per request in the paged-attention figure
MASKED = "#d9d9d9"    # a cell that is never read (masked, or not filled yet)
FONT = 9              # points: every label is at least 8


def _figure_and_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    """Draw on the caller's axes, or on a fresh figure's."""
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    return fig, ax


def _cell_label(text: str) -> str:
    """A token string as it can be printed in a cell: visible spaces and newlines."""
    return text.replace("\n", "\\n").replace(" ", "␣")


# --- 1. attention with the causal mask ------------------------------------------------------

MAX_ATTENTION_TOKENS = 24


def causal_attention(tokens: Sequence[str] | int, weights: np.ndarray | None = None, ax: Axes | None = None, *,
                     title: str | None = None) -> Figure:
    """The T x T attention matrix of a short sequence: which query may see which key.

    Row ``q`` is the query of token ``q``, column ``k`` the key of token ``k``.
    Cells with ``k > q`` are masked (their score is set to -inf before the
    softmax, so their weight is 0): a token never sees the future. ``tokens`` is
    the token strings (or just their number); ``weights``, if given, is a real
    attention matrix (rows summing to 1, zero above the diagonal), drawn as
    shades with its numbers; without it the allowed cells are drawn flat.
    """
    labels = [str(i) for i in range(tokens)] if isinstance(tokens, int) else [_cell_label(t) for t in tokens]
    T = len(labels)
    if not 1 <= T <= MAX_ATTENTION_TOKENS:
        raise ValueError(f"give 1 to {MAX_ATTENTION_TOKENS} tokens (more cannot be labelled legibly), got {T}")
    allowed = np.tril(np.ones((T, T), dtype=bool))
    if weights is not None:
        weights = np.asarray(weights, dtype=float)
        if weights.shape != (T, T):
            raise ValueError(f"weights must be a {T} x {T} matrix (one row per query), got shape {weights.shape}")
        if (weights < 0).any() or np.abs(weights[~allowed]).max(initial=0.0) > 1e-6:
            raise ValueError("weights must be non-negative and zero above the diagonal (causal)")
        if not np.allclose(weights.sum(axis=1), 1.0, atol=1e-3):
            raise ValueError("each row of weights must sum to 1 (a softmax over the keys)")
    side = max(4.0, 0.42 * T + 2.2)
    fig, ax = _figure_and_axes(ax, figsize=(side + 1.6, side))
    masked = np.ma.masked_where(allowed, np.ones((T, T)))
    ax.imshow(masked, cmap=ListedColormap([MASKED]), vmin=0, vmax=1, aspect="equal")
    if weights is None:
        ax.imshow(np.ma.masked_where(~allowed, np.ones((T, T))), cmap=ListedColormap([SKY]),
                  vmin=0, vmax=1, aspect="equal")
    else:
        image = ax.imshow(np.ma.masked_where(~allowed, weights), cmap="cividis", vmin=0, vmax=1, aspect="equal")
        fig.colorbar(image, ax=ax, shrink=0.7, label="attention weight (softmax of the scores)")
        if T <= 12:
            for q in range(T):
                for k in range(q + 1):
                    ax.text(k, q, f"{weights[q, k]:.2f}", ha="center", va="center", fontsize=8,
                            color="black" if weights[q, k] > 0.5 else "white")
    for q in range(T):
        for k in range(q + 1, T):
            ax.text(k, q, "−∞", ha="center", va="center", fontsize=8, color="#555555")
    ax.set_xticks(range(T), labels, rotation=60, ha="right", rotation_mode="anchor", fontsize=FONT)
    ax.set_yticks(range(T), [f"{lab} ({q})" for q, lab in enumerate(labels)], fontsize=FONT)
    ax.set_xticks(np.arange(-0.5, T), minor=True)
    ax.set_yticks(np.arange(-0.5, T), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.2)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key: the token being looked at")
    ax.set_ylabel("query: the token looking (its position)")
    seen = Patch(color=SKY if weights is None else "#7f7f6f", label="may attend (k ≤ q)")
    ax.legend(handles=[seen, Patch(color=MASKED, label="masked: score −∞, weight 0")],
              loc="upper center", bbox_to_anchor=(0.5, -0.22 if T > 6 else -0.3), ncol=2, fontsize=FONT,
              frameon=False)
    ax.set_title(title or "Causal attention: each token sees itself and the tokens before it")
    return fig


# --- 2. the KV cache growing ---------------------------------------------------------------

MAX_CACHE_SLOTS = 32
WRITTEN, READ = ORANGE, BLUE  # K/V computed and stored this step; K/V read from the cache


def kv_cache_growth(prompt_len: int = 5, decode_steps: int = 4, ax: Axes | None = None, *,
                    tokens: Sequence[str] | None = None, title: str | None = None) -> Figure:
    """The KV cache of one request, step by step: one row per model call.

    The prefill computes K/V for all ``prompt_len`` prompt tokens and writes
    them; each decode step computes K/V for one new token, writes it to the next
    slot, and reads every earlier slot back for attention. Slots to the right
    are reserved but not yet filled. ``tokens`` (optional) labels the slots with
    the ``prompt_len + decode_steps`` token strings that fill them.
    """
    if prompt_len < 1 or decode_steps < 0:
        raise ValueError(f"need prompt_len >= 1 and decode_steps >= 0, got {prompt_len} and {decode_steps}")
    slots = prompt_len + decode_steps
    if slots > MAX_CACHE_SLOTS:
        raise ValueError(f"prompt_len + decode_steps must be at most {MAX_CACHE_SLOTS} to stay legible, got {slots}")
    if tokens is not None and len(tokens) != slots:
        raise ValueError(f"tokens must label every slot: {slots} strings (prompt + one per decode step), "
                         f"got {len(tokens)}")
    rows = 1 + decode_steps
    longest = max((len(_cell_label(t)) for t in tokens), default=0) if tokens is not None else 0
    column = max(0.55, 0.075 * longest + 0.2)  # inches: wide enough for the longest token label
    fig, ax = _figure_and_axes(ax, figsize=(max(6.0, column * slots + 4.2), 1.3 + 0.5 * rows))
    for row in range(rows):
        written = range(prompt_len) if row == 0 else range(prompt_len + row - 1, prompt_len + row)
        end = written[-1] + 1
        for slot in range(slots):
            color = WRITTEN if slot in written else READ if slot < end else "white"
            ax.add_patch(Rectangle((slot, row), 0.92, 0.8, facecolor=color,
                                   edgecolor="#999999" if slot >= end else color, linewidth=0.8))
            if slot < end:
                label = _cell_label(tokens[slot]) if tokens is not None else str(slot)
                ax.text(slot + 0.46, row + 0.4, label, ha="center", va="center", fontsize=8,
                        color="black" if slot in written else "white")
    ticks = [r + 0.4 for r in range(rows)]
    ax.set_yticks(ticks, ["prefill"] + [f"decode {i}" for i in range(1, rows)], fontsize=FONT)
    notes = ax.twinx()  # what each step computes and reads, as right-hand labels (kept inside the figure)
    notes.set_yticks(ticks, [f"computes K/V of {prompt_len} tokens, attends over {prompt_len}"]
                     + [f"computes K/V of 1 token, reads {prompt_len + i - 1} from the cache"
                        for i in range(1, rows)], fontsize=FONT)
    ax.set_xticks([s + 0.46 for s in range(slots)], [str(s) for s in range(slots)], fontsize=8)
    ax.set_xlim(-0.2, slots + 0.2)
    for axis in (ax, notes):
        axis.set_ylim(rows, -0.2)
        axis.tick_params(length=0)
        for side in ("top", "right", "left", "bottom"):
            axis.spines[side].set_visible(False)
    ax.set_xlabel("cache slot (= token position)")
    ax.legend(handles=[Patch(color=WRITTEN, label="K/V computed and written this step"),
                       Patch(color=READ, label="K/V read from the cache"),
                       Patch(facecolor="white", edgecolor="#999999", label="reserved, not filled yet")],
              loc="upper left", bbox_to_anchor=(0.0, -0.5 / rows - 0.08), ncol=3, fontsize=FONT,
              frameon=False)
    ax.set_title(title or "The KV cache grows by one slot per decode step")
    return fig


# --- 3. prefill vs decode on a roofline ------------------------------------------------------

@dataclass(frozen=True)
class Roof:
    """A machine's roofline: peak arithmetic (FLOP/s), memory bandwidth (bytes/s), bytes per number."""

    name: str
    peak_flops: float
    bandwidth: float
    bytes_per_number: int

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which the machine stops waiting for memory."""
        return self.peak_flops / self.bandwidth


# NVIDIA T4 datasheet: 65 TFLOP/s float16 on tensor cores, 8.1 TFLOP/s float32, 320 GB/s.
T4_FP16 = Roof("T4, float16 tensor cores (spec)", 65e12, 320e9, 2)
T4_FP32 = Roof("T4, float32 (spec)", 8.1e12, 320e9, 4)


def arithmetic_intensity(tokens: int, num_params: int, bytes_per_number: int, *,
                         kv_values_per_token: int = 0, context: int = 0) -> float:
    """FLOPs per byte of one forward step over ``tokens`` tokens (one per request in decode).

    Each weight is read once and does a multiply and an add per token:
    ``2 * num_params * tokens`` FLOPs. The bytes are the weights plus, per
    token, ``context`` cached K/V vectors read and its own written
    (``kv_values_per_token`` numbers each); attention's own FLOPs are left out.
    """
    if tokens < 1 or num_params < 1 or bytes_per_number < 1 or kv_values_per_token < 0 or context < 0:
        raise ValueError("tokens, num_params and bytes_per_number must be positive; kv_values_per_token and "
                         "context non-negative")
    flops = 2.0 * num_params * tokens
    moved = bytes_per_number * (num_params + tokens * (context + 1) * kv_values_per_token)
    return flops / moved


def prefill_vs_decode(peak_flops: float, bandwidth: float, *, num_params: int, bytes_per_number: int = 4,
                      kv_values_per_token: int = 0, context: int = 512,
                      prompt_lengths: Sequence[int] = (16, 128, 1024), batch_sizes: Sequence[int] = (1, 8, 64),
                      roofs: Sequence[Roof] = (T4_FP16, T4_FP32), machine: str = "this machine (measured)",
                      ax: Axes | None = None, title: str | None = None) -> Figure:
    """Prefill and decode placed on rooflines: this machine's (measured) and a T4's (spec).

    A roof is ``min(peak, bandwidth x intensity)``: left of its ridge point a
    step waits for memory, right of it for arithmetic. A prefill of P tokens
    reads the weights once for P tokens; a decode step of a batch of B requests
    reads them once for B tokens, plus each request's cached K/V (``context``
    tokens of ``kv_values_per_token`` numbers). Each shape is marked on this
    machine's roof and on the first reference roof, at the intensity it has
    in that roof's number format (bytes per weight); further reference roofs
    show their ridge only.
    """
    if peak_flops <= 0 or bandwidth <= 0:
        raise ValueError(f"peak_flops and bandwidth must be positive (measured FLOP/s and bytes/s), "
                         f"got {peak_flops} and {bandwidth}")
    if not prompt_lengths or not batch_sizes or min(*prompt_lengths, *batch_sizes) < 1:
        raise ValueError("give at least one prompt length and one batch size, each >= 1")
    all_roofs = [Roof(machine, peak_flops, bandwidth, bytes_per_number), *roofs]
    colors = [VERMILLION, BLUE, GREEN, PURPLE, ORANGE]
    if len(all_roofs) > len(colors):
        raise ValueError(f"at most {len(colors) - 1} reference roofs, got {len(roofs)}")
    shapes = [(f"prefill P={p}", p, 0, "o") for p in prompt_lengths] + \
             [(f"decode B={b}", b, context, "^") for b in batch_sizes]
    points = {(roof.name, label): arithmetic_intensity(n, num_params, roof.bytes_per_number,
                                                       kv_values_per_token=kv_values_per_token, context=ctx)
              for roof in all_roofs for label, n, ctx, _ in shapes}
    lo = min(min(points.values()), min(r.ridge for r in all_roofs)) / 3
    hi = max(max(points.values()), max(r.ridge for r in all_roofs)) * 3
    fig, ax = _figure_and_axes(ax, figsize=(10, 5.5))
    x = np.geomspace(lo, hi, 200)
    for roof, color in zip(all_roofs, colors):
        style = "-" if roof is all_roofs[0] else "--"
        ax.plot(x, np.minimum(roof.peak_flops, roof.bandwidth * x), style, color=color, lw=2,
                label=f"{roof.name}, {roof.bytes_per_number}-byte numbers: ridge {roof.ridge:.0f} FLOP/byte")
        ax.axvline(roof.ridge, color=color, lw=0.8, ls=":")
        if roof not in all_roofs[:2]:
            continue  # further roofs are drawn for their ridge only: their markers would pile up
        for label, _, _, marker in shapes:
            ai = points[(roof.name, label)]
            ax.plot(ai, min(roof.peak_flops, roof.bandwidth * ai), marker, color=color, ms=8,
                    mfc=color if marker == "o" else "white", mew=1.5)
            ax.annotate(label, (ai, min(roof.peak_flops, roof.bandwidth * ai)), xytext=(4, -11 if
                        marker == "^" else 5), textcoords="offset points", fontsize=8, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.set_ylabel("attainable FLOP/s")
    shape_keys = [plt.Line2D([], [], marker="o", ls="", color="#444444", label="prefill of P prompt tokens"),
                  plt.Line2D([], [], marker="^", ls="", color="#444444", mfc="white",
                             label=f"decode of B requests ({context}-token context)")]
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + shape_keys, loc="lower right", fontsize=FONT)
    ax.grid(which="major", alpha=0.3)
    ax.set_title(title or "Prefill and decode on the roofline: left of a ridge, memory is the limit")
    return fig


# --- 4. paged attention: logical blocks -> block table -> physical blocks -> gathered keys -------

DEFAULT_TABLES = {"req 0": (5, 1, 7), "req 1": (2, 6)}


def _default_length(num_blocks: int, block_size: int) -> int:
    """Fill all blocks but leave the last one a slot short, so the mask shows."""
    return max((num_blocks - 1) * block_size + 1, num_blocks * block_size - 1)


BlockTables = Mapping[str, Sequence[int]] | Sequence[Sequence[int]]  # by request name, or in request order


def paged_attention_flow(block_size: int = 4, tables: BlockTables | None = None, ax: Axes | None = None, *,
                         lengths: Sequence[int] | None = None, num_blocks: int | None = None,
                         title: str | None = None) -> Figure:
    """How paged attention finds a request's keys, left to right.

    Each request's tokens fill *logical* blocks of ``block_size`` slots in
    order; its *block table* maps logical block i to a *physical* block of the
    shared pool, anywhere in it; attention *gathers* the request's physical
    blocks in table order back into one contiguous run of keys, and masks the
    unfilled slots of the last block. ``tables`` maps request names to block
    ids (default: two requests, 3 and 2 blocks); ``lengths`` gives each
    request's token count (default: its last block one slot short of full).
    """
    if not 1 <= block_size <= 16:
        raise ValueError(f"block_size must be 1..16 to stay legible, got {block_size}")
    if tables is None:
        tables = DEFAULT_TABLES
    if not isinstance(tables, Mapping):
        tables = {f"req {i}": t for i, t in enumerate(tables)}
    names, tabs = list(tables), [list(t) for t in tables.values()]
    if not 1 <= len(tabs) <= len(REQUEST_COLORS) or any(not t for t in tabs):
        raise ValueError(f"give 1 to {len(REQUEST_COLORS)} requests, each with at least one block")
    used = [b for t in tabs for b in t]
    if min(used) < 0 or len(set(used)) != len(used):
        raise ValueError(f"block ids must be non-negative and owned by one request each, got {tables}")
    num_blocks = max(used) + 1 if num_blocks is None else num_blocks
    if num_blocks <= max(used) or num_blocks > 24:
        raise ValueError(f"num_blocks must hold every block id ({max(used) + 1}+) and be at most 24, got {num_blocks}")
    lengths = [_default_length(len(t), block_size) for t in tabs] if lengths is None else list(lengths)
    if len(lengths) != len(tabs):
        raise ValueError(f"give one length per request: {len(tabs)} requests, {len(lengths)} lengths")
    for name, t, n in zip(names, tabs, lengths):
        if not (len(t) - 1) * block_size < n <= len(t) * block_size:
            raise ValueError(f"{name} holds {n} tokens but has {len(t)} blocks of {block_size}: each block but "
                             f"the last must be full and the last must hold at least one token")

    # Layout, in slot units: columns for logical blocks, tables, the pool and the gathered keys.
    gap = 2.5
    x_logical, x_table = 0.0, block_size + 1.0
    x_pool = x_table + 1.0 + gap
    x_gather = x_pool + block_size + gap + 0.8
    widest = max(len(t) for t in tabs) * block_size
    # Logical rows: each request's blocks stacked, one empty row between requests.
    logical_row, row = {}, 0
    for r, t in enumerate(tabs):
        for i in range(len(t)):
            logical_row[r, i] = row
            row += 1
        row += 1
    total_rows = max(row - 1, num_blocks)
    fig, ax = _figure_and_axes(ax, figsize=(max(9.0, 0.42 * (x_gather + widest) + 1.0), 1.4 + 0.42 * total_rows))
    owner = {b: (r, i) for r, t in enumerate(tabs) for i, b in enumerate(t)}

    def block(x: float, y: float, r: int | None, i: int, *, label_slots: bool = True) -> None:
        """One block of ``block_size`` slots at (x, y): logical block i of request r, or free."""
        for s in range(block_size):
            pos = i * block_size + s
            filled = r is not None and pos < lengths[r]
            ax.add_patch(Rectangle((x + s, y), 0.94, 0.8, facecolor=REQUEST_COLORS[r] if filled else "white",
                                   edgecolor="#999999" if not filled else REQUEST_COLORS[r], linewidth=0.8))
            if filled and label_slots:
                ax.text(x + s + 0.47, y + 0.4, str(pos), ha="center", va="center", fontsize=8, color="white"
                        if REQUEST_COLORS[r] in (BLUE, GREEN) else "black")

    def arrow(start: tuple[float, float], end: tuple[float, float], color: str) -> None:
        ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="->", color=color, lw=1.2,
                                                               shrinkA=1, shrinkB=1))

    for r, (name, t) in enumerate(zip(names, tabs)):
        for i, b in enumerate(t):
            y = logical_row[r, i]
            block(x_logical, y, r, i)
            ax.text(x_logical - 0.2, y + 0.4, f"{name}, block {i}", ha="right", va="center", fontsize=FONT)
            ax.add_patch(Rectangle((x_table, y), 1.0, 0.8, facecolor="white", edgecolor=REQUEST_COLORS[r], lw=1.2))
            ax.text(x_table + 0.5, y + 0.4, str(b), ha="center", va="center", fontsize=FONT, fontweight="bold")
            arrow((x_table + 1.0, y + 0.4), (x_pool - 0.05, b + 0.4), REQUEST_COLORS[r])
    for b in range(num_blocks):
        r, i = owner.get(b, (None, 0))
        block(x_pool, b, r, i)
        ax.text(x_pool + block_size + 0.1, b + 0.4, str(b), ha="left", va="center", fontsize=8, color="#444444")
    # Gathered keys: each request's physical blocks read back in table order, the tail masked.
    for r, t in enumerate(tabs):
        y = logical_row[r, 0]
        ax.text(x_gather - 0.2, y + 0.4, names[r], ha="right", va="center", fontsize=FONT)
        for i, b in enumerate(t):
            left = x_gather + i * block_size
            ax.plot([left + 0.1, left + block_size - 0.16], [y + 1.0] * 2, color=REQUEST_COLORS[r], lw=1.5)
            ax.text(left + block_size / 2, y + 1.1, f"from block {b}", ha="center", va="top", fontsize=8,
                    color="#333333")
            for s in range(block_size):
                pos = i * block_size + s
                filled = pos < lengths[r]
                ax.add_patch(Rectangle((x_gather + pos, y), 0.94, 0.8,
                                       facecolor=REQUEST_COLORS[r] if filled else MASKED,
                                       hatch=None if filled else "////", edgecolor="white" if filled else "#777777",
                                       linewidth=0.8))
                ax.text(x_gather + pos + 0.47, y + 0.4, f"k{pos}" if filled else "×", ha="center", va="center",
                        fontsize=8, color=("white" if REQUEST_COLORS[r] in (BLUE, GREEN) else "black")
                        if filled else "#333333")
    top = -1.4
    arrow((x_pool + block_size + 0.8, top + 0.5), (x_gather - 0.6, top + 0.5), "#555555")
    ax.text((x_pool + block_size + x_gather) / 2 + 0.1, top + 0.2, "gather", ha="center", va="bottom",
            fontsize=8, color="#555555")
    for x, text in [(x_logical + block_size / 2, "logical blocks\n(token positions)"),
                    (x_table + 0.5, "block\ntable"),
                    (x_pool + block_size / 2, f"physical block pool\n({num_blocks} blocks × {block_size} slots)"),
                    (x_gather + widest / 2, "keys attention reads\n(gathered in table order)")]:
        ax.text(x, top + 0.5, text, ha="center", va="center", fontsize=FONT, fontweight="bold")
    ax.set_xlim(x_logical - 4.2, x_gather + widest + 0.5)
    ax.set_ylim(total_rows + 0.2, top - 0.3)
    ax.set_aspect("equal")
    ax.axis("off")
    handles = [Patch(color=REQUEST_COLORS[r], label=name) for r, name in enumerate(names)]
    handles += [Patch(facecolor="white", edgecolor="#999999", label="free / empty slot"),
                Patch(facecolor=MASKED, edgecolor="#777777", hatch="////", label="masked: past the request's end")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles), fontsize=FONT,
              frameon=False)
    ax.set_title(title or "Paged attention: a block table maps each request's logical blocks to physical ones")
    return fig


# --- 5. speculative decoding: one propose-and-verify step ----------------------------------------

MAX_SPEC_GUESSES = 12   # k: more columns than that stop being legible
MAX_SPEC_CONTEXT = 8    # context tokens drawn before the step (the rest is "...")
ACCEPTED, REJECTED, DISCARDED, TARGET = GREEN, VERMILLION, MASKED, BLUE


def speculative_step(context: Sequence[str], guesses: Sequence[str], target: Sequence[str], ax: Axes | None = None,
                     *, title: str | None = None) -> Figure:
    """One step of speculative decoding, as a grid: what the target is fed, what it predicts, what comes out.

    ``context`` is the text so far (its last token not yet in the KV cache),
    ``guesses`` the k proposed tokens and ``target`` the target model's argmax
    after each fed token: k + 1 predictions, one per position from the first
    guess's to one past the last. Guesses are kept while they equal the target's
    prediction for their position; the first mismatch is replaced by the
    target's token (a *correction*); if all k match, the target's last
    prediction is a free *bonus* token. Everything after a mismatch is discarded.
    """
    k = len(guesses)
    if not 1 <= k <= MAX_SPEC_GUESSES:
        raise ValueError(f"give 1 to {MAX_SPEC_GUESSES} guesses to stay legible, got {k}")
    if len(target) != k + 1:
        raise ValueError(f"target must hold k + 1 = {k + 1} predictions (one after each fed token), got {len(target)}")
    if not context:
        raise ValueError("context must hold at least one token: the last one is fed with the guesses")
    accepted = 0
    while accepted < k and guesses[accepted] == target[accepted]:
        accepted += 1
    shown = list(context[-MAX_SPEC_CONTEXT:])
    clipped = len(context) > len(shown)
    c = len(shown)  # column of the first guess; the last context token sits at column c - 1
    columns = c + k + 1
    longest = max(len(_cell_label(t)) for t in [*shown, *guesses, *target])
    width = max(0.75, 0.08 * longest + 0.25)
    fig, ax = _figure_and_axes(ax, figsize=(max(7.0, width * columns + 3.2), 3.4))

    def cell(col: int, row: int, text: str, color: str, *, edge: str | None = None, dark: bool = False) -> None:
        ax.add_patch(Rectangle((col * width, row), width * 0.94, 0.8, facecolor=color,
                               edgecolor=edge or color, linewidth=1.0))
        ax.text(col * width + width * 0.47, row + 0.4, _cell_label(text), ha="center", va="center", fontsize=8,
                color="white" if dark else "black")

    # Row 0: the context (in the cache), then the last token and the k guesses, fed in one forward pass.
    for i, t in enumerate(shown):
        fed = i == c - 1
        cell(i, 0, t, SKY if fed else "white", edge="#999999")
    for i, g in enumerate(guesses):
        color = ACCEPTED if i < accepted else REJECTED if i == accepted else DISCARDED
        cell(c + i, 0, g, color, dark=color in (ACCEPTED, REJECTED))
    # Row 1: the target's prediction for each position (after the token to its left).
    for i, t in enumerate(target):
        verified = i <= accepted
        cell(c + i, 1, t, "white" if verified else DISCARDED, edge=TARGET if verified else "#999999")
        mark = "" if i == k else "=" if i < accepted else "≠" if i == accepted else ""
        if mark:
            ax.text((c + i) * width + width * 0.47, 0.9, mark, ha="center", va="center", fontsize=FONT,
                    color=ACCEPTED if mark == "=" else REJECTED, fontweight="bold")
    # Row 2: the tokens this step emits: the kept guesses, then the target's own token.
    for i in range(accepted):
        cell(c + i, 2, guesses[i], ACCEPTED, dark=True)
    cell(c + accepted, 2, target[accepted], TARGET, dark=True)
    kind = "bonus" if accepted == k else "correction"
    ax.text((c + accepted) * width + width * 0.47, 2.95, kind, ha="center", va="top", fontsize=8, color=TARGET)
    if clipped:
        ax.text(-0.1, 0.4, "…", ha="right", va="center", fontsize=FONT)
    ax.set_yticks([0.4, 1.4, 2.4], ["fed to the target\n(one forward pass)", "target's argmax\nat each position",
                                    f"emitted: {accepted + 1} token{'s' if accepted else ''}"], fontsize=FONT)
    ax.set_xticks([(c - 1) * width + width * 0.47, (c + k / 2) * width],
                  ["last token", f"k = {k} guesses (+1 position)"], fontsize=8)
    ax.xaxis.tick_top()
    ax.set_xlim(-0.3, columns * width + 0.1)
    ax.set_ylim(3.1, -0.2)
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.legend(handles=[Patch(facecolor="white", edgecolor="#999999", label="context, already in the KV cache"),
                       Patch(color=SKY, label="last token (fed)"),
                       Patch(color=ACCEPTED, label="guess accepted"), Patch(color=REJECTED, label="guess rejected"),
                       Patch(color=DISCARDED, label="discarded (after a rejection)"),
                       Patch(color=TARGET, label="target's own token")],
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=FONT, frameon=False)
    ax.set_title(title or f"One speculative step: {accepted} of {k} guesses accepted, {accepted + 1} tokens emitted",
                 pad=18)
    return fig
