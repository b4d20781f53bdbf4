"""Which constrained rows a step takes on: token masks are work, and a step carries at most
`step_mask_budget` of it.

Each row counts at its last mask's time (Matcher.mask_seconds, measured by the mask threads in
their own CPU time: loom/model/grammar.py); a waiting request, whose first mask may come in
this step, at a copy's first, as its constraint's compile measured it. The engine charges
each row's tenant for the mask it took (loom/engine/engine_core.py), so a tenant of
expensive masks falls behind in the order below as well as waiting for budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from loom.core.config import SchedulerConfig
from loom.core.request import Request, RequestStatus


def past_mask_budget(
    running: Iterable[Request],
    waiting: Iterable[Request],
    counters: Mapping[str, float],
    config: SchedulerConfig,
) -> set[Request]:
    """The constrained rows (decodes, and waiting requests) that would take this step past
    the budget. The least served tenant's rows go first (its fair-share counter), and within
    a tenant the ones with the fewest tokens (a row left out is first next time); the first
    always goes, whatever its cost: no request waits for ever, and no tenant's running rows
    hold the budget from another's new request."""
    decodes = [
        r
        for r in running
        if r.matcher is not None
        and not r.paused
        and r.status is RequestStatus.RUNNING
        and r.num_tokens - r.num_computed_tokens == 1
    ]
    rows = decodes + [r for r in waiting if r.matcher is not None and not r.paused]
    rows.sort(key=lambda r: (counters.get(r.tenant, 0.0), len(r.output_token_ids)))
    spent, later = 0.0, set()
    for request in rows:
        assert request.matcher is not None
        cost = request.matcher.mask_seconds
        if spent and spent + cost > config.step_mask_budget:
            later.add(request)
        else:
            spent += cost
    return later
