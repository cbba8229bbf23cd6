//! One sequence's DSpark drafter: the latent cache of its context rows, fed by the taps of the
//! rows K3 committed; the model it drafts with is `k3::dspark`.
//!
//! Contract: the cache holds one row per committed token, in position order; [`Drafter::observe`]
//! with rows starting at position p first drops every cached row at p or later (a truncated
//! session, a rejected verify), so the cache always describes a prefix of the committed tokens.
//! Past [`MAX_DRAFT_CONTEXT`] tokens it neither caches nor drafts.

use super::Drafter;
use crate::backend::{AppendBuf, BackendError};
use crate::k3::dspark::{DSparkModel, MAX_DRAFT_CONTEXT};
use crate::k3::forward::RowsOut;
use std::sync::Arc;

pub struct DSparkDrafter {
    model: Arc<DSparkModel>,
    /// Per draft layer: [rows, kv_lora + rope] (a GPU backend mirrors them in device memory).
    caches: Vec<AppendBuf>,
    rows: usize,
    /// The block's logits of the last proposal (tests compare them with the reference).
    pub last_logits: Vec<f32>,
}

impl DSparkDrafter {
    pub fn new(model: Arc<DSparkModel>) -> Self {
        let caches = (0..model.cfg.layers).map(|_| AppendBuf::new()).collect();
        DSparkDrafter { model, caches, rows: 0, last_logits: Vec::new() }
    }

    /// Context rows cached.
    pub fn context_rows(&self) -> usize {
        self.rows
    }

    fn truncate(&mut self, rows: usize) {
        if rows < self.rows {
            let lat = self.model.cfg.latent_width();
            self.caches.iter_mut().for_each(|c| c.truncate(rows * lat));
            self.rows = rows;
        }
    }

    /// Appends the context rows of `n` committed tokens at positions `start..start + n` from the
    /// tapped rows (in `model.cfg.target_layers` order). On an error nothing is appended.
    pub fn append(&mut self, start: usize, taps: &[&[f32]], n: usize) -> Result<(), BackendError> {
        self.truncate(start);
        // A gap (rows of earlier tokens never seen) cannot be filled later: keep what is contiguous.
        if start != self.rows {
            return Ok(());
        }
        let n = n.min(MAX_DRAFT_CONTEXT.saturating_sub(start));
        if n == 0 {
            return Ok(());
        }
        let th = self.model.cfg.target_hidden;
        let taps: Vec<&[f32]> = taps.iter().map(|t| &t[..n * th]).collect();
        for (c, new) in self.caches.iter_mut().zip(self.model.context_latents(&taps, start)?) {
            c.extend_from_slice(&new);
        }
        self.rows += n;
        Ok(())
    }

    /// The block's drafts after the cached context for `anchor` at position `pos`.
    pub fn draft(&mut self, anchor: u32, pos: usize) -> Result<Vec<u32>, BackendError> {
        self.truncate(pos);
        let (logits, drafts) = self.model.block(&mut self.caches, anchor, pos)?;
        self.last_logits = logits;
        Ok(drafts)
    }
}

impl Drafter for DSparkDrafter {
    fn name(&self) -> &str {
        "dspark"
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, BackendError> {
        let Some(&anchor) = context.last() else { return Ok(Vec::new()) };
        let pos = context.len() - 1;
        // Rows past the anchor belong to tokens no longer committed (a rolled-back prefill).
        self.truncate(pos);
        // Without the whole context cached (past the limit, or rows never observed) it stays quiet.
        if k == 0 || pos >= MAX_DRAFT_CONTEXT || self.rows != pos {
            return Ok(Vec::new());
        }
        let mut d = self.draft(anchor, pos)?;
        d.truncate(k);
        Ok(d)
    }

    fn taps(&self) -> &[usize] {
        &self.model.cfg.target_layers
    }

    fn observe(&mut self, start: usize, rows: &RowsOut, committed: usize) -> Result<(), BackendError> {
        let layers = &self.model.cfg.target_layers;
        let taps: Option<Vec<&[f32]>> =
            layers.iter().map(|l| rows.taps.iter().find(|(tl, _)| tl == l).map(|(_, r)| r.as_slice())).collect();
        match taps {
            Some(t) => self.append(start, &t, committed),
            // A forward without this drafter's taps: the context has a hole from here on.
            None => {
                self.truncate(start);
                Ok(())
            }
        }
    }
}
