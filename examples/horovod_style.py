"""examples/train.py in the style of Horovod's examples (pytorch_mnist.py), engine=horovod.

    horovodrun -np 2 -H localhost:2 python examples/horovod_style.py --data DIR --out OUT

Horovod's calls and what stands for them here:

    hvd.init(); torch.cuda.set_device(...)    job = spotring.init(engine="horovod")
    DistributedSampler + set_epoch            job.loader(...), loader.set_epoch(epoch)
    broadcast_parameters, broadcast_optimizer_state, DistributedOptimizer
                                              job.wrap(model, optimizer)
    metric_average: hvd.allreduce(value)      job.all_reduce(value)
    hvd.rank() == 0                           job.is_main

The learning rate is not multiplied by the number of workers: --batch-size is the global
batch, the same samples per step on any number of workers. What Horovod leaves to the
script comes with the job: checkpoints, resuming on another number of workers, and the
stop all workers agree on at a spot notice (exit 75). --engine ddp runs this file over
PyTorch DDP instead (under torchrun as well). The model and the data are plain_train.py's.
"""

import torch
import torch.nn.functional as F
from plain_train import evaluate, image_folders, parser, save_weights, small_cnn

import spotring

if __name__ == "__main__":
    cli = parser()
    cli.add_argument("--engine", choices=("horovod", "ddp"), default="horovod")
    args = cli.parse_args()
    job = spotring.init(engine=args.engine, seed=args.seed, run_dir=args.out)
    train_set, test_set = image_folders(args.data, args.dtype)
    net = small_cnn(len(train_set.classes)).to(job.device, getattr(torch, args.dtype))
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    loader = job.loader(train_set, args.batch_size, num_workers=args.workers)
    model, optimizer = job.wrap(net, optimizer)  # Horovod wraps the optimizer only; DDP the model
    job.track(model=net, optimizer=optimizer, loader=loader)
    job.restore()
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(job.device)), y.to(job.device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if job.should_stop():
                job.save_and_exit()
        job.save()
        if job.is_main:
            print(f"epoch {epoch + 1}: loss {loss.item():.4f} (rank 0's share)")
    # Each rank tests every W-th sample; the sum over ranks counts each sample once.
    shard = torch.utils.data.Subset(test_set, range(job.rank, len(test_set), job.world_size))
    correct = job.all_reduce(evaluate(net, shard, job.device) * len(shard), op="sum")
    accuracy = correct.item() / len(test_set)
    job.log("test", accuracy=accuracy)
    if job.is_main:
        print(f"test accuracy {accuracy:.2%}")
        save_weights(net, args.out)
    job.finish(test_accuracy=accuracy)
