"""Writing a checkpoint in the background while training goes on.

The training thread only stages the state: a copy into CPU buffers that are kept from one
save to the next (allocating and faulting in a fresh copy of the whole state each time
was most of what staging cost). Everything else runs off the training thread, in order:
DCP's write over a process group of its own (on the training group it would interleave
with the training collectives and hang), then the manifest with every file's CRC32. The
future a save returns is done when both are, so a checkpoint is never reported before its
manifest exists, and a crash before then leaves a directory nobody resumes from.

One write at a time: `Checkpointer` decides what happens when a save falls due while one
is still in flight (`checkpoint.if_busy`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from shoal.worker.checkpoint import format as checkpoint_format


class BackgroundWriter:
    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        # Pinned buffers and a non-blocking copy on CUDA; plain reused buffers on CPU.
        options = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
        self.stager = DefaultStager(options)
        self.sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-checkpoint")

    def write(self, states: dict[str, Any], directory: Path, rank: int) -> Future:
        """Stage `states` (on this thread) and write and seal them in the background."""
        written = dcp.async_save(
            states, checkpoint_id=str(directory), process_group=self.group, async_stager=self.stager
        )
        return self.sealer.submit(_seal_when_written, written, directory, rank)

    def close(self) -> None:
        self.sealer.shutdown(wait=True)
        self.stager.close()


def _seal_when_written(written: Future, directory: Path, rank: int) -> None:
    written.result()
    checkpoint_format.seal(directory, rank)
