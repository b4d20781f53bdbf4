"""A deliberately broken server for `loom chaos` to catch: `loom serve`, except that every
request aborted (a client cancel, reset or disconnect) leaks one KV block.

    python -m tests.chaos.leaky_server serve --model sim
"""

from __future__ import annotations

from loom import cli
from loom.core.request import Request, RequestStatus
from loom.core.scheduler import Scheduler

finish = Scheduler.finish


def leaky_finish(
    self: Scheduler, request: Request, status: RequestStatus, error: str | None = None
) -> bool:
    if status is RequestStatus.FINISHED_ABORTED and not request.finished:
        self.block_manager.allocate(f"leaked-{request.request_id}", 1)  # held by no one, forever
    return finish(self, request, status, error)


if __name__ == "__main__":
    Scheduler.finish = leaky_finish  # type: ignore[method-assign]
    cli.main()
