"""The loom.v1 gRPC front: Loom's own HTTP/2 layer on h2, every limit held where frames arrive
(docs/serving.md, "The network boundary"), and the servicer its calls go to.

What grpclib's own server does differently, and why Loom does not use it: a stream reset
before its handler task starts is never released (rapid reset keeps ~9 KB a stream for the
connection's life, and every later SETTINGS or WINDOW_UPDATE walks the dead streams); it
answers PINGs and SETTINGS into an unbounded buffer for a peer that does not read; it has no
preface, header, body or idle timeouts and no connection limits; and on a lost connection it
ends a handler only by cancelling its task, which a swallowed cancellation defeats (Python
3.11's asyncio.wait_for swallowed one, and the request ran on, writing into a dead socket).
Here the connection owns each stream's end, and a call's end runs what must not outlive it
(the engine abort) itself.
"""
