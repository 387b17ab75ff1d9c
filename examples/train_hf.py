"""Train a Hugging Face model, unchanged, with ``parallelize`` on a (virtual) cluster.

    python examples/train_hf.py --family bert             # BertForSequenceClassification
    python examples/train_hf.py --family bert-mlm         # BertForMaskedLM (tied decoder)
    python examples/train_hf.py --family t5 --check       # T5ForConditionalGeneration, labels=
    python examples/train_hf.py --family llama --hosts 2 --devices 2 --steps 5
    python examples/train_hf.py --family gpt2 --png plan.png

Each model is built from a small config with random weights (nothing is
downloaded; ``alpa_torch/zoo.py``: ``hf_gpt2``, ``hf_llama``, ``hf_bert``,
``hf_bert_mlm``, ``hf_t5``) and wrapped in a module whose ``loss(batch)`` calls
the transformers model exactly as a user would (T5 with ``labels=``). The
training step is the plain single-device one; ``parallelize`` captures, plans
and runs it. ``--check`` replays the steps eagerly and prints the largest loss
difference; ``--png`` draws the plan. BERT-MLM's and T5's tied embeddings span
every layer, so the planner keeps them in one stage (it never cuts a stage inside
a tied weight's layers); the tensor constants T5 holds (relative-position
buckets) are computed on every stage that reads them.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from alpa_torch import Cluster, parallelize
from alpa_torch.progress import PlanProgress
from alpa_torch.zoo import OPTIMIZERS, build, make_batch, make_optimizer, train_step

FAMILIES = {"gpt2": "hf_gpt2", "llama": "hf_llama", "bert": "hf_bert", "bert-mlm": "hf_bert_mlm", "t5": "hf_t5"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="bert")
    p.add_argument("--hosts", type=int, default=1, help="hosts of the local virtual cluster")
    p.add_argument("--devices", type=int, default=2, help="virtual devices per host")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--no-pipeline", action="store_true", help="one stage on all devices")
    p.add_argument("--microbatches", type=int, help="force this many microbatches")
    p.add_argument("--check", action="store_true", help="compare with eager single-device training")
    p.add_argument("--png", help="draw the plan (cluster by stage + predicted timeline)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("intra_ilp.strategies").setLevel(logging.ERROR)

    name = FAMILIES[args.family]
    model, _ = build(name)  # seeded; random weights from the config
    reference = copy.deepcopy(model) if args.check else None
    optimizer = make_optimizer(args.optimizer, model)
    print(f"{type(model.hf).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)

    with PlanProgress() as progress:  # a bar on a terminal, silent otherwise
        step = parallelize(train_step, cluster=Cluster.local(args.hosts, args.devices),
                           pipeline=not args.no_pipeline, num_microbatches=args.microbatches, progress=progress)
        losses = []
        try:
            for i in range(args.steps):
                t0 = time.perf_counter()
                losses.append(float(step(model, optimizer, make_batch(name, args.batch, seed=i))))
                progress.close()
                print(f"step {i} loss {losses[-1]:.6f} ({time.perf_counter() - t0:.2f} s)", flush=True)
            print(step.plan.table(), flush=True)
            if args.png:
                from alpa_torch.viz import plan_figure

                plan_figure(step.plan, args.png)
                print(f"wrote {args.png}", flush=True)
            step.sync(model, optimizer)  # trained weights back into the HF model
        finally:
            step.shutdown()
    if reference is not None:
        ref_opt = make_optimizer(args.optimizer, reference)
        worst = max(abs(float(train_step(reference, ref_opt, make_batch(name, args.batch, seed=i)).detach()) - loss)
                    for i, loss in enumerate(losses))
        with torch.no_grad():
            drift = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
        print(f"max |loss - eager loss| = {worst:.3g}; max |param - eager param| = {drift:.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
