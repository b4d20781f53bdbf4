"""Loom: an LLM inference engine and gRPC server. Its layers, each importing only those above it
in this list (tests/test_layers.py holds the rule):

- `loom.core`: requests, sampling parameters, blocks, scheduling, stops, detokenising. Plain
  synchronous Python: no torch, no trio, no I/O.
- `loom.model`: the model runner, its forward pass, attention, KV pool, sampler and loader (torch).
- `loom.engine`: the trio engine: admission, the stepping loop, request streams.
- `loom.server`: the serving process: grpclib on its own thread, the bridge to trio, the handlers.
- `loom.bench`, `loom.cli` and `loom.entry_point`: the benchmarks and the command line, on top.
"""
