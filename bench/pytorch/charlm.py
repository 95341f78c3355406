"""PyTorch reference for layerwise's character Transformer (charlm presets), for the GPU and
many-core benchmarks: the same model (token + position embeddings; pre-norm decoder blocks of
causal self-attention with a fused qkv projection and a GELU (tanh) MLP of 4 d; a final layer
norm and the vocabulary projection), the same batch, context and AdamW step, timed on random
token ids (the speed does not depend on the text).

    python3 bench/pytorch/charlm.py --layers 4 --d-model 256 --heads 4 --context 128 \
        --batch-size 32 --steps 12 [--device cuda|cpu] [--threads 16] [--sdpa] [--bf16]

Prints one JSON line: {"device", "threads", "sdpa", "bf16", "tokens_per_s", "step_s": [...]},
tokens/s being batch x context over the median step time of the steps after two warm-up steps.
Needs PyTorch (pip install torch); layerwise's own code does not.
"""

import argparse
import json
import math
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    """One pre-norm decoder block, as layerwise's decoderBlock (model/transformer.ts)."""

    def __init__(self, d: int, heads: int, sdpa: bool):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.w1, self.w2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [b, h, t, dh]
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
            mask = torch.ones(t, t, device=x.device, dtype=torch.bool).triu(1)
            y = s.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.w2(F.gelu(self.w1(self.ln2(x)), approximate="tanh"))


class CharLm(nn.Module):
    def __init__(self, vocab: int, layers: int, d: int, heads: int, context: int, sdpa: bool):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, sdpa) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--vocab", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--sdpa", action="store_true")
    p.add_argument("--bf16", action="store_true", help="autocast to bfloat16")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    torch.manual_seed(1)
    model = CharLm(a.vocab, a.layers, a.d_model, a.heads, a.context, a.sdpa).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    x = torch.randint(0, a.vocab, (a.batch_size, a.context), device=dev)
    y = torch.randint(0, a.vocab, (a.batch_size, a.context), device=dev)

    def step() -> float:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()  # a readback each step, as layerwise reads its loss

    times = []
    for i in range(a.steps + 2):
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(json.dumps({
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "sdpa": a.sdpa,
        "bf16": a.bf16,
        "layers": a.layers, "d_model": a.d_model, "context": a.context,
        "batch_size": a.batch_size,
        "tokens_per_s": a.batch_size * a.context / med,
        "step_s": times,
    }))


if __name__ == "__main__":
    main()
