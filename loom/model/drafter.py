"""A draft model for speculative decoding: the target's own weights in a cheaper method (the q4
copy of the exact model), with a KV pool of its own, proposing draft tokens greedily.

The draft pool has the target's shape and is addressed by the same block tables: token i of a
request lives in the same slot in both. So that the draft model has K/V wherever the target
has, it computes every token the target computes, each step, before the target: the step's
prompt chunks and decode tokens, and `draft_prefix`, the one token it lacks when the last step
accepted every draft (the draft model never computed the last of them). Then, for each
sequence given `num_draft_slots` k, it takes its argmax after its last token, and k - 1 times
more after the token it just took: the k drafts, which the step verifies (the drafts are
one-hot, so keeping those the target samples is rejection sampling: loom/core/speculative.py).
A draft token the target rejects leaves its K/V in the draft pool at a position the target
computes again, as the target's own: overwritten before it is read.

Worked example, k 2, a request with 10 tokens computed and token t10 to compute:

    pass 1: t10 at 10                 -> d1 (argmax after t10)
    pass 2: d1 at 11                  -> d2
    target: t10, d1, d2 at 10, 11, 12 -> samples s10, s11, s12; d1 == s10 and d2 == s11 keep
            both (emitting d1, d2, s12): the draft pool lacks d2 at 12, so the next step's
            pass 1 computes d2 at 12 (its draft_prefix) before s12 at 13.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import attrs
import torch

from loom.core.step import ScheduledSequence
from loom.model.decoder import DecoderModel
from loom.model.family import UnsupportedModelError
from loom.model.linear import check_method
from loom.model.loader import LoadedModel

log = logging.getLogger(__name__)
CHEAPER = ("none", "int8", "q4")  # the linear layers' methods, dearest first

Forward = Callable[[Sequence[ScheduledSequence]], torch.Tensor]  # hidden states, K/V written


class Drafter:
    """`forward` runs the draft model over the draft pool (ModelRunner.forward)."""

    def __init__(self, model: DecoderModel, forward: Forward) -> None:
        self.model = model
        self.forward = forward

    @torch.inference_mode()
    def draft(self, sequences: Sequence[ScheduledSequence]) -> list[ScheduledSequence]:
        """The step's sequences, each with `num_draft_slots` drafts in its tokens (the draft
        model having computed every sequence's tokens, with their prefixes)."""
        first = [
            attrs.evolve(
                s,
                token_ids=s.draft_prefix + s.token_ids,
                num_computed_tokens=s.num_computed_tokens - len(s.draft_prefix),
            )
            for s in sequences
        ]
        hidden = self.forward(first)
        ends = torch.tensor([len(s.token_ids) for s in first]).cumsum(0) - 1
        slotted = [i for i, s in enumerate(sequences) if s.num_draft_slots]
        drafts: dict[int, list[int]] = {i: [] for i in slotted}
        if slotted:
            last = self.argmax(hidden[ends[slotted]])
            for i, token in zip(slotted, last, strict=True):
                drafts[i].append(token)
        for step in range(1, max((sequences[i].num_draft_slots for i in slotted), default=0)):
            going = [i for i in slotted if sequences[i].num_draft_slots > step]
            one = [
                attrs.evolve(
                    sequences[i],
                    token_ids=(drafts[i][-1],),
                    num_computed_tokens=sequences[i].num_computed_tokens
                    + len(sequences[i].token_ids)
                    + step
                    - 1,
                    sampling=None,
                    scoring=None,
                )
                for i in going
            ]
            for i, token in zip(going, self.argmax(self.forward(one)), strict=True):
                drafts[i].append(token)
        return [
            attrs.evolve(
                s,
                token_ids=s.token_ids + tuple(drafts[i]),
                draft_token_ids=tuple(drafts[i]),
                num_draft_slots=0,
                draft_prefix=(),
            )
            if i in drafts
            else s
            for i, s in enumerate(sequences)
        ]

    def argmax(self, hidden: torch.Tensor) -> list[int]:
        logits = self.model.compute_logits(hidden).float()[:, : self.model.vocab_size]
        return [int(t) for t in logits.max(dim=-1).indices.tolist()]


def draft_model(loaded: LoadedModel, kv_dtype: torch.dtype) -> DecoderModel | None:
    """The target's weights as `draft_quantization` computes them, if set: refused at start
    where that method cannot run (a GPU, a dtype not float32), and a warning where it costs
    what the target does (no faster: nothing to gain)."""
    method = loaded.draft_quantization
    if method is None:
        return None
    try:
        check_method(method, loaded.device, loaded.dtype)
    except ValueError as exc:
        raise UnsupportedModelError(f"--speculative-quantization: {exc}") from None
    if CHEAPER.index(method) <= CHEAPER.index(loaded.quantization):
        log.warning(
            "the draft model computes as %s, the model as %s: its drafts cost what the "
            "model's own tokens do (no faster)",
            method,
            loaded.quantization,
        )
    return DecoderModel(
        loaded.model, quantization=method, tokenizer=loaded.tokenizer, kv_dtype=kv_dtype
    )
