"""The step's stats all-reduce carried inside DDP's first gradient all-reduce.

Every step shoal all-reduces a small tensor (loss, decisions, every rank's timings:
reporting.py's StepStats) beside DDP's gradient all-reduce. On CPU, where a step of a
small model is mostly coordination, that second collective cost shoal ~5% of a step on 8
workers sharing 2 cores. This DDP communication hook appends the stats to the first
gradient bucket, so that one collective carries both. The first, because DDP keeps it small
(1 MiB, or one larger parameter; the others up to 25 MiB) and riding costs a copy of the
bucket and back: on `make bench`'s 10.8M-parameter GPT the last bucket holds 3.1M
parameters (~3 ms a step), the first 0.59M (~0.4 ms).

The stats are float64; a bucket holds float32 (or float64) gradients. Each stat travels
as two float32 halves (the value rounded, then what rounding lost), summed separately
and added back: a per-rank slot, where one rank sends a value and the others zeros,
comes back exact to ~48 bits (a 32-bit address or a row count included); a sum over
ranks, to fp32's rounding of each half (a finite stat beyond fp32's range, ~3.4e38, would
come back inf: no stat shoal sends is near it). Buckets of other dtypes (bf16 parameters)
carry nothing: the stats start their own all-reduce beside that bucket's, on every rank alike.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

CARRIES = (torch.float32, torch.float64)


NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def split64(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 values (on CPU) as [rounded to `dtype`, what rounding lost], concatenated; in
    numpy, where these few small operations cost a fifth of torch's dispatch."""
    exact = values.numpy()
    # over: a finite stat beyond float32's range becomes inf, as torch's cast made it silently;
    # invalid: inf - inf, where the `where` keeps inf as it is
    with np.errstate(over="ignore", invalid="ignore"):
        high = exact.astype(NUMPY_DTYPES[dtype])
        lost = np.where(np.isfinite(high), exact - high, 0.0).astype(high.dtype)
    return torch.from_numpy(np.concatenate([high, lost]))


def join64(halves: torch.Tensor) -> torch.Tensor:
    high, low = halves.to(torch.float64).chunk(2)
    return high + low


class StatsRide:
    """Holds one step's stats until DDP's first bucket all-reduces them with its gradients.
    DDP all-reduces every bucket once a step, bucket 0 first, on every rank alike."""

    def __init__(self, world: int):
        self.world = world
        self.outgoing: torch.Tensor | None = None
        self.received: torch.Tensor | None = None
        self.alone: dist.Work | None = None  # the stats' own all-reduce, where no bucket carried them
        self.carried = 0  # steps whose stats rode a bucket

    def carry(self, values: torch.Tensor) -> "RideWork":
        """Offer `values` (float64, summed over ranks in place) to the coming backward pass:
        call between the last forward and the last backward of a step."""
        self.outgoing, self.received, self.alone = values, None, None
        return RideWork(self, values)

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        outgoing = self.outgoing if bucket.index() == 0 else None
        if outgoing is not None and buffer.dtype not in CARRIES:
            self.alone, self.outgoing, outgoing = dist.all_reduce(outgoing, async_op=True), None, None
        if outgoing is None:
            return allreduce_hook(None, bucket)  # DDP's own average
        self.outgoing, self.carried = None, self.carried + 1
        buffer.div_(self.world)
        size = buffer.numel()
        packed = torch.cat([buffer.flatten(), split64(outgoing, buffer.dtype)])

        def unpack(done: torch.futures.Future) -> torch.Tensor:
            summed = done.value()[0]
            self.received = join64(summed[size:])
            buffer.copy_(summed[:size].view_as(buffer))
            return buffer

        return dist.all_reduce(packed, async_op=True).get_future().then(unpack)


def ride_hook(ride: StatsRide, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's `register_comm_hook(ride, ride_hook)`: its state is the ride."""
    return ride.hook(bucket)


class RideWork:
    """What `dist.all_reduce(..., async_op=True)` returns, for stats offered to the backward
    pass: `wait()` after it puts the sums in place (waiting for their own all-reduce where
    no bucket could carry them, or starting one where no bucket came: the same on every rank)."""

    def __init__(self, ride: StatsRide, values: torch.Tensor):
        self.ride, self.values = ride, values

    def wait(self) -> bool:
        ride = self.ride
        received, alone = ride.received, ride.alone
        ride.outgoing, ride.received, ride.alone = None, None, None
        if received is not None:
            self.values.copy_(received)
        elif alone is not None:
            alone.wait()
        else:
            dist.all_reduce(self.values)
        return True
