"""What every rank of the FSDP benchmarks runs (fsdp_memory.py, the GPU kit's fsdp figure
and test): a GPT-2-like language model trained with AdamW through spotring's API under
engine=ddp or engine=fsdp, its bytes and speed.

    torchrun --standalone --nproc-per-node 2 -m spotring.benchmarks.fsdp_ranks --engine fsdp

--size gpt2 is GPT-2 small's shape (124M parameters, the output layer tied to the token
embedding), tiny the same code at toy size. --warmup untimed steps, then --steps timed,
on random tokens under job.autocast(). After the last backward each rank counts in its
own memory the bytes of the parameters, gradients and AdamW state (a DTensor's local
shard), and its peak memory (torch.cuda.max_memory_allocated on a GPU, the process's peak
resident set on a CPU). Rank 0 prints one JSON line, {"fsdp_ranks": {..., "ranks": [each
rank's figures]}}.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import spotring


@dataclass(frozen=True)
class GPTSize:
    layers: int
    width: int
    heads: int
    vocab: int
    context: int


SIZES = {"gpt2": GPTSize(layers=12, width=768, heads=12, vocab=50257, context=1024),
         "tiny": GPTSize(layers=2, width=32, heads=2, vocab=64, context=16)}


class Attention(nn.Module):
    def __init__(self, size: GPTSize) -> None:
        super().__init__()
        self.heads = size.heads
        self.qkv = nn.Linear(size.width, 3 * size.width)
        self.proj = nn.Linear(size.width, size.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, size: GPTSize) -> None:
        super().__init__()
        self.norm1, self.attention = nn.LayerNorm(size.width), Attention(size)
        self.norm2 = nn.LayerNorm(size.width)
        self.mlp = nn.Sequential(nn.Linear(size.width, 4 * size.width), nn.GELU(),
                                 nn.Linear(4 * size.width, size.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """GPT-2's architecture: token and position embeddings, pre-norm blocks, a final norm
    and an output layer tied to the token embedding."""

    def __init__(self, size: GPTSize) -> None:
        super().__init__()
        self.tokens = nn.Embedding(size.vocab, size.width)
        self.positions = nn.Embedding(size.context, size.width)
        self.blocks = nn.ModuleList([Block(size) for _ in range(size.layers)])
        self.norm = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, size.vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1],
                                                              device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds of ``tensors``: a DTensor's local shard, a tensor whole."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spotring.benchmarks.fsdp_ranks",
                                description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("ddp", "fsdp"), default="fsdp")
    p.add_argument("--size", choices=list(SIZES), default="gpt2")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank and step (1)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (64)")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps first (0)")
    p.add_argument("--steps", type=int, default=1, help="timed steps (1)")
    p.add_argument("--precision", default="fp32", help="job.wrap's: fp32, bf16, auto (fp32)")
    p.add_argument("--device", default="auto", help="spotring.init's: auto, cpu, cuda (auto)")
    p.add_argument("--run-dir", type=Path, default=Path("runs/fsdp_ranks"),
                   help="spotring.init's run_dir")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    size = SIZES[args.size]
    if args.seq > size.context:
        p.error(f"--seq {args.seq}: longer than --size {args.size}'s context of "
                f"{size.context} tokens")
    with spotring.init(engine=args.engine, device=args.device, run_dir=args.run_dir,
                       notices="none") as job:
        model = GPT(size)
        parameters = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        model, optimizer = job.wrap(model, optimizer, precision=args.precision)
        g = torch.Generator().manual_seed(job.rank)
        tokens = torch.randint(size.vocab, (args.batch, args.seq + 1), generator=g)
        inputs, targets = tokens[:, :-1].to(job.device), tokens[:, 1:].to(job.device)
        gradient_bytes, start = 0, time.perf_counter()
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                if job.device.type == "cuda":
                    torch.cuda.synchronize(job.device)
                start = time.perf_counter()
            with job.autocast():
                logits = model(inputs)
            job.backward(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()))
            if step == args.warmup + args.steps - 1:  # before step() lets them go
                gradient_bytes = local_bytes(p.grad for p in model.parameters()
                                             if p.grad is not None)
            job.step(optimizer)
        if job.device.type == "cuda":
            torch.cuda.synchronize(job.device)
        seconds = time.perf_counter() - start
        state = [v for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        mine = {"parameter_bytes": local_bytes(model.parameters()),
                "gradient_bytes": gradient_bytes, "optimizer_bytes": local_bytes(state),
                "peak_memory_mib": peak_memory_mib(job.device), "seconds": seconds}
        ranks = job.engine.all_gather_object(mine)
        if job.is_main:
            slowest = max(r["seconds"] for r in ranks)
            tokens_per_step = job.world_size * args.batch * args.seq
            print(json.dumps({"fsdp_ranks": {
                "engine": args.engine, "world_size": job.world_size, "size": args.size,
                **asdict(size), "parameters": parameters, "batch": args.batch,
                "seq": args.seq, "steps": args.steps, "precision": job.precision,
                "device": str(job.device), "backend": job.engine.backend,
                "tokens_per_second": args.steps * tokens_per_step / max(slowest, 1e-9),
                "step_seconds": slowest / args.steps, "ranks": ranks}}), flush=True)


if __name__ == "__main__":
    main()
