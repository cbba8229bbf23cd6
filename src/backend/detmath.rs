//! Deterministic transcendentals and reciprocals from `+`, `*`, `fma` and bit operations only.
//!
//! Contract: every function here is one fixed sequence of correctly rounded f32 operations (no
//! library `exp`, `tanh`, `sqrt` or `/`, whose rounding differs between libm and GPU drivers), and
//! `kernels/detmath.wgsl` is the same sequence line for line, with the same constants given as
//! bits. So the CPU kernels and the GPU kernels give the same bits wherever the GPU's `fma` is
//! fused and its `+` and `*` round to nearest (true of Vulkan and Metal for normal numbers). Every
//! product that feeds an addition is an explicit `fma`, so that no compiler contraction can change
//! an operation. Accuracy (checked in the tests below against f64): `exp` and `rsqrt` within 2 ulp,
//! `recip_div` within 1 ulp, `tanh` and `sigmoid` within 4e-7 relative.
//!
//! Written once: `exp`, `tanh`, `sigmoid` and `div` (what SiTU is made of) are functions over
//! [`Lanes`], a vector of f32 lanes with the operations they use; `f32` is the one-lane form (the
//! public scalar functions here) and each SIMD instruction set gives its lanes (`cpu/x86/situ.rs`,
//! `cpu/neon/situ.rs`), so every CPU kernel runs the same sequence, lane by lane.
//!
//! Ranges: `exp` returns 0 below -87 (where exp would be subnormal: GPUs may flush those) and
//! +inf above 88.72; `div` and `rsqrt` expect normal finite divisors / arguments in
//! [2^-125, 2^125] (callers guarantee it: softmax sums >= 1, eps-offset norms, 1 + e^x).

/// Defines a function whose body is compiled twice: with the FMA instructions (chosen at run time
/// where the x86-64 CPU has them) and without. `mul_add` is fused either way, so the results are
/// the same; without the instructions each `mul_add` is a library call, several times slower.
/// For the loops over [`exp`], [`tanh`] and the others (all `inline(always)`).
macro_rules! fma_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name($($a: $t),*) $(-> $r)? {
            #[inline(always)]
            fn body($($a: $t),*) $(-> $r)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "fma")]
                #[inline]
                unsafe fn fast($($a: $t),*) $(-> $r)? {
                    body($($a),*)
                }
                if std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU has the FMA instructions (checked just above).
                    return unsafe { fast($($a),*) };
                }
            }
            body($($a),*)
        }
    };
}
pub(crate) use fma_fn;

const LOG2E: u32 = 0x3fb8_aa3b; // 1.44269504
const LN2_HI: u32 = 0x3f31_8000; // 0.693359375 (9 significant bits: k * LN2_HI is exact)
const LN2_LO: u32 = 0xb95e_8083; // -2.12194440e-4
/// 1/n! for n = 2..7 (Taylor coefficients of exp; the remainder on |r| <= ln2/2 is below 6e-9).
const C: [u32; 6] = [0x3f00_0000, 0x3e2a_aaab, 0x3d2a_aaab, 0x3c08_8889, 0x3ab6_0b61, 0x3950_0d01];
/// 1/8! = 2.48015873e-5 (the 1/9! term of expm1's series is below the rounding).
const C8: u32 = 0x37d0_0d01;
/// The largest x whose e^x is finite in f32 (88.7228).
const EXP_MAX: u32 = 0x42b1_70a4;
/// ln2 / 2: below it tanh takes e^y - 1 from the series.
const HALF_LN2: u32 = 0x3eb1_7218;
/// The reciprocal's bit-trick start: bits(1/b) ~ RECIP_MAGIC - bits(b).
const RECIP_MAGIC: u32 = 0x7ef3_11c3;

#[inline(always)]
fn f(bits: u32) -> f32 {
    f32::from_bits(bits)
}

/// A vector of f32 lanes with the operations the functions below are made of, each the correctly
/// rounded f32 operation (or an exact bit operation) lane by lane: `f32` itself is the one-lane
/// form (the scalar definition), `cpu/x86/situ.rs` (AVX-512, AVX2) and `cpu/neon/situ.rs` give
/// the vector forms. The functions are written once over `Lanes`, branches as selects (every path
/// computed, each lane taking its own), so every lane of every form gets the one-lane form's bits.
///
/// A vector form's values exist only inside the target-feature functions of its file (its type
/// is private there), into which every method is inlined.
pub trait Lanes: Copy {
    /// A lane mask (a comparison's result).
    type Mask: Copy;
    /// Lanes per value.
    const N: usize;
    fn splat(v: f32) -> Self;
    /// The first `N` values of `src` (which holds at least `N`).
    fn load(src: &[f32]) -> Self;
    /// Into the first `N` values of `dst` (which holds at least `N`).
    fn store(self, dst: &mut [f32]);
    fn add(self, b: Self) -> Self;
    fn sub(self, b: Self) -> Self;
    fn mul(self, b: Self) -> Self;
    /// self * b + c with one rounding (the scalar `mul_add`).
    fn fma(self, b: Self, c: Self) -> Self;
    /// The sign bit flipped.
    fn neg(self) -> Self;
    /// The sign bit cleared.
    fn abs(self) -> Self;
    /// |self| with the sign of `s` (`f32::copysign`).
    fn copysign(self, s: Self) -> Self;
    /// Rounded toward -inf.
    fn floor(self) -> Self;
    /// Ordered comparisons (false where either side is NaN).
    fn lt(self, b: Self) -> Self::Mask;
    fn gt(self, b: Self) -> Self::Mask;
    fn le(self, b: Self) -> Self::Mask;
    fn eq(self, b: Self) -> Self::Mask;
    fn is_nan(self) -> Self::Mask;
    /// `t` in the lanes `m` sets, `self` in the others.
    fn select(self, m: Self::Mask, t: Self) -> Self;
    /// The value whose bits are `bits - bits(self)` (wrapping integer subtraction).
    fn bits_minus(self, bits: u32) -> Self;
    /// The value whose bits are `bits(self) + (k << 23)` (wrapping), `k` the integer `kf` holds
    /// (`kf` is integral in every lane whose result is kept).
    fn add_exponent(self, kf: Self) -> Self;
}

impl Lanes for f32 {
    type Mask = bool;
    const N: usize = 1;
    #[inline(always)]
    fn splat(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    fn load(src: &[f32]) -> f32 {
        src[0]
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32]) {
        dst[0] = self;
    }
    #[inline(always)]
    fn add(self, b: f32) -> f32 {
        self + b
    }
    #[inline(always)]
    fn sub(self, b: f32) -> f32 {
        self - b
    }
    #[inline(always)]
    fn mul(self, b: f32) -> f32 {
        self * b
    }
    #[inline(always)]
    fn fma(self, b: f32, c: f32) -> f32 {
        self.mul_add(b, c)
    }
    #[inline(always)]
    fn neg(self) -> f32 {
        -self
    }
    #[inline(always)]
    fn abs(self) -> f32 {
        f32::abs(self)
    }
    #[inline(always)]
    fn copysign(self, s: f32) -> f32 {
        f32::copysign(self, s)
    }
    #[inline(always)]
    fn floor(self) -> f32 {
        f32::floor(self)
    }
    #[inline(always)]
    fn lt(self, b: f32) -> bool {
        self < b
    }
    #[inline(always)]
    fn gt(self, b: f32) -> bool {
        self > b
    }
    #[inline(always)]
    fn le(self, b: f32) -> bool {
        self <= b
    }
    #[inline(always)]
    fn eq(self, b: f32) -> bool {
        self == b
    }
    #[inline(always)]
    fn is_nan(self) -> bool {
        (self.to_bits() & 0x7fff_ffff) > 0x7f80_0000
    }
    #[inline(always)]
    fn select(self, m: bool, t: f32) -> f32 {
        if m { t } else { self }
    }
    #[inline(always)]
    fn bits_minus(self, bits: u32) -> f32 {
        f32::from_bits(bits.wrapping_sub(self.to_bits()))
    }
    #[inline(always)]
    fn add_exponent(self, kf: f32) -> f32 {
        f32::from_bits(self.to_bits().wrapping_add((kf as i32 as u32) << 23))
    }
}

/// e^x: k = floor(x log2 e + 1/2), r = x - k ln2 (two-part ln2), degree-7 Taylor of e^r by
/// Horner, times 2^k by adding k to the exponent bits (exact: the result is normal on the accepted
/// range). The last operation on a kept value is an integer one, so a caller's `exp(x) + c` can
/// never be contracted. 0 below -87, +inf above [`EXP_MAX`], NaN for NaN.
#[inline(always)]
pub fn exp_lanes<L: Lanes>(x: L) -> L {
    let kf = x.fma(L::splat(f(LOG2E)), L::splat(0.5)).floor();
    let r = kf.fma(L::splat(-f(LN2_HI)), x);
    let r = kf.fma(L::splat(-f(LN2_LO)), r);
    let mut p = L::splat(f(C[5]));
    for c in [C[4], C[3], C[2], C[1], C[0]] {
        p = p.fma(r, L::splat(f(c)));
    }
    p = p.fma(r, L::splat(1.0));
    p = p.fma(r, L::splat(1.0));
    let v = p.add_exponent(kf);
    let v = v.select(x.gt(L::splat(f(EXP_MAX))), L::splat(f32::INFINITY));
    let v = v.select(x.lt(L::splat(-87.0)), L::splat(0.0));
    v.select(x.is_nan(), x)
}

/// p(x) with e^x - 1 = p(x) x for x in [0, ln2/2] (degree-8 Taylor by Horner; no cancellation
/// near 0). The caller forms p x and p x + 2 itself, the latter as an explicit fma.
#[inline(always)]
fn expm1_small_over_x<L: Lanes>(x: L) -> L {
    let mut p = L::splat(f(C8));
    for c in [C[5], C[4], C[3], C[2], C[1], C[0]] {
        p = p.fma(x, L::splat(f(c)));
    }
    p.fma(x, L::splat(1.0))
}

/// 1/b by Newton's iteration from a bit-trick start (4 steps: relative error below 1e-9 before
/// the final rounding). Expects a normal |b| in [2^-125, 2^125].
#[inline(always)]
pub fn recip_lanes<L: Lanes>(b: L) -> L {
    let mut r = b.bits_minus(RECIP_MAGIC);
    let nb = b.neg();
    for _ in 0..4 {
        let e = nb.fma(r, L::splat(1.0));
        r = r.fma(e, r);
    }
    r
}

/// a / b given `r = recip_lanes(b)`: q = a r, then one residual correction q + (a - q b) r
/// (correctly rounded but for rare double-rounding cases). Expects a normal |b| in
/// [2^-125, 2^125] and a finite a.
#[inline(always)]
pub fn div_lanes<L: Lanes>(a: L, b: L, r: L) -> L {
    let q = a.mul(r);
    let rem = q.neg().fma(b, a);
    rem.fma(r, q)
}

/// tanh(x) = sign(x) m / (m + 2) with m = e^{2|x|} - 1 (from the series up to ln2/2, else from
/// exp); x itself where m is 0, +-1 beyond |x| = 9 (where tanh rounds to 1 anyway), NaN for NaN.
#[inline(always)]
pub fn tanh_lanes<L: Lanes>(x: L) -> L {
    let a = x.abs();
    let y = L::splat(2.0).mul(a);
    let p = expm1_small_over_x(y);
    let e = exp_lanes(y);
    let small = y.le(L::splat(f(HALF_LN2)));
    let m = e.sub(L::splat(1.0)).select(small, p.mul(y));
    let d = e.add(L::splat(1.0)).select(small, p.fma(y, L::splat(2.0)));
    let v = div_lanes(m, d, recip_lanes(d)).copysign(x);
    let v = v.select(m.eq(L::splat(0.0)), x);
    let v = v.select(a.gt(L::splat(9.0)), L::splat(1.0).copysign(x));
    v.select(x.is_nan(), x)
}

/// 1 / (1 + e^-x); e^x itself below x = -80 (where the two agree to f32 rounding): one exp, of x
/// there and of -x elsewhere. NaN for NaN.
#[inline(always)]
pub fn sigmoid_lanes<L: Lanes>(x: L) -> L {
    let low = x.lt(L::splat(-80.0));
    let e = exp_lanes(x.neg().select(low, x));
    let d = L::splat(1.0).add(e);
    let v = div_lanes(L::splat(1.0), d, recip_lanes(d)).select(low, e);
    v.select(x.is_nan(), x)
}

#[inline(always)]
fn fma(a: f32, b: f32, c: f32) -> f32 {
    a.mul_add(b, c)
}

/// 1 / sqrt(x) for a normal x > 0 in [2^-125, 2^125]: a bit-trick start, three Newton steps
/// y (3 - x y^2) / 2, then one step in residual form y + y (1 - x y^2) / 2.
#[inline(always)]
fn rsqrt_body(x: f32) -> f32 {
    let h = 0.5 * x;
    let mut y = f32::from_bits(0x5f37_59dfu32.wrapping_sub(x.to_bits() >> 1));
    for _ in 0..3 {
        let t = h * y;
        y *= fma(-t, y, 1.5);
    }
    let t = h * y;
    let e = fma(-t, y, 0.5);
    fma(y, e, y)
}

// The public functions: the one-lane forms, each body compiled with the FMA instructions where
// the CPU has them (a `mul_add` without them is a library call); inlined, so a caller's own
// `fma_fn` loop runs the fused instructions directly.
fma_fn! {
    /// e^x (0 below -87, +inf above 88.72, NaN for NaN).
    #[inline(always)]
    pub fn exp(x: f32) -> f32 { exp_lanes(x) }
}
fma_fn! {
    /// a / b for a normal |b| in [2^-125, 2^125] and a finite a.
    #[inline(always)]
    pub fn div(a: f32, b: f32) -> f32 { div_lanes(a, b, recip_lanes(b)) }
}
fma_fn! {
    /// 1 / sqrt(x) for a normal x > 0 in [2^-125, 2^125].
    #[inline(always)]
    pub fn rsqrt(x: f32) -> f32 { rsqrt_body(x) }
}
fma_fn! {
    /// tanh(x).
    #[inline(always)]
    pub fn tanh(x: f32) -> f32 { tanh_lanes(x) }
}
fma_fn! {
    /// 1 / (1 + e^-x).
    #[inline(always)]
    pub fn sigmoid(x: f32) -> f32 { sigmoid_lanes(x) }
}

/// x * sigmoid(x).
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Index of the largest value (lowest index on ties; NaN never wins): the pick every backend's
/// argmax gives.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || (logits[best].is_nan() && !v.is_nan()) {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f64) -> f64 {
        let b32 = b as f32;
        let ulp = (f32::from_bits(b32.abs().to_bits() + 1) - b32.abs()) as f64;
        (a as f64 - b).abs() / ulp
    }

    fn grid(lo: f32, hi: f32, n: usize) -> impl Iterator<Item = f32> {
        (0..=n).map(move |i| lo + (hi - lo) * (i as f32 / n as f32))
    }

    #[test]
    fn constants_are_what_they_say() {
        assert_eq!(f(LOG2E), std::f32::consts::LOG2_E);
        assert_eq!(f(LN2_HI) as f64 + f(LN2_LO) as f64, (f(LN2_HI) as f64 + f(LN2_LO) as f64));
        assert!((f(LN2_HI) as f64 + f(LN2_LO) as f64 - std::f64::consts::LN_2).abs() < 1e-11);
        let fact = [2.0, 6.0, 24.0, 120.0, 720.0, 5040.0];
        for (c, n) in C.iter().zip(fact) {
            assert_eq!(f(*c), (1.0f64 / n) as f32);
        }
        assert_eq!(f(C8), (1.0f64 / 40320.0) as f32);
        assert_eq!(f(HALF_LN2), std::f32::consts::LN_2 / 2.0);
    }

    #[test]
    fn dispatched_and_plain_bodies_agree_bit_for_bit() {
        // The FMA-instruction build and the library-call build of each body are the same function.
        for x in grid(-90.0, 90.0, 20_000) {
            assert_eq!(exp(x).to_bits(), exp_lanes(x).to_bits(), "exp {x}");
            assert_eq!(tanh(x / 8.0).to_bits(), tanh_lanes(x / 8.0).to_bits(), "tanh {x}");
            assert_eq!(sigmoid(x).to_bits(), sigmoid_lanes(x).to_bits(), "sigmoid {x}");
            let b = x.abs() + 1e-3;
            assert_eq!(rsqrt(b).to_bits(), rsqrt_body(b).to_bits(), "rsqrt {b}");
            assert_eq!(div(x, b).to_bits(), div_lanes(x, b, recip_lanes(b)).to_bits(), "div {x} {b}");
        }
    }

    /// The functions as they were written before `Lanes` (branches, early returns), kept to hold
    /// the one-lane form of the written-once functions to them bit for bit.
    mod branches {
        use super::super::{C, C8, EXP_MAX, HALF_LN2, LN2_HI, LN2_LO, LOG2E, RECIP_MAGIC, f, fma};

        pub fn exp(x: f32) -> f32 {
            if x.is_nan() {
                return x;
            }
            if x < -87.0 {
                return 0.0;
            }
            if x > f(EXP_MAX) {
                return f32::INFINITY;
            }
            let kf = fma(x, f(LOG2E), 0.5).floor();
            let r = fma(kf, -f(LN2_HI), x);
            let r = fma(kf, -f(LN2_LO), r);
            let mut p = f(C[5]);
            for c in [C[4], C[3], C[2], C[1], C[0]] {
                p = fma(p, r, f(c));
            }
            p = fma(p, r, 1.0);
            p = fma(p, r, 1.0);
            f32::from_bits(p.to_bits().wrapping_add(((kf as i32) as u32) << 23))
        }

        fn recip(b: f32) -> f32 {
            let mut r = f32::from_bits(RECIP_MAGIC.wrapping_sub(b.to_bits()));
            for _ in 0..4 {
                let e = fma(-b, r, 1.0);
                r = fma(r, e, r);
            }
            r
        }

        pub fn div(a: f32, b: f32) -> f32 {
            let r = recip(b);
            let q = a * r;
            let rem = fma(-q, b, a);
            fma(rem, r, q)
        }

        pub fn tanh(x: f32) -> f32 {
            if x.is_nan() {
                return x;
            }
            let a = x.abs();
            if a > 9.0 {
                return 1f32.copysign(x);
            }
            let y = 2.0 * a;
            let (m, d) = if y <= f(HALF_LN2) {
                let mut p = f(C8);
                for c in [C[5], C[4], C[3], C[2], C[1], C[0]] {
                    p = fma(p, y, f(c));
                }
                let p = fma(p, y, 1.0);
                (p * y, fma(p, y, 2.0))
            } else {
                let e = exp(y);
                (e - 1.0, e + 1.0)
            };
            if m == 0.0 {
                return x;
            }
            div(m, d).copysign(x)
        }

        pub fn sigmoid(x: f32) -> f32 {
            if x.is_nan() {
                return x;
            }
            if x < -80.0 {
                return exp(x);
            }
            div(1.0, 1.0 + exp(-x))
        }
    }

    /// Every 211th f32 bit pattern (20 million: every exponent, sign and NaN class) and the
    /// neighbours of the thresholds: the written-once functions give the branches' bits.
    #[test]
    fn the_lanes_functions_give_the_branches_bits() {
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        let edges = [0.0f32, 9.0, 80.0, 87.0, f(EXP_MAX), f(HALF_LN2) / 2.0, 1.0, 1e-30];
        let near = edges
            .iter()
            .flat_map(|&t| [t, -t])
            .flat_map(|t| (0..17).map(move |d| t.to_bits().wrapping_add(d).wrapping_sub(8)));
        for bits in (0..=u32::MAX).step_by(211).chain(near) {
            let x = f32::from_bits(bits);
            assert!(same(exp(x), branches::exp(x)), "exp {x:e} ({bits:#x})");
            assert!(same(tanh(x), branches::tanh(x)), "tanh {x:e} ({bits:#x})");
            assert!(same(sigmoid(x), branches::sigmoid(x)), "sigmoid {x:e} ({bits:#x})");
            let b = f32::from_bits(0x0100_0000 | (bits.rotate_left(7) & 0x7e7f_ffff));
            if b.is_finite() && x.is_finite() && (2f32.powi(-125)..=2f32.powi(125)).contains(&b.abs()) {
                assert!(same(div(x, b), branches::div(x, b)), "div {x:e} / {b:e}");
            }
        }
    }

    #[test]
    fn exp_within_two_ulp() {
        for x in grid(-86.9, 88.6, 200_000) {
            let u = ulps(exp(x), (x as f64).exp());
            assert!(u <= 2.0, "exp({x}): {u} ulp");
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn div_and_rsqrt_within_rounding() {
        let mut seed = 11u64;
        for _ in 0..200_000 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let a = f32::from_bits(0x3000_0000 + ((seed >> 33) as u32 % 0x1e00_0000));
            let b = f32::from_bits(0x3000_0000 + ((seed >> 3) as u32 % 0x1e00_0000));
            let u = ulps(div(a, b), a as f64 / b as f64);
            assert!(u <= 1.0, "{a} / {b}: {u} ulp");
            let u = ulps(rsqrt(b), 1.0 / (b as f64).sqrt());
            assert!(u <= 2.0, "rsqrt({b}): {u} ulp");
        }
        for b in [1.0f32, 4.0, 1e-6, 7168.0, 1e30, 2f32.powi(-125), 2f32.powi(125)] {
            assert!(ulps(div(1.0, b), 1.0 / b as f64) <= 1.0, "1 / {b}");
            assert!(ulps(rsqrt(b), 1.0 / (b as f64).sqrt()) <= 2.0, "rsqrt {b}");
        }
    }

    #[test]
    fn tanh_and_sigmoid_close_to_f64() {
        for x in grid(-12.0, 12.0, 100_000).chain([1e-30f32, -1e-7, 1e-3, 0.17328, 0.17329]) {
            let t = (x as f64).tanh();
            let e = (tanh(x) as f64 - t).abs() / t.abs().max(1e-30);
            assert!(e < 4e-7, "tanh({x}): relative error {e:.2e}");
            let s = 1.0 / (1.0 + (-(x as f64)).exp());
            let e = (sigmoid(x) as f64 - s).abs() / s;
            assert!(e < 4e-7, "sigmoid({x}): relative error {e:.2e}");
        }
        assert_eq!(tanh(0.0), 0.0);
        assert_eq!(sigmoid(-200.0), 0.0);
        assert_eq!(sigmoid(200.0), 1.0);
    }
}
