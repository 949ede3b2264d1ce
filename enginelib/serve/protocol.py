"""What a request may say, and the one way a bad one is answered (OpenAI's error shape, a 4xx naming the field).

Every field is known: one the server implements is validated here (strictly: a string where a number belongs is
a 400, not a guess), one it does not is refused by name unless it holds the value that means "not used", and any
other name is refused as unknown. Nothing is silently ignored. JSON has one number type, so ``2.0`` is the integer
2, as OpenAI's SDKs and JavaScript clients may send it; ``null`` means "the default" wherever OpenAI allows it.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from enginelib.config import MAX_LOGPROBS, SamplingParams
from enginelib.serve.guard import error_object
from enginelib.serve.guided import FieldError, GuidedFields, structured_output

MAX_N = 16        # samples per prompt at most: each is a request of its own in the batch
MAX_PROMPTS = 64  # prompts in one /v1/completions body at most
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 16, 128  # a stream holds back max(len(stop)) - 1 characters
ECHO_LIMIT = 80  # characters of a refused value repeated in an error message


class ApiError(Exception):
    """An error the client caused (or a busy server), answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_object(self.status, self.message, self.code, self.param), status_code=self.status,
                            headers=self.headers)


def echo(value: object) -> str:
    """A refused value, shortened: an error must not send a 900 KB body back."""
    text = repr(value)
    return text if len(text) <= ECHO_LIMIT else f"{text[:ECHO_LIMIT]}... ({len(text)} characters)"


def _whole(value: object) -> object:
    """``2.0`` is the integer 2 (JSON does not tell them apart); ``2.5`` stays a float, which strict validation
    refuses."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole)]


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options`` and vLLM's ``continuous_usage_stats``: strict, no other key."""
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = None           # a last chunk with the usage of the whole request
    continuous_usage_stats: bool | None = None  # (vLLM's) every chunk carries the usage so far


class _Body(GuidedFields):
    """Fields both endpoints take (those that constrain the output: :mod:`.guided`); ``None`` (or leaving one out)
    means the default."""

    model_config = ConfigDict(strict=True, extra="allow")  # extras are checked against REFUSED, then refused
    model: str
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None   # the newer name OpenAI gives max_tokens
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None                   # vLLM's extension: 0 or -1 turns it off
    min_p: float | None = None                 # vLLM's
    min_tokens: Int | None = None              # vLLM's
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None    # vLLM's
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None    # vLLM's
    ignore_eos: bool | None = None             # vLLM's
    include_stop_str_in_output: bool | None = None  # vLLM's
    skip_special_tokens: bool | None = None    # vLLM's (default true)
    prompt_logprobs: Int | None = None         # vLLM's: each prompt token's logprob and this many top ones (0..20)
    seed: Int | None = None                    # choice j of n samples with seed + j (as vLLM)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Int | None = None                       # samples per prompt (None: 1)
    user: str | None = None                    # OpenAI's end-user id: kept by no one here, changes no output


class CompletionBody(_Body):
    prompt: str | list[Int] | list[str] | list[list[Int]]  # one prompt, or a list: a choice per prompt (and n)
    logprobs: Int | None = None  # the legacy API's: this many most likely tokens per position (0..20)
    echo: bool | None = None     # the answer starts with the prompt (and its logprobs, with logprobs): lm-eval's


class TextPart(BaseModel):
    """A chat content part: text is all this model reads (an image or audio part is refused by name)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # extras (tool_calls, audio...) are refused by name
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None  # a participant's name: handed to the chat template, as vLLM does

    def rendered(self, where: str) -> dict[str, str]:
        """What the chat template gets: text parts joined by new lines (as vLLM joins them); ``developer`` is
        OpenAI's newer name for ``system``."""
        for key in self.model_extra or {}:
            raise ApiError(400, f"{where}.{key} is not supported by this server (text chats only): leave it out",
                           f"{where}.{key}")
        content = self.content
        if isinstance(content, list):
            texts = []
            for i, part in enumerate(content):
                kind = part.get("type")
                if kind != "text":
                    raise ApiError(400, f"{where}.content.{i}: {echo(kind)} parts are not supported: this model "
                                        "reads text only; send {'type': 'text', 'text': ...} parts",
                                   f"{where}.content.{i}.type")
                try:
                    texts.append(TextPart.model_validate(part).text)
                except ValidationError as error:
                    raise _validation_error(error, f"{where}.content.{i}") from None
            content = "\n".join(texts)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        return message | ({"name": self.name} if self.name is not None else {})


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None               # each output token's logprob ...
    top_logprobs: Int | None = None            # ... and this many most likely tokens per position (0..20)


# Fields of OpenAI's and vLLM's requests this server does not implement, with the values that mean "not used"
# (null always does): any other value is refused by name, never ignored. A name in neither the bodies nor here
# is refused as unknown. ``echo`` is a completions field; on chat (vLLM's "echo the last message") it is refused.
REFUSED: dict[str, tuple] = {
    "best_of": (1,), "logit_bias": ({},), "tools": ([],),
    "tool_choice": ("none",), "functions": ([],), "function_call": ("none",), "parallel_tool_calls": (True, False),
    "echo": (False,), "suffix": ("",), "audio": (), "modalities": (["text"],), "prediction": (),
    "reasoning_effort": (), "verbosity": (), "store": (False,), "metadata": ({},), "service_tier": ("auto", "default"),
    "web_search_options": (), "prompt_cache_key": (), "safety_identifier": (),
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "early_stopping": (False,),
    "truncate_prompt_tokens": (), "allowed_token_ids": (), "bad_words": ([],), "spaces_between_special_tokens": (True,),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (), "structural_tag": (), "logits_processors": (),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "add_special_tokens": (),
    "chat_template": (), "chat_template_kwargs": ({},), "documents": (), "mm_processor_kwargs": (), "priority": (0,),
    "request_id": (), "return_tokens_as_token_ids": (False,), "return_token_ids": (False,), "cache_salt": (),
    "kv_transfer_params": (), "vllm_xargs": (), "top_logprobs": (),  # top_logprobs: the chat endpoint's field
}


def validate(data: object, model: type[_Body]) -> _Body:
    """A parsed JSON body as ``model``, every field known; a 400 naming the first field that is not fine."""
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        body = model.model_validate(data)
    except ValidationError as error:
        raise _validation_error(error) from None
    for name, value in (body.model_extra or {}).items():
        if name not in REFUSED:
            raise ApiError(400, f"unknown field {echo(name)}: this server does not know it (GET /openapi.json lists "
                                "the fields it takes); leave it out", name)
        if value is not None and not any(value == off and type(value) is type(off) for off in REFUSED[name]):
            hint = " (on /v1/completions, logprobs: k asks for the top k)" if name == "top_logprobs" else ""
            raise ApiError(400, f"{name}={echo(value)} is not supported by this server: leave {name} out{hint}", name)
    _check_stream_options(body)
    return body


def _validation_error(error: ValidationError, prefix: str = "") -> ApiError:
    first = error.errors()[0]
    where = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(first["loc"]))
    return ApiError(400, f"{where}: {first['msg']} (got {echo(first.get('input'))})", where or None)


def _check_stream_options(body: _Body) -> None:
    if body.stream and body.prompt_logprobs is not None:  # as vLLM: they would need a chunk of their own
        raise ApiError(400, "prompt_logprobs are not available with stream: true (with echo: true, logprobs: k "
                            "streams the prompt's logprobs in its first chunk)", "prompt_logprobs")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options needs stream: true (it shapes a stream's chunks): set stream or leave "
                            "stream_options out", "stream_options")
    stop = body.stop
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
    if any(len(s) > MAX_STOP_LENGTH for s in ([stop] if isinstance(stop, str) else stop or [])):
        raise ApiError(400, f"stop: a stop string may have at most {MAX_STOP_LENGTH} characters", "stop")


def loads(raw: bytes | bytearray) -> object:
    """The body's JSON; anything that is not (bad bytes, a number too long to convert, deep nesting) is a 400."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ApiError(400, f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, "the body's JSON is nested too deeply") from None
    except ValueError as error:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        reason = str(error).split(";")[0]  # not its advice to call sys.set_int_max_str_digits: that is ours to do
        raise ApiError(400, f"the body holds a number this server cannot read ({reason}): send a shorter one") from None
    try:  # a lone surrogate (JSON "\\ud800") is not Unicode text: no tokenizer takes it
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the body holds a lone surrogate (e.g. \\ud800), which is not valid Unicode text") from None
    return data


def max_tokens_asked(body: _Body) -> int | None:
    """``max_completion_tokens`` (OpenAI's newer name) or ``max_tokens``; both, disagreeing, is a 400. 0 is
    taken with ``echo`` only (the prompt and its logprobs back, nothing generated: lm-eval's loglikelihood)."""
    new, old = body.max_completion_tokens, body.max_tokens
    if new is not None and old is not None and new != old:
        raise ApiError(400, f"max_tokens={old} and max_completion_tokens={new} disagree: send one of them",
                       "max_completion_tokens")
    asked = old if new is None else new
    if asked == 0 and not echoes(body):
        raise ApiError(400, "max_tokens must be at least 1 (0 only with echo: true, which returns the prompt)",
                       "max_tokens" if new is None else "max_completion_tokens")
    return asked


def echoes(body: _Body) -> bool:
    """The answer repeats the prompt (completions' ``echo: true``)."""
    return isinstance(body, CompletionBody) and bool(body.echo)


def prompts_of(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """/v1/completions' ``prompt``: one text or token-id list, or a list of them (a choice per prompt)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}", "prompt")
    return list(prompt)


def logprobs_asked(body: _Body) -> int | None:
    """How many top tokens per position the body asks for (None: no logprobs). Chat says ``logprobs: true``
    and ``top_logprobs: k``; the legacy completions API says ``logprobs: k``."""
    if isinstance(body, CompletionBody):
        return body.logprobs
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be from 0 to {MAX_LOGPROBS}, got {body.top_logprobs}",
                           "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def prompt_logprobs_asked(body: _Body, logprobs: int | None) -> int | None:
    """vLLM's rule: ``prompt_logprobs`` if given, else with ``echo`` the ``logprobs`` asked for (None: none)."""
    if body.prompt_logprobs is not None:
        return body.prompt_logprobs
    return logprobs if echoes(body) else None


# SamplingParams' fields a body sets by the same name (None: SamplingParams' default)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "min_tokens", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
                   "skip_special_tokens", "seed")


def sampling_params(body: _Body, prompt: list[int], context: int, logprobs: int | None = None) -> SamplingParams:
    """The request's sampling fields as SamplingParams (a bad value: a 400 naming it)."""
    max_tokens = max_tokens_asked(body)
    if max_tokens is None:  # as vLLM does: whatever the context leaves after the prompt
        max_tokens = max(1, context - len(prompt))
    given = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    try:
        given["structured_output"] = structured_output(body)
    except FieldError as error:
        raise ApiError(400, str(error), error.param) from None
    try:  # echo with max_tokens 0: one token is generated and dropped (as vLLM does); logprobs cover the prompt too
        return SamplingParams(max_tokens=1 if max_tokens == 0 else max_tokens,
                              stop=[] if body.stop is None else body.stop, logprobs=logprobs, **given,
                              prompt_logprobs=prompt_logprobs_asked(body, logprobs))
    except ValueError as error:
        raise ApiError(400, str(error), param(str(error))) from None


def param(message: str) -> str | None:
    """The request field an engine error names (its messages start with it), for OpenAI's ``param``."""
    names = ("max_tokens", "stop_token_ids", "stop", "prompt_logprobs", "logprobs", *SAMPLING_FIELDS)
    return next((f for f in names if message.startswith(f)), None) or next((f for f in names if f"{f} (" in message),
                                                                           None)
