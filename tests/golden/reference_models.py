"""PyTorch reference implementations of keel's built-in models, with the same parameter names.

Used by make_golden.py (golden tests) and by bench/ (keel vs PyTorch on identical work).
Shapes follow the foundation issue: mlp 784 -> 8 x Linear(256) -> 10; the "2 Conv + pooling"
cnn; a byte-level nanoGPT-style gpt with a fused qkv projection and tied output projection.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Mlp(nn.Module):
    def __init__(self, width=256, depth=8, classes=10):
        super().__init__()
        dims = [784] + [width] * depth
        self.fc = nn.ModuleList([nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])] + [nn.Linear(dims[-1], classes)])

    def forward(self, x):
        h = x.flatten(1)
        for i, layer in enumerate(self.fc):
            h = layer(h)
            if i + 1 < len(self.fc):
                h = F.relu(h)
        return h


class Cnn(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class Attention(nn.Module):
    # Fused causal attention (F.scaled_dot_product_attention), as keel's gpt; sdpa=False: the
    # explicit masked softmax that tests/golden/gpt_small.pt was made with.
    def __init__(self, d, heads, sdpa=True):
        super().__init__()
        self.heads = heads
        self.sdpa = sdpa
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
            return self.c_proj(y)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.heads))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MlpBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d, heads, sdpa=True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, sdpa)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MlpBlock(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, vocab=256, context=128, layers=4, heads=4, d=256, sdpa=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList([Block(d, heads, sdpa) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        # GPT-2 initialisation, as keel's models/gpt.cpp does it.
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif "ln_" in name:
                    p.fill_(1.0)
                elif name.endswith("c_proj.weight"):
                    p.normal_(0.0, 0.02 / math.sqrt(2 * layers))
                else:
                    p.normal_(0.0, 0.02)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()
