"""viz draws what the data says: hand-made runs, no model, Agg backend."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from enginelib.baselines import Generation, StaticBatchRun  # noqa: E402
from enginelib.viz import STATE_LABELS, Segment, plot_padding, plot_static_timeline, static_timeline_segments  # noqa: E402


def make_run(lengths: list[int], step_times: list[float] | None = None) -> StaticBatchRun:
    """A batch whose requests produced ``lengths`` tokens; it ran max(lengths) steps."""
    steps = max(lengths)
    gens = [Generation([1, 2, 3], list(range(n)), "length") for n in lengths]
    return StaticBatchRun(gens, step_times or [0.1 * (s + 1) for s in range(steps)], padded_prompt_len=3)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def bars_by_state(fig: Figure) -> dict[str, list]:
    """The rectangles drawn for each state, found through the legend labels of the bar groups."""
    ax = fig.axes[0]
    label_to_state = {label: state for state, label in STATE_LABELS.items()}
    return {label_to_state[c.get_label()]: list(c.patches) for c in ax.containers}


def test_segments_of_one_batch_in_steps():
    segs = static_timeline_segments(make_run([3, 1, 2]))
    assert segs == [
        Segment(0, "prefill", 0, 1), Segment(0, "decode", 1, 2),
        Segment(1, "prefill", 0, 1), Segment(1, "idle", 1, 2),
        Segment(2, "prefill", 0, 1), Segment(2, "decode", 1, 1), Segment(2, "idle", 2, 1),
    ]


def test_segments_of_consecutive_batches_wait_for_the_previous_batch():
    segs = static_timeline_segments([make_run([2, 4]), make_run([1, 3])])
    waiting = [s for s in segs if s.state == "waiting"]
    assert waiting == [Segment(2, "waiting", 0, 4), Segment(3, "waiting", 0, 4)]
    # every row is busy (in some state) from 0 to the end of its batch, with no gaps or overlaps
    for row, end in [(0, 4), (1, 4), (2, 7), (3, 7)]:
        mine = sorted((s for s in segs if s.row == row), key=lambda s: s.start)
        assert mine[0].start == 0 and mine[-1].start + mine[-1].width == end
        assert all(a.start + a.width == b.start for a, b in zip(mine, mine[1:]))


def test_segments_in_seconds_follow_step_times():
    first = make_run([2, 1], step_times=[0.5, 0.6])
    second = make_run([1], step_times=[0.25])
    segs = static_timeline_segments([first, second], unit="time")
    assert Segment(0, "prefill", 0.0, 0.5) in segs
    assert [s for s in segs if s.row == 0 and s.state == "decode"][0].width == pytest.approx(0.1)
    assert [s for s in segs if s.row == 2 and s.state == "waiting"] == [Segment(2, "waiting", 0.0, 0.6)]
    assert [s for s in segs if s.row == 2 and s.state == "prefill"][0].width == pytest.approx(0.25)


def test_segments_reject_a_request_longer_than_its_batch():
    run = make_run([2, 2])
    run.generations[0].token_ids.append(99)
    with pytest.raises(ValueError, match="ran 2 steps"):
        static_timeline_segments(run)
    with pytest.raises(ValueError, match="unit"):
        static_timeline_segments(make_run([1]), unit="tokens")


def test_timeline_draws_one_bar_per_segment_and_one_row_per_request():
    runs = [make_run([3, 1, 2]), make_run([2, 2, 1])]
    fig = plot_static_timeline(runs)
    assert isinstance(fig, Figure)
    bars = bars_by_state(fig)
    assert {state: len(b) for state, b in bars.items()} == {"waiting": 3, "prefill": 6, "decode": 4, "idle": 3}
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"req {i}" for i in range(6)]
    assert ax.get_xlim() == (0, 5)
    assert ax.get_xlabel() == "engine step"
    assert len(ax.get_legend().get_texts()) == 4
    # request 1 finished after its first token: its idle bar covers steps 1..3
    idle = [(p.get_y() + p.get_height() / 2, p.get_x(), p.get_width()) for p in bars["idle"]]
    assert (1, 1, 2) in idle


def test_timeline_without_stragglers_has_no_idle_bars():
    fig = plot_static_timeline(make_run([4, 4]))
    assert set(bars_by_state(fig)) == {"prefill", "decode"}
    assert len(fig.axes[0].get_legend().get_texts()) == 2


def test_timeline_draws_on_given_axes_in_seconds():
    fig, (left, right) = plt.subplots(1, 2)
    out = plot_static_timeline(make_run([2, 1]), ax=right, unit="time")
    assert out is fig
    assert right.get_xlabel() == "time (s)" and not left.has_data()


def test_padding_grid_marks_real_tokens_and_pads():
    fig = plot_padding([2, 5, 3], labels=[["a", "b"], list("abcde"), list("xyz")])
    ax = fig.axes[0]
    grid = ax.images[0].get_array()
    assert grid.shape == (3, 5)
    assert grid.sum() == 2 + 5 + 3
    assert grid[0].tolist() == [0, 0, 0, 1, 1]  # left-padded: real tokens at the end
    assert grid[:, -1].tolist() == [1, 1, 1]  # all prompts end in the last column
    assert len(ax.texts) == 10


def test_padding_rejects_labels_that_do_not_fit():
    with pytest.raises(ValueError, match="one string per token"):
        plot_padding([2, 3], labels=[["a"], ["a", "b", "c"]])
    with pytest.raises(ValueError, match="at least one"):
        plot_padding([])


# --- the engine's pictures: hand-made StepRecords, then a real (tiny) engine -------------

from enginelib.core.engine import Engine, EngineConfig, StepRecord  # noqa: E402
from enginelib.model.sampling import SamplingParams  # noqa: E402
from enginelib.viz import (  # noqa: E402
    EngineExplorer,
    busiest_frame,
    engine_timeline_segments,
    ink_for,
    plot_block_map,
    plot_engine_step,
    plot_engine_timeline,
    request_color,
)


def record(step, scheduled, prefill, states, tables, cached, preempted=()) -> StepRecord:
    return StepRecord(step, 0.0, scheduled, frozenset(prefill), tuple(preempted), states, tables, cached,
                      num_blocks=6, block_size=4)


HISTORY = [
    record(0, {"0": 5}, {"0"}, {"0": "running", "1": "waiting"}, {"0": [2, 4]}, {"0": 5}),
    record(1, {"0": 1, "1": 3}, {"1"}, {"0": "running", "1": "running"}, {"0": [2, 4], "1": [0]}, {"0": 6, "1": 3}),
    record(2, {"0": 1}, set(), {"0": "running", "1": "preempted"}, {"0": [2, 4]}, {"0": 7}, preempted=["1"]),
    record(3, {"1": 4}, {"1"}, {"0": "finished", "1": "running"}, {"1": [1]}, {"1": 4}),
]


def test_engine_timeline_segments_follow_each_request_state():
    segments, ids = engine_timeline_segments(HISTORY)
    assert ids == ["0", "1"]
    by_row = {r: [(s.start, s.state) for s in segments if s.row == r] for r in (0, 1)}
    assert by_row[0] == [(0, "prefill"), (1, "decode"), (2, "decode")]
    assert by_row[1] == [(0, "waiting"), (1, "prefill"), (2, "preempted"), (3, "prefill")]


def test_block_map_fills_each_block_to_its_tokens():
    fig = plot_block_map(HISTORY[1])
    ax = fig.axes[0]
    # one background square per block, plus an outline and a fill per used block
    assert len(ax.patches) == 6 + 2 * 3
    fills = sorted(round(p.get_height() / 0.94, 2) for p in ax.patches if p.get_facecolor()[:3] != (0.0, 0.0, 0.0)
                   and p.get_edgecolor()[3] == 0)
    assert fills == [0.5, 0.75, 1.0]  # request 0: 6 tokens -> 4 + 2 of 4 slots; request 1: 3 of 4
    assert "req 0 (6 tok): [2, 4]" in fig.axes[1].texts[0].get_text()  # the tables, beside the grid
    fig, (left, right) = plt.subplots(1, 2)
    plot_block_map(HISTORY[1], ax=left)  # on a caller's axes: written right of the grid
    assert "req 1 (3 tok): [0]" in left.texts[-1].get_text() and not right.has_data()


def test_block_map_has_a_legend_and_legible_labels():
    fig = plot_block_map(HISTORY[1])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["req 0", "req 1", "free"]
    labels = {t.get_text(): t for t in ax.texts}
    assert sorted(labels, key=int) == [str(b) for b in range(6)]
    assert all(t.get_fontsize() >= 8 for t in ax.texts)
    # block 2 is request 0's full block: its id is written in the ink that reads on that colour;
    # block 4 is half full (the id sits on the colour), block 1 is free (dark on light grey)
    assert labels["2"].get_color() == ink_for(request_color("0"))
    assert labels["1"].get_color() == "#222222"
    assert ink_for("#1f77b4") == "#ffffff" and ink_for("#eeeeee") == "#222222"


def test_block_tables_are_listed_in_full_and_wrapped():
    table = list(range(40))
    record = StepRecord(0, 0.0, {"0": 1}, frozenset(), (), {"0": "running"}, {"0": table}, {"0": 160},
                        num_blocks=48, block_size=4)
    text = plot_block_map(record).axes[1].texts[0].get_text()
    assert "".join(text.split()).count(",") == len(table) - 1  # every block id is there
    assert max(len(line) for line in text.splitlines()) <= 44


def test_the_still_of_a_step_marks_it_on_the_timeline():
    index = busiest_frame(HISTORY)
    assert index == 1  # steps 1 (3 blocks in use) is the busiest
    fig = plot_engine_step(HISTORY, index)
    top, tables, bottom = fig.axes
    assert "req 1 (3 tok): [0]" in tables.texts[0].get_text()
    assert top.get_title().startswith("step 1:")
    assert "step 1" in bottom.get_xlabel()


def test_engine_timeline_needs_a_recorded_history():
    with pytest.raises(ValueError, match="record=True"):
        plot_engine_timeline([])
    fig = plot_engine_timeline(HISTORY)
    assert len(fig.axes) == 2


def test_the_explorer_drives_an_engine_and_leaves_a_still(tiny):
    import base64

    from tests.conftest import tiny_tokenizer

    engine = Engine(tiny, tiny_tokenizer(tiny.cfg.vocab_size), EngineConfig(num_blocks=8, block_size=4, record=True))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    explorer = EngineExplorer(engine, params)
    assert "image/png" not in explorer._repr_mimebundle_()  # nothing to draw yet
    explorer.add("t1 t2 t3")
    explorer.add("t4 t5")
    explorer.run_step()
    explorer.run_step()
    assert explorer.slider.max == 1 and explorer.slider.value == 1
    explorer.abort(explorer.victim.options[0])
    assert len(explorer.victim.options) == 1
    explorer.add(" ".join(["t1"] * 40))  # more than the pool: refused, engine unharmed
    assert "refused" in explorer.message.value
    while engine.has_unfinished_requests():
        explorer.run_step()
    assert engine.pool.num_used == 0
    # Displayed again, it starts at the busiest step, and its output carries a still of that step.
    again = EngineExplorer(engine, params)
    assert again.slider.value == busiest_frame(engine.history) > 0
    bundle = again._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == again.widget.model_id
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    assert f"step {again.slider.value}" in bundle["text/plain"]


def test_explorer_is_importable_from_its_module_and_from_viz():
    from enginelib import viz
    from enginelib.viz import explorer

    assert viz.EngineExplorer is explorer.EngineExplorer
    with pytest.raises(AttributeError):
        viz.animate_block_map  # replaced by enginelib.viz.player.BlockMapPlayer


# --- chapter 10: the step mix, token gaps and the budget's trade-off ------------------------

from enginelib.core.scheduler import SchedulerConfig  # noqa: E402
from enginelib.viz import plot_budget_tradeoff, plot_step_mix, plot_token_gaps, step_mix, token_gaps  # noqa: E402


def chunked_run(tiny_dt, budget: int = 8):
    """Two short requests decoding when a 30-token prompt arrives; prefills chunked under ``budget``."""
    from tests.conftest import tiny_tokenizer

    config = EngineConfig(num_blocks=32, block_size=4, record=True,
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget))
    engine = Engine(tiny_dt, tiny_tokenizer(tiny_dt.cfg.vocab_size), config)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    short = [engine.add_request([1, 2, 3], params), engine.add_request([4, 5], params)]
    engine.step()
    engine.step()
    long = engine.add_request(list(range(10, 40)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine, short, long


def test_step_mix_counts_every_prefill_and_decode_token(tiny_dt):
    engine, short, long = chunked_run(tiny_dt)
    mix = step_mix(engine.history)
    assert mix.steps == list(range(engine.steps))
    assert max(mix.total) == 8 and all(t <= 8 for t in mix.total)  # the budget holds in every step
    assert sum(mix.prefill) == 3 + 2 + 30  # every prompt token is computed once, in some step
    outputs = [engine.request(rid).output_token_ids for rid in (*short, long)]
    assert sum(mix.decode) == sum(len(o) - 1 for o in outputs)  # every token after the first is one decode
    # The long prompt took 30 / (8 - 2 decodes) = 5 steps, each with both short requests decoding beside it.
    chunks = [r.scheduled[long] for r in engine.history if long in r.prefill]
    assert chunks == [6] * 5
    assert [mix.decode[r.step] for r in engine.history if long in r.prefill] == [2] * 5
    with pytest.raises(ValueError, match="record=True"):
        step_mix([])


def test_step_mix_plot_stacks_prefill_on_decode_under_the_budget_line(tiny_dt):
    engine, _, _ = chunked_run(tiny_dt)
    mix = step_mix(engine.history)
    fig = plot_step_mix(engine.history, budget=8)
    ax = fig.axes[0]
    decode, prefill = ax.containers
    assert [p.get_height() for p in decode] == mix.decode
    assert [p.get_height() for p in prefill] == mix.prefill
    assert [p.get_y() for p in prefill] == mix.decode  # prefill sits on top of the decodes
    budget_lines = [line for line in ax.lines if line.get_label().startswith("token budget")]
    assert len(budget_lines) == 1 and list(budget_lines[0].get_ydata()) == [8, 8]
    assert len(ax.get_legend().get_texts()) == 3
    assert not [line for line in plot_step_mix(engine.history).axes[0].lines]  # no budget, no line
    with pytest.raises(ValueError, match="positive"):
        plot_step_mix(engine.history, budget=0)


def test_token_gaps_follow_the_token_times():
    times = {"0": [1.0, 1.5, 1.75], "1": [1.25], "2": [2.0, 4.0]}
    gaps = token_gaps(times)
    assert set(gaps) == {"0", "2"}  # one token: no gap
    assert gaps["0"] == ([0.5, 0.75], [0.5, 0.25])
    assert gaps["2"] == ([3.0], [2.0])
    assert token_gaps(times, start=0.0)["2"] == ([4.0], [2.0])
    with pytest.raises(ValueError, match="backwards"):
        token_gaps({"0": [2.0, 1.0]})
    with pytest.raises(ValueError, match="no token times"):
        token_gaps({"0": []})


def test_token_gap_plot_draws_one_line_per_request_in_ms_and_the_marks(tiny_dt):
    engine, short, long = chunked_run(tiny_dt)
    times = {rid: engine.request(rid).metrics.token_times for rid in short}
    arrived = engine.request(long).metrics.arrival_time
    fig = plot_token_gaps(times, marks={"long prompt arrives": arrived})
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.lines}
    assert set(lines) == {f"req {rid}" for rid in short} | {"long prompt arrives"}
    first = min(t[0] for t in times.values())
    for rid in short:
        t = times[rid]
        gaps_ms = [1e3 * (b - a) for a, b in zip(t, t[1:])]
        # a step per gap, from the token before to the token it waited for
        assert list(lines[f"req {rid}"].get_ydata()) == pytest.approx([*gaps_ms, gaps_ms[-1]])
        assert list(lines[f"req {rid}"].get_xdata()) == pytest.approx([x - first for x in t])
        assert lines[f"req {rid}"].get_drawstyle() == "steps-post"
    widths = [lines[f"req {rid}"].get_linewidth() for rid in short]
    assert widths == sorted(widths, reverse=True) and widths[-1] >= 1  # coinciding lines stay visible
    assert list(lines["long prompt arrives"].get_xdata()) == pytest.approx([arrived - first] * 2)
    assert ax.get_ylim()[0] == 0


def test_budget_tradeoff_plots_one_labelled_point_per_budget():
    fig = plot_budget_tradeoff([256, 32, 64], ttft=[1.0, 3.0, 2.0], itl_p99=[0.5, 0.1, 0.2], unchunked=(0.9, 1.2))
    ax = fig.axes[0]
    curve, alone = ax.lines
    assert list(curve.get_xdata()) == pytest.approx([100, 200, 500])  # in budget order, in ms
    assert list(curve.get_ydata()) == [3.0, 2.0, 1.0]
    assert [t.get_text() for t in ax.texts] == ["32", "64", "256"]
    assert list(alone.get_xdata()) == pytest.approx([1200]) and list(alone.get_ydata()) == [0.9]
    assert ax.get_xlim()[1] > 1200 and ax.get_ylim() == pytest.approx((0, 3.0 * 1.12))  # labels stay inside
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["chunked prefill, by token budget", "no chunking"]
    with pytest.raises(ValueError, match="one ttft and one itl_p99 per budget"):
        plot_budget_tradeoff([32, 64], ttft=[1.0], itl_p99=[0.1, 0.2])
