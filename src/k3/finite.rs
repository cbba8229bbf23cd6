//! The forward's guard against non-finite values: every layer's outputs (the embedding rows, each
//! attention and FFN output, each routed expert's contribution) and the logits are checked as
//! they are made, so a NaN or an infinity — a damaged weight (an E8M0 scale byte of 0xFF is NaN),
//! or values that overflow — fails the step with [`super::ForwardError::NonFinite`] naming the
//! layer and the tensors that made it, instead of reaching a sampler (where a NaN logit row gave
//! token 0 on every step) or a perplexity.
//!
//! Contract: [`first_non_finite`] finds the first element that is NaN or ±inf; it changes
//! nothing, so results keep their bits. Its cost is one read of what it checks (an integer max
//! over the bits, which vectorises), a few microseconds per layer of a decode step.

use crate::model::roster::{LM_HEAD, layer, top};
use rayon::prelude::*;

/// Where a forward found a non-finite value: the part of the model whose output it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    /// The token embedding rows.
    Embedding,
    /// Layer `l`'s attention (with the AttnRes mix and norm before it).
    Attention(usize),
    /// Layer `l`'s dense MLP (with the mix and norm before it).
    Mlp(usize),
    /// Routed expert `e` of MoE layer `l`.
    Expert(usize, u32),
    /// MoE layer `l` beside its routed experts: the weighted sum, latent norm, up-projection and
    /// shared experts (and the mix, norm and router before them).
    Moe(usize),
    /// The final mix, norm and lm_head.
    Logits,
}

impl std::fmt::Display for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Site::Embedding => write!(f, "the token embedding (`{}`)", top("embed_tokens.weight")),
            Site::Attention(l) => write!(f, "layer {l}'s attention (`{}*` and its norms)", layer(l, "self_attn.")),
            Site::Mlp(l) => write!(f, "layer {l}'s dense MLP (`{}*`)", layer(l, "mlp.")),
            Site::Expert(l, e) => {
                write!(f, "layer {l}'s routed expert {e} (`{}*`)", layer(l, &format!("block_sparse_moe.experts.{e}.")))
            }
            Site::Moe(l) => write!(
                f,
                "layer {l}'s MoE outside its routed experts (`{}*`: router, latent projections, shared experts)",
                layer(l, "block_sparse_moe.")
            ),
            Site::Logits => write!(f, "the output (`{}`, `{LM_HEAD}`)", top("norm.weight")),
        }
    }
}

/// Elements from which [`first_non_finite`] runs across threads (a prompt's rows).
const PAR_MIN: usize = 1 << 18;
/// Elements per chunk of the scan.
const CHUNK: usize = 1 << 12;

/// Whether `xs` holds a NaN or an infinity (the largest magnitude bits reach the exponent's all
/// ones): an integer max over the bits, without a branch per element.
fn any_non_finite(xs: &[f32]) -> bool {
    xs.iter().fold(0u32, |m, x| m.max(x.to_bits() & 0x7fff_ffff)) >= 0x7f80_0000
}

/// The index of the first NaN or infinity in `xs`.
pub fn first_non_finite(xs: &[f32]) -> Option<usize> {
    let chunk = if xs.len() >= PAR_MIN {
        xs.par_chunks(CHUNK).position_first(any_non_finite)?
    } else {
        xs.chunks(CHUNK).position(any_non_finite)?
    };
    let start = chunk * CHUNK;
    xs[start..].iter().position(|x| !x.is_finite()).map(|i| start + i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_first_nan_or_infinity_anywhere() {
        for n in [0usize, 1, 7, CHUNK - 1, CHUNK, CHUNK + 3, PAR_MIN + 5] {
            let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - 3.0) * 1e30).collect();
            v.iter_mut().step_by(3).for_each(|x| *x = -*x);
            assert_eq!(first_non_finite(&v), None, "n {n}");
            if n == 0 {
                continue;
            }
            for bad in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::from_bits(0x7f80_0001)] {
                for at in [0, n / 2, n - 1] {
                    let mut w = v.clone();
                    w[at] = bad;
                    if at + 1 < n {
                        w[n - 1] = f32::NAN;
                    }
                    assert_eq!(first_non_finite(&w), Some(at), "n {n} at {at} {bad}");
                }
            }
        }
        assert_eq!(first_non_finite(&[f32::MAX, f32::MIN, f32::MIN_POSITIVE, -0.0]), None);
    }

    #[test]
    fn sites_name_their_tensors() {
        let s = Site::Expert(3, 17).to_string();
        assert!(s.contains("layer 3") && s.contains("layers.3.block_sparse_moe.experts.17."), "{s}");
        assert!(Site::Logits.to_string().contains("lm_head"));
        assert!(Site::Attention(0).to_string().contains("layers.0.self_attn."));
    }
}
