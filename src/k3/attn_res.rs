//! Attention residuals (AttnRes): instead of one residual stream, each token keeps block
//! snapshots (pushed every `attn_res_block_size` layers) plus a running prefix sum, and every
//! sublayer input is a softmax-weighted mix of them (`Backend::attn_res_mix`: scores use the
//! RMS-normalised sources, the sum uses the raw ones).

use crate::backend::{Backend, BackendError};
use rayon::prelude::*;

/// Floats from which the element-wise work here runs across threads (a prefill's rows are
/// hundreds of MB; a decode step's a few KB stay on the calling thread).
const PAR_MIN: usize = 1 << 18;

/// The residual state of a batch of rows through the layer stack (rows are [n, hidden]).
pub struct Residual {
    pub hidden: usize,
    /// Completed block snapshots, oldest first.
    pub blocks: Vec<Vec<f32>>,
    /// Running sum of sublayer outputs in the current block (None right after a push).
    pub prefix: Option<Vec<f32>>,
}

impl Residual {
    /// The completed row stream after a layer: the running prefix (what DSpark taps).
    pub fn prefix(&self) -> Option<&[f32]> {
        self.prefix.as_deref()
    }

    pub fn new(embeddings: Vec<f32>, hidden: usize) -> Self {
        Residual { hidden, blocks: Vec::new(), prefix: Some(embeddings) }
    }

    /// Mixes blocks + prefix for every row (the backend's `attn_res_mix_rows`, sources oldest block
    /// first, then the prefix). With no blocks yet, the input is the prefix itself.
    pub fn mixed(&self, be: &dyn Backend, score_w: &[f32], eps: f32) -> Result<Vec<f32>, BackendError> {
        let prefix = self.prefix.as_ref().expect("mix needs a prefix");
        if self.blocks.is_empty() {
            if prefix.len() < PAR_MIN {
                return Ok(prefix.clone());
            }
            let mut out = vec![0f32; prefix.len()];
            out.par_chunks_mut(PAR_MIN).zip(prefix.par_chunks(PAR_MIN)).for_each(|(d, s)| d.copy_from_slice(s));
            return Ok(out);
        }
        let mut out = vec![0f32; prefix.len()];
        let mut src: Vec<&[f32]> = self.blocks.iter().map(|b| &b[..]).collect();
        src.push(prefix);
        be.attn_res_mix_rows(&src, score_w, eps, &mut out)?;
        Ok(out)
    }

    /// Moves the prefix into the block list (at the first layer of each block).
    pub fn push_block(&mut self) {
        if let Some(p) = self.prefix.take() {
            self.blocks.push(p);
        }
    }

    /// prefix += delta (or prefix = delta right after a push).
    pub fn add(&mut self, delta: Vec<f32>) {
        match &mut self.prefix {
            None => self.prefix = Some(delta),
            Some(p) => {
                let add = |(a, b): (&mut [f32], &[f32])| a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                if p.len() < PAR_MIN {
                    add((p, &delta));
                } else {
                    p.par_chunks_mut(PAR_MIN).zip(delta.par_chunks(PAR_MIN)).for_each(add);
                }
            }
        }
    }
}
