//! The K3 forward pass, top to bottom, as K3.md states it and llama.cpp's
//! `src/models/kimi-k3.cpp` builds it: the embedding starts the AttnRes residual; every layer
//! mixes its input from the block snapshots, runs attention (KDA or MLA) on each sequence's own
//! state, mixes again and runs its FFN (the dense SiTU MLP, or the latent MoE); the final mix,
//! norm and lm_head give the logits.
//!
//! Contract: [`forward`] runs the rows of every sequence of a batch through one layer loop: every
//! row passes layer L before any row enters layer L+1, and results do not depend on how rows are
//! grouped into batches or calls, on thread count or on expert arrival order. It reads no bytes
//! and keeps no clock: a MoE layer's routed experts come from the [`Schedule`] (`crate::forward`
//! implements it with the expert store), which is also told when each [`Phase`] starts. The
//! forward leaves its rows *pending* in each sequence's state (see `state`); the caller commits
//! them (all, or the first j after a verification). If it fails, every sequence is rolled back:
//! exactly as before the call. Every layer's outputs and the logits are checked for NaN and
//! infinities as they are made (`finite`): one is an error naming the layer and its tensors and
//! the position, never a value passed on.

use super::attn_res::Residual;
use super::finite::{Site, first_non_finite};
use super::moe::{self, Routes};
use super::state::{LayerPending, LayerState, SeqState};
use super::weights::{Attn, Ffn, LayerWeights, MoeWeights};
use super::{ForwardError, K3, KdaMode, kda, mla, situ};
use crate::backend::Backend;
use crate::model::K3Config;
use rayon::prelude::*;
use std::ops::Range;

/// Which rows of a sequence get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    None,
    /// Only the last row (generation).
    Last,
    /// Every row (scoring, verification).
    All,
}

/// One sequence's part of a batch.
pub struct SeqRows<'a> {
    pub state: &'a mut SeqState,
    pub tokens: &'a [u32],
    pub logits: LogitRows,
    /// Layers after which this sequence's hidden rows are returned (the AttnRes running prefix
    /// after the layer's FFN, as DSpark reads it).
    pub taps: &'a [usize],
}

/// What a forward returns for one sequence.
#[derive(Debug, Default)]
pub struct RowsOut {
    /// [rows with logits, vocab].
    pub logits: Vec<f32>,
    /// (layer, [rows, hidden]) for each requested tap, in the order asked.
    pub taps: Vec<(usize, Vec<f32>)>,
}

/// The steps of a forward, as its schedule times them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// A layer's input mix, norm and attention, and the mix and norm before its FFN.
    Attention,
    /// A dense layer's MLP.
    DenseMlp,
    /// A MoE layer's router.
    Router,
    /// The routed input and the routed experts.
    Experts,
    /// The weighted sum in router order, the latent norm and up-projection, the shared experts.
    Combine,
    /// The final mix, norm and lm_head.
    Output,
}

/// What a forward needs from its schedule.
pub trait Schedule {
    /// The routed experts of MoE layer `layer` for rows whose router chose `routes`, on their
    /// deinterleaved latent inputs `zd` [n, latent]: every expert of the routes' union run (with
    /// [`moe::RoutedExperts`]) on the rows routed to it, each row's outputs weighted and summed in
    /// router order ([n, latent]). `xn` is the layer's input [n, hidden] (a schedule may run the next MoE
    /// layer's router on it to read ahead). A non-finite sum is [`ForwardError::NonFinite`] with
    /// the row of the pass as its `pos` ([`moe::RoutedExperts::finish`] gives it).
    fn routed(&mut self, layer: usize, xn: &[f32], routes: &Routes, zd: &[f32]) -> Result<Vec<f32>, ForwardError>;

    /// The forward enters `phase` (until the next call).
    fn phase(&mut self, _phase: Phase) {}
}

/// Runs every sequence's rows through the model; see the module contract.
pub fn forward(
    model: &K3,
    batch: &mut [SeqRows],
    kda_mode: KdaMode,
    sched: &mut dyn Schedule,
) -> Result<Vec<RowsOut>, ForwardError> {
    let c = &model.cfg;
    for s in batch.iter() {
        if s.tokens.is_empty() {
            return Err(ForwardError::Empty);
        }
        let have = s.state.pos;
        let max = s.state.cap.min(c.max_context);
        if have.saturating_add(s.tokens.len()) > max {
            return Err(ForwardError::ContextFull { have, new: s.tokens.len(), max });
        }
        if let Some((i, &id)) = s.tokens.iter().enumerate().find(|(_, id)| **id as usize >= c.vocab) {
            return Err(ForwardError::TokenOutOfRange { id, pos: have + i, vocab: c.vocab });
        }
    }
    let places = Places::of(batch);
    for s in batch.iter_mut() {
        s.state.begin(s.tokens.len());
    }
    let result = layers(model, batch, &places, kda_mode, sched);
    if result.is_err() {
        for s in batch.iter_mut() {
            s.state.rollback();
        }
    }
    result
}

/// Where each row of a pass is: its sequence and position, to name where a value went wrong.
struct Places {
    /// Row ranges of each sequence in the concatenated batch.
    ranges: Vec<Range<usize>>,
    /// Each sequence's committed length before the pass.
    starts: Vec<usize>,
}

impl Places {
    fn of(batch: &[SeqRows]) -> Self {
        let (mut ranges, mut total) = (Vec::with_capacity(batch.len()), 0usize);
        for s in batch {
            ranges.push(total..total + s.tokens.len());
            total += s.tokens.len();
        }
        Places { ranges, starts: batch.iter().map(|s| s.state.pos).collect() }
    }

    /// The error for a non-finite value at row `row` of the pass.
    fn at(&self, site: Site, row: usize, value: f32) -> ForwardError {
        let seq = self.ranges.iter().position(|r| r.contains(&row)).unwrap_or(0);
        let start = self.ranges.get(seq).map_or(0, |r| r.start);
        let pos = self.starts.get(seq).copied().unwrap_or(0) + row.saturating_sub(start);
        ForwardError::NonFinite { site, value, pos, seq }
    }

    /// Rows `xs` ([rows, width], rows of the pass) are all finite, else the error at the first.
    fn check(&self, site: Site, xs: &[f32], width: usize) -> Result<(), ForwardError> {
        match first_non_finite(xs) {
            None => Ok(()),
            Some(i) => Err(self.at(site, i / width.max(1), xs[i])),
        }
    }

    /// A non-finite error of the routed experts (`moe::RoutedExperts::finish`) names a row of
    /// the pass in `pos`: the sequence's position instead.
    fn place(&self, e: ForwardError) -> ForwardError {
        match e {
            ForwardError::NonFinite { site, value, pos: row, .. } => self.at(site, row, value),
            e => e,
        }
    }
}

/// The pass itself, once the batch is checked and its states are ready for pending rows.
fn layers(
    model: &K3,
    batch: &mut [SeqRows],
    places: &Places,
    kda_mode: KdaMode,
    sched: &mut dyn Schedule,
) -> Result<Vec<RowsOut>, ForwardError> {
    let be: &dyn Backend = &*model.be;
    let (c, w) = (&model.cfg, &model.w);
    let h = c.hidden;
    let ranges = &places.ranges;
    let total = ranges.last().map_or(0, |r| r.end);
    // The embedding: each token's row of embed_tokens starts the residual.
    let mut embeds = vec![0f32; total * h];
    for (s, r) in batch.iter().zip(ranges) {
        for (i, &id) in s.tokens.iter().enumerate() {
            w.embed.decode_row(id as usize, &mut embeds[(r.start + i) * h..][..h]);
        }
    }
    places.check(Site::Embedding, &embeds, h)?;
    let mut res = Residual::new(embeds, h);
    let mut outs: Vec<RowsOut> = batch.iter().map(|_| RowsOut::default()).collect();
    for (l, lw) in w.layers.iter().enumerate() {
        sched.phase(Phase::Attention);
        // Attention: its input mixed from the blocks and the prefix; a block starts every
        // `attn_res_block` layers.
        let mut x = res.mixed(be, &lw.attn_res_score, c.rms_eps)?;
        if l % c.attn_res_block == 0 {
            res.push_block();
        }
        be.rms_norm_rows(&mut x, &lw.input_norm, c.rms_eps)?;
        let a = attention(model, l, lw, batch, ranges, &x, kda_mode)?;
        places.check(Site::Attention(l), &a, h)?;
        res.add(a);
        // The FFN on its own mix of the same sources.
        let mut x = res.mixed(be, &lw.mlp_res_score, c.rms_eps)?;
        be.rms_norm_rows(&mut x, &lw.post_attn_norm, c.rms_eps)?;
        let f = match &lw.ffn {
            Ffn::Dense(mw) => {
                sched.phase(Phase::DenseMlp);
                let f = moe::mlp(be, mw, situ(c), &x)?;
                places.check(Site::Mlp(l), &f, h)?;
                f
            }
            Ffn::Moe(mw) => {
                let f = moe_layer(be, c, mw, l, &x, places, sched)?;
                places.check(Site::Moe(l), &f, h)?;
                f
            }
        };
        res.add(f);
        for ((s, r), o) in batch.iter().zip(ranges).zip(outs.iter_mut()) {
            if s.taps.contains(&l)
                && let Some(p) = res.prefix()
            {
                o.taps.push((l, p[r.start * h..r.end * h].to_vec()));
            }
        }
    }
    sched.phase(Phase::Output);
    let out = res.mixed(be, &w.output_res_score, c.rms_eps)?;
    logits(model, batch, places, &out, &mut outs)?;
    Ok(outs)
}

/// A MoE layer on rows `xn` [n, hidden]: the router, the routed input, the routed experts from
/// `sched`, their weighted sum in router order and the shared experts; returns [n, hidden].
fn moe_layer(
    be: &dyn Backend,
    c: &K3Config,
    w: &MoeWeights,
    layer: usize,
    xn: &[f32],
    places: &Places,
    sched: &mut dyn Schedule,
) -> Result<Vec<f32>, ForwardError> {
    sched.phase(Phase::Router);
    let routes = moe::route(be, c, w, xn)?;
    sched.phase(Phase::Experts);
    let input = moe::expert_input(be, c, w, xn)?;
    let routed = sched.routed(layer, xn, &routes, &input.zd).map_err(|e| places.place(e))?;
    sched.phase(Phase::Combine);
    Ok(moe::combine(be, c, w, routed, input)?)
}

/// Layer `l`'s attention for every sequence's rows of `x` (normalised), each on its own state,
/// the results pending there; returns [rows, hidden].
fn attention(
    model: &K3,
    l: usize,
    lw: &LayerWeights,
    batch: &mut [SeqRows],
    ranges: &[Range<usize>],
    x: &[f32],
    kda_mode: KdaMode,
) -> Result<Vec<f32>, ForwardError> {
    let (be, c, h) = (&*model.be, &model.cfg, model.cfg.hidden);
    // Each sequence on its own state: several at once across threads (each one's ops are the
    // same whichever thread runs them, so the bits are too; a batched prefill's host-side
    // attention work was one sequence after another).
    let one = |(s, r): (&mut SeqRows, &Range<usize>)| -> Result<Vec<f32>, ForwardError> {
        let xs = &x[r.start * h..r.end * h];
        let st = &mut *s.state;
        // The state's layer kinds are built from the same config as the weights.
        let out = match &lw.attn {
            Attn::Kda(w) => {
                let spare = st.take_spare(l);
                let LayerState::Kda(ks) = &st.layers[l] else { unreachable!("KDA state for a KDA layer") };
                let (out, pending) = kda::forward(be, c, w, ks, xs, kda_mode, spare)?;
                st.set_pending(l, LayerPending::Kda(pending));
                out
            }
            Attn::Mla(w) => {
                let LayerState::Mla(ms) = &mut st.layers[l] else { unreachable!("MLA state for an MLA layer") };
                let committed = ms.latent.len();
                // Pending before the call: a failure is undone by truncating back to `committed`.
                st.set_pending(l, LayerPending::Mla { committed });
                let LayerState::Mla(ms) = &mut st.layers[l] else { unreachable!("MLA state for an MLA layer") };
                mla::forward(be, c, w, ms, xs)?
            }
        };
        Ok(out)
    };
    let outs: Vec<Vec<f32>> = if batch.len() > 1 {
        batch.par_iter_mut().zip(ranges.par_iter()).map(one).collect::<Result<_, _>>()?
    } else {
        batch.iter_mut().zip(ranges).map(one).collect::<Result<_, _>>()?
    };
    if outs.len() == 1 {
        return Ok(outs.into_iter().next().unwrap_or_default());
    }
    let mut a = vec![0f32; x.len()];
    let mut rest = &mut a[..];
    let mut parts = Vec::with_capacity(outs.len());
    for o in &outs {
        let (head, tail) = rest.split_at_mut(o.len());
        parts.push((head, &o[..]));
        rest = tail;
    }
    parts.into_par_iter().for_each(|(d, s)| d.copy_from_slice(s));
    Ok(a)
}

/// Every requested row of every sequence through the final norm and one lm_head product.
fn logits(
    model: &K3,
    batch: &[SeqRows],
    places: &Places,
    out: &[f32],
    outs: &mut [RowsOut],
) -> Result<(), ForwardError> {
    let (be, c, h) = (&*model.be, &model.cfg, model.cfg.hidden);
    let mut rows: Vec<usize> = Vec::new();
    let mut counts = Vec::with_capacity(batch.len());
    for (s, r) in batch.iter().zip(&places.ranges) {
        let before = rows.len();
        match s.logits {
            LogitRows::None => {}
            LogitRows::Last => rows.push(r.end - 1),
            LogitRows::All => rows.extend(r.clone()),
        }
        counts.push(rows.len() - before);
    }
    let mut xs = Vec::with_capacity(rows.len() * h);
    for &r in &rows {
        xs.extend_from_slice(&out[r * h..(r + 1) * h]);
    }
    be.rms_norm_rows(&mut xs, &model.w.final_norm, c.rms_eps)?;
    let mut logits = vec![0f32; rows.len() * c.vocab];
    if !rows.is_empty() {
        be.matmul_bf16(&model.w.lm_head, &xs, &mut logits)?;
    }
    if c.logit_scale != 1.0 {
        logits.iter_mut().for_each(|x| *x *= c.logit_scale);
    }
    if let Some(i) = first_non_finite(&logits) {
        return Err(places.at(Site::Logits, rows[i / c.vocab.max(1)], logits[i]));
    }
    let mut at = 0;
    for (o, n) in outs.iter_mut().zip(counts) {
        o.logits = logits[at * c.vocab..(at + n) * c.vocab].to_vec();
        at += n;
    }
    Ok(())
}
