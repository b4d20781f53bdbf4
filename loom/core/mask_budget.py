"""Which constrained rows a step takes on: token masks are work, and a step carries at most
`step_mask_budget` of it.

Each row counts at what its recent tokens cost its grammar, at their peak
(Matcher.token_seconds: CPU time, a token's mask and the consume of the token sampled under it,
a dearer token at once, a cheaper one halving the figure at most: loom/model/grammar.py); a new
request at its template's figure (its first mask as it compiled, then its copies' first
tokens, by the same rule). The engine charges
each row's tenant for what its token took (loom/engine/engine_core.py), so under the fair
policy a tenant of expensive grammars falls behind in the order below as well as waiting for
budget.
"""

from __future__ import annotations

from collections.abc import Mapping

from loom.core.policy import Policy
from loom.core.request import Request


def within_mask_budget(
    chosen: list[tuple[Request, int]],
    budget: float,
    policy: Policy,
    drafts: Mapping[str, tuple[int, ...]],
) -> list[tuple[Request, int]]:
    """The step's `chosen` rows (request, tokens), less the constrained ones that sample and
    would take the step past `budget` seconds (`step_mask_budget`): those wait for a later step,
    holding what they were given (their blocks; an admitted one stays admitted). Rows go in
    the policy's order (its `mask_key`: fair, the least served tenant's first;
    priority, the lowest number), then the row longest out of a step first (Request.last_step:
    a row left out goes before those that ran); the first always goes, whatever its cost, so
    a step with rows keeps one and no request waits for ever. A row with k `drafts` counts
    k + 1 masks (speculative decoding: one for each position it samples at)."""

    masked = [
        r for r, n in chosen if r.matcher is not None and r.num_computed_tokens + n == r.num_tokens
    ]
    masked.sort(key=lambda r: (policy.mask_key(r), r.last_step))
    spent, later = 0.0, set()
    for request in masked:
        assert request.matcher is not None
        cost = request.matcher.token_seconds * (1 + len(drafts.get(request.request_id, ())))
        if spent and spent + cost > budget:
            later.add(request)
        else:
            spent += cost
    return [(r, n) for r, n in chosen if r not in later] if later else chosen
