"""`jaxspec client "PROMPT"`: stream a generation from a running `jaxspec serve` to stdout.

Library use::

    with GenerationClient("127.0.0.1:50051") as client:
        for message in client.generate("Hello", max_tokens=32):
            print(message.text, end="")

Errors arrive as grpc.RpcError (code() and details() say what went wrong).

Replicas (docs/scale_out.md): a target naming several servers, e.g. ``ipv4:127.0.0.1:50051,127.0.0.1:50052``,
spreads calls over them with gRPC's round_robin policy, health-checked: a replica whose health is not
SERVING (warming up, draining after SIGTERM) gets no new calls, and a call it refuses with UNAVAILABLE
before any response is retried on another (gRPC's retry policy, at most `RETRY_ATTEMPTS` attempts).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxspec.serving.auth import TOKEN_ENV, resolve_token
from jaxspec.serving.proto.jaxspec.v1 import generation_pb2 as pb
from jaxspec.serving.proto.jaxspec.v1 import generation_pb2_grpc as pb_grpc

FINISH_NAMES = {pb.FINISH_REASON_EOS: "eos", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop"}
SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # jaxspec.v1.Generation
RETRY_ATTEMPTS = 3


def balanced_service_config() -> str:
    """The gRPC service config of a balanced channel: round_robin over the replicas whose health service
    reports SERVING for jaxspec.v1.Generation; UNAVAILABLE before any response is retried (on another replica)."""
    return json.dumps({
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": SERVICE},
        "methodConfig": [{"name": [{"service": SERVICE}],
                          "retryPolicy": {"maxAttempts": RETRY_ATTEMPTS, "initialBackoff": "0.05s",
                                          "maxBackoff": "1s", "backoffMultiplier": 2,
                                          "retryableStatusCodes": ["UNAVAILABLE"]}}],
    })


def lists_several(target: str) -> bool:
    """Whether `target` names several addresses (ipv4:A,B / ipv6:A,B); ValueError for a list without the
    scheme gRPC needs to read it as one."""
    if "," not in target:
        return False
    if not target.startswith(("ipv4:", "ipv6:")):
        raise ValueError(f"a target with several addresses needs gRPC's ipv4: or ipv6: scheme, e.g. "
                         f"ipv4:127.0.0.1:50051,127.0.0.1:50052; got {target!r}")
    if any(not part for part in target.split(":", 1)[1].split(",")):
        raise ValueError(f"empty address in target {target!r}")
    return True


class GenerationClient:
    """A channel to a server, or to replicas (target ipv4:A,B,...). tls_ca: PEM bytes or a file path (TLS
    on); auth_token: bearer token; max_message_bytes: the largest response message accepted. Requests are
    not limited here: the server answers one over its limit with INVALID_ARGUMENT.

    balance: round_robin over the health-checked replicas (`balanced_service_config`); default: on when
    the target lists several addresses (pass True for a DNS name with several records, e.g.
    dns:///jaxspec.internal:50051). A balanced channel only sends to SERVING replicas, so `health()` on
    it fails while none is."""

    def __init__(self, target: str = "127.0.0.1:50051", *, auth_token: str | None = None,
                 tls_ca: bytes | str | Path | None = None, tls_server_name: str | None = None,
                 max_message_bytes: int = 1 << 20, balance: bool | None = None):
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", -1)]
        self.balanced = lists_several(target) if balance is None else balance
        if self.balanced:
            options += [("grpc.service_config", balanced_service_config()), ("grpc.enable_retries", 1)]
        if tls_server_name is not None:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if tls_ca is not None:
            ca = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
            self.channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca), options)
        else:
            self.channel = grpc.insecure_channel(target, options)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    @staticmethod
    def request(prompt: str | None = None, *, messages: Sequence[tuple[str, str]] | None = None,
                max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                top_k: int | None = None, seed: int | None = None, stop: Sequence[str] = (),
                ignore_eos: bool = False, model: str = "") -> pb.GenerateRequest:
        """A GenerateRequest; unset (None) values are left unset for the server's defaults."""
        req = pb.GenerateRequest(prompt=prompt or "", model=model, stop=list(stop), ignore_eos=ignore_eos,
                                 messages=[pb.ChatMessage(role=r, content=c) for r, c in messages or ()])
        for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                            ("top_k", top_k), ("seed", seed)):
            if value is not None:
                setattr(req, name, value)
        return req

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **params) -> Iterator[pb.GenerateResponse]:
        """Stream the responses of one request (see `request` for the parameters). The returned
        iterator is also a grpc.Call: `.cancel()` stops the request."""
        return self.stub.Generate(self.request(prompt, **params), timeout=timeout, metadata=self._metadata)

    def list_models(self, timeout: float | None = 10.0) -> list[pb.ModelInfo]:
        return list(self.stub.ListModels(pb.ListModelsRequest(), timeout=timeout, metadata=self._metadata).models)

    def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        """'SERVING', 'NOT_SERVING', ... for `service` ('' = the whole server)."""
        response = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


# --- `jaxspec client` ------------------------------------------------------------------------


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (with --chat: the user message)")
    parser.add_argument("--host", default=None, help="server address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="server port (default 50051)")
    parser.add_argument("--target", default=None, help="a gRPC target instead of --host/--port; several replicas "
                        "as ipv4:HOST:PORT,HOST:PORT,... are balanced round-robin over the SERVING ones "
                        "(docs/scale_out.md)")
    parser.add_argument("--round-robin", action="store_true", help="balance a --target that resolves to several "
                        "addresses (e.g. dns:///NAME:PORT) like a list")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens at most (default: the server's)")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a chat user message")
    parser.add_argument("--system", default=None, help="with --chat: a system message first")
    parser.add_argument("--model", default="", help="model name (default: the server's)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--auth-token", default=None, help="bearer token, if the server requires one (every local "
                        f"user sees argv in `ps`: prefer --auth-token-file or ${TOKEN_ENV})")
    parser.add_argument("--auth-token-file", default=None, metavar="FILE",
                        help=f"read the bearer token from FILE; without either flag, ${TOKEN_ENV} is used when set")
    parser.add_argument("--tls-ca", default=None, help="PEM CA certificate: connect with TLS")
    parser.add_argument("--tls-server-name", default=None, help="expected name in the server certificate")
    parser.add_argument("--stats", action="store_true", help="print the request's statistics to stderr")


def run_client(args: argparse.Namespace, out=None, err=None) -> int:
    """Stream the text to `out` (stdout). Returns 0, or 1 with the gRPC status on `err` (stderr)."""
    out = out or sys.stdout
    err = err or sys.stderr
    if args.chat:
        messages = ([("system", args.system)] if args.system else []) + [("user", args.prompt)]
        prompt = None
    else:
        if args.system:
            print("jaxspec client: --system needs --chat", file=err)
            return 2
        messages, prompt = None, args.prompt
    if args.target is not None and (args.host is not None or args.port is not None):
        print("jaxspec client: give --target or --host/--port, not both", file=err)
        return 2
    if args.round_robin and args.target is None:
        print("jaxspec client: --round-robin needs --target", file=err)
        return 2
    target = args.target or f"{args.host or '127.0.0.1'}:{50051 if args.port is None else args.port}"
    try:
        token = resolve_token(args.auth_token, args.auth_token_file)
        lists_several(target)
    except (ValueError, OSError) as exc:
        print(f"jaxspec client: {exc}", file=err)
        return 2
    try:
        with GenerationClient(target, auth_token=token, tls_ca=args.tls_ca, tls_server_name=args.tls_server_name,
                              balance=True if args.round_robin else None) as client:
            last = None
            for message in client.generate(prompt, messages=messages, max_tokens=args.max_tokens,
                                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                           seed=args.seed, stop=args.stop, model=args.model, timeout=args.timeout):
                out.write(message.text)
                out.flush()
                last = message
            out.write("\n")
            out.flush()
    except grpc.RpcError as exc:
        print(f"\njaxspec client: {exc.code().name}: {exc.details()}", file=err)
        return 1
    except OSError as exc:  # e.g. an unreadable --tls-ca file
        print(f"jaxspec client: {exc}", file=err)
        return 2
    if args.stats and last is not None:
        s = last.stats
        ttft = f"{s.time_to_first_token_s:.3f}s" if s.HasField("time_to_first_token_s") else "-"
        acc = f"{s.acceptance:.2f}" if s.HasField("acceptance") else "-"
        print(f"[{FINISH_NAMES.get(last.finish_reason, '?')}] prompt {s.prompt_tokens} tokens, "
              f"completion {s.completion_tokens} tokens, ttft {ttft}, acceptance {acc}, total {s.total_s:.3f}s",
              file=err)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxspec.serving.client ...` (the same flags as `jaxspec client`)."""
    parser = argparse.ArgumentParser(prog="jaxspec client", description="Stream a generation from jaxspec serve.")
    add_client_arguments(parser)
    return run_client(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
