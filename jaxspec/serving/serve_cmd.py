"""`jaxspec serve`: its flags, building the server a ServeConfig names, and the process lifecycle
(signals, drain, exit codes). The service itself is jaxspec.serving.service.GenerationServer.

Multi-process (docs/multiprocess.md): process 0 serves; the others mirror its engine calls until it stops."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable

from jaxspec.engine import distributed
from jaxspec.engine.args import EngineArgs
from jaxspec.serving.auth import TOKEN_ENV, resolve_token
from jaxspec.serving.serve_config import DEFAULT_CONFIG, ServeConfig, load_serve_config
from jaxspec.serving.service import GenerationServer, PolicyFactory

log = logging.getLogger(__name__)

# the EngineArgs fields ServeConfig has
ENGINE_FLAGS = ("model", "proposer", "draft", "policy", "menu", "tokenizer", "dtype", "mesh", "tree", "kernels",
                "no_overlap", "logprobs", "num_pages", "no_prefix_cache")


def build_server(config: ServeConfig, progress: bool = True,
                 leader: distributed.LeaderLink | None = None) -> GenerationServer:
    """The engine (jaxspec.engine.build), tokenizer and policy a ServeConfig names, as an unstarted server.
    Policy defaults and menu trimming are those of every engine command (jaxspec.serving.runtime). `leader`:
    process 0 of a multi-process run (its engine calls are mirrored on the others)."""
    from jaxspec.engine.api import EngineAPI
    from jaxspec.engine.build import load_menu
    from jaxspec.policy.base import Policy
    from jaxspec.serving.runtime import assemble_engine, build_policy

    engine_args = config.engine_args()
    spec = engine_args.policy_spec()
    menu = engine_args.engine_menu(load_menu(engine_args.menu))  # --tree, then only the k values the policy can pick
    policy: Policy | PolicyFactory
    if spec.needs_cost_model:
        def policy(warm: EngineAPI) -> Policy:  # needs the warmed-up engine: loads or measures its cost profile
            return build_policy(spec, engine=warm, progress=progress)
    else:
        policy = build_policy(spec)  # a bad spec fails before the model loads
    local, tokenizer, model_name = assemble_engine(engine_args, menu)
    engine = local if leader is None else distributed.LeaderEngine(local, leader)
    return GenerationServer(engine, tokenizer, policy, config, model_name=model_name, progress=progress)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `jaxspec serve` (each overrides the --config file, which overrides the defaults)."""
    d = ServeConfig()
    parser.add_argument("--config", default=None,
                        help=f"serving YAML with ServeConfig keys (e.g. {DEFAULT_CONFIG.name})")
    EngineArgs.add_arguments(parser, only=ENGINE_FLAGS, overrides=True)
    parser.add_argument("--max-tokens-limit", type=int, default=None, help=f"largest max_tokens per request "
                        f"(default {d.max_tokens_limit})")
    parser.add_argument("--max-queue", type=int, default=None, help=f"requests waiting for a slot before "
                        f"RESOURCE_EXHAUSTED (default {d.max_queue})")
    parser.add_argument("--host", default=None, help=f"address to bind (default {d.host})")
    parser.add_argument("--port", type=int, default=None, help=f"gRPC port (default {d.port}; 0 = off)")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (default: off)")
    parser.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP API port, same process "
                        "and scheduler as gRPC (default: off; 0 = off; docs/openai_api.md)")
    parser.add_argument("--metrics-host", default=None, help=f"address /metrics binds (default {d.metrics_host}; "
                        "the endpoint has no auth and no TLS)")
    parser.add_argument("--allow-plaintext", action="store_true", default=None,
                        help="serve without TLS on a --host other than loopback (refused without this flag: "
                        "prompts, outputs and the bearer token cross the network in clear)")
    parser.add_argument("--max-pending-calls-per-peer", type=int, default=None, metavar="N",
                        help=f"calls of one client connection that may await their request message at once "
                        f"(default {d.max_pending_calls_per_peer}; {d.max_pending_calls} in all)")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key): serve TLS")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--auth-token", default=None, help="require 'authorization: Bearer TOKEN' on every call "
                        "(health checks exempt). Every local user sees argv in `ps`: prefer --auth-token-file or "
                        f"${TOKEN_ENV}")
    parser.add_argument("--auth-token-file", default=None, metavar="FILE",
                        help=f"read the bearer token from FILE (surrounding whitespace stripped); without either "
                        f"flag, ${TOKEN_ENV} is used when set")
    distributed.add_arguments(parser)


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    return load_serve_config(args.config, **EngineArgs.given(args, ENGINE_FLAGS),
                             max_tokens_limit=args.max_tokens_limit, max_queue=args.max_queue, host=args.host,
                             port=args.port, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                             http_port=args.http_port, allow_plaintext=args.allow_plaintext,
                             max_pending_calls_per_peer=args.max_pending_calls_per_peer, tls_cert=args.tls_cert,
                             tls_key=args.tls_key, auth_token=resolve_token(args.auth_token, args.auth_token_file))


def run_serve(args: argparse.Namespace, build: Callable[[ServeConfig], GenerationServer] = build_server) -> int:
    """`jaxspec serve`: build, warm up, serve until SIGTERM / SIGINT, drain. Returns the exit code: 0
    when every in-flight request finished, 1 when some were dropped (a second signal, or
    drain_timeout_s), 2 for bad input or configuration."""

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = serve_config_from_args(args)
        spec = distributed.DistributedSpec.from_args(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"jaxspec serve: {exc}", file=sys.stderr)
        return 2
    link = distributed.initialize(spec)
    if isinstance(link, distributed.FollowerLink):
        from jaxspec.serving.runtime import follow_runtime

        return follow_runtime(config.engine_args(), link)
    with link or contextlib.nullcontext():
        return _serve(config, build, link)


def _serve(config: ServeConfig, build: Callable[..., GenerationServer], leader: distributed.LeaderLink | None) -> int:
    from jaxspec.engine.engine import enable_compilation_cache

    enable_compilation_cache()
    stop = threading.Event()
    server: GenerationServer | None = None
    http = None  # jaxspec.serving.openai_api.OpenAIServer with --http-port

    def on_signal(signum, _frame):
        if stop.is_set() and server is not None:
            log.warning("second %s: cancelling in-flight requests", signal.Signals(signum).name)
            server.cancel_inflight()
        log.info("%s: draining", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            server = build(config) if leader is None else build(config, leader=leader)
            if config.http_port:  # bound first: /health answers 503 during warm-up
                from jaxspec.serving.openai_api import start_http

                http = start_http(server, config.http_port)
            server.start()
        except (ValueError, OSError, KeyError) as exc:
            if http is not None:
                http.shutdown(timeout=0)
            print(f"jaxspec serve: {exc}", file=sys.stderr)
            return 2
        if http is not None:
            http.mark_ready()
        metrics = f", metrics on :{server.metrics_port}" if server.metrics_port is not None else ""
        api = f", HTTP on {http.address}" if http is not None else ""
        grpc_at = f" on {server.address}" if server.port is not None else " (gRPC off)"
        print(f"jaxspec serve: {server.model_name}{grpc_at}{api}{metrics}", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
        if http is not None:
            http.begin_shutdown()
        drained = server.shutdown(drain=True)
        if http is not None:  # its streams relay their last events, then it stops
            drained = http.shutdown() and drained
            server.dropped += http.dropped
        if drained:
            print("jaxspec serve: stopped (drained)", file=sys.stderr, flush=True)
            return 0
        n = server.dropped
        print(f"jaxspec serve: stopped: {n} in-flight request{'' if n == 1 else 's'} dropped (exit 1)",
              file=sys.stderr, flush=True)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxspec.serving.serve_cmd ...` (the same flags as `jaxspec serve`)."""
    parser = argparse.ArgumentParser(prog="jaxspec serve", description="Serve jaxspec.v1.Generation over gRPC.")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
