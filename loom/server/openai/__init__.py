"""OpenAI's HTTP API on the same engine as the gRPC front (README, "The OpenAI HTTP API")."""
