"""The serving process: the trio supervisor and the drain, one asyncio I/O thread for both
fronts (`grpc/`, `openai/`) and the metrics port, what the fronts share (the traffic ledger,
the caps, the limits, TLS, tenants), and the bridge and relay to the trio engine."""
