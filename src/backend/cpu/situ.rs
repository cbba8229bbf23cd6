//! SiTU, written once over `backend::detmath`'s lanes: [`Situ::apply`] (one element, the
//! definition) and [`situ_rows_with`], the loop every SiTU kernel runs — `Lanes::N` elements at a
//! time, then the tail one at a time. The portable kernel [`situ_rows`] is that loop on one lane;
//! each instruction set's kernel (`x86/situ.rs`, `neon/situ.rs`) is the loop on its lanes,
//! compiled inside its target-feature function.
//!
//! Contract: every element is `beta tanh(g / beta) sigmoid(g)` times `linear_beta tanh(u /
//! linear_beta)` (where `linear_beta > 0`, else `u`), each operation `detmath`'s, in that order, so
//! every kernel gives every element these bits.

use crate::backend::detmath::{Lanes, div_lanes, fma_fn, recip_lanes, sigmoid_lanes, tanh_lanes};
use crate::backend::types::Situ;

/// SiTU on lanes, given the reciprocals of beta (`rb`) and of linear_beta (`rlb`, unused where
/// linear_beta is 0): `div(x, b)` is `div_lanes(x, b, recip(b))`, and b is the same everywhere.
#[inline(always)]
fn situ_lanes<L: Lanes>(s: Situ, rb: L, rlb: L, g: L, u: L) -> L {
    let beta = L::splat(s.beta);
    let a = beta.mul(tanh_lanes(div_lanes(g, beta, rb))).mul(sigmoid_lanes(g));
    let b = if s.linear_beta > 0.0 {
        let lbeta = L::splat(s.linear_beta);
        lbeta.mul(tanh_lanes(div_lanes(u, lbeta, rlb)))
    } else {
        u
    };
    a.mul(b)
}

/// The reciprocals [`situ_lanes`] takes.
#[inline(always)]
fn reciprocals<L: Lanes>(s: Situ) -> (L, L) {
    let rlb = if s.linear_beta > 0.0 { recip_lanes(L::splat(s.linear_beta)) } else { L::splat(0.0) };
    (recip_lanes(L::splat(s.beta)), rlb)
}

fma_fn! {
    /// SiTU of one element (compiled with the FMA instructions where the CPU has them).
    #[inline(always)]
    fn situ_one(s: Situ, g: f32, u: f32) -> f32 {
        let (rb, rlb) = reciprocals::<f32>(s);
        situ_lanes(s, rb, rlb, g, u)
    }
}

impl Situ {
    /// SiTU of one gate and up value: the definition every kernel follows.
    #[inline(always)]
    pub fn apply(self, g: f32, u: f32) -> f32 {
        situ_one(self, g, u)
    }
}

/// out[i] = s.apply(gate[i], up[i]), `L::N` elements at a time and the tail one at a time: the
/// loop of every SiTU kernel. Always inlined, into the kernel's target-feature function.
#[inline(always)]
pub(super) fn situ_rows_with<L: Lanes>(s: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = L::N;
    let full = out.len() / n * n;
    let (rb, rlb) = reciprocals::<L>(s);
    let (body, tail) = out.split_at_mut(full);
    for ((o, g), u) in body.chunks_exact_mut(n).zip(gate.chunks_exact(n)).zip(up.chunks_exact(n)) {
        situ_lanes(s, rb, rlb, L::load(g), L::load(u)).store(o);
    }
    for ((o, &g), &u) in tail.iter_mut().zip(&gate[full..]).zip(&up[full..]) {
        *o = s.apply(g, u);
    }
}

fma_fn! {
    /// The portable SiTU kernel: the loop on one lane.
    pub(super) fn situ_rows(s: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
        situ_rows_with::<f32>(s, gate, up, out)
    }
}
