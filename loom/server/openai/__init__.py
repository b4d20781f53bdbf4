"""OpenAI's HTTP API on the same engine as the gRPC front (docs/apis.md, "The OpenAI HTTP API")."""
