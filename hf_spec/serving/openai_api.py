"""The OpenAI request and response shapes of ``hf-spec serve``, as pure functions: a request body checked and read
into `Completion` (every field either honoured or refused by name), the text released as it streams (`TextStream`:
no partial character, no stop string, nothing that may begin one), and the response documents."""

from __future__ import annotations

import dataclasses
import time
from typing import Any


class RequestError(ValueError):
    """A request the server cannot honour: HTTP ``status``, OpenAI's ``error`` object naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


#: Fields taken as OpenAI defines them, and the extras vLLM's server also takes.
COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
                           "n", "user", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias", "top_k",
                           "min_p", "typical_p", "repetition_penalty", "min_tokens", "num_assistant_tokens"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                               "tool_choice"}
#: Fields accepted only at the value that asks for nothing (OpenAI's default).
NEUTRAL = {"n": (None, 1), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
           "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}), "echo": (None, False),
           "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
           "response_format": (None, {"type": "text"})}


@dataclasses.dataclass(frozen=True)
class Completion:
    """One request, read: its prompts as token ids, its limit, its settings for `add_request`, its stop strings."""

    prompts: list[list[int]]
    max_tokens: int
    settings: dict[str, Any]  # per-request settings of the batching manager (hf_spec.serving.REQUEST_SETTINGS)
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def read_request(body: Any, *, chat: bool, tokenizer, model_name: str, context_length: int | None,
                 default_max_tokens: int) -> Completion:
    """The request ``body`` checked, field by field, before any work."""
    if not isinstance(body, dict):
        raise RequestError(f"The request body must be a JSON object, got {type(body).__name__}.")
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if unknown:
        raise RequestError(f"Unsupported field(s) {unknown}.", param=unknown[0])
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise RequestError(f"`{name}` = {body[name]!r} is not supported by this server; leave it unset.",
                               param=name)
    if body.get("model") not in (None, model_name):
        raise RequestError(f"The model {body['model']!r} does not exist; this server serves {model_name!r}.",
                           param="model", status=404, code="model_not_found")
    prompts = _chat_prompt(body, tokenizer) if chat else _completion_prompts(body, tokenizer)
    limit_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, limit_name, int, minimum=1, default=default_max_tokens)
    if context_length is not None:
        longest = max(len(prompt) for prompt in prompts)
        if longest + max_tokens > context_length:
            raise RequestError(f"The prompt ({longest} tokens) and `{limit_name}` = {max_tokens} exceed the model's "
                               f"context of {context_length} tokens.", param=limit_name)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
        raise RequestError(f"`stream_options` takes only `include_usage`, got {stream_options!r}.",
                           param="stream_options")
    stream = _flag(body, "stream")
    if stream_options and not stream:
        raise RequestError("`stream_options` is only allowed with `stream` = true.", param="stream_options")
    return Completion(prompts, max_tokens, sampling_settings(body), _stop(body.get("stop")), stream,
                      bool(stream_options.get("include_usage", False)))


def sampling_settings(body: dict) -> dict[str, Any]:
    """The batching manager's per-request settings: OpenAI's temperature (default 1, 0 is greedy), top-p and seed,
    and the extras top-k, min-p, typical-p, repetition penalty, min tokens and the draft length."""
    temperature = _number(body, "temperature", float, minimum=0.0, maximum=2.0, default=1.0)
    settings: dict[str, Any] = {"do_sample": temperature > 0}
    if temperature > 0:
        settings["temperature"] = temperature
        settings["top_p"] = _number(body, "top_p", float, minimum=0.0, maximum=1.0, default=1.0, open_low=True)
        for name, kind, low in (("top_k", int, 0), ("min_p", float, 0.0), ("typical_p", float, 0.0)):
            value = _number(body, name, kind, minimum=low, default=None)
            if value is not None:
                settings[name] = value
    penalty = _number(body, "repetition_penalty", float, minimum=0.0, default=None, open_low=True)
    if penalty is not None:
        settings["repetition_penalty"] = penalty
    for name, key, low in (("min_tokens", "min_new_tokens", 0), ("seed", "seed", None),
                           ("num_assistant_tokens", "num_assistant_tokens", 0)):
        value = _number(body, name, int, minimum=low, default=None)
        if value is not None:
            settings[key] = value
    return settings


def _number(body: dict, name: str, kind: type, *, minimum=None, maximum=None, default=None, open_low=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise RequestError(f"`{name}` must be {'an integer' if kind is int else 'a number'}, got {value!r}.",
                           param=name)
    too_low = minimum is not None and (value <= minimum if open_low else value < minimum)
    if too_low or (maximum is not None and value > maximum):
        low = "" if minimum is None else f"{'>' if open_low else '>='} {minimum}"
        high = "" if maximum is None else f"<= {maximum}"
        raise RequestError(f"`{name}` must be {' and '.join(filter(None, (low, high)))}, got {value!r}.", param=name)
    return kind(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"`{name}` must be true or false, got {value!r}.", param=name)
    return bool(value)


def _stop(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"`stop` must be a non-empty string or a list of them, got {stop!r}.", param="stop")
    return tuple(stops)


def _completion_prompts(body: dict, tokenizer) -> list[list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids, or a list of such lists; one choice each."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise RequestError(f"`prompt` must be a string, a list of strings or token ids, got {prompt!r}.",
                           param="prompt")
    ids = [tokenizer(p)["input_ids"] if isinstance(p, str) else p for p in prompts]
    vocab = len(tokenizer)
    for one in ids:
        if not one or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in one):
            raise RequestError(f"Every prompt must hold at least one token id in [0, {vocab}), got {one!r}.",
                               param="prompt")
    return ids


def _chat_prompt(body: dict, tokenizer) -> list[list[int]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise RequestError("`messages` must be a non-empty list of {'role': str, 'content': str} objects, got "
                           f"{messages!r}.", param="messages")
    if tokenizer.chat_template is None:
        raise RequestError("The served tokenizer has no chat template: use /v1/completions.", param="messages")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return [tokenizer(text, add_special_tokens=False)["input_ids"]]


class TextStream:
    """A request's generated text, released as it grows: never a partial character, never a stop string or what may
    begin one; `stopped` once a stop string appears (the text ends before it)."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.text, self.released, self.stopped = "", 0, False

    def feed(self, token_ids: list[int]) -> str:
        """The text newly safe to release, given every generated token so far."""
        if self.stopped:
            return ""
        self.text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        found = [i for i in (self.text.find(s, max(0, self.released - len(s) + 1)) for s in self.stop) if i >= 0]
        if found:
            self.text, self.stopped = self.text[: min(found)], True
            return self._release(len(self.text))
        end = len(self.text) - 1 if self.text.endswith("\ufffd") else len(self.text)
        held = max((n for s in self.stop for n in range(1, len(s)) if self.text[:end].endswith(s[:n])), default=0)
        return self._release(end - held)

    def finish(self) -> str:
        """What is left once generation has ended."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        delta = self.text[self.released: end] if end > self.released else ""
        self.released = max(self.released, end)
        return delta


def finish_reason(ended_by_eos: bool, num_tokens: int, max_tokens: int) -> str:
    """OpenAI's reason: ``length`` where the limit ended the text, ``stop`` where the model or a stop string did."""
    return "length" if not ended_by_eos and num_tokens >= max_tokens else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def merged_stats(stats: list[dict | None]) -> dict | None:
    """The speculative statistics of a response's choices, summed (None without speculation)."""
    stats = [s for s in stats if s]
    if not stats:
        return None
    total = {name: sum(s[name] for s in stats) for name in ("num_steps", "num_drafted", "num_accepted")}
    total["acceptance_rate"] = round(total["num_accepted"] / total["num_drafted"], 4) if total["num_drafted"] else 0.0
    return total


def document(kind: str, response_id: str, model_name: str, choices: list[dict], **extra: Any) -> dict:
    """A response or a stream chunk: ``kind`` is its ``object`` (``text_completion``, ``chat.completion``...)."""
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model_name, "choices": choices,
            **{name: value for name, value in extra.items() if value is not None}}


def choice(chat: bool, index: int, text: str, reason: str | None, *, delta: bool = False,
           first: bool = False) -> dict:
    """One choice of a response (``delta``: of a stream chunk; ``first``: the chat stream's first, with its role)."""
    if not chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
    if not delta:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}
    content = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
    return {"index": index, "delta": content, "logprobs": None, "finish_reason": reason}
