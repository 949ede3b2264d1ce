"""The pictures and widgets: matplotlib figures of timelines and block maps, the block-map player
(HTML, works without a kernel), the engine explorer (a widget) and the chapters' diagrams."""
from enginelib.viz import diagrams
from enginelib.viz.explorer import EngineExplorer
from enginelib.viz.figures import (
    FREE_COLOR,
    STATE_COLORS,
    STATE_LABELS,
    Segment,
    StepMix,
    busiest_frame,
    engine_timeline_segments,
    ink_for,
    plot_block_map,
    plot_budget_tradeoff,
    plot_engine_step,
    plot_engine_timeline,
    plot_padding,
    plot_static_timeline,
    plot_step_mix,
    plot_token_gaps,
    request_color,
    request_state,
    sort_ids,
    static_timeline_segments,
    step_mix,
    token_gaps,
)
from enginelib.viz.player import BlockMapPlayer
from enginelib.viz.source import show_source

__all__ = [
    "FREE_COLOR", "STATE_COLORS", "STATE_LABELS", "BlockMapPlayer", "EngineExplorer", "Segment", "StepMix",
    "busiest_frame", "diagrams", "engine_timeline_segments", "ink_for", "plot_block_map", "plot_budget_tradeoff",
    "plot_engine_step", "plot_engine_timeline", "plot_padding", "plot_static_timeline", "plot_step_mix",
    "plot_token_gaps", "request_color", "request_state", "show_source", "sort_ids", "static_timeline_segments",
    "step_mix", "token_gaps",
]
