"""The training script of docs/quickstart-cluster.md: train on the Ray cluster this job runs on.

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python examples/quickstart_train.py --out /shared/quickstart
    python examples/quickstart_train.py --out /tmp/quickstart   # on a host where `ray start` ran

A plain single-device training step, run by ``parallelize(train_step, cluster_from_ray())``
on every GPU (or, without GPUs, every CPU node) of the cluster; then the validation loss on
the workers (``step.evaluate``), the same loss read in this process from the model object,
a checkpoint (``step.save``) and the weights in Hugging Face's layout (``step.save_pretrained``)
under ``--out``, and the checkpoint loaded back into a fresh model (``alpa_torch.load_into``).
Every worker writes its own shards, so on several hosts ``--out`` must be shared storage.
Exit status 1 if the reloaded model's loss differs from the trained one's.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.nn.functional as F

import alpa_torch
from alpa_torch import cluster_from_ray, parallelize
from alpa_torch.zoo import GPT, GPTConfig  # your own torch.nn.Module goes here


def train_step(model, optimizer, batch):
    """One plain single-device step, as written for eager training."""
    tokens, targets = batch  # [B, T] token ids, [B, T] the next token of each
    optimizer.zero_grad()
    logits = model(tokens)  # [B, T, vocab]
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    return loss


def validation_loss(model, batch):
    """Forward only: what ``step.evaluate`` runs on the workers."""
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def make_batch(config: GPTConfig, size: int, seed: int):
    """Random token sequences (your data loader goes here): inputs and next-token targets."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (size, config.block_size + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]  # [size, T] each


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="global batch, split over the devices by the plan")
    p.add_argument("--out", default="quickstart-out", help="directory for the checkpoint and the weights "
                   "(shared storage when the cluster has several hosts)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for noisy in ("ray", "intra_ilp", "stage_dp", "runtime"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    cluster = cluster_from_ray()  # the Ray cluster this job runs on (ray.init's address)
    print(f"cluster: {cluster.describe()}", flush=True)
    config = GPTConfig.tiny()
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = parallelize(train_step, cluster)  # the first call captures, plans and starts the workers
    evaluate = step.evaluate(validation_loss)
    held_out = make_batch(config, args.batch, seed=10_000)
    try:
        for i in range(args.steps):
            loss = step(model, optimizer, make_batch(config, args.batch, seed=i))
            print(f"step {i} loss {float(loss):.6f}", flush=True)
        on_workers = float(evaluate(model, held_out))  # runs on the workers, against the trained state
        with torch.no_grad():
            here = float(validation_loss(model, held_out))  # the model object holds the trained weights
        print(f"validation loss {on_workers:.6f} on the workers, {here:.6f} in this process", flush=True)
        checkpoint = step.save(os.path.join(args.out, "checkpoint"))
        weights = step.save_pretrained(os.path.join(args.out, "weights"))
        print(f"saved {checkpoint} and {weights}", flush=True)
    finally:
        step.shutdown()

    fresh = GPT(config)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    loaded_step = alpa_torch.load_into(fresh, fresh_optimizer, checkpoint)
    with torch.no_grad():
        reloaded = float(validation_loss(fresh, held_out))
    ok = abs(reloaded - on_workers) <= 1e-5
    print(f"checkpoint of step {loaded_step} loaded into a fresh model: validation loss {reloaded:.6f} "
          f"({'ok' if ok else 'DIFFERS'})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
