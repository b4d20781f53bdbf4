"""Where the model tests run: the device and dtype that LOOM_TEST_DEVICE and LOOM_TEST_DTYPE
name (cpu and float32 by default; `cuda` and `bfloat16` on a GPU machine, as
tools/gpu_check.sh runs them). Tests that compare with transformers build its model here too."""

from __future__ import annotations

import os

import torch

from loom.model.device import DTYPES

DEVICE = torch.device(os.environ.get("LOOM_TEST_DEVICE", "cpu"))
DTYPE = DTYPES[os.environ.get("LOOM_TEST_DTYPE", "float32")]
ON_GPU = DEVICE.type == "cuda"
