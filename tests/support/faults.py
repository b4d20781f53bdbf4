"""Model runners with a fault in them, for the engine's `make_runner` seam."""

from __future__ import annotations

from collections.abc import Callable

from loom.core.step import ModelRunnerOutput, SchedulerOutput
from loom.model.model_runner import ModelRunner
from loom.model.sampler import Masks


def failing_at(step: int) -> type[ModelRunner]:
    """A runner whose `step`-th step raises RuntimeError("injected fault")."""

    class FailingRunner(ModelRunner):
        num_steps = 0

        def execute_model(
            self, output: SchedulerOutput, masks: Masks | None = None
        ) -> ModelRunnerOutput:
            self.num_steps += 1
            if self.num_steps == step:
                raise RuntimeError("injected fault")
            return super().execute_model(output, masks)

    return FailingRunner


def calling_before_each_step(hook: Callable[[SchedulerOutput], None]) -> type[ModelRunner]:
    """A runner that calls `hook(output)` in the worker thread as each step starts."""

    class HookedRunner(ModelRunner):
        def execute_model(
            self, output: SchedulerOutput, masks: Masks | None = None
        ) -> ModelRunnerOutput:
            hook(output)
            return super().execute_model(output, masks)

    return HookedRunner
