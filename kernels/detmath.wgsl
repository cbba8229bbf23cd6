// Deterministic transcendentals and reciprocals: the same operation sequence, line for line and
// with the same constants (as bits), as `src/backend/detmath.rs`, so that a GPU whose `fma` is
// fused gives the CPU's bits. Every product that feeds an addition is an explicit fma (a driver
// may contract a separate a * b + c). Prepended to the kernels that use it.

const DM_LOG2E: u32 = 0x3fb8aa3bu;
const DM_LN2_HI: u32 = 0x3f318000u;
const DM_LN2_LO: u32 = 0xb95e8083u;

fn dm_f(b: u32) -> f32 {
    return bitcast<f32>(b);
}

fn dm_is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn dm_copysign(m: f32, s: f32) -> f32 {
    return bitcast<f32>((bitcast<u32>(m) & 0x7fffffffu) | (bitcast<u32>(s) & 0x80000000u));
}

fn dm_exp(x: f32) -> f32 {
    if (dm_is_nan(x)) {
        return x;
    }
    if (x < -87.0) {
        return 0.0;
    }
    if (x > dm_f(0x42b170a4u)) {
        return bitcast<f32>(0x7f800000u);
    }
    let kf = floor(fma(x, dm_f(DM_LOG2E), 0.5));
    var r = fma(kf, -dm_f(DM_LN2_HI), x);
    r = fma(kf, -dm_f(DM_LN2_LO), r);
    var p = dm_f(0x39500d01u);
    p = fma(p, r, dm_f(0x3ab60b61u));
    p = fma(p, r, dm_f(0x3c088889u));
    p = fma(p, r, dm_f(0x3d2aaaabu));
    p = fma(p, r, dm_f(0x3e2aaaabu));
    p = fma(p, r, dm_f(0x3f000000u));
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    let k = i32(kf);
    return bitcast<f32>(bitcast<u32>(p) + (bitcast<u32>(k) << 23u));
}

fn dm_expm1_small_over_x(x: f32) -> f32 {
    var p = dm_f(0x37d00d01u);
    p = fma(p, x, dm_f(0x39500d01u));
    p = fma(p, x, dm_f(0x3ab60b61u));
    p = fma(p, x, dm_f(0x3c088889u));
    p = fma(p, x, dm_f(0x3d2aaaabu));
    p = fma(p, x, dm_f(0x3e2aaaabu));
    p = fma(p, x, dm_f(0x3f000000u));
    return fma(p, x, 1.0);
}

fn dm_recip(b: f32) -> f32 {
    var r = bitcast<f32>(0x7ef311c3u - bitcast<u32>(b));
    for (var i = 0; i < 4; i = i + 1) {
        let e = fma(-b, r, 1.0);
        r = fma(r, e, r);
    }
    return r;
}

fn dm_div(a: f32, b: f32) -> f32 {
    let r = dm_recip(b);
    let q = a * r;
    let rem = fma(-q, b, a);
    return fma(rem, r, q);
}

fn dm_rsqrt(x: f32) -> f32 {
    let h = 0.5 * x;
    var y = bitcast<f32>(0x5f3759dfu - (bitcast<u32>(x) >> 1u));
    for (var i = 0; i < 3; i = i + 1) {
        let t = h * y;
        y = y * fma(-t, y, 1.5);
    }
    let t = h * y;
    let e = fma(-t, y, 0.5);
    return fma(y, e, y);
}

fn dm_tanh(x: f32) -> f32 {
    if (dm_is_nan(x)) {
        return x;
    }
    let a = abs(x);
    if (a > 9.0) {
        return dm_copysign(1.0, x);
    }
    let y = 2.0 * a;
    var m: f32;
    var d: f32;
    if (y <= dm_f(0x3eb17218u)) {
        let p = dm_expm1_small_over_x(y);
        m = p * y;
        d = fma(p, y, 2.0);
    } else {
        let e = dm_exp(y);
        m = e - 1.0;
        d = e + 1.0;
    }
    if (m == 0.0) {
        return x;
    }
    return dm_copysign(dm_div(m, d), x);
}

fn dm_sigmoid(x: f32) -> f32 {
    if (dm_is_nan(x)) {
        return x;
    }
    if (x < -80.0) {
        return dm_exp(x);
    }
    return dm_div(1.0, 1.0 + dm_exp(-x));
}

// The CPU's 16-lane dot order (`cpu::dot_f32`, `cpu::reduce16`) over n elements of a and b read
// through `load_a(i)` / `load_b(i)` is written out in each kernel (WGSL has no closures).
