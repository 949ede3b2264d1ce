"""The block-map player: its frames are the engine's history, its HTML stands alone."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import pytest
from matplotlib.colors import to_hex

from enginelib.core.engine import Engine, EngineConfig, StepRecord
from enginelib.model.sampling import SamplingParams
from enginelib.viz import busiest_frame, request_color
from enginelib.viz.player import BlockMapPlayer


def run_tiny_engine(model, num_blocks: int = 10, block_size: int = 4, arrivals: dict | None = None,
                    max_tokens: int = 9) -> Engine:
    """Requests arriving over time (by default a few, in a pool small enough that some get preempted)."""
    from tests.conftest import tiny_tokenizer

    engine = Engine(model, tiny_tokenizer(model.cfg.vocab_size),
                    EngineConfig(num_blocks=num_blocks, block_size=block_size, record=True))
    arrivals = arrivals or {0: ["t1 t2 t3 t4 t5", "t6 t7"], 2: ["t3 t3 t3 t3 t3 t3 t3"], 4: ["t9 t8"]}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    step = 0
    while engine.has_unfinished_requests() or step <= max(arrivals):
        for prompt in arrivals.get(step, []):
            engine.add_request(prompt, params)
        engine.step()
        step += 1
    return engine


def player_data(player: BlockMapPlayer) -> dict:
    found = re.search(r'<script type="application/json" data-enginelib-frames>(.*?)</script>', player.html, re.S)
    assert found, "the frames are embedded as JSON"
    return json.loads(found.group(1))


@pytest.fixture
def engine(tiny) -> Engine:
    return run_tiny_engine(tiny)


def test_frames_are_the_engine_history(engine):
    history = engine.history
    assert any(r.preempted for r in history), "the workload should exercise preemption"
    data = player_data(BlockMapPlayer(history, title="tiny"))
    assert (data["num_blocks"], data["block_size"]) == (10, 4)
    assert len(data["frames"]) == len(history)
    for frame, record in zip(data["frames"], history):
        assert frame["step"] == record.step
        assert frame["block_tables"] == record.block_tables
        assert frame["num_cached"] == record.num_cached
        assert frame["states"] == record.states
        assert frame["scheduled"] == record.scheduled
        assert set(frame["prefill"]) == record.prefill and frame["preempted"] == list(record.preempted)
        assert frame["ref_counts"] == {str(b): n for b, n in enumerate(record.ref_counts)}
        assert frame["block_hashes"] == {str(b): h for b, h in record.block_hashes.items()}
    assert [r["id"] for r in data["requests"]] == ["0", "1", "2", "3"]


def test_the_first_picture_is_drawn_in_python(engine):
    """Without scripts (an untrusted notebook) the HTML already shows the busiest step."""
    history = engine.history
    player = BlockMapPlayer(history)
    start = busiest_frame(history)
    record = history[start]
    assert player.start == start and f'data-frame="{start}"' in player.html
    used = {b for t in record.block_tables.values() for b in t}
    assert len(used) == max(len({b for t in r.block_tables.values() for b in t}) for r in history)
    lines = re.findall(r"<span data-line>(.*?)</span>", player.html)
    assert lines == [f"req {rid}: [{', '.join(map(str, t))}]" for rid, t in sorted(record.block_tables.items())]
    assert len(re.findall(r'<g data-block="\d+"', player.html)) == record.num_blocks
    # a used block is filled in its request's colour, a free one is not
    rid = sorted(record.block_tables)[0]
    color = to_hex(request_color(rid))
    height = 36 * min(4, record.num_cached[rid]) / 4  # its first block (36 px), filled to its tokens
    assert f'data-role="fill" y="{36 - height:.1f}" width="36" height="{height:.1f}" fill="{color}"' in block_markup(
        player, record.block_tables[rid][0]), "a used block is filled in its request's colour"
    for free in set(range(record.num_blocks)) - used:
        assert 'height="0.0" fill="none"' in block_markup(player, free)
        assert f"block {free}: free" in block_markup(player, free)
    assert BlockMapPlayer(history, start=0).start == 0 and BlockMapPlayer(history, start=-1).start == len(history) - 1


def test_html_is_self_contained_and_ids_are_unique(engine):
    a, b = BlockMapPlayer(engine.history), BlockMapPlayer(engine.history)
    assert a.id != b.id and a._repr_html_() == a.html
    for player in (a, b):
        assert player.html.count(f'id="{player.id}"') == 1
        assert f'getElementById("{player.id}")' in player.html
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", player.html), "no network"
        assert "src=" not in player.html and "@import" not in player.html
        assert player.html.count("<script") == 2 and "</script>" not in player_data_raw(player)


def block_markup(player: BlockMapPlayer, block: int) -> str:
    return re.search(rf'<g data-block="{block}".*?</g>', player.html, re.S).group(0)


def player_data_raw(player: BlockMapPlayer) -> str:
    return player.html.split("data-enginelib-frames>", 1)[1].split("</script>", 1)[0]


def test_request_ids_cannot_break_out_of_the_json():
    bad = "</script><b>x"
    record = StepRecord(0, 0.0, {bad: 1}, frozenset({bad}), (), {bad: "running"}, {bad: [0]}, {bad: 1}, 2, 4)
    player = BlockMapPlayer([record])
    assert "</script><b>" not in player.html
    assert json.loads(player_data_raw(player))["frames"][0]["block_tables"] == {bad: [0]}


@dataclass(frozen=True)
class HashedRecord(StepRecord):
    """What a prefix-caching chapter may record: ref counts and hashes per block."""

    ref_counts: dict[int, int] = field(default_factory=dict)
    block_hashes: dict[int, int] = field(default_factory=dict)


def test_ref_counts_and_hashes_slot_in_when_recorded():
    record = HashedRecord(0, 0.0, {"0": 4, "1": 1}, frozenset({"0", "1"}), (), {"0": "running", "1": "running"},
                          {"0": [0, 1], "1": [0, 2]}, {"0": 6, "1": 5}, 4, 4,
                          ref_counts={0: 2, 1: 1, 2: 1}, block_hashes={0: 2 ** 60 + 5, 1: 7})
    player = BlockMapPlayer([record])
    frame = player_data(player)["frames"][0]
    assert frame["ref_counts"] == {"0": 2, "1": 1, "2": 1}
    assert frame["block_hashes"] == {"0": format(2 ** 60 + 5, "x"), "1": 7}
    shared = block_markup(player, 0)
    assert "req 0, logical block 0" in shared and "req 1, logical block 0" in shared  # both owners
    assert "ref count: 2" in shared and f"hash: {2 ** 60 + 5:x}" in shared


def test_clear_errors(tiny):
    from tests.conftest import tiny_tokenizer

    with pytest.raises(ValueError, match="record=True"):
        BlockMapPlayer([])
    unrecorded = Engine(tiny, tiny_tokenizer(tiny.cfg.vocab_size), EngineConfig(num_blocks=4, block_size=4))
    unrecorded.add_request("t1 t2", SamplingParams(temperature=0, max_tokens=2))
    unrecorded.step()
    with pytest.raises(ValueError, match=r"EngineConfig\(record=True\)"):
        BlockMapPlayer(unrecorded.history)
    with pytest.raises(TypeError, match="StepRecord"):
        BlockMapPlayer(["step 0"])
    record = StepRecord(0, 0.0, {}, frozenset(), (), {}, {}, {}, 4, 4)
    with pytest.raises(ValueError, match="outside the history"):
        BlockMapPlayer([record], start=3)
    with pytest.raises(ValueError, match="one pool"):
        BlockMapPlayer([record, StepRecord(1, 0.0, {}, frozenset(), (), {}, {}, {}, 8, 4)])


def run_shared_prefix_engine(model) -> Engine:
    """Requests that share an 8-token prefix (two blocks of 4), the later ones arriving while the first runs."""
    prefix = "t1 t2 t3 t4 t5 t6 t7 t8"
    return run_tiny_engine(model, 16, 4, {0: [prefix + " t9"], 2: [prefix + " t10 t11", prefix + " t12"]},
                           max_tokens=5)


def test_shared_and_cached_free_blocks_are_marked(tiny):
    engine = run_shared_prefix_engine(tiny)
    history = engine.history
    # a step where the three requests hold the prefix's two blocks at once
    at = next(i for i, r in enumerate(history) if r.ref_counts and max(r.ref_counts) == 3)
    record = history[at]
    shared = sorted(b for b, n in enumerate(record.ref_counts) if n == 3)
    assert len(shared) == 2 and all(t[:2] == shared for t in record.block_tables.values())
    player = BlockMapPlayer(history, start=at)
    for b in shared:
        markup = block_markup(player, b)
        assert 'data-role="edge"' in markup and 'stroke="#222222" stroke-width="4.5"' in markup
        assert re.search(r'data-role="badge"[^>]*display="inline"', markup)
        assert re.search(r'data-role="badge-label"[^>]*display="inline">×3</text>', markup)
        assert f"block {b}: shared by 3 requests" in markup and "ref count: 3" in markup
        assert f"hash: {record.block_hashes[b]}" in markup
    private = next(b for t in record.block_tables.values() for b in t if record.ref_counts[b] == 1)
    markup = block_markup(player, private)
    assert 'stroke-width="2.5"' in markup and re.search(r'data-role="badge"[^>]*display="none"', markup)
    assert "2 shared" in re.search(r'data-role="step"[^>]*>(.*?)</span>', player.html).group(1)

    # after the end: no owner, but the blocks keep their hashes (free but cached), and the rest are plain free
    last = history[-1]
    assert not last.block_tables and set(shared) <= set(last.block_hashes)
    player = BlockMapPlayer(history, start=len(history) - 1)
    for b in range(last.num_blocks):
        markup = block_markup(player, b)
        assert 'height="0.0" fill="none"' in markup  # no fill bar: a free block, cached or not
        assert re.search(r'data-role="badge"[^>]*display="none"', markup)
        if b in last.block_hashes:
            assert 'data-role="bg"' in markup and 'fill="#cfcfcf"' in markup and 'stroke-dasharray="4 2"' in markup
            assert f"block {b}: free, but cached" in markup and "ref count: 0" in markup
        else:
            assert 'fill="#cfcfcf"' not in markup and 'stroke-dasharray="none"' in markup
            assert f"block {b}: free\n" in html_unescape(markup)
    label = re.search(r'data-role="step"[^>]*>(.*?)</span>', player.html).group(1)
    assert f"{len(last.block_hashes)} free but cached" in label
    # the legend explains both marks, and the script draws them for every other step
    assert "shared: held by" in player.html and "free but cached: no request holds it" in player.html
    assert '"#cfcfcf"' in player.html and "badge-label" in player.html and "%CACHED" not in player.html


def html_unescape(text: str) -> str:
    import html

    return html.unescape(text)
