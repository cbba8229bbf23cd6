//! Schedules: the layer loop over the rows of one or several sequences at once.
//!
//! Contract of [`forward`]: every row of every sequence in the batch passes layer L (attention on
//! each sequence's own state, then one fetch of the layer's expert union for all rows) before any
//! row enters layer L+1; results do not depend on how rows are grouped into batches or calls, on
//! thread count or on expert arrival order. The forward leaves its rows *pending* in each
//! sequence's state (see `k3::state`); the caller commits them (all, or the first j after a
//! verification). If the forward fails, every sequence is rolled back: exactly as before the call.
//!
//! Prefill and decode are the same loop: a prompt is one batch of many rows (chunked by the
//! caller at `prefill_rows`), a decode step one row per sequence.

pub mod moe;

use crate::backend::Backend;
use crate::cpu::ops::Situ;
use crate::k3::state::{LayerPending, LayerState, SeqState};
use crate::k3::weights::{Attn, Ffn};
use crate::k3::{ForwardError, K3, KdaMode, kda, mla};
use crate::stats::Stats;
use crate::store::ExpertSource;
use std::time::Instant;

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

/// How the loop runs (changes timing or the reference path, never the result's meaning).
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    pub kda_mode: KdaMode,
    /// Predict and prefetch the next MoE layer's experts.
    pub prefetch: bool,
}

/// Runs every sequence's rows through the model; see the module contract.
pub fn forward(
    model: &K3,
    source: Option<&dyn ExpertSource>,
    opts: Options,
    batch: &mut [SeqRows],
    stats: &mut Stats,
) -> Result<Vec<RowsOut>, ForwardError> {
    let c = &model.cfg;
    for s in batch.iter() {
        if s.tokens.is_empty() {
            return Err(ForwardError::Empty);
        }
        let have = s.state.pos;
        if have.saturating_add(s.tokens.len()) > c.max_context {
            return Err(ForwardError::ContextFull { have, new: s.tokens.len(), max: c.max_context });
        }
        if let Some((i, &id)) = s.tokens.iter().enumerate().find(|(_, id)| **id as usize >= c.vocab) {
            return Err(ForwardError::TokenOutOfRange { id, pos: have + i, vocab: c.vocab });
        }
    }
    for s in batch.iter_mut() {
        s.state.begin(s.tokens.len());
    }
    let result = run(model, source, opts, batch, stats);
    if result.is_err() {
        for s in batch.iter_mut() {
            s.state.rollback();
        }
    }
    result
}

fn run(
    model: &K3,
    source: Option<&dyn ExpertSource>,
    opts: Options,
    batch: &mut [SeqRows],
    stats: &mut Stats,
) -> Result<Vec<RowsOut>, ForwardError> {
    let be: &dyn Backend = &*model.be;
    let c = &model.cfg;
    let h = c.hidden;
    let t_start = Instant::now();
    let moe_before = stats.router_s + stats.expert_kernel_s + stats.read_wait_s;
    // Row ranges of each sequence in the concatenated batch.
    let mut ranges = Vec::with_capacity(batch.len());
    let mut total = 0usize;
    for s in batch.iter() {
        ranges.push(total..total + s.tokens.len());
        total += s.tokens.len();
    }
    let mut embeds = vec![0f32; total * h];
    for (s, r) in batch.iter().zip(&ranges) {
        for (i, &id) in s.tokens.iter().enumerate() {
            crate::cpu::decode_bf16_row(model.w.embed.row(id as usize), &mut embeds[(r.start + i) * h..][..h]);
        }
    }
    let situ = Situ { beta: c.situ_beta, linear_beta: c.situ_linear_beta };
    let mut res = crate::k3::attn_res::Residual::new(embeds, h);
    let (mut attn_s, mut dense_s) = (0f64, 0f64);
    let mut predicted: Option<Vec<u32>> = None;
    let mut outs: Vec<RowsOut> = batch.iter().map(|_| RowsOut::default()).collect();
    for (l, lw) in model.w.layers.iter().enumerate() {
        let t0 = Instant::now();
        let mut x = res.mixed(be, &lw.attn_res_score, c.rms_eps);
        if l % c.attn_res_block == 0 {
            res.push_block();
        }
        be.rms_norm_rows(&mut x, &lw.input_norm, c.rms_eps);
        let mut a = Vec::with_capacity(total * h);
        for (s, r) in batch.iter_mut().zip(&ranges) {
            let xs = &x[r.start * h..r.end * h];
            let st = &mut *s.state;
            // The state's layer kinds are built from the same config as the weights.
            let out = match &lw.attn {
                Attn::Kda(w) => {
                    let spare = st.take_spare(l);
                    let LayerState::Kda(ks) = &st.layers[l] else { unreachable!("KDA state for a KDA layer") };
                    let (out, pending) = kda::forward(be, c, w, ks, xs, opts.kda_mode, spare);
                    st.set_pending(l, LayerPending::Kda(pending));
                    out
                }
                Attn::Mla(w) => {
                    let LayerState::Mla(ms) = &mut st.layers[l] else { unreachable!("MLA state for an MLA layer") };
                    let committed = ms.latent.len();
                    let out = mla::forward(be, c, w, ms, xs);
                    st.set_pending(l, LayerPending::Mla { committed });
                    out
                }
            };
            a.extend_from_slice(&out);
        }
        res.add(a);
        let mut x = res.mixed(be, &lw.mlp_res_score, c.rms_eps);
        be.rms_norm_rows(&mut x, &lw.post_attn_norm, c.rms_eps);
        attn_s += t0.elapsed().as_secs_f64();
        let f = match &lw.ffn {
            Ffn::Dense(w) => {
                let t1 = Instant::now();
                let out = crate::k3::moe::mlp(be, w, situ, &x);
                dense_s += t1.elapsed().as_secs_f64();
                out
            }
            Ffn::Moe(w) => {
                let src = source.ok_or(ForwardError::NoExpertSource)?;
                let next = if opts.prefetch || total >= moe::READ_AHEAD_ROWS { model.next_moe(l) } else { None };
                let look = moe::Lookahead { predicted_here: predicted.as_deref(), next };
                let (out, pred) = moe::layer(model, w, l, src, &x, stats, look)?;
                predicted = pred;
                out
            }
        };
        res.add(f);
        for ((s, r), o) in batch.iter().zip(&ranges).zip(outs.iter_mut()) {
            if s.taps.contains(&l)
                && let Some(p) = res.prefix()
            {
                o.taps.push((l, p[r.start * h..r.end * h].to_vec()));
            }
        }
    }
    let out = res.mixed(be, &model.w.output_res_score, c.rms_eps);
    // Every requested row of every sequence through the final norm and one lm_head product.
    let mut rows: Vec<usize> = Vec::new();
    let mut counts = Vec::with_capacity(batch.len());
    for (s, r) in batch.iter().zip(&ranges) {
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
    be.rms_norm_rows(&mut xs, &model.w.final_norm, c.rms_eps);
    let mut logits = vec![0f32; rows.len() * c.vocab];
    if !rows.is_empty() {
        be.matmul_bf16(&model.w.lm_head, &xs, &mut logits);
    }
    if c.logit_scale != 1.0 {
        logits.iter_mut().for_each(|x| *x *= c.logit_scale);
    }
    let mut at = 0;
    for (o, n) in outs.iter_mut().zip(counts) {
        o.logits = logits[at * c.vocab..(at + n) * c.vocab].to_vec();
        at += n;
    }
    stats.forward_calls += 1;
    stats.rows += total as u64;
    stats.attention_s += attn_s;
    stats.dense_mlp_s += dense_s;
    let moe_s = stats.router_s + stats.expert_kernel_s + stats.read_wait_s - moe_before;
    stats.other_s += (t_start.elapsed().as_secs_f64() - attn_s - dense_s - moe_s).max(0.0);
    Ok(outs)
}
