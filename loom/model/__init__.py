"""The model: loading, the Llama-family forward pass, paged attention over the KV pool, sampling,
and the runner that turns one `SchedulerOutput` into one `ModelRunnerOutput`. torch; no trio."""
