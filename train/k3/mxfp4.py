"""MXFP4 as K3 ships its routed experts (compressed-tensors `mxfp4-pack-quantized`).

Each row is cut into blocks of 32 consecutive inputs; a block shares one E8M0 scale 2^(s - 127) and
each element is an E2M1 code (0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives). The scale comes from
the block maximum: the smallest power of two with max|w| / scale <= 6, so nothing clips; elements
round to the nearest code. `quantize` gives the dequantised values (exact in bf16), `quantize_ste`
the same in the forward pass with a straight-through gradient (quantisation-aware training), and
`pack` the shipped bytes, which dequantise to exactly the values `quantize` returns.
"""

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Midpoints between consecutive magnitudes: a value at or below a midpoint rounds down.
MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
BLOCK = 32


def _blocks(w):
    *lead, n = w.shape
    assert n % BLOCK == 0, f"MXFP4 needs the input dimension to be a multiple of {BLOCK}, got {n}"
    return w.reshape(*lead, n // BLOCK, BLOCK)


def scale_exponent(wb):
    """E8M0 exponents (unbiased, int) per block: ceil(log2(max|w| / 6)), clamped to [-127, 127]."""
    amax = wb.abs().amax(-1).float()
    e = torch.ceil(torch.log2(torch.clamp(amax, min=2.0 ** -140) / 6.0))
    # log2 of a float32 can land one ulp off a power of two: make sure max / 2^e <= 6 exactly.
    e = torch.where(amax / torch.exp2(e) > 6.0, e + 1, e)
    return torch.clamp(e, -127, 127)


def codes(w):
    """(codes uint8 [..., n], exponents int [..., n/32]) of w [..., n]."""
    wb = _blocks(w.detach().float())
    e = scale_exponent(wb)
    x = wb / torch.exp2(e)[..., None]
    mag = torch.bucketize(x.abs(), MIDPOINTS.to(x.device), right=False)   # 0..7
    c = mag.to(torch.uint8) | ((x < 0) & (mag > 0)).to(torch.uint8) << 3
    return c.reshape(w.shape), e.to(torch.int32)


def dequant(c, e):
    """Values of codes [..., n] and exponents [..., n/32] as float32."""
    mag = E2M1.to(c.device)[(c & 7).long()]
    val = torch.where((c & 8) != 0, -mag, mag)
    vb = _blocks(val)
    return (vb * torch.exp2(e.float())[..., None]).reshape(c.shape)


def quantize(w):
    c, e = codes(w)
    return dequant(c, e).to(w.dtype)


def quantize_ste(w):
    """MXFP4-rounded w in the forward pass, identity gradient in the backward pass."""
    return w + (quantize(w) - w).detach()


def pack(w):
    """(weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32]) of w [out, in]:
    element 2i in the low nibble, 2i+1 in the high nibble; scale byte = exponent + 127."""
    c, e = codes(w)
    packed = (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), (e + 127).to(torch.uint8).contiguous()


def unpack(packed, scale):
    """Float32 values of shipped bytes (the inverse of `pack`)."""
    lo, hi = packed & 0x0F, packed >> 4
    c = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return dequant(c, scale.to(torch.int32) - 127)
