"""diagrams draw what they say, label it, and refuse impossible pictures: no model, Agg backend."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from enginelib.viz.diagrams import (  # noqa: E402
    MASKED,
    READ,
    T4_FP16,
    T4_FP32,
    WRITTEN,
    Roof,
    arithmetic_intensity,
    causal_attention,
    kv_cache_growth,
    paged_attention_flow,
    prefill_vs_decode,
)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def texts(fig: Figure) -> list[str]:
    """Every string drawn on the figure's axes: cell texts, tick labels, legend entries, titles."""
    out = []
    for ax in fig.axes:
        out += [t.get_text() for t in ax.texts]
        out += [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        if ax.get_legend():
            out += [t.get_text() for t in ax.get_legend().get_texts()]
    return out


def cells(ax, color: str) -> list[Rectangle]:
    return [p for p in ax.patches if isinstance(p, Rectangle)
            and matplotlib.colors.same_color(p.get_facecolor(), color)]


def test_causal_attention_masks_the_upper_triangle_and_labels_the_tokens():
    fig = causal_attention(["The", " cat", " sat"])
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["The", "␣cat", "␣sat"]
    assert sum(t.get_text() == "−∞" for t in ax.texts) == 3  # (0,1), (0,2), (1,2)
    assert any("masked" in s for s in texts(fig)) and any("may attend" in s for s in texts(fig))


def test_causal_attention_with_weights_writes_them_and_adds_a_colorbar():
    w = np.array([[1.0, 0, 0], [0.25, 0.75, 0], [0.2, 0.3, 0.5]])
    fig = causal_attention(3, w)
    assert len(fig.axes) == 2  # the matrix and its colorbar
    assert {"0.75", "0.50", "1.00"} <= set(texts(fig))


@pytest.mark.parametrize("tokens, weights", [
    ([], None),
    (["x"] * 30, None),
    (3, np.ones((2, 2))),                                    # wrong shape
    (2, np.array([[0.5, 0.5], [0.5, 0.5]])),                 # sees the future
    (2, np.array([[1.0, 0.0], [0.4, 0.4]])),                 # a row not summing to 1
])
def test_causal_attention_rejects_bad_input(tokens, weights):
    with pytest.raises(ValueError):
        causal_attention(tokens, weights)


def test_kv_cache_growth_writes_the_prompt_then_one_slot_per_step():
    fig = kv_cache_growth(3, 2)
    ax = fig.axes[0]
    # prefill writes 3; each decode step writes 1: 5 written cells in all
    assert len(cells(ax, WRITTEN)) == 3 + 2
    # decode 1 reads 3 earlier slots, decode 2 reads 4
    assert len(cells(ax, READ)) == 3 + 4
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["prefill", "decode 1", "decode 2"]
    notes = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    assert notes[2] == "computes K/V of 1 token, reads 4 from the cache"
    assert "K/V read from the cache" in texts(fig)


def test_kv_cache_growth_labels_slots_with_tokens():
    fig = kv_cache_growth(2, 1, tokens=["Hi", " there", "!"])
    assert "␣there" in texts(fig) and "!" in texts(fig)


@pytest.mark.parametrize("kwargs", [dict(prompt_len=0), dict(decode_steps=-1), dict(prompt_len=30, decode_steps=5),
                                    dict(prompt_len=2, decode_steps=1, tokens=["a"])])
def test_kv_cache_growth_rejects_bad_input(kwargs):
    with pytest.raises(ValueError):
        kv_cache_growth(**kwargs)


def test_arithmetic_intensity_is_tokens_per_byte_of_weights_without_a_cache():
    # 2 FLOPs per weight per token, each weight read once: 2 * tokens / bytes_per_number.
    assert arithmetic_intensity(1, 1000, 2) == 1.0
    assert arithmetic_intensity(128, 1000, 2) == 128.0
    # reading a cache lowers it: 8 tokens reading 100 cached K/V numbers each (plus their own)
    with_cache = arithmetic_intensity(8, 1000, 2, kv_values_per_token=10, context=99)
    assert with_cache == pytest.approx(2 * 1000 * 8 / (2 * (1000 + 8 * 100 * 10)))
    with pytest.raises(ValueError):
        arithmetic_intensity(0, 1000, 2)


def test_t4_ridges_follow_the_datasheet():
    assert T4_FP16.ridge == pytest.approx(65e12 / 320e9)
    assert T4_FP32.ridge == pytest.approx(8.1e12 / 320e9)
    assert "spec" in T4_FP16.name and "spec" in T4_FP32.name


def test_prefill_vs_decode_draws_every_roof_and_labels_every_shape():
    fig = prefill_vs_decode(50e9, 10e9, num_params=1000, prompt_lengths=(16, 256), batch_sizes=(1, 32))
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(s.startswith("this machine (measured)") and "ridge 5 FLOP/byte" in s for s in legend)
    assert any(s.startswith(T4_FP16.name) for s in legend) and any(s.startswith(T4_FP32.name) for s in legend)
    # the shapes are annotated on this machine's roof and on the T4 float16 one
    drawn = texts(fig)
    for label in ("prefill P=16", "prefill P=256", "decode B=1", "decode B=32"):
        assert drawn.count(label) == 2
    # a marker sits on its roof: decode B=1 in float32 on this machine is at 0.5 FLOP/byte, 5 GFLOP/s
    ys = {tuple(np.round(line.get_xydata()[0], 3)) for line in fig.axes[0].lines if len(line.get_xydata()) == 1}
    assert (0.5, 5e9) in ys


@pytest.mark.parametrize("kwargs", [dict(peak_flops=0.0, bandwidth=1e9), dict(peak_flops=1e9, bandwidth=-1.0),
                                    dict(peak_flops=1e9, bandwidth=1e9, prompt_lengths=()),
                                    dict(peak_flops=1e9, bandwidth=1e9, batch_sizes=(0,)),
                                    dict(peak_flops=1e9, bandwidth=1e9, roofs=[Roof("r", 1, 1, 2)] * 5)])
def test_prefill_vs_decode_rejects_bad_input(kwargs):
    with pytest.raises(ValueError):
        prefill_vs_decode(num_params=1000, **kwargs)


def test_paged_attention_flow_default_shows_tables_pool_and_gathered_keys():
    fig = paged_attention_flow()
    drawn = texts(fig)
    headers = ("logical blocks\n(token positions)", "block\ntable", "keys attention reads\n(gathered in table order)")
    assert all(header in drawn for header in headers)
    assert "physical block pool\n(8 blocks × 4 slots)" in drawn
    # the table entries, and one "from block b" per logical block
    assert [s for s in drawn if s.startswith("from block")] == [f"from block {b}" for b in (5, 1, 7, 2, 6)]
    # req 0 holds 11 tokens (k0..k10), req 1 holds 7 (k0..k6); the last slot of each is masked
    assert drawn.count("k10") == 1 and drawn.count("k6") == 2 and drawn.count("×") == 2
    assert {"req 0", "req 1", "masked: past the request's end"} <= set(drawn)


def test_paged_attention_flow_takes_real_tables_and_lengths():
    fig = paged_attention_flow(2, [[3, 0], [1]], lengths=[3, 2], num_blocks=6)
    drawn = texts(fig)
    assert "physical block pool\n(6 blocks × 2 slots)" in drawn
    assert drawn.count("×") == 1  # request 0's last block is half full; request 1's only block is full
    assert any(matplotlib.colors.same_color(p.get_facecolor(), MASKED) for p in fig.axes[0].patches)


@pytest.mark.parametrize("kwargs", [
    dict(block_size=0), dict(block_size=17),
    dict(tables={"a": [0, 1], "b": [1]}),                    # block 1 owned twice
    dict(tables={"a": [-1]}),
    dict(tables={"a": []}),
    dict(tables=[[0], [1], [2], [3], [4]]),                  # too many requests
    dict(tables={"a": [0, 1]}, lengths=[4]),                 # the last block would be empty
    dict(tables={"a": [0, 1]}, lengths=[9]),                 # more tokens than slots
    dict(tables={"a": [0, 1]}, lengths=[5, 5]),              # one length per request
    dict(tables={"a": [0, 5]}, num_blocks=4),                # block 5 is outside the pool
])
def test_paged_attention_flow_rejects_bad_input(kwargs):
    with pytest.raises(ValueError):
        paged_attention_flow(**kwargs)


def test_speculative_step_keeps_the_agreeing_prefix_then_the_targets_token():
    from enginelib.viz.diagrams import ACCEPTED, DISCARDED, REJECTED, TARGET, speculative_step

    fig = speculative_step(["The", " cat"], [" sat", " on", " a", " mat"], [" sat", " on", " the", " mat", "."])
    ax = fig.axes[0]
    # two guesses kept (drawn fed and emitted), the third rejected, the fourth discarded with its prediction
    assert len(cells(ax, ACCEPTED)) == 2 + 2
    assert len(cells(ax, REJECTED)) == 1
    assert len(cells(ax, DISCARDED)) == 1 + 2
    emitted = [t.get_text() for t in ax.texts if abs(t.get_position()[1] - 2.4) < 1e-9]
    assert emitted == ["␣sat", "␣on", "␣the"]
    assert len(cells(ax, TARGET)) == 1 and "correction" in texts(fig) and "bonus" not in texts(fig)
    assert "emitted: 3 tokens" in texts(fig) and "2 of 4 guesses accepted" in ax.get_title()


def test_speculative_step_all_accepted_earns_a_bonus_token():
    from enginelib.viz.diagrams import speculative_step

    fig = speculative_step(["a"], ["b", "c"], ["b", "c", "d"])
    assert "bonus" in texts(fig) and "emitted: 3 tokens" in texts(fig)
    fig = speculative_step(["a"], ["x"], ["b", "c"])
    assert "correction" in texts(fig) and "emitted: 1 token" in texts(fig)


@pytest.mark.parametrize("context, guesses, target", [
    (["a"], [], ["b"]),                    # no guesses
    (["a"], ["b"] * 13, ["b"] * 14),       # too many to draw
    (["a"], ["b", "c"], ["b", "c"]),       # target needs k + 1 predictions
    ([], ["b"], ["b", "c"]),               # no context
])
def test_speculative_step_rejects_bad_input(context, guesses, target):
    from enginelib.viz.diagrams import speculative_step

    with pytest.raises(ValueError):
        speculative_step(context, guesses, target)
