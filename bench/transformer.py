"""The bench's second workload: a small decoder-only transformer with a transformer-sized state.

Built from `CONFIG` (no download, no tokenizer: random token ids from the rank's generator), so
that snapshot, checkpoint and restore costs are measured at the size of a real model's state: its
46 million parameters are 185 MB of float32, and AdamW keeps two more tensors of that size, so
model plus optimizer state is about 555 MB (`state_bytes`; at least 500 MB, the issue's floor).
A GPT-style stack: token and position embeddings, pre-norm self-attention blocks under a causal
mask (`nn.TransformerEncoderLayer`: a decoder-only model has no cross-attention), a final norm
and an output head tied to the token embedding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int = 16384
    seq: int = 64
    d_model: int = 512
    heads: int = 8
    layers: int = 12
    ff: int = 2048
    batch: int = 1  # sequences a rank trains a step: about 3 s a step on one core here


CONFIG = Config()


class Decoder(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq, c.d_model)
        layer = nn.TransformerEncoderLayer(
            c.d_model, c.heads, c.ff, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, c.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2's
        nn.init.normal_(self.tok.weight, std=0.02)  # GPT-2's: N(0, 1) logits would be huge
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(c.seq))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.tok(ids) + self.pos(pos)
        n = ids.shape[1]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The bytes of the model's parameters and buffers plus the optimizer's state tensors."""
    seen: set[int] = set()
    total = 0
    tensors = [*model.state_dict().values()]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if t.data_ptr() not in seen:  # the tied head is the embedding's storage
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def build(c: Config = CONFIG) -> tuple[nn.Module, Callable, Callable, int]:
    """What `bench.workload.build` returns for this workload: the model, AdamW, a batch of
    `c.batch` random sequences (inputs, next-token targets) and the sequences a rank trains."""

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]

    def make_opt(params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=3e-4)

    return Decoder(c), make_opt, batch, c.batch
