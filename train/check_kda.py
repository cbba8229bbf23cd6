#!/usr/bin/env python3
"""Checks k3/kda.py's chunked KDA against its token-by-token recurrence (fp64 and fp32, several
chunk sizes, a length that is not a multiple of the chunk, gates down to K3's bound of -5)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from k3 import kda  # noqa: E402

torch.manual_seed(0)
B, T, H, K, V = 2, 45, 3, 8, 6
worst = {torch.float64: 0.0, torch.float32: 0.0}
for dt in (torch.float64, torch.float32):
    q = torch.randn(B, T, H, K, dtype=dt)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=dt), dim=-1)
    v = torch.randn(B, T, H, V, dtype=dt)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, K, dtype=dt) * 3)
    beta = torch.sigmoid(torch.randn(B, T, H, dtype=dt))
    o1, s1 = kda.naive(q, k, v, g, beta)
    for C in (4, 16, 64):
        o2, s2 = kda.chunked(q, k, v, g, beta, chunk=C)
        e = max(((o1 - o2).norm() / o1.norm()).item(), ((s1 - s2).norm() / s1.norm()).item())
        worst[dt] = max(worst[dt], e)
        print(f"{str(dt):14} chunk {C:3}: relative error {e:.2e}")
assert worst[torch.float64] < 1e-13 and worst[torch.float32] < 1e-5, worst
print("ok")
