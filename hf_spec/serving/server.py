"""``hf-spec serve``'s application: OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` (SSE streams, ``usage``,
the speculative statistics as the extra field ``speculative``), ``/v1/models`` and ``/health``, over a started
continuous-batching manager: hf_spec's speculative one, or transformers' own (``--no-speculation``, greedy only).

Each request joins the running batch through the manager's public API (``register_result_handler``,
``add_request``, ``cancel_request``); its outputs come back on the event loop. A request that ends early (a stop
string, a client gone) is cancelled and leaves the batch."""

# No `from __future__ import annotations` here: FastAPI reads the routes' annotations (`fastapi.Request`) at run time.
import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from hf_spec.compat import drop_result_handler
from hf_spec.extras import require
from hf_spec.serving.openai_api import (
    Completion,
    RequestError,
    TextStream,
    choice,
    document,
    finish_reason,
    merged_stats,
    read_request,
    usage,
)


class Served:
    """What one server serves: a started manager, its tokenizer and name, its limits."""

    def __init__(self, manager, tokenizer, model_name: str, *, speculative: bool, default_max_tokens: int = 256,
                 context_length: int | None = None):
        self.manager, self.tokenizer, self.model_name = manager, tokenizer, model_name
        self.speculative, self.default_max_tokens, self.context_length = speculative, default_max_tokens, context_length
        eos = manager.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None, -1}

    def read(self, body: Any, chat: bool) -> Completion:
        completion = read_request(body, chat=chat, tokenizer=self.tokenizer, model_name=self.model_name,
                                  context_length=self.context_length, default_max_tokens=self.default_max_tokens)
        if not self.speculative and (completion.settings != {"do_sample": False}):
            raise RequestError("This server runs transformers' continuous batching without speculation "
                               "(--no-speculation), greedy only: send `temperature` = 0 and no other sampling "
                               f"setting (got {completion.settings}).", param="temperature")
        return completion

    async def run(self, request_id: str, prompt: list[int], completion: Completion) -> AsyncIterator[tuple]:
        """``(text delta, tokens so far, finish reason or None, speculative stats)`` as the request's outputs arrive;
        the request is cancelled if the caller stops early (stop string, client gone, error)."""
        outputs: asyncio.Queue = asyncio.Queue()
        self.manager.register_result_handler(request_id, outputs.put_nowait)
        finished = False
        try:
            stops = {"stop_strings": list(completion.stop), "tokenizer": self.tokenizer} if (
                self.speculative and completion.stop) else {}  # the request leaves the batch at the stop's token
            self.manager.add_request(prompt, request_id=request_id, max_new_tokens=completion.max_tokens,
                                     streaming=True, **completion.settings, **stops)
            text = TextStream(self.tokenizer, completion.stop)
            while not finished:
                output = await outputs.get()
                if output.error is not None:
                    finished = True
                    raise RuntimeError(f"The request failed in the batch: {output.error}")
                tokens = list(output.generated_tokens)
                finished = output.is_finished()
                delta = text.feed(tokens)
                stats = getattr(output, "speculative_stats", None)
                if text.stopped:
                    yield delta, len(tokens), "stop", stats
                    return
                if finished:
                    delta += text.finish()
                    ended_by_eos = bool(tokens) and tokens[-1] in self.eos_token_ids
                    yield delta, len(tokens), finish_reason(ended_by_eos, len(tokens), completion.max_tokens), stats
                else:
                    yield delta, len(tokens), None, stats
        finally:
            if not finished:
                self.manager.cancel_request(request_id)
                drop_result_handler(self.manager, request_id)


def build_app(served: Served):
    """The FastAPI application serving ``served``."""
    fastapi = require("fastapi", "serve", "hf-spec serve")
    from fastapi.responses import JSONResponse, StreamingResponse

    app = fastapi.FastAPI(title="hf-spec serve")

    @app.exception_handler(RequestError)
    async def _refused(_request, error: RequestError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ValueError)
    async def _refused_by_the_manager(_request, error: ValueError):  # add_request's own checks
        return JSONResponse(RequestError(str(error)).body(), status_code=400)

    @app.exception_handler(RuntimeError)
    async def _failed(_request, error: RuntimeError):  # a request that failed in the batch
        return JSONResponse({"error": {"message": str(error), "type": "server_error", "param": None, "code": None}},
                            status_code=500)

    @app.get("/health")
    def health():
        fatal = served.manager.background_thread_status.fatal_error
        if fatal is not None or not served.manager.is_running():
            return JSONResponse({"status": "unhealthy", "reason": str(fatal or "stopped")}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": 0,
                                            "owned_by": "hf_spec"}]}

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await _respond(served, await _body(request), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        return await _respond(served, await _body(request), chat=True)

    async def _respond(served: Served, body: Any, chat: bool):
        completion = served.read(body, chat)
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if completion.stream:
            return StreamingResponse(_stream(served, completion, response_id, chat), media_type="text/event-stream")
        return await _whole(served, completion, response_id, chat)

    return app


async def _body(request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"The request body is not JSON: {error}.") from None


async def _whole(served: Served, completion: Completion, response_id: str, chat: bool) -> dict:
    """A response with every choice, generated side by side in the batch."""

    async def one(index: int, prompt: list[int]) -> tuple[str, int, str, dict | None]:
        text, count, reason, stats = "", 0, None, None
        async for delta, count, reason, stats in served.run(f"{response_id}-{index}", prompt, completion):
            text += delta
        return text, count, reason, stats

    tasks = [asyncio.ensure_future(one(i, prompt)) for i, prompt in enumerate(completion.prompts)]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:  # one choice failed (or the call was cancelled): the others leave the batch too
        for task in tasks:
            task.cancel()
        raise
    choices = [choice(chat, i, text, reason) for i, (text, _, reason, _) in enumerate(results)]
    return document("chat.completion" if chat else "text_completion", response_id, served.model_name, choices,
                    usage=usage(sum(map(len, completion.prompts)), sum(r[1] for r in results)),
                    speculative=merged_stats([r[3] for r in results]))


async def _stream(served: Served, completion: Completion, response_id: str, chat: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per step with new text per choice, the finish reasons, the usage chunk if asked,
    then ``[DONE]``."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    queue: asyncio.Queue = asyncio.Queue()

    async def one(index: int, prompt: list[int]) -> None:
        try:
            async for item in served.run(f"{response_id}-{index}", prompt, completion):
                await queue.put((index, *item))
        except Exception as error:  # the stream reports it, then ends
            await queue.put((index, error))

    tasks = [asyncio.ensure_future(one(i, prompt)) for i, prompt in enumerate(completion.prompts)]
    counts, stats, first = [0] * len(tasks), [None] * len(tasks), [True] * len(tasks)
    try:
        left = len(tasks)
        while left:
            index, *item = await queue.get()
            if isinstance(item[0], Exception):
                yield _event({"error": {"message": str(item[0]), "type": "server_error", "param": None,
                                        "code": None}})
                return
            delta, counts[index], reason, stats[index] = item
            left -= reason is not None
            if delta or reason or (chat and first[index]):
                yield _event(document(kind, response_id, served.model_name,
                                      [choice(chat, index, delta, reason, delta=True, first=first[index])],
                                      speculative=merged_stats([stats[index]]) if reason else None))
                first[index] = False
        if completion.include_usage:
            yield _event(document(kind, response_id, served.model_name, [],
                                  usage=usage(sum(map(len, completion.prompts)), sum(counts)),
                                  speculative=merged_stats(stats)))
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
