#!/usr/bin/env python3
"""Checks k3/kda.py's chunked KDA against its token-by-token recurrence (fp64 and fp32, several
chunk sizes, a length that is not a multiple of the chunk, gates down to K3's bound of -5 and a
run of gates at the bound itself), in both intra-chunk forms: pairwise decays (no bound given) and
factored decays (g_bound=-5, which chunk 16 and smaller take; chunk 64 falls back to pairwise),
and the gradients of the two forms against each other."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from k3 import kda  # noqa: E402

torch.manual_seed(0)
B, T, H, K, V = 2, 45, 3, 8, 6
worst = {torch.float64: 0.0, torch.float32: 0.0}
for dt in (torch.float64, torch.float32):
    for gates in ("random", "at the bound"):
        q = torch.randn(B, T, H, K, dtype=dt)
        k = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=dt), dim=-1)
        v = torch.randn(B, T, H, V, dtype=dt)
        g = -5 * torch.sigmoid(torch.randn(B, T, H, K, dtype=dt) * 3)
        if gates == "at the bound":
            g = torch.full_like(g, -5.0)
            g[:, ::3] = -1e-3
        beta = torch.sigmoid(torch.randn(B, T, H, dtype=dt))
        o1, s1 = kda.naive(q, k, v, g, beta)
        for C in (4, 16, 64):
            for bound in (None, -5.0):
                o2, s2 = kda.chunked(q, k, v, g, beta, chunk=C, g_bound=bound)
                e = max(((o1 - o2).norm() / o1.norm()).item(), ((s1 - s2).norm() / s1.norm()).item())
                worst[dt] = max(worst[dt], e)
                form = "pairwise" if bound is None else "bound -5"
                print(f"{str(dt):14} {gates:12} chunk {C:3} {form}: relative error {e:.2e}")
# Gradients: factored against pairwise (fp64).
q, k, v = (torch.randn(B, T, H, K, dtype=torch.float64, requires_grad=True) for _ in range(3))
g = (-5 * torch.sigmoid(torch.randn(B, T, H, K, dtype=torch.float64) * 3)).requires_grad_()
beta = torch.sigmoid(torch.randn(B, T, H, dtype=torch.float64)).requires_grad_()
grads = []
for bound in (None, -5.0):
    o, s = kda.chunked(q, torch.nn.functional.normalize(k, dim=-1), v, g, beta, chunk=16, g_bound=bound)
    grads.append(torch.autograd.grad((o.sin().sum() + s.cos().sum()), (q, k, v, g, beta)))
ge = max(((a - b).norm() / b.norm()).item() for a, b in zip(*grads))
print(f"gradients, factored vs pairwise (fp64): relative error {ge:.2e}")
assert worst[torch.float64] < 1e-12 and worst[torch.float32] < 1e-5 and ge < 1e-12, (worst, ge)
print("ok")
