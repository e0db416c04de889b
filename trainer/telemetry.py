"""What rank 0 records of a run; on every other rank each call returns at once.

    RUN_DIR/tensorboard/   TensorBoard scalars: train/{loss,accuracy,lr,images_per_second},
                           epoch/seconds, test/{loss,accuracy}
    RUN_DIR/metrics.jsonl  one JSON object per line: kind=train (every telemetry.log_every
                           steps), kind=epoch, kind=test
    stderr                 a progress bar (a line every 5% when not a terminal)
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Progress:
    """A one-line progress bar on a terminal; periodic plain lines in a log."""

    def __init__(self, total: int, stream=sys.stderr) -> None:
        self.total = max(total, 1)
        self.stream = stream
        self.tty = stream.isatty()
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._last_fraction = -1.0

    def update(self, done: int, text: str) -> None:
        now = time.monotonic()
        fraction = done / self.total
        if self.tty:
            if now - self._last_draw < 0.2 and done < self.total:
                return
            bar = "#" * int(30 * fraction)
            self.stream.write(f"\r[{bar:<30}] {done}/{self.total} {text} "
                              f"eta {self._eta(now, fraction)}\x1b[K")
            if done >= self.total:
                self.stream.write("\n")
        else:
            if fraction - self._last_fraction < 0.05 and done < self.total:
                return
            self._last_fraction = fraction
            self.stream.write(f"step {done}/{self.total} ({fraction:.0%}) {text} "
                              f"eta {self._eta(now, fraction)}\n")
        self._last_draw = now
        self.stream.flush()

    def _eta(self, now: float, fraction: float) -> str:
        if fraction <= 0:
            return "?"
        left = int((now - self.start) * (1 - fraction) / fraction)
        return f"{left // 60}:{left % 60:02d}"


class Telemetry:
    def __init__(self, run_dir: Path, enabled: bool, progress: bool, total_steps: int) -> None:
        self.enabled = enabled
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.tensorboard_dir = run_dir / "tensorboard"
        self.metrics_path = run_dir / "metrics.jsonl"
        self.writer = SummaryWriter(str(self.tensorboard_dir))
        self.metrics = self.metrics_path.open("a", buffering=1)  # a line at a time
        self.progress = Progress(total_steps) if progress else None
        self._lrs: list[tuple[int, float]] = []

    def lr(self, step: int, lr: float) -> None:
        """Every step's LR. Handed to TensorBoard's writer thread with the next train
        record, not one by one: each hand-over wakes that thread, which then takes a core
        from the compute threads."""
        if self.enabled:
            self._lrs.append((step, lr))

    def _write_lrs(self) -> None:
        for step, lr in self._lrs:
            self.writer.add_scalar("train/lr", lr, step)
        self._lrs.clear()

    def train(self, step: int, epoch: int, lr: float, loss: float, accuracy: float,
              images_per_second: float) -> None:
        if not self.enabled:
            return
        self._write_lrs()
        for name, value in (("loss", loss), ("accuracy", accuracy),
                            ("images_per_second", images_per_second)):
            self.writer.add_scalar(f"train/{name}", value, step)
        self._record(kind="train", step=step, epoch=epoch, lr=lr, loss=loss,
                     accuracy=accuracy, images_per_second=images_per_second)
        if self.progress:
            self.progress.update(step, f"epoch {epoch + 1} loss {loss:.4f} lr {lr:.4g} "
                                       f"{images_per_second:.0f} img/s")

    def epoch(self, step: int, epoch: int, seconds: float, images_per_second: float) -> None:
        if not self.enabled:
            return
        self.writer.add_scalar("epoch/seconds", seconds, epoch + 1)
        self.writer.add_scalar("epoch/images_per_second", images_per_second, epoch + 1)
        self._record(kind="epoch", step=step, epoch=epoch, seconds=seconds,
                     images_per_second=images_per_second)

    def test(self, step: int, epochs: float, train_seconds: float, loss: float,
             accuracy: float) -> None:
        if not self.enabled:
            return
        self.writer.add_scalar("test/loss", loss, step)
        self.writer.add_scalar("test/accuracy", accuracy, step)
        self._record(kind="test", step=step, epochs=round(epochs, 4),
                     train_seconds=round(train_seconds, 3), loss=loss, accuracy=accuracy)
        log.info("step %d (%.2f epochs): test accuracy %.2f%%, loss %.4f",
                 step, epochs, 100 * accuracy, loss)

    def _record(self, **fields: Any) -> None:
        self.metrics.write(json.dumps({"time": round(time.time(), 3), **fields}) + "\n")

    def close(self) -> None:
        if self.enabled:
            self._write_lrs()
            self.writer.close()
            self.metrics.close()
