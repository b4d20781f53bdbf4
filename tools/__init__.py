"""Tools run by hand or by CI: the GPU device check (gpu_check.py)."""
