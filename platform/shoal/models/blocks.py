"""A model's repeated blocks: what FSDP shards, activation checkpointing recomputes and
compile compiles one at a time, and what the cost trace measures block by block.

The built-in GPT keeps them in its `blocks` ModuleDict. A Hugging Face model names their
class in `_no_split_modules` (LlamaDecoderLayer, GPT2Block, ...) and holds them in a
ModuleList (`model.layers`, `transformer.h`). Any other model has none and is treated as
one piece.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class BlockSlot:
    """Where one block sits: its container and its key there (the last part of its
    parameters' names before the block's own), so that it can be replaced in place."""

    container: nn.Module
    name: str

    @property
    def module(self) -> nn.Module:
        return getattr(self.container, self.name)

    def replace(self, module: nn.Module) -> None:
        """Put `module` (a wrapper of the block) where the block was, under the same key."""
        setattr(self.container, self.name, module)


def repeated_blocks(model: nn.Module) -> list[BlockSlot]:
    """The model's repeated blocks in forward order; none for a model without any."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return [BlockSlot(blocks, name) for name in blocks]
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    return list(_find(model, block_classes)) if block_classes else []


def _find(module: nn.Module, block_classes: set[str]) -> list[BlockSlot]:
    found = []
    for name, child in module.named_children():
        if isinstance(module, CONTAINERS) and _is_block(child, block_classes):
            found.append(BlockSlot(module, name))
        else:
            found += _find(child, block_classes)
    return found


def _is_block(module: nn.Module, block_classes: set[str]) -> bool:
    """By class name anywhere in its class hierarchy (FSDP renames the class it shards to
    FSDP<Name>, a subclass), looking through an activation-checkpointing wrapper."""
    inner = getattr(module, "_checkpoint_wrapped_module", module)
    return any(cls.__name__ in block_classes for cls in type(inner).__mro__)
