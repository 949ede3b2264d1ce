"""The output processor: from new token ids to what a caller sees. Each request's text is detokenized one token at a
time and searched for stop strings in its new characters (one completed by the token that reaches ``max_tokens`` still
ends the text there, with ``finish_reason="stop"``, as in vLLM); the scheduler is asked to stop the request. A caller
gets each request's whole output so far, or its delta: what is new since the last (one :class:`DeltaCursor` each)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from enginelib.config import stop_hold_back
from enginelib.core.outputs import CompletionOutput, DeltaCursor, RequestOutput, StreamDelta
from enginelib.core.request import Request
from enginelib.core.scheduler import SchedulerOutput
from enginelib.model.tokenizer import IncrementalDetokenizer, Tokenizer

KEEP_FINISHED = 1024  # finished requests kept for engine.request(); nothing walks them per step


@dataclass
class _Live:
    """What the output side keeps of an unfinished request."""
    request: Request
    detokenizer: IncrementalDetokenizer
    num_seen: int = 0  # output tokens already detokenized
    error: str | None = None  # why it failed (finish_reason "error")
    cursor: DeltaCursor = field(default_factory=DeltaCursor)  # what its deltas have sent so far


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.live: dict[str, _Live] = {}                          # unfinished requests
        self.finished: OrderedDict[str, Request] = OrderedDict()  # the last KEEP_FINISHED that ended
        self.leaving: list[_Live] = []  # aborted since the last step: their last outputs come with the next
        self.num_finished = self.num_generated = self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.finished.pop(request.request_id, None)  # an id may be used again once its request is done
        self.live[request.request_id] = _Live(request, IncrementalDetokenizer(
            self.tokenizer, request.params.skip_special_tokens), cursor=DeltaCursor(stop_hold_back(request.params)))

    def request(self, request_id: str) -> Request:
        """An unfinished request, or one of the last KEEP_FINISHED to end."""
        if request_id in self.live:
            return self.live[request_id].request
        if request_id in self.finished:
            return self.finished[request_id]
        raise ValueError(f"no request {request_id!r}: unknown, or finished more than {KEEP_FINISHED} requests ago "
                         "(keep the RequestOutput that step() returned when it finished)")

    def process(self, plan: SchedulerOutput, scheduled_time: float, now: float, stop: Callable[[Request, int], None],
                fail: Callable[[Request, Exception], None],
                deltas: bool = False) -> list[RequestOutput] | list[StreamDelta]:
        """The outputs of every request that sampled this step (after ``Scheduler.update``) and of those aborted since
        the last: each whole so far, or with ``deltas`` only what is new since its last delta. ``stop(request, n)``
        ends a request after ``n`` output tokens (a stop string); ``fail(request, error)`` one whose text raised."""
        outputs = [self.emit(live, deltas) for live in self.leaving]
        self.leaving = []
        self.num_preemptions += len(plan.preempted)
        for request in plan.preempted:
            request.metrics.num_preemptions += 1
        for work in plan.scheduled:
            metrics = work.request.metrics
            if work.admitted:
                metrics.num_cached_tokens = work.start  # the prefix found in the cache counts as computed
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = scheduled_time
            if not work.samples:
                continue  # a prefill chunk: nothing to tell yet
            live = self.live[work.request.request_id]
            try:
                self._new_tokens(live, now, stop)
            except Exception as error:  # noqa: BLE001 - this request's text: it fails alone, the others go on
                fail(work.request, error)
            outputs.append(self.emit(live, deltas))
            if work.request.is_finished:
                self._forget(live, now)
        return outputs

    def _new_tokens(self, live: _Live, now: float, stop: Callable[[Request, int], None]) -> None:
        """Stamp each new token's time and extend the text by its new characters, token by token, looking
        for stop strings there: one found before the last token of a verified run cuts the run there. As EOS
        does, a stop string waits for ``min_tokens``: only a token past them may complete one (vLLM's rule)."""
        request, detok = live.request, live.detokenizer
        ids = request.output_token_ids
        for end in range(live.num_seen + 1, len(ids) + 1):
            request.metrics.token_times.append(now)
            self.num_generated += 1
            before = len(detok.text)
            detok.step(ids if end == len(ids) else ids[:end])
            if request.params.stop and end > request.params.min_tokens and self._cut_at_stop_string(live, before):
                stop(request, end)  # nothing past a stop: later tokens of the run are dropped
                break
        else:
            if request.is_finished:  # ended by a token (EOS, a stop id, max_tokens): nothing is held back any more
                detok.flush(ids)
        live.num_seen = len(ids)

    @staticmethod
    def _cut_at_stop_string(live: _Live, before: int) -> bool:
        """Cut the text at the earliest stop string, if any (after it with ``include_stop_str_in_output``). Only new
        characters complete a match: the search starts ``max(len(stop)) - 1`` before them."""
        text, params = live.detokenizer.text, live.request.params
        start = max(0, before - stop_hold_back(params))
        hits = [(i, len(s)) for s in params.stop if (i := text.find(s, start)) >= 0]
        if not hits:
            return False
        index, length = min(hits)
        live.detokenizer.text = text[:index + length] if params.include_stop_str_in_output else text[:index]
        return True

    def fail(self, request: Request, message: str) -> None:
        """Keep why a request failed for its last output (the first error: a later one is a consequence)."""
        live = self.live[request.request_id]
        live.error = live.error or message

    def abort(self, request: Request, now: float) -> RequestOutput:
        """An aborted request's last output; it leaves the live set, and the next step's outputs carry it too."""
        live = self.live[request.request_id]
        self._forget(live, now)
        self.leaving.append(live)
        return self.output(live)

    def _forget(self, live: _Live, now: float) -> None:
        """A finished request leaves the per-step state; counters and a bounded record remain."""
        request = live.request
        request.metrics.finished_time = now
        del self.live[request.request_id]
        self.finished[request.request_id] = request
        if len(self.finished) > KEEP_FINISHED:
            self.finished.popitem(last=False)
        self.num_finished += 1

    def emit(self, live: _Live, delta: bool) -> RequestOutput | StreamDelta:
        """A request's output, or its delta: the text and tokens new since the last (one cursor per request)."""
        return live.cursor.delta(self.output(live)) if delta else self.output(live)

    @staticmethod
    def output(live: _Live) -> RequestOutput:
        r = live.request
        n = len(r.output_token_ids)  # a stop string's cut drops the logprobs of the tokens it dropped
        logprobs = None if r.params.logprobs is None else r.output_logprobs[:n]
        prompt_logprobs = None if r.params.prompt_logprobs is None else [None, *r.prompt_logprobs]
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids,
                             [CompletionOutput(0, live.detokenizer.text, list(r.output_token_ids), r.finish_reason,
                                               live.error, logprobs)], r.is_finished, r.metrics, prompt_logprobs)
