"""The trio engine: admission, the stepping loop that drives the scheduler and the model runner,
and the bounded per-request streams its consumers read. No grpclib."""
