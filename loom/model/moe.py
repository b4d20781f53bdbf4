"""A mixture of experts in place of a layer's MLP (Qwen2-MoE, Qwen1.5-MoE): a router picks each
token's top-k experts, their gated MLPs' outputs are summed by the router's weights, and a
shared expert, gated by a sigmoid, adds to every token.

The arithmetic is transformers' (Qwen2MoeSparseMoeBlock): the router's softmax in float32, the
top-k weights renormalised only with `norm_topk_prob`, each expert run on the tokens that chose
it, experts in ascending order, their outputs added into the sum in that order. The experts'
weights stay in the model's dtype under every quantization (the layers around them are
quantised as usual); the experts' weights are kept fused, as transformers stores them:
`gate_up [E, 2I, H]` (gate first), `down [E, H, I]`.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F  # noqa: N812


@attrs.frozen(kw_only=True, eq=False)
class Experts:
    router: torch.Tensor  # [E, hidden]
    gate_up: torch.Tensor  # [E, 2 I, hidden]
    down: torch.Tensor  # [E, hidden, I]
    top_k: int
    normalize: bool  # renormalise the top-k weights to sum to 1
    shared_gate: torch.Tensor | None  # [1, hidden]: sigmoid(x @ g) scales the shared expert

    def __call__(self, x: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """x [T, hidden] -> the experts' sum [T, hidden], plus the gated `shared` expert's
        output where there is one."""
        logits = F.linear(x, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(x)
        # The (token, slot) pairs grouped by expert, ascending, each group in row order (what
        # torch.where(chosen == e) gives, expert by expert): one stable sort, and one read back,
        # the groups' sizes, where a where and a unique each were a wait for the device.
        flat = chosen.flatten()
        order = torch.sort(flat, stable=True).indices
        counts = torch.zeros(self.router.shape[0], dtype=torch.long, device=x.device)
        sizes: list[int] = counts.scatter_add_(0, flat, torch.ones_like(flat)).tolist()
        start = 0
        for expert, size in enumerate(sizes):
            if size == 0:
                continue
            pairs, start = order[start : start + size], start + size
            tokens, slot = pairs // self.top_k, pairs % self.top_k
            gate, up = F.linear(x[tokens], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[expert])
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        if shared is not None and self.shared_gate is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out


def load_experts(
    weights: dict[str, torch.Tensor], mlp: str, top_k: int, normalize: bool
) -> Experts | None:
    """The layer's experts (`mlp` is its `model.layers.N.mlp.` prefix), if it has any."""
    if mlp + "experts.gate_up_proj" not in weights:
        return None
    gate = weights.get(mlp + "shared_expert_gate.weight")
    return Experts(
        router=weights[mlp + "gate.weight"].clone(),
        gate_up=weights[mlp + "experts.gate_up_proj"].clone(),
        down=weights[mlp + "experts.down_proj"].clone(),
        top_k=top_k,
        normalize=normalize,
        shared_gate=None if gate is None else gate.clone(),
    )
