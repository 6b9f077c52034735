"""A decoder-only transformer over bytes (nanoGPT-shaped, written for clarity).

Input: token ids [batch, time]; output: logits [batch, time, vocab_size].
Attention views heads as `view(B, T, -1, head_dim)` so that a tensor-parallel
shard (heads / tp per rank) runs the same code.

It implements models/protocol.py's ParallelModel: tensor parallelism shards the
attention and MLP projections (Megatron style: q/k/v and up column-wise, out
and down row-wise; embeddings, norms and the head stay replicated); pipeline
stages hold contiguous runs of blocks, the first also the embeddings, the last
the final norm and head.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.degrees import layer_ranges


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.up = nn.Linear(d_model, 4 * d_model, bias=False)
        self.down = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    task = "lm"
    arg_limits = {  # checked before launch (models/registry.py): beyond these, a typo
        "n_layers": (1, 1024),
        "d_model": (1, 65536),
        "n_heads": (1, 1024),
        "vocab_size": (1, 1 << 22),
        "seq_len": (1, 1 << 20),
        "dropout": (0, 1),
    }

    def __init__(
        self,
        n_layers: int = 4,
        d_model: int = 128,
        n_heads: int = 4,
        vocab_size: int = 256,
        seq_len: int = 128,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
    ):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.seq_len, self.n_heads, self.n_layers = seq_len, n_heads, n_layers
        self.token_embedding: nn.Embedding | None = nn.Embedding(vocab_size, d_model)
        self.position_embedding: nn.Embedding | None = nn.Embedding(seq_len, d_model)
        # A dict, not a list: a pipeline stage keeps only its layers, under their original names.
        self.blocks = nn.ModuleDict({str(i): Block(d_model, n_heads, dropout) for i in range(n_layers)})
        self.final_norm: nn.LayerNorm | None = nn.LayerNorm(d_model)
        self.lm_head: nn.Linear | None = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:  # as in GPT-2; pipeline parallelism needs them untied
            self.lm_head.weight = self.token_embedding.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith(("out.weight", "down.weight")):  # residual projections, GPT-2 scaling
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids -> logits; a pipeline stage without the embedding or head takes or
        returns hidden states instead."""
        if self.token_embedding is not None:
            length = tokens.shape[1]
            if length > self.seq_len:
                raise ValueError(f"sequence of {length} tokens is longer than seq_len={self.seq_len}")
            positions = torch.arange(length, device=tokens.device)
            x = self.token_embedding(tokens) + self.position_embedding(positions)
        else:
            x = tokens
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is None:
            return x
        return self.lm_head(self.final_norm(x))

    # -- models/protocol.py's ParallelModel ------------------------------------------
    @classmethod
    def parallel_problems(cls, args: Mapping[str, Any], tp: int, stages: int) -> list[tuple[str, str]]:
        defaults = {k: p.default for k, p in inspect.signature(cls).parameters.items()}
        given = {**defaults, **args}
        problems = []
        if tp > 1 and given["n_heads"] % tp:
            problems.append(
                ("parallel.tp", f"model.args.n_heads ({given['n_heads']}) is not divisible by tp ({tp})")
            )
        if stages > 1 and given["n_layers"] < stages:
            problems.append(
                (
                    "parallel.pp",
                    f"{stages} pipeline stages need at least {stages} layers "
                    f"(model.args.n_layers is {given['n_layers']})",
                )
            )
        if stages > 1 and given["tie_embeddings"]:
            problems.append(
                (
                    "model.args",
                    "pipeline parallelism needs tie_embeddings: false "
                    "(the embedding and the head live on different stages)",
                )
            )
        return problems

    def tensor_parallel_plan(self) -> dict[str, Any]:
        # Lazy: torch.distributed.tensor takes most of a second to import, and `shoal validate`
        # imports this module without ever sharding a model.
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {
            "blocks.*.attn.q": ColwiseParallel(),
            "blocks.*.attn.k": ColwiseParallel(),
            "blocks.*.attn.v": ColwiseParallel(),
            "blocks.*.attn.out": RowwiseParallel(),
            "blocks.*.mlp.up": ColwiseParallel(),
            "blocks.*.mlp.down": RowwiseParallel(),
        }

    def pipeline_stage(self, stage: int, num_stages: int) -> GPT:
        part = copy.deepcopy(self)
        keep = {str(i) for i in layer_ranges(len(self.blocks), num_stages)[stage]}
        for name in list(part.blocks.keys()):
            if name not in keep:
                del part.blocks[name]
        if stage > 0:
            part.token_embedding = None
            part.position_embedding = None
        if stage < num_stages - 1:
            part.final_norm = None
            part.lm_head = None
        return part

    def fp8_filter(self, module: nn.Module, fqn: str) -> bool:
        return "lm_head" not in fqn  # the head stays in high precision
