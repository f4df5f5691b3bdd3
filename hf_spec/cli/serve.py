"""``hf-spec serve``: an OpenAI-compatible server (``/v1/completions``, ``/v1/chat/completions``) over continuous
batching whose steps speculate exactly (`hf_spec.serving`); ``--no-speculation`` serves transformers' own continuous
batching on the same weights and kernels, for comparison."""

from __future__ import annotations

import argparse

from hf_spec.cli.common import draft_arguments, load_models, log, positive_int, target_arguments
from hf_spec.extras import require_extra

DEFAULT_NUM_BLOCKS = 256
DEFAULT_PAGE_SIZE = 256  # tokens per page: transformers' default


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "serve", parents=[target_arguments(), draft_arguments()],
        help="OpenAI-compatible server (/v1/completions, /v1/chat/completions) over continuous batching that "
             "speculates exactly",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the name requests give as `model` (default: "
                        "--target)")
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="a request's limit when it sets none")
    parser.add_argument("--num-blocks", type=positive_int, default=DEFAULT_NUM_BLOCKS,
                        help="pages of the paged KV cache (the target's, and as many for the draft)")
    parser.add_argument("--page-size", type=positive_int, default=DEFAULT_PAGE_SIZE, help="tokens per page")
    parser.add_argument("--max-batch-tokens", type=positive_int, default=512,
                        help="tokens one target pass takes at most (prefill chunks and verification blocks)")
    parser.add_argument("--no-speculation", action="store_true",
                        help="serve transformers' continuous batching without a draft (greedy requests only)")
    parser.set_defaults(run=run, num_assistant_tokens="auto")  # k per request and step, 0 where drafting cannot pay


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number in [1, 65535], got {text}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    require_extra("serve", "hf-spec serve")
    import uvicorn
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from hf_spec.serving.server import Served, build_app

    pair = load_models(args)
    generation_config = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False,
                                         eos_token_id=pair.target.generation_config.eos_token_id)
    cache = ContinuousBatchingConfig(num_blocks=args.num_blocks, page_size=args.page_size,
                                     max_batch_tokens=args.max_batch_tokens)
    draft = {} if args.no_speculation else {"assistant_model": pair.draft,
                                            "num_assistant_tokens": args.num_assistant_tokens}
    manager = pair.target.init_continuous_batching(generation_config, cache, **draft)
    manager.start()
    try:
        served = Served(manager, pair.tokenizer, args.served_model_name or args.target,
                        speculative=not args.no_speculation, default_max_tokens=args.max_tokens,
                        context_length=getattr(pair.target.config.get_text_config(), "max_position_embeddings", None))
        log(f"serving {served.model_name!r} on http://{args.host}:{args.port}/v1 "
            f"({'speculative, k = ' + str(args.num_assistant_tokens) if draft else 'no speculation'})")
        uvicorn.run(build_app(served), host=args.host, port=args.port, log_level="warning")
    finally:
        manager.stop(block=True)
    return 0
