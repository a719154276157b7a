"""A tiny GPT-like stack for pipeline tests, and its single-process reference training loop.

embedding (+ learned positions) -> NUM_LAYERS pre-norm blocks (causal single-head attention + MLP)
-> final norm -> output head -> cross-entropy. Every block is initialised from a generator
seeded by its layer index, so a stage built from layers [a, b) equals those layers of the full
model. Activations are [seq, batch, hidden].
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, HIDDEN, SEQ, MICRO_BATCH, NUM_LAYERS = 32, 16, 8, 2, 8
STEPS, LR, MOMENTUM, ADAM_LR, CLIP = 5, 0.05, 0.9, 0.01, 1.0

# Outputs of stage forwards still referenced somewhere (in-flight activations on this process).
LIVE_OUTPUTS: weakref.WeakSet = weakref.WeakSet()


def _fill(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)


class Block(nn.Module):
    """Pre-norm residual block: causal single-head self-attention, then a GELU MLP."""

    def __init__(self, index: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(HIDDEN)
        # No qkv bias: the key bias has an exactly-zero gradient (softmax ignores a shift), and
        # Adam would turn its rounding noise into visible parameter differences.
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.mlp_norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)
        _fill(self, 100 + index)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def attention(self, h: torch.Tensor) -> torch.Tensor:  # [s, b, h] -> [s, b, h]
        q, k, v = self.qkv(h).transpose(0, 1).chunk(3, dim=-1)  # (b, s, h) each
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, h]
        x = x + self.attention(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TPBlock(Block):
    """Block with a tensor-parallel MLP (column- then row-parallel), loaded from ``Block(index)``.

    With sequence parallelism the block's input and output are this rank's ``[s/tp, b, h]``
    shard: attention (replicated weights) runs on the gathered sequence, the MLP on the shard.
    """

    def __init__(self, index: int, grid, sp: bool = False) -> None:
        super().__init__(index)
        from mg_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        self.group, self.sp = grid.tp_group, sp
        tp, rank = grid.tp_size, grid.tp_rank
        ref_fc1, ref_fc2 = self.fc1, self.fc2
        self.fc1 = ColumnParallelLinear(HIDDEN, 4 * HIDDEN, tp_group=self.group, sequence_parallel=sp)
        self.fc2 = RowParallelLinear(4 * HIDDEN, HIDDEN, tp_group=self.group, sequence_parallel=sp)
        with torch.no_grad():
            self.fc1.weight.copy_(ref_fc1.weight.chunk(tp, 0)[rank])
            self.fc1.bias.copy_(ref_fc1.bias.chunk(tp, 0)[rank])
            self.fc2.weight.copy_(ref_fc2.weight.chunk(tp, 1)[rank])
            self.fc2.bias.copy_(ref_fc2.bias)
        if sp:  # norms see only this rank's tokens: their gradients are partial sums over tp
            for p in [*self.attn_norm.parameters(), *self.mlp_norm.parameters()]:
                p.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from mg_parallel.tensor_parallel import (
            gather_from_sequence_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        h = self.attn_norm(x)
        if self.sp:
            full = gather_from_sequence_parallel_region(h, self.group, tensor_parallel_output_grad=False)
            x = x + scatter_to_sequence_parallel_region(self.attention(full), self.group)
        else:
            x = x + self.attention(h)
        return x + self.mlp(self.mlp_norm(x))


class Stage(nn.Module):
    """Layers ``layer_ids`` of the model, plus the embedding on the first and the head on the last stage."""

    def __init__(self, layer_ids: Sequence[int], *, first: bool, last: bool, tied: bool = False,
                 recompute: bool = False, grid=None, sp: bool = False) -> None:
        super().__init__()
        self.layer_ids = list(layer_ids)
        tp = grid is not None and grid.tp_size > 1
        self.layers = nn.ModuleList(TPBlock(i, grid, sp) if tp else Block(i) for i in self.layer_ids)
        self.tp_group = grid.tp_group if tp else None
        self.sp = sp and tp
        self.first, self.last, self.recompute = first, last, recompute
        self.input_tensor: torch.Tensor | None = None
        if first:
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.pos = nn.Parameter(torch.zeros(SEQ, 1, HIDDEN))
            _fill(self.embed, 1)
            _fill(nn.ParameterList([self.pos]), 2)
        if last:
            self.final_norm = nn.LayerNorm(HIDDEN)
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
            _fill(self.final_norm, 3)
            _fill(self.head, 4)
            if tied:
                if first:
                    self.head.weight = self.embed.weight  # one parameter in a single stage
                else:
                    _fill(self.head, 1)  # the same values as the first stage's embedding
        if self.sp and last:
            for p in self.final_norm.parameters():
                p.sequence_parallel = True
        if tied and (first ^ last):
            (self.embed.weight if first else self.head.weight).shared_embedding = True

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, tokens: torch.Tensor | None) -> torch.Tensor:
        if self.first:
            x = self.embed(tokens).transpose(0, 1) + self.pos  # (s, b, h)
            if self.sp:
                from mg_parallel.tensor_parallel import scatter_to_sequence_parallel_region

                x = scatter_to_sequence_parallel_region(x, self.tp_group)  # (s/tp, b, h)
        else:
            x = self.input_tensor
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.recompute else layer(x)
        if self.last:
            x = self.final_norm(x)
            if self.sp:
                from mg_parallel.tensor_parallel import gather_from_sequence_parallel_region

                x = gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=False)
            out = self.head(x)
        else:
            out = x
        LIVE_OUTPUTS.add(out)
        return out

    def global_params(self, tied: bool = False) -> dict[str, torch.Tensor]:
        """Parameters under the full model's names (layer indices global; tied head -> embedding)."""
        out = {}
        for name, p in self.named_parameters():
            if name.startswith("layers."):
                _, j, rest = name.split(".", 2)
                name = f"layers.{self.layer_ids[int(j)]}.{rest}"
            if tied and name == "head.weight":
                name = "embed.weight"
            out[name] = p.detach().clone()
            if getattr(p, "tensor_parallel", False):
                out[name] = (out[name], p.partition_dim)  # a shard: the caller joins the tp ranks
        return out


def make_batches(step: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` microbatches of (tokens, labels), each [MICRO_BATCH, SEQ], fixed by ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (count, MICRO_BATCH, SEQ + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def microbatch_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of [s, b, V] logits against [b, s] labels."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.transpose(0, 1).reshape(-1))


@functools.cache
def reference_run(num_microbatches: int, *, tied: bool = False, adam: bool = False
                  ) -> tuple[list[float], float, dict[str, torch.Tensor]]:
    """The full model in one process: plain gradient accumulation and SGD with momentum (or
    AdamW + grad-norm clipping with ``adam``); returns (losses, eval loss, params)."""
    with one_thread():
        return _reference_run(num_microbatches, tied, adam)


@contextlib.contextmanager
def one_thread():
    """Tiny shapes: intra-op threads only contend with the other processes on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _reference_run(num_microbatches: int, tied: bool, adam: bool) -> tuple[list[float], float, dict[str, torch.Tensor]]:
    model = Stage(range(NUM_LAYERS), first=True, last=True, tied=tied)
    if adam:
        opt = torch.optim.AdamW(model.parameters(), lr=ADAM_LR, weight_decay=0.0)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for tokens, labels in make_batches(step, num_microbatches):
            loss = microbatch_loss(model(tokens), labels)
            (loss / num_microbatches).backward()
            total += loss.item()
        if adam:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        losses.append(total / num_microbatches)
        opt.step()
    with torch.no_grad():
        batches = make_batches(STEPS, num_microbatches)
        eval_loss = sum(microbatch_loss(model(t), y).item() for t, y in batches) / num_microbatches
    return losses, eval_loss, model.global_params(tied)
