"""Loom's own clients, for everything that calls a server: `loom health`, `loom bench`,
`loom chaos`, the examples and the tests.

- `tls`: a client's TLS context, and the flags that ask for it;
- `channel`: a grpclib channel with TLS and the metadata (an API key) every call carries;
- `calls`: the unary calls (server stats, polled until a condition, model info, health);
- `health`: the `loom health` command, for docker and Kubernetes probes;
- `sse`: the events of a server-sent-event stream, as its bytes arrive;
- `frames`: raw HTTP/2 frames made by hand, for clients no gRPC library would let be.
"""
