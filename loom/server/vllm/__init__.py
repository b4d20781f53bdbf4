"""vllm.grpc.engine.VllmEngine, the SMG gateway's worker protocol, on Loom's gRPC port."""
