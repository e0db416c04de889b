"""What rank 0 records of a run; on every other rank each call returns at once.

    RUN_DIR/tensorboard/   TensorBoard scalars: train/{loss,accuracy,lr,images_per_second},
                           epoch/seconds, test/{loss,accuracy}
    RUN_DIR/metrics.jsonl  one JSON object per line: kind=train (every telemetry.log_every
                           steps), kind=epoch, kind=test
    stderr                 a tqdm progress bar (telemetry.progress): redrawn in place on a
                           terminal; in a log, a plain line every LOG_LINE_SECONDS

Epochs are counted from 1 wherever a user reads one: epoch N is the N-th pass over the
training set, N = 1 .. train.epochs, in metrics.jsonl's "epoch" (train records: the epoch
in progress; epoch records: the epoch just ended), on TensorBoard's axis of epoch/*, on the
progress bar and in the log ("resumed at step 40 (epoch 2, ...)"). A test record's
"epochs" counts epochs done (steps / steps per epoch), so epoch N ends at epochs = N. The
methods here take the 0-based index that seeds the epoch's order and that checkpoints
store (the loop's Position.epoch, the sampler's epoch); epoch_number is the one place it
becomes the number shown.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger(__name__)

# Where stderr is not a terminal (CI, a file, a launcher's pipe): a line this often.
LOG_LINE_SECONDS = 30.0


def epoch_number(index: int) -> int:
    """The epoch a user reads for a 0-based epoch index: counted from 1."""
    return index + 1


class _Lines(io.TextIOBase):
    """tqdm's output as whole lines. tqdm redraws with a carriage return, which a log
    keeps: one line growing with every redraw."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        if line := text.strip():
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


class Progress:
    """Steps done of the run's total, with the last logged loss, LR and img/s."""

    def __init__(self, total: int, done: int, stream: TextIO = sys.stderr) -> None:
        self._on_exit = contextlib.ExitStack()
        if stream.isatty():
            self.bar = tqdm(total=total, initial=done, unit="step", file=stream,
                            dynamic_ncols=True)
            # Log lines go through tqdm, which clears the bar, prints, and draws it again.
            self._on_exit.enter_context(logging_redirect_tqdm())
        else:
            self.bar = tqdm(total=total, initial=done, unit="step", file=_Lines(stream),
                            ascii=True, mininterval=LOG_LINE_SECONDS, miniters=1)

    def update(self, done: int) -> None:
        self.bar.update(done - self.bar.n)

    def describe(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        self.bar.close()
        self._on_exit.close()


class Telemetry:
    def __init__(self, run_dir: Path, enabled: bool, progress: bool, total_steps: int,
                 done_steps: int) -> None:
        self.tensorboard_dir = run_dir / "tensorboard"
        self.metrics_path = run_dir / "metrics.jsonl"
        self._progress, self._total_steps = progress, total_steps
        self.enabled = False
        self.switch(enabled, done_steps)

    def switch(self, enabled: bool, done_steps: int) -> None:
        """Record from now on, or no longer (``close``): a job in place makes another
        process rank 0 where rank 0's is lost, which goes on with the same files,
        ``done_steps`` into the run."""
        if not enabled:
            self.close()
        elif not self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.tensorboard_dir))
            self.metrics = self.metrics_path.open("a", buffering=1)  # a line at a time
            self.progress = (Progress(self._total_steps, done_steps) if self._progress
                             else None)
            self._lrs: list[tuple[int, float]] = []
            self.enabled = True

    def step(self, step: int, lr: float) -> None:
        """Every step: its LR, and the progress bar. The LRs go to TensorBoard's writer
        thread with the next train record, not one by one: each hand-over wakes that
        thread, which then takes a core from the compute threads."""
        if self.enabled:
            self._lrs.append((step, lr))
            if self.progress:
                self.progress.update(step)

    def _write_lrs(self) -> None:
        for step, lr in self._lrs:
            self.writer.add_scalar("train/lr", lr, step)
        self._lrs.clear()

    def train(self, step: int, epoch: int, lr: float, loss: float, accuracy: float,
              images_per_second: float) -> None:
        """The metrics since the last train record; ``epoch``: the index in progress."""
        if not self.enabled:
            return
        self._write_lrs()
        for name, value in (("loss", loss), ("accuracy", accuracy),
                            ("images_per_second", images_per_second)):
            self.writer.add_scalar(f"train/{name}", value, step)
        number = epoch_number(epoch)
        self._record(kind="train", step=step, epoch=number, lr=lr, loss=loss,
                     accuracy=accuracy, images_per_second=images_per_second)
        if self.progress:
            self.progress.describe(f"epoch {number} loss {loss:.4f} lr {lr:.4g} "
                                   f"{images_per_second:.0f} img/s")

    def epoch(self, step: int, epoch: int, seconds: float, images_per_second: float) -> None:
        """The epoch of index ``epoch`` has ended at ``step``."""
        if not self.enabled:
            return
        number = epoch_number(epoch)
        self.writer.add_scalar("epoch/seconds", seconds, number)
        self.writer.add_scalar("epoch/images_per_second", images_per_second, number)
        self._record(kind="epoch", step=step, epoch=number, seconds=seconds,
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

    def record(self, kind: str, step: int, epoch: int | None = None,
               **scalars: float) -> None:
        """One record of any ``kind`` (a user script's metrics): the scalars in TensorBoard
        as kind/name at ``step``, and in metrics.jsonl with kind, step and the epoch
        (``epoch``: the index in progress, shown counted from 1)."""
        if not self.enabled:
            return
        for name, value in scalars.items():
            self.writer.add_scalar(f"{kind}/{name}", value, step)
        where = {} if epoch is None else {"epoch": epoch_number(epoch)}
        self._record(kind=kind, step=step, **where, **scalars)

    def _record(self, **fields: Any) -> None:
        self.metrics.write(json.dumps({"time": round(time.time(), 3), **fields}) + "\n")

    def close(self) -> None:
        """Flush and close; a second call does nothing."""
        if self.enabled:
            self.enabled = False
            if self.progress:
                self.progress.close()
            self._write_lrs()
            self.writer.close()
            self.metrics.close()
