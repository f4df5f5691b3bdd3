"""OpenVINO GenAI's decoding for `hf-spec bench`, run by the Python of an environment that has ``openvino-genai``
(`hf_spec.bench.peers` starts it). It imports nothing from hf_spec, so that environment needs only OpenVINO.

Protocol, one JSON object per line: the first line read names the pipelines (``{"pipelines": {name: {"target":
folder, "draft": folder or null}}, "threads": n}``, folders exported by ``optimum-cli export openvino``); each later
line is one call (``{"pipeline": name, "input_ids": [...], "max_new_tokens": n, "num_assistant_tokens": k or null,
"do_sample": bool, "temperature": t, "top_p": p, "top_k": k, "seed": s, "eos_token_ids": [...]}``), answered with
``{"seconds": wall seconds of generate(), "new_ids": [...]}`` or ``{"error": "..."}``. A pipeline is built at its
first call (that call's time is the load and the compile: the bench's warm-up makes it).
"""

from __future__ import annotations

import json
import sys
import time


def _pipeline(spec: dict, threads: int):
    import openvino_genai

    properties = {"INFERENCE_NUM_THREADS": threads}
    if spec.get("draft"):
        draft = openvino_genai.draft_model(spec["draft"], "CPU", **properties)
        return openvino_genai.LLMPipeline(spec["target"], "CPU", draft_model=draft, **properties)
    return openvino_genai.LLMPipeline(spec["target"], "CPU", **properties)


def _config(call: dict):
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = call["max_new_tokens"]
    config.min_new_tokens = call.get("min_new_tokens") or 0
    config.apply_chat_template = False  # the prompt's ids are already what the model reads
    config.stop_token_ids = set(call.get("eos_token_ids") or ())
    if call.get("num_assistant_tokens"):
        config.num_assistant_tokens = call["num_assistant_tokens"]
    config.do_sample = bool(call.get("do_sample"))
    if config.do_sample:
        config.temperature = call.get("temperature", 1.0)
        config.top_p = call.get("top_p", 1.0)
        config.top_k = call.get("top_k") or 0
        config.rng_seed = call.get("seed", 0)
    return config


def main() -> int:
    import numpy as np
    import openvino

    setup = json.loads(sys.stdin.readline())
    pipelines: dict = {}
    for line in sys.stdin:
        call = json.loads(line)
        try:
            name = call["pipeline"]
            if name not in pipelines:
                pipelines[name] = _pipeline(setup["pipelines"][name], setup["threads"])
            ids = openvino.Tensor(np.asarray([call["input_ids"]], dtype=np.int64))
            mask = openvino.Tensor(np.ones_like(ids.data))
            config = _config(call)
            started = time.perf_counter()
            result = _generate(pipelines[name], ids, mask, config)
            seconds = time.perf_counter() - started
            answer = {"seconds": seconds, "new_ids": [int(t) for t in result.tokens[0]]}
        except Exception as error:  # reported to the bench, which records the call as failed
            answer = {"error": f"{type(error).__name__}: {error}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


def _generate(pipeline, ids, mask, config):
    import openvino_genai

    return pipeline.generate(openvino_genai.TokenizedInputs(ids, mask), config)


if __name__ == "__main__":
    sys.exit(main())
