"""Benchmarks: `loom bench` (the serving benchmark, its transformers baseline and its figures) and
`loom bench-step` (the model runner's decode step, part by part)."""
