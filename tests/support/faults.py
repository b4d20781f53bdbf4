"""Model runners with a fault in them, for the engine's `make_runner` seam."""

from __future__ import annotations

from collections.abc import Callable

from loom.core.step import SchedulerOutput
from loom.model.launched import Launched
from loom.model.model_runner import ModelRunner
from loom.model.sampler import Masks


def failing_at(step: int) -> type[ModelRunner]:
    """A runner whose `step`-th step raises RuntimeError("injected fault")."""

    class FailingRunner(ModelRunner):
        num_steps = 0

        def launch(self, output: SchedulerOutput, masks: Masks | None = None) -> Launched:
            self.num_steps += 1
            if self.num_steps == step:
                raise RuntimeError("injected fault")
            return super().launch(output, masks)

    return FailingRunner


def calling_before_each_step(
    hook: Callable[[SchedulerOutput], None], base: type[ModelRunner] = ModelRunner
) -> type[ModelRunner]:
    """A runner (a `base`) that calls `hook(output)` in the worker thread as each step starts."""

    class HookedRunner(base):  # type: ignore[valid-type,misc]
        def launch(self, output: SchedulerOutput, masks: Masks | None = None) -> Launched:
            hook(output)
            return super().launch(output, masks)

    return HookedRunner
