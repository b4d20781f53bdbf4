"""Generated gRPC code for the loom.v1 API (`just proto`); do not edit."""
