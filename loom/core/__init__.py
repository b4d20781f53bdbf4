"""The synchronous core: request state, sampling parameters, the block manager, the scheduler and
the step's contract, stop checks and detokenising. Plain Python: it imports neither torch nor trio
and does no I/O, so it is tested in milliseconds."""
