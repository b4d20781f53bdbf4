"""The static decode step: a decode step of fixed shape over persistent buffers, so that a GPU
replays it from a CUDA graph (one launch for the whole step) instead of issuing its kernels one
by one from Python.

A step of S decoding sequences runs at the bucket B >= S (1, 2, 4, ..., MAX_GRAPH_SEQS): the
inputs are written into the first B rows of persistent buffers (token ids, positions, slot
mapping, sequence lengths, block tables: one copy from the host), rows S..B-1 padded, and the
step reads only those buffers. Its forward is the decoder's own (loom/model/decoder.py) with
the in-place decode attention (loom/model/attention.py) and the rotary table looked up by
position (computed once for every position at start: the context cap keeps the model's rotary
tables fixed, loom/model/family.py), then the LM head. The host reads nothing back inside the
step; the hidden states and logits of the S real rows come out.

Padded rows decode a token of id 0 at position 0 that attends one key, the null block's first
(zeros), and write their K and V to the scratch slot: a block past the BlockManager's, which no
request ever reads. So a padded row changes nothing a real row reads, and never block 0.

Worked example, block_size 4, buckets 1, 2, 4. Three sequences decode: A (5 cached, table
[7, 2]), B (0 cached, table [4]), C (9 cached, table [3, 6, 1]); the pool has 9 blocks, the
scratch block is 9 (slot 36). Bucket 4, max_blocks 3:

    input_ids      [a, b, c, 0]
    positions      [5, 0, 9, 0]
    slot_mapping   [2*4+1, 4*4+0, 1*4+1, 36] = [9, 16, 5, 36]
    seq_lens       [6, 1, 10, 1]
    block_tables   [[7, 2, 0], [4, 0, 0], [3, 6, 1], [0, 0, 0]]

On a GPU each bucket is captured once at start (a warm-up on padded rows, then the capture);
on a CPU the same step runs eagerly, which is how the tests hold it equal to the dynamic step.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from loom.core.step import ScheduledSequence
from loom.model.attention_metadata import AttentionGroup, AttentionMetadata
from loom.model.decoder import DecoderModel, RotaryTable
from loom.model.kv_cache import KVCache
from loom.model.launched import SampledTokens

MAX_GRAPH_SEQS = 256  # the largest bucket: a step of more sequences runs dynamically
FIELDS = 4  # input_ids, positions, slot_mapping, seq_lens: a row each in the buffers


@attrs.frozen
class StaticOutput:
    hidden: torch.Tensor  # [rows, hidden]: the last layer's, before the final norm
    logits: torch.Tensor  # [rows, vocab], in the model's dtype
    argmax: torch.Tensor  # [rows] each row's greedy token (the sampler's argmax: the first max)


class StaticDecode:
    """Decode steps of up to `max_seqs` sequences over persistent buffers; captured in CUDA
    graphs where `graphs` (a GPU)."""

    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        *,
        block_size: int,
        scratch_block: int,
        max_seqs: int = MAX_GRAPH_SEQS,
        graphs: bool = False,
    ) -> None:
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.buckets = [1 << i for i in range(max(1, max_seqs - 1).bit_length() + 1)]
        self.scratch_slot = scratch_block * block_size
        self.max_blocks = -(-model.max_model_len // block_size)
        rows, device = self.buckets[-1], model.device
        index = torch.int64 if device.type == "cpu" else torch.int32  # the CPU kernel's: int64
        # On the host (pinned on a GPU): the fields, the pending tokens' rows and sources
        # (loom/model/launched.py), then a step's tables packed [rows, width].
        size = (FIELDS + 2) * rows + rows * self.max_blocks
        self.host = torch.zeros(size, dtype=index, pin_memory=device.type == "cuda")
        self.staged = torch.zeros(size, dtype=index, device=device)  # the host's, copied
        self.fields = self.staged[: FIELDS * rows].view(FIELDS, rows)
        self.pending = self.staged[FIELDS * rows : (FIELDS + 2) * rows].view(2, rows)
        self.block_tables = torch.zeros(rows, self.max_blocks, dtype=index, device=device)
        on_gpu = device.type == "cuda"
        self.copied = torch.cuda.Event() if on_gpu else None  # type: ignore[no-untyped-call]
        # Read back into two pinned buffers in turn: a step's tokens stay there while the
        # next step (launched before they are read) writes the other.
        self.readbacks = [Readback.pinned(rows, on_gpu) for _ in range(2)]
        self.num_reads = 0
        self.rotary = self.rotary_table()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, StaticOutput] = {}
        if graphs:
            self.capture()

    def takes(self, sequences: Sequence[ScheduledSequence]) -> bool:
        """A step this runs: every sequence decodes one token, draws no drafts, and scores and
        pools nothing, within the largest bucket."""
        return len(sequences) <= self.buckets[-1] and all(
            len(s.token_ids) == 1 and s.scoring is None and s.pooling is None for s in sequences
        )

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def run(
        self, sequences: Sequence[ScheduledSequence], sampled: SampledTokens | None = None
    ) -> StaticOutput:
        """The step's last hidden states and logits, the sequences' rows; a pending token is
        taken from `sampled` (the last step's)."""
        rows, num_seqs = self.bucket(len(sequences)), len(sequences)
        self.fill(sequences, rows, sampled)
        graph = self.graphs.get(rows)
        if graph is None:
            out = self.forward(rows)
        else:
            graph.replay()
            out = self.outputs[rows]
        return StaticOutput(
            hidden=out.hidden[:num_seqs], logits=out.logits[:num_seqs], argmax=out.argmax[:num_seqs]
        )

    def fill(
        self,
        sequences: Sequence[ScheduledSequence],
        rows: int,
        sampled: SampledTokens | None = None,
    ) -> None:
        """Write the step's inputs into the buffers' first `rows` rows (see the worked example
        at the top), padded: built on the host, copied over in one piece (the fields, the
        pending tokens' rows and sources, and the tables packed as wide as this step's
        longest); on the device the pending tokens are put in place and the tables spread (a
        table's entries past its sequence's blocks are never read: left as they were)."""
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy out of the host buffer is done
        most, padding = self.buckets[-1], rows - len(sequences)
        positions = self.write_fields(sequences, rows)
        sampled = sampled or SampledTokens.none()
        sources = sampled.sources(sequences)  # (row, its token's row in `sampled`) each
        if sources:
            pending = self.host[FIELDS * most : (FIELDS + 2) * most].view(2, most)
            pending[:, : len(sources)] = torch.tensor(sources).T
        width = max((p // self.block_size + 1 for p in positions), default=1)
        tables = [
            list(s.block_table[:width]) + [0] * (width - len(s.block_table)) for s in sequences
        ]
        first = (FIELDS + 2) * most
        end = first + rows * width
        self.host[first:end] = torch.tensor(tables + [[0] * width] * padding).view(-1)
        # Asynchronous from pinned memory: the host buffer is written again only once the
        # event recorded after the copy has passed (above).
        self.staged[:end].copy_(self.host[:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if sources:  # the pending tokens put in place, from the device
            at, source = self.pending[:, : len(sources)].long().unbind(0)
            self.fields[0].index_copy_(0, at, sampled.token_ids[source].to(self.host.dtype))
        self.block_tables[:rows, :width] = self.staged[first:end].view(rows, width)

    def write_fields(self, sequences: Sequence[ScheduledSequence], rows: int) -> list[int]:
        """The fields of the first `rows` rows into the host buffer; the sequences' positions."""
        block_size, padding = self.block_size, rows - len(sequences)
        positions = [s.num_computed_tokens for s in sequences]
        slots = [
            s.block_table[p // block_size] * block_size + p % block_size
            for s, p in zip(sequences, positions, strict=True)
        ]
        fields = torch.tensor(
            [
                [s.token_ids[0] for s in sequences] + [0] * padding,
                positions + [0] * padding,
                slots + [self.scratch_slot] * padding,
                [p + 1 for p in positions] + [1] * padding,  # a padded row: the null block's key
            ]
        )
        most = self.buckets[-1]
        self.host[: FIELDS * most].view(FIELDS, most)[:, :rows] = fields
        return positions

    def forward(self, rows: int) -> StaticOutput:
        """The model's forward and LM head over the buffers' first `rows` rows: reads the
        buffers alone."""
        ids, positions, slots, lens = self.fields[:, :rows].long().unbind(0)
        tables = self.block_tables[:rows]
        group = AttentionGroup(
            query_index=torch.arange(rows, device=ids.device)[:, None],
            block_index=tables.reshape(-1),
            mask=ids.new_zeros(0),
            window_masks={},
            valid=ids.new_ones(rows, 1, dtype=torch.bool),
            output_index=ids.new_zeros(0),
            valid_rows=ids.new_zeros(0),
            seq_lens=lens,
        )
        metadata = AttentionMetadata(slot_mapping=slots, groups=(group,), decode_in_place=True)
        looked_up = {
            key: (cos[positions], sin[positions]) for key, (cos, sin) in self.rotary.items()
        }
        hidden = self.model.forward(ids, positions, metadata, self.kv_cache, rotary=looked_up)
        logits = self.model.compute_logits(hidden)
        argmax = logits[:, : self.model.vocab_size].max(dim=-1).indices
        return StaticOutput(hidden=hidden, logits=logits, argmax=argmax)

    def read(self, token_ids: torch.Tensor) -> Readback:
        """The step's tokens [S] on their way to the host: one copy into pinned memory (a
        GPU's), the step's one read back, waited for when they are read."""
        readback = self.readbacks[self.num_reads % 2]
        self.num_reads += 1
        return readback.start(token_ids)

    def rotary_table(self) -> dict[object, RotaryTable]:
        """cos and signed sin [max_model_len, 1, rotary_dim] per table, every position's."""
        model = self.model
        positions = torch.arange(model.max_model_len, device=model.device)
        hidden = torch.zeros(1, model.hidden_size, dtype=model.dtype, device=model.device)
        return dict(model.rotary_tables(hidden, positions))

    def capture(self) -> None:
        """Each bucket's step captured in a CUDA graph, largest first so that the smaller ones
        share its memory pool; each warmed up first on padded rows (Triton's compiles, cuBLAS's
        workspaces), which write only the scratch slot."""
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.buckets):
            self.fill((), rows)
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.forward(rows)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[rows] = self.forward(rows)
            self.graphs[rows] = graph
        torch.cuda.synchronize()


@attrs.define
class Readback:
    """A pinned host buffer a step's tokens are copied into, and the event recorded after the
    copy; on a CPU (no event) the tokens are read at once."""

    host: torch.Tensor
    copied: torch.cuda.Event | None
    num_tokens: int = 0
    known: list[int] = attrs.field(factory=list)  # a CPU's

    @classmethod
    def pinned(cls, rows: int, on_gpu: bool) -> Readback:
        event = torch.cuda.Event() if on_gpu else None  # type: ignore[no-untyped-call]
        return cls(torch.zeros(rows, dtype=torch.long, pin_memory=on_gpu), event)

    def start(self, token_ids: torch.Tensor) -> Readback:
        """The copy of `token_ids` [S] begun (on a GPU), or the tokens read (on a CPU)."""
        self.num_tokens = len(token_ids)
        if self.copied is None:
            self.known = token_ids.tolist()
            return self
        self.host[: self.num_tokens].copy_(token_ids, non_blocking=True)
        self.copied.record()
        return self

    def ready(self) -> bool:
        """Whether the tokens can be read without a wait."""
        return self.copied is None or bool(self.copied.query())  # type: ignore[no-untyped-call]

    def token_ids(self) -> list[int]:
        """The tokens, once the copy is done (waited for here)."""
        if self.copied is None:
            return self.known
        self.copied.synchronize()
        found: list[int] = self.host[: self.num_tokens].tolist()
        return found
