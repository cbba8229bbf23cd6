#!/usr/bin/env python3
"""Checks k3/kda.py's chunked KDA against its token-by-token recurrence (fp64 and fp32, several
chunk sizes, a length that is not a multiple of the chunk, gates down to K3's bound of -5 and a
run of gates at the bound itself), in both intra-chunk forms: pairwise decays (no bound given) and
factored decays (g_bound=-5, which chunk 16 and smaller take; chunk 64 falls back to pairwise),
each with the chunks' states by the sequential loop and by the associative scan (from a random
start state), and the gradients of the forms against each other."""
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
        for C in (4, 16, 64):
            for bound in (None, -5.0):
                for scan in (False, True):
                    s0 = torch.randn(B, H, K, V, dtype=dt) if scan else None
                    o1, s1 = kda.naive(q, k, v, g, beta, state=s0)
                    o2, s2 = kda.chunked(q, k, v, g, beta, chunk=C, g_bound=bound, scan=scan, state=s0)
                    e = max(((o1 - o2).norm() / o1.norm()).item(), ((s1 - s2).norm() / s1.norm()).item())
                    worst[dt] = max(worst[dt], e)
                    form = ("pairwise" if bound is None else "bound -5") + (", scan, start state" if scan else ", loop")
                    print(f"{str(dt):14} {gates:12} chunk {C:3} {form}: relative error {e:.2e}")
# A training-length sequence (32 chunks of 16) in fp32: the scan against the recurrence.
q, v = torch.randn(2, 512, 4, 64), torch.randn(2, 512, 4, 64)
k = torch.nn.functional.normalize(torch.randn(2, 512, 4, 64), dim=-1)
g, beta = -5 * torch.sigmoid(torch.randn(2, 512, 4, 64) * 3), torch.sigmoid(torch.randn(2, 512, 4))
o1, s1 = kda.naive(q, k, v, g, beta)
o2, s2 = kda.chunked(q, k, v, g, beta, chunk=16, g_bound=-5.0, scan=True)
e = max(((o1 - o2).norm() / o1.norm()).item(), ((s1 - s2).norm() / s1.norm()).item())
print(f"torch.float32  512 tokens, chunk 16, bound -5, scan: relative error {e:.2e}")
worst[torch.float32] = max(worst[torch.float32], e)
# Gradients: factored against pairwise (fp64).
q, k, v = (torch.randn(B, T, H, K, dtype=torch.float64, requires_grad=True) for _ in range(3))
g = (-5 * torch.sigmoid(torch.randn(B, T, H, K, dtype=torch.float64) * 3)).requires_grad_()
beta = torch.sigmoid(torch.randn(B, T, H, dtype=torch.float64)).requires_grad_()
grads = []
for bound, scan in ((None, False), (-5.0, False), (-5.0, True)):
    o, s = kda.chunked(q, torch.nn.functional.normalize(k, dim=-1), v, g, beta, chunk=16, g_bound=bound, scan=scan)
    grads.append(torch.autograd.grad((o.sin().sum() + s.cos().sum()), (q, k, v, g, beta)))
ge = max(((a - b).norm() / b.norm()).item() for other in grads[1:] for a, b in zip(other, grads[0]))
print(f"gradients, factored and scanned vs pairwise loop (fp64): relative error {ge:.2e}")
assert worst[torch.float64] < 1e-12 and worst[torch.float32] < 1e-5 and ge < 1e-12, (worst, ge)
print("ok")
