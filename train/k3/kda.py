"""Kimi Delta Attention (KDA): the token recurrence and an exact chunked form for training.

Per head, with key-channel log-decay g_t (<= 0), strength beta_t, unit-norm k_t, scaled q_t:

    S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t

(K3.md: "S *= exp(g) along k; S += k (x) beta (v - k^T S); o = q^T S"). `naive` runs it token by
token, as deltafin's engine does; `chunked` is the same map in chunks of C tokens (the UT / WY
form): inside a chunk the deltas u_t = beta_t (v_t - k_t^T D_t S_{t-1}) solve a unit lower
triangular system, and only the chunk boundary states run sequentially. Decays inside a chunk
enter as exp(G_t - G_j) with t >= j (never a positive exponent), so the form is stable in fp32
whatever the gate. `tests` in train/check_kda.py hold the two to each other.
"""

import torch
import torch.utils.checkpoint


def naive(q, k, v, g, beta, state=None):
    """q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] (log decay); beta [B, T, H].
    Returns (o [B, T, H, V], final state [B, H, K, V]). Computes in float32 (float64 inputs stay)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    S = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if state is None else state.to(dt)
    out = []
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None]
        kS = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        d = beta[:, t][..., None] * (v[:, t] - kS)
        S = S + k[:, t][..., None] * d[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, dim=1), S


def _scan(A, b):
    """Inclusive scan of the affine maps x -> A_n x + b_n along dim 2 (Hillis-Steele: map n <-
    map n o map n - d for n >= d, d = 1, 2, 4, ...): returns the composed maps."""
    N = A.shape[2]
    d = 1
    while d < N:
        A_tail = A[:, :, d:] @ A[:, :, : N - d]
        b_tail = A[:, :, d:] @ b[:, :, : N - d] + b[:, :, d:]
        A, b = torch.cat([A[:, :, :d], A_tail], 2), torch.cat([b[:, :, :d], b_tail], 2)
        d *= 2
    return A, b


def chunked(q, k, v, g, beta, chunk=16, state=None, g_bound=None, scan=True):
    """The same map as `naive`, differentiable, in chunks of `chunk` tokens. float32 throughout
    (float64 if given float64). T need not be a multiple of `chunk`.

    `g_bound` (optional, < 0): a lower bound on every g (the model's gate_lower_bound). When it
    makes exp(+-(G_t - G_m)) safe in the working precision (G_m the chunk's middle row), the
    pairwise decays exp(G_t - G_j) enter factored, as (k_t exp(G_t - G_m)) . (k_j exp(G_m - G_j)),
    two small matrix products instead of a [.., C, C, K] tensor per chunk; otherwise (or without a
    bound) the pairwise form, where no exponent is ever positive.

    `scan`: the chunks' start states by an associative scan of their affine state maps (few ops,
    for training on a GPU where a Python loop of launches per chunk is the cost), else by the
    sequential loop over chunks."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    C = chunk
    pad = (-T) % C
    if pad:
        # Padded tokens: g = 0 (no decay), beta = 0 (no write), q = 0: they change nothing.
        zp = lambda x: torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        q, k, v, g = zp(q), zp(k), zp(v), zp(g)
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // C
    # [B, H, N, C, *]
    r = lambda x: x.reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4)
    q, k, v, g = r(q), r(k), r(v), r(g)
    beta = beta.reshape(B, N, C, H).permute(0, 3, 1, 2)
    G = torch.cumsum(g, dim=3)                                   # G_t = sum_{s<=t} g_s
    tri_strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
    m = C // 2 - 1 if C > 1 else 0
    # The largest exponent the factored form meets is |g_bound| * max(m, C - 1 - m); keep it well
    # inside the range of the working precision (fp32 overflows past exp(88)).
    limit = 40.0 if dt == torch.float32 else 300.0
    if g_bound is not None and -g_bound * max(m, C - 1 - m) <= limit:
        Gm = G[:, :, :, m:m + 1, :]
        kL, kR = k * torch.exp(G - Gm), k * torch.exp(Gm - G)
        qL = q * torch.exp(G - Gm)
        A = (kL @ kR.transpose(-1, -2)) * tri_strict                          # k_t.D k_j, j < t
        Bm = (qL @ kR.transpose(-1, -2)) * torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    else:
        # Pairwise decays exp(G_t - G_j) for j <= t (masked elsewhere before the exp).
        diff = G[:, :, :, :, None, :] - G[:, :, :, None, :, :]       # [B,H,N,C(t),C(j),K]
        tri_incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
        dec = torch.exp(torch.where(tri_incl[:, :, None], diff, torch.full_like(diff, -1e30)))
        A = torch.einsum("bhntk,bhntjk,bhnjk->bhntj", k, dec, k) * tri_strict   # k_t.D k_j, j < t
        Bm = torch.einsum("bhntk,bhntjk,bhnjk->bhntj", q, dec, k)                # q_t.D k_j, j <= t
    eG = torch.exp(G)
    kG = k * eG                                                   # k_t * exp(G_t): reads S0
    qG = q * eG
    # (I + diag(beta) A) U = diag(beta) (V - kG S0)  =>  U = W1 - W2 S0
    M = torch.eye(C, dtype=dt, device=q.device) + beta[..., None] * A
    W1 = torch.linalg.solve_triangular(M, beta[..., None] * v, upper=False, unitriangular=True)
    W2 = torch.linalg.solve_triangular(M, beta[..., None] * kG, upper=False, unitriangular=True)
    GC = G[:, :, :, -1:, :]                                       # [B,H,N,1,K]
    kE = k * torch.exp(GC - G)                                    # k_j * exp(G_C - G_j)
    eGC = torch.exp(GC[:, :, :, 0, :])                            # [B,H,N,K]
    S = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if state is None else state.to(dt)
    if scan and N > 1:
        # Chunk n maps its start state affinely: S' = A_n S + b_n with A_n = diag(exp(G_C)) -
        # kE_n^T W2_n and b_n = kE_n^T W1_n. An inclusive scan of these maps (log2 N levels of
        # batched products; the maps contract, so their products stay bounded) gives every
        # chunk's start state at once: a few dozen ops instead of a Python loop of N steps.
        kEt = kE.transpose(-1, -2)                                # [B,H,N,K,C]
        A = torch.diag_embed(eGC) - kEt @ W2                      # [B,H,N,K,K]
        b = kEt @ W1                                              # [B,H,N,K,V]
        if torch.is_grad_enabled() and (A.requires_grad or b.requires_grad):
            # Recomputed in the backward pass: the levels' [.., K, K] products are cheap to redo
            # and would otherwise be kept, 5 levels of them, for every KDA layer.
            A, b = torch.utils.checkpoint.checkpoint(_scan, A, b, use_reentrant=False)
        else:
            A, b = _scan(A, b)
        S_end = A @ S[:, :, None] + b                             # state after each chunk
        S_start = torch.cat([S[:, :, None], S_end[:, :, :-1]], 2)
        U = W1 - W2 @ S_start
        o = qG @ S_start + Bm @ U                                 # [B,H,N,C,V]
        S = S_end[:, :, -1]
        o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
        return o, S
    # Per-chunk pieces taken apart once (unbind's backward is one stack; indexing chunk n inside
    # the loop would make each backward step write a zero-filled copy of the whole tensor).
    W1s, W2s, qGs, Bms = W1.unbind(2), W2.unbind(2), qG.unbind(2), Bm.unbind(2)
    kEs, eGCs = kE.transpose(-1, -2).unbind(2), eGC[..., None].unbind(2)
    outs = []
    for n in range(N):
        U = W1s[n] - W2s[n] @ S                                   # [B,H,C,V]
        outs.append(qGs[n] @ S + Bms[n] @ U)
        S = eGCs[n] * S + kEs[n] @ U
    o = torch.stack(outs, dim=2)                                  # [B,H,N,C,V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o, S
