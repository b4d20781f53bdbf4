"""Stream an answer from a Loom server to the terminal as it is generated.

    python examples/client.py "What is the capital of France?"
    python examples/client.py --raw "Once upon a time" --max-tokens 40 --temperature 0.8 --seed 1

By default the prompt is sent as a chat message (the model's chat template applies); `--raw`
sends it as plain text. A grpclib client: one channel, one server-streaming call.

Behind nginx (deploy/nginx/), `--routing-key ID` sends the `loom-routing-key` metadata header:
calls with the same key (say, one conversation's turns) reach the same replica, where their
shared prefix is cached.

    python examples/client.py --routing-key conversation-42 "What is the capital of France?"

Over TLS (a server started with --tls-cert-file and --tls-key-file), `--tls-ca-file CA.pem`
checks the server's certificate; with mutual TLS, `--tls-cert-file` and `--tls-key-file` give
the client's own.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from grpclib import GRPCError
from grpclib.client import Channel

from loom.client.tls import add_tls_arguments, tls_of
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub


def request_from(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        stop=args.stop,
    )
    if args.top_k is not None:
        sampling.top_k = args.top_k
    if args.seed is not None:
        sampling.seed = args.seed
    if args.raw:
        return pb.GenerateRequest(text=args.prompt, sampling=sampling)
    messages = [pb.ChatMessage(role="user", content=args.prompt)]
    if args.system:
        messages.insert(0, pb.ChatMessage(role="system", content=args.system))
    return pb.GenerateRequest(messages=pb.ChatMessages(messages=messages), sampling=sampling)


async def main(args: argparse.Namespace) -> int:
    async with Channel(args.host, args.port, ssl=tls_of(args)) as channel:
        stub = LoomStub(channel)
        try:
            metadata = {"loom-routing-key": args.routing_key} if args.routing_key else None
            async with stub.Generate.open(timeout=args.timeout, metadata=metadata) as stream:
                await stream.send_message(request_from(args), end=True)
                async for response in stream:
                    if response.HasField("delta"):
                        print(response.delta.text, end="", flush=True)
                    else:
                        final = response.final
                        print(final.delta.text, flush=True)
                        reason = pb.FinishReason.Name(final.finish_reason)
                        print(
                            f"[{reason.removeprefix('FINISH_REASON_').lower()}: "
                            f"{final.usage.prompt_tokens} prompt "
                            f"({final.usage.cached_tokens} of them cached) + "
                            f"{final.usage.completion_tokens} generated tokens, "
                            f"first token after {final.timings.ttft_ms:.0f} ms, "
                            f"{final.timings.e2e_ms:.0f} ms in all]",
                            file=sys.stderr,
                        )
        except GRPCError as exc:
            print(f"\nerror: {exc.status.name}: {exc.message}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--raw", action="store_true", help="send plain text, not a chat message")
    parser.add_argument("--routing-key", default=None, help="loom-routing-key, for nginx")
    parser.add_argument("--system", default=None, help="a system message (chat mode)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--timeout", type=float, default=None, help="the call's deadline, seconds")
    add_tls_arguments(parser)
    sys.exit(asyncio.run(main(parser.parse_args())))
