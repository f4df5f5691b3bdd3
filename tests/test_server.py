"""``hf-spec serve``'s application (`hf_spec.serving.server`) on a live server over the tiny pair, called as users call
it: the `openai` client and `curl`. Greedy answers equal the target's own `generate()`, streams equal whole answers,
stop strings cut where they should, requests run side by side, bad requests are refused by name, and a client that
leaves takes its request out of the batch."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from hf_spec import speculative
from hf_spec.loading.tiny import build_tiny_pair, tiny_tokenizer
from hf_spec.serving.openai_api import RequestError, TextStream, read_request
from hf_spec.serving.server import Served, build_app

uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny"
PROMPTS = ["def add(a, b):", "hello world", "x = [1, 2, 3]", "the quick brown fox"]


@pytest.fixture(scope="module")
def server():
    """A live server on a free port: the tiny pair, speculative continuous batching, k = 3."""
    target, draft = build_tiny_pair(seed=5)
    target = speculative(target)
    tokenizer = tiny_tokenizer()
    config = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    manager = target.init_continuous_batching(config, ContinuousBatchingConfig(num_blocks=64, page_size=16,
                                                                               max_batch_tokens=64),
                                              assistant_model=draft, num_assistant_tokens=3)
    manager.start()
    served = Served(manager, tokenizer, MODEL, speculative=True, default_max_tokens=32, context_length=1024)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(build_app(served), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uv.started, "the server did not start"
    try:
        yield {"url": f"http://127.0.0.1:{port}", "target": target, "tokenizer": tokenizer, "manager": manager}
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        manager.stop(block=True)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=60)


def target_alone(server, prompt: str, max_tokens: int) -> str:
    """The target's own greedy text for ``prompt`` (generate(), no draft, no batch)."""
    tokenizer = server["tokenizer"]
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = server["target"].generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_greedy_completions_equal_the_target_alone_side_by_side(server, client):
    def ask(prompt: str):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # the requests share the batch
        responses = list(pool.map(ask, PROMPTS))
    for prompt, response in zip(PROMPTS, responses, strict=True):
        assert response.choices[0].text == target_alone(server, prompt, 24)
        assert response.usage.prompt_tokens == len(server["tokenizer"](prompt)["input_ids"])
        assert response.choices[0].finish_reason in ("length", "stop")
        stats = response.speculative  # the extra field
        assert stats["num_drafted"] > 0 and 0 <= stats["num_accepted"] <= stats["num_drafted"]
    several = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=24, temperature=0)
    assert [c.text for c in sorted(several.choices, key=lambda c: c.index)] == [r.choices[0].text
                                                                                 for r in responses[:2]]


def test_a_chat_stream_equals_the_whole_answer_with_usage_last(server, client):
    messages = [{"role": "user", "content": "write a loop"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    text = server["tokenizer"].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert whole.usage.prompt_tokens == len(server["tokenizer"](text, add_special_tokens=False)["input_ids"])


def test_stop_strings_cut_before_the_stop_whole_and_streamed(server, client):
    full = target_alone(server, PROMPTS[0], 24)
    stop = full[9:11]  # a string the answer holds
    cut = full[: full.index(stop)]
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_a_seed_reproduces_a_sampled_answer(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=1.0, top_p=0.9,
                                         seed=seed, extra_body={"top_k": 20}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) > 1  # sampling samples


@pytest.mark.parametrize(("request_body", "status", "param"), [
    ({"prompt": "a", "n": 2}, 400, "n"),
    ({"prompt": "a", "temperature": 3}, 400, "temperature"),
    ({"prompt": "a", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "a", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [70000]}, 400, "prompt"),
    ({"prompt": "a", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "a", "num_assistant_tokens": -1}, 400, "num_assistant_tokens"),
])
def test_bad_requests_are_refused_by_name_with_curl(server, request_body, status, param):
    body = {"model": MODEL, **request_body}
    result = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", f"{server['url']}/v1/completions", "-H",
                             "content-type: application/json", "-d", json.dumps(body)],
                            capture_output=True, text=True, timeout=30, check=True)
    document, code = result.stdout.rsplit("\n", 1)
    assert int(code) == status, document
    assert json.loads(document)["error"]["param"] == param


def test_curl_streams_server_sent_events(server):
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "stream": True}
    result = subprocess.run(["curl", "-sN", f"{server['url']}/v1/completions", "-H", "content-type: application/json",
                             "-d", json.dumps(body)], capture_output=True, text=True, timeout=30, check=True)
    events = [line.removeprefix("data: ") for line in result.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == target_alone(server, PROMPTS[2], 12)
    assert "speculative" in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] is not None


def test_the_openai_client_sees_refusals_as_its_own_errors(client):
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL, prompt="a", logprobs=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="a")
    assert [m.id for m in client.models.list()] == [MODEL]


def test_a_client_that_leaves_takes_its_request_out_of_the_batch(server):
    import http.client

    host, port = server["url"].removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 900, "temperature": 0, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.close()  # gone after its first chunk, 900 tokens asked
    manager, deadline = server["manager"], time.monotonic() + 20
    while time.monotonic() < deadline and (manager.output_router.result_handlers
                                           or manager.batch_processor.scheduler.active_requests):
        time.sleep(0.1)
    assert not manager.output_router.result_handlers
    assert not manager.batch_processor.scheduler.active_requests


# -- the pure parts ------------------------------------------------------------------------------------------------

def test_text_stream_holds_back_what_may_begin_a_stop_string():
    tokenizer = tiny_tokenizer()
    ids = tokenizer("abcdef")["input_ids"]
    stream = TextStream(tokenizer, ("cde",))
    assert stream.feed(ids[:3]) == "ab"  # "c" may begin "cde"
    assert stream.feed(ids[:4]) == ""  # "cd" too
    assert stream.feed(ids[:5]) == "" and stream.stopped and stream.text == "ab"
    plain = TextStream(tokenizer, ("cx",))
    assert plain.feed(ids[:3]) == "ab" and plain.feed(ids[:4]) == "cd" and plain.finish() == ""


def test_without_speculation_the_server_refuses_what_it_would_ignore():
    class Manager:
        generation_config = GenerationConfig(eos_token_id=0)

    served = Served(Manager(), tiny_tokenizer(), MODEL, speculative=False)
    assert served.read({"prompt": "a", "temperature": 0}, chat=False).settings == {"do_sample": False}
    with pytest.raises(RequestError, match="greedy only"):
        served.read({"prompt": "a"}, chat=False)  # OpenAI's default temperature is 1: sampled
    with pytest.raises(RequestError, match="chat template"):
        tokenizer = tiny_tokenizer()
        tokenizer.chat_template = None
        read_request({"messages": [{"role": "user", "content": "a"}]}, chat=True, tokenizer=tokenizer,
                     model_name=MODEL, context_length=None, default_max_tokens=4)


def test_a_request_that_fails_in_the_batch_answers_500_whole_and_an_error_event_streamed():
    import asyncio
    import types

    from fastapi.testclient import TestClient

    class FailingManager:
        """Delivers one output with an error for every request (a batch that could not run it)."""

        generation_config = GenerationConfig(eos_token_id=0)

        def register_result_handler(self, request_id, callback):
            self.callback, self.loop = callback, asyncio.get_running_loop()

        def add_request(self, prompt, request_id, **settings):
            failed = types.SimpleNamespace(error="no cache block left", generated_tokens=[], is_finished=lambda: True)
            self.loop.call_soon(self.callback, failed)

    client = TestClient(build_app(Served(FailingManager(), tiny_tokenizer(), MODEL, speculative=True)))
    whole = client.post("/v1/completions", json={"prompt": "abc", "temperature": 0})
    assert whole.status_code == 500 and "no cache block left" in whole.json()["error"]["message"]
    streamed = client.post("/v1/completions", json={"prompt": "abc", "temperature": 0, "stream": True})
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert "no cache block left" in json.loads(events[-1].removeprefix("data: "))["error"]["message"]
