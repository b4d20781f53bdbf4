"""The serving process: grpclib on its own asyncio thread, the bridge to the trio engine, the
loom.v1 handlers and their wire conversions, drain and signals, and the health probe."""
