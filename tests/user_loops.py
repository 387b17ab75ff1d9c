"""Training loops as people write them, for ``test_user_loops.py`` (and its resumed run in a fresh process).

``NanoGPT`` follows nanoGPT's ``model.py`` (token and position embeddings, pre-norm blocks with
causal ``scaled_dot_product_attention`` and a GELU MLP, the head tied to the token embedding,
the loss from ``targets`` inside ``forward``), with its ``bias=False`` option: the key
projection's bias gets a gradient of pure rounding noise (softmax ignores what it adds), and
AdamW's first steps turn noise into +-lr, so no two summation orders agree on it.
``configure_optimizers`` and ``get_lr`` follow its ``train.py``: AdamW with two parameter
groups (decay for matrices only), betas (0.9, 0.95), a warmup and cosine learning rate set
by hand in ``param_groups`` every iteration, gradient accumulation inside the step,
clipping, ``zero_grad(set_to_none=True)`` after the update.

Run as ``python -m tests.user_loops CHECKPOINT OUT HxD ITERS``: load a checkpoint that
``torch.save`` wrote mid-run, continue training with ``parallelize`` and write the losses
and the final model state to ``OUT`` (what a resumed run in a new process does).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 48, 16, 32, 4, 2
GRAD_ACCUM = 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD, bias=False)
        self.c_proj = nn.Linear(EMBD, EMBD, bias=False)

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(EMBD, bias=False), Attention()
        self.ln_2 = nn.LayerNorm(EMBD, bias=False)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD, bias=False), nn.GELU(),
                                 nn.Linear(4 * EMBD, EMBD, bias=False))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, EMBD), wpe=nn.Embedding(BLOCK, EMBD),
            h=nn.ModuleList([Block() for _ in range(LAYERS)]), ln_f=nn.LayerNorm(EMBD, bias=False)))
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def make_model_and_optimizer():
    torch.manual_seed(0)
    model = NanoGPT()
    return model, model.configure_optimizers(0.1, 6e-3, (0.9, 0.95))


def get_lr(it: int, warmup: int = 2, decay_iters: int = 12, lr: float = 6e-3, min_lr: float = 6e-4) -> float:
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (lr - min_lr)


def train_step(model, optimizer, batch):
    """nanoGPT's inner loop: micro-steps accumulated, clipped, stepped, gradients set to None."""
    X, Y = batch
    n = len(X) // GRAD_ACCUM
    total = 0.0
    for micro in range(GRAD_ACCUM):
        _, loss = model(X[micro * n:(micro + 1) * n], Y[micro * n:(micro + 1) * n])
        loss = loss / GRAD_ACCUM
        loss.backward()
        total = total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def get_batch(it: int, split: str = "train", batch_size: int = 8):
    g = torch.Generator().manual_seed(it * 2 + (split == "val"))
    data = torch.randint(0, VOCAB, (batch_size, BLOCK + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


@torch.no_grad()
def estimate_loss(model, iters: int = 2) -> float:
    """nanoGPT's ``estimate_loss`` on the validation split: eval mode, no_grad, back to train."""
    model.eval()
    losses = [model(*get_batch(100 + k, "val"))[1].item() for k in range(iters)]
    model.train()
    return sum(losses) / len(losses)


def set_lr(optimizer, it: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = get_lr(it)


def resume(checkpoint: str, out: str, cluster: str, iters: int) -> None:
    """Continue a run from ``checkpoint`` with ``parallelize`` in this process (module docstring)."""
    from alpa_torch import Cluster, parallelize

    model, optimizer = make_model_and_optimizer()
    ckpt = torch.load(checkpoint, weights_only=False)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    step = parallelize(train_step, Cluster.local(*map(int, cluster.split("x"))))
    losses = []
    for it in range(ckpt["iter_num"] + 1, ckpt["iter_num"] + 1 + iters):
        set_lr(optimizer, it)
        losses.append(float(step(model, optimizer, get_batch(it))))
    torch.save({"losses": losses, "model": model.state_dict()}, out)
    step.shutdown()


if __name__ == "__main__":
    resume(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
