"""What the driver writes beside the metrics: profiler traces, TensorBoard event files and
the end-of-run plot. Files are written under the run directory first, then logged to
MLflow (buffered, like every write, while the store is unreachable)."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

from shoal.messages import Metric, ProfileTrace

PLOTTED = (Metric.TRAIN_LOSS, Metric.VAL_LOSS, Metric.TRAIN_SAMPLES_PER_S, Metric.TRAIN_TOKENS_PER_S)


def save_trace(trace: ProfileTrace, directory: Path) -> Path | None:
    """A worker's gzipped trace as a file here; None when it stayed on a worker's disk and
    that disk is not this one."""
    target = directory / trace.name
    directory.mkdir(parents=True, exist_ok=True)
    if trace.data is not None:
        target.write_bytes(base64.b64decode(trace.data))
        return target
    source = Path(trace.path or "")
    if not source.exists():
        return None
    shutil.copyfile(source, target)
    return target


class TensorBoard:
    """Scalars (every metric MLflow gets, at the same steps) and profiler traces, as
    TensorBoard event files through tensorboardX."""

    def __init__(self, logdir: Path):
        # deferred: tensorboardX loads only when tracking.tensorboard is on
        from tensorboardX import SummaryWriter

        self.logdir = logdir
        self.writer = SummaryWriter(logdir=str(logdir))

    def scalars(self, rows: list[tuple[str, float, int, float | None]]) -> None:
        for key, value, step, at in rows:
            self.writer.add_scalar(key, value, global_step=step, walltime=at)

    def trace(self, path: Path) -> None:
        """Where TensorBoard's PyTorch profiler plugin looks: <logdir>/<run>/*.pt.trace.json.gz."""
        profile_dir = self.logdir / "profile"
        profile_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, profile_dir / path.name)

    def close(self) -> None:
        self.writer.close()


def plot_run(series: dict[str, list[tuple[int, float]]], title: str, path: Path) -> Path | None:
    """Loss (train and val) and throughput against step, as a PNG; None without data."""
    if not series.get(Metric.TRAIN_LOSS):
        return None
    # deferred: matplotlib loads only to draw the end-of-run plot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (losses, speed) = plt.subplots(1, 2, figsize=(11, 4))
    for key in (Metric.TRAIN_LOSS, Metric.VAL_LOSS):
        if series.get(key):
            steps, values = zip(*sorted(series[key]), strict=True)
            losses.plot(steps, values, label=key.value, marker="o" if key == Metric.VAL_LOSS else None)
    losses.set_xlabel("step")
    losses.set_ylabel("loss")
    losses.legend()
    tokens = series.get(Metric.TRAIN_TOKENS_PER_S)
    throughput = Metric.TRAIN_TOKENS_PER_S if tokens else Metric.TRAIN_SAMPLES_PER_S
    if series.get(throughput):
        steps, values = zip(*sorted(series[throughput]), strict=True)
        speed.plot(steps, values, color="tab:green")
    speed.set_xlabel("step")
    speed.set_ylabel(throughput.split("/")[1].replace("_", " "))
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
