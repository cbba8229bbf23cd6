//! One sequence's DSpark drafter: the latent cache of its context rows, fed by the taps of the
//! rows K3 committed; the model it drafts with is `k3::dspark`.
//!
//! Contract: the drafter knows one row per committed token, in position order; [`Drafter::observe`]
//! with rows starting at position p first drops every row at p or later (a truncated session, a
//! rejected verify), so what it knows always describes a prefix of the committed tokens. Rows are
//! fed lazily: a committed row's taps are kept as they came (the backlog) and turned into the
//! draft layers' latents only when a draft needs them — at the next proposal, all of them in one
//! pass — or when the backlog reaches [`MAX_BACKLOG`] rows; so a sequence whose policy asks for no
//! DSpark draft runs no drafter forward (`forwards`, `folded_rows` count what ran). Latents of rows
//! folded together equal those folded one by one (each row's kernels do not depend on the others).
//! A drafter that missed rows it cannot get back (a resumed session whose prefix it never saw) is
//! stranded: it asks for no taps and proposes nothing. Past [`MAX_DRAFT_CONTEXT`] tokens it
//! neither caches nor drafts.

use super::Drafter;
use crate::backend::{AppendBuf, BackendError};
use crate::k3::dspark::{DSparkModel, MAX_BACKLOG, MAX_DRAFT_CONTEXT};
use crate::k3::forward::RowsOut;
use std::sync::Arc;
use std::time::Instant;

pub struct DSparkDrafter {
    model: Arc<DSparkModel>,
    /// Per draft layer: [rows, kv_lora + rope] (a GPU backend mirrors them in device memory).
    caches: Vec<AppendBuf>,
    /// Rows in `caches`.
    rows: usize,
    /// The taps of the rows after `rows` not folded yet: per tapped layer [backlog, target hidden].
    backlog: Vec<Vec<f32>>,
    backlog_rows: usize,
    /// Rows before the first one it saw were never seen: it cannot draft.
    stranded: bool,
    /// The block's logits of the last proposal (tests compare them with the reference).
    pub last_logits: Vec<f32>,
    /// Draft blocks run.
    pub forwards: u64,
    /// Context rows folded into the latents, and the seconds that took.
    pub folded_rows: u64,
    pub fold_s: f64,
    /// The last proposal's split: (rows folded, seconds folding, seconds of the block).
    pub last_call: (usize, f64, f64),
}

impl DSparkDrafter {
    pub fn new(model: Arc<DSparkModel>) -> Self {
        let caches = (0..model.cfg.layers).map(|_| AppendBuf::new()).collect();
        let backlog = model.cfg.target_layers.iter().map(|_| Vec::new()).collect();
        DSparkDrafter {
            model,
            caches,
            rows: 0,
            backlog,
            backlog_rows: 0,
            stranded: false,
            last_logits: Vec::new(),
            forwards: 0,
            folded_rows: 0,
            fold_s: 0.0,
            last_call: (0, 0.0, 0.0),
        }
    }

    /// Context rows known (folded or in the backlog).
    pub fn context_rows(&self) -> usize {
        self.rows + self.backlog_rows
    }

    /// Rows known but not folded yet.
    pub fn backlog_rows(&self) -> usize {
        self.backlog_rows
    }

    fn truncate(&mut self, rows: usize) {
        if rows < self.rows {
            let lat = self.model.cfg.latent_width();
            self.caches.iter_mut().for_each(|c| c.truncate(rows * lat));
            self.rows = rows;
            self.backlog.iter_mut().for_each(Vec::clear);
            self.backlog_rows = 0;
        } else if rows < self.context_rows() {
            let th = self.model.cfg.target_hidden;
            self.backlog_rows = rows - self.rows;
            self.backlog.iter_mut().for_each(|b| b.truncate(self.backlog_rows * th));
        }
    }

    /// Turns the backlog into latents (one pass for all of its rows). On an error the backlog is
    /// dropped (the context ends at the folded rows).
    fn fold(&mut self) -> Result<(), BackendError> {
        if self.backlog_rows == 0 {
            return Ok(());
        }
        let t0 = Instant::now();
        let n = self.backlog_rows;
        let taps: Vec<&[f32]> = self.backlog.iter().map(Vec::as_slice).collect();
        let latents = self.model.context_latents(&taps, self.rows);
        self.backlog.iter_mut().for_each(Vec::clear);
        self.backlog_rows = 0;
        for (c, new) in self.caches.iter_mut().zip(latents?) {
            c.extend_from_slice(&new);
        }
        self.rows += n;
        self.folded_rows += n as u64;
        self.fold_s += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Appends the context rows of `n` committed tokens at positions `start..start + n` from the
    /// tapped rows (in `model.cfg.target_layers` order), to the backlog. On an error nothing is
    /// appended.
    pub fn append(&mut self, start: usize, taps: &[&[f32]], n: usize) -> Result<(), BackendError> {
        self.truncate(start);
        // A gap (rows of earlier tokens never seen) cannot be filled later: keep what is contiguous.
        if start != self.context_rows() {
            self.stranded = true;
            return Ok(());
        }
        self.stranded = false;
        let n = n.min(MAX_DRAFT_CONTEXT.saturating_sub(start));
        if n == 0 {
            return Ok(());
        }
        let th = self.model.cfg.target_hidden;
        for (b, t) in self.backlog.iter_mut().zip(taps) {
            b.extend_from_slice(&t[..n * th]);
        }
        self.backlog_rows += n;
        if self.backlog_rows >= MAX_BACKLOG {
            self.fold()?;
        }
        Ok(())
    }

    /// The block's drafts after the cached context for `anchor` at position `pos` (the backlog
    /// folded first).
    pub fn draft(&mut self, anchor: u32, pos: usize) -> Result<Vec<u32>, BackendError> {
        self.truncate(pos);
        let (rows0, fold0) = (self.folded_rows, self.fold_s);
        self.fold()?;
        let t0 = Instant::now();
        let (logits, drafts) = self.model.block(&mut self.caches, anchor, pos)?;
        self.forwards += 1;
        self.last_call = ((self.folded_rows - rows0) as usize, self.fold_s - fold0, t0.elapsed().as_secs_f64());
        self.last_logits = logits;
        Ok(drafts)
    }
}

impl Drafter for DSparkDrafter {
    fn name(&self) -> &str {
        "dspark"
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, BackendError> {
        self.last_call = (0, 0.0, 0.0);
        if k == 0 || !self.ready(context) {
            return Ok(Vec::new());
        }
        let pos = context.len() - 1;
        let mut d = self.draft(context[pos], pos)?;
        d.truncate(k);
        Ok(d)
    }

    fn ready(&self, context: &[u32]) -> bool {
        // Without the whole context known (past the limit, or rows never observed) it stays quiet.
        let Some(pos) = context.len().checked_sub(1) else { return false };
        // Rows past the anchor belong to tokens no longer committed (a rolled-back prefill):
        // dropped when it drafts.
        !self.stranded && pos < MAX_DRAFT_CONTEXT && self.context_rows() >= pos
    }

    fn backlog(&self) -> usize {
        self.backlog_rows
    }

    fn last_call(&self) -> Option<super::CallCost> {
        let (rows, fold_s, block_s) = self.last_call;
        Some(super::CallCost { rows, fold_s, block_s })
    }

    fn counters(&self) -> (u64, u64) {
        (self.forwards, self.folded_rows)
    }

    fn taps(&self) -> &[usize] {
        if self.stranded { &[] } else { &self.model.cfg.target_layers }
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
