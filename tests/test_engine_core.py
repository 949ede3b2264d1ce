"""The engine core in its own process (``EngineCoreClient``): the same answers as the offline engine, refused
prompts that never reach the core, aborts that free every block, and a dead core that every caller hears of."""
from __future__ import annotations

import asyncio
import functools
import time

import pytest

from enginelib import LLM, Engine, EngineConfig, SamplingParams
from enginelib.serve.async_engine import AsyncEngine
from enginelib.serve.cli import build_engine, parse_args
from enginelib.serve.engine_client import EngineClient, EngineDead, EngineOverloaded
from enginelib.serve.engine_core import EngineCoreClient

PROMPTS = ["The capital of France is", "Water boils at", "My favourite colour is", "Once upon a time"]


def _core(*flags: str, max_waiting: int | None = None) -> EngineCoreClient:
    return EngineCoreClient(functools.partial(build_engine, parse_args(["--threads", "1", *flags])),
                            max_waiting=max_waiting, threads=1)


@pytest.fixture(scope="module")
def core():
    """Two seats, two waiting places beyond them: the queue limit is easy to reach."""
    client = _core("--num-blocks", "64", "--max-num-seqs", "2", max_waiting=2)
    yield client
    client.shutdown()
    assert not client.process.is_alive()


async def _text(core: EngineCoreClient, prompt: str, params: SamplingParams) -> str:
    return "".join([d.text async for d in core.generate(prompt, params)])


def _idle(core: EngineCoreClient, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while (core.stats.pool.used or core.stats.running) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert core.stats.pool.used == 0 and core.stats.running == 0


def test_streams_equal_offline(core, real):
    params = SamplingParams(temperature=0, max_tokens=12, stop=[" the"])

    async def main():
        return await asyncio.gather(*(_text(core, p, params) for p in PROMPTS))
    assert asyncio.run(main()) == [o.outputs[0].text for o in LLM.from_model(*real).generate(PROMPTS, params)]
    _idle(core)


def test_the_thread_and_the_process_are_both_engine_clients(core, real):
    """The app asks only for EngineClient's members, whichever engine it is given; idle, neither is overloaded."""
    thread = AsyncEngine(Engine(*real, EngineConfig(num_blocks=16)), max_waiting=0, threads=1)
    try:
        for client in (core, thread):
            assert isinstance(client, EngineClient) and client.overloaded() is None, type(client).__name__
    finally:
        thread.shutdown()


def test_a_refused_prompt_never_reaches_the_core(core, monkeypatch):
    sent = []
    monkeypatch.setattr(core, "_send", sent.append)

    async def main():
        with pytest.raises(ValueError, match="context"):
            await core.add_request("word " * 9000, SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="vocabulary"):
            await core.add_request([10**9], SamplingParams(max_tokens=4))
    asyncio.run(main())
    assert sent == []


def test_abort_and_the_queue_limit_across_processes(core):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        running = [await core.add_request(p, long) for p in PROMPTS[:2]]
        for stream in running:
            await stream.__anext__()                          # admitted: the two seats are taken
        waiting = [await core.add_request(p, long) for p in PROMPTS[2:]]
        with pytest.raises(EngineOverloaded, match="retry later"):
            await core.add_request(PROMPTS[0], long)
        running[0].close()                                    # its client left: its seat goes to a waiting one
        delta = await asyncio.wait_for(waiting[0].__anext__(), 60)
        assert delta.text or delta.token_ids
        for stream in (running[1], *waiting):
            assert await core.abort(stream.request_id) is True
        assert await core.abort(waiting[0].request_id) is False   # gone already
    asyncio.run(main())
    _idle(core)


def test_a_caller_that_stops_waiting_for_its_add_leaves_nothing_running(core):
    """A client gone while its request is being added (the add's answer not yet back): the core aborts it."""
    async def main():
        adding = asyncio.ensure_future(core.add_request(PROMPTS[0], SamplingParams(max_tokens=1000, ignore_eos=True)))
        await asyncio.sleep(0)  # the add is sent; its answer is not back yet
        adding.cancel()
        with pytest.raises(asyncio.CancelledError):
            await adding
        assert await _text(core, PROMPTS[1], SamplingParams(temperature=0, max_tokens=4))  # the core still serves
    asyncio.run(main())
    _idle(core, within=10)  # the 1000-token request would hold its blocks for far longer


def test_a_dead_core_fails_every_caller():
    core = _core("--num-blocks", "16")

    async def main():
        stream = await core.add_request(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        core.process.kill()                                   # what an out-of-memory kill does
        with pytest.raises(EngineDead, match="exited with code -9"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDead):
            await core.add_request(PROMPTS[0])
    try:
        asyncio.run(main())
        assert not core.is_running
    finally:
        core.shutdown()


def test_a_prompt_is_checked_once(real, monkeypatch):
    """The caller's side checks a prompt (a 400 before the engine is touched); the engine queues the CheckedPrompt
    as it is, and refuses one paired with other params. Offline, Engine.add_request checks what it is given."""
    import enginelib.core.prompt as request_module
    calls = []
    check = request_module.check_request
    monkeypatch.setattr(request_module, "check_request", lambda *args: calls.append(args) or check(*args))
    engine = Engine(*real, EngineConfig(num_blocks=16))
    client = AsyncEngine(engine, threads=1)
    try:
        text = asyncio.run(_text(client, PROMPTS[0], SamplingParams(temperature=0, max_tokens=4)))
    finally:
        client.shutdown()
    assert text and len(calls) == 1, calls
    cfg = engine.model.cfg
    checked = request_module.check_prompt(PROMPTS[0], SamplingParams(), real[1], cfg.vocab_size, cfg.context_length)
    with pytest.raises(ValueError, match="carries its own params"):
        engine.add_request(checked, SamplingParams())
    assert engine.add_request(checked) and len(calls) == 2  # check_prompt's own call; add_request made none
    engine.add_request(PROMPTS[1])
    assert len(calls) == 3
