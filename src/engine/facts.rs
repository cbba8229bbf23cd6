//! What a front end may ask an opened engine beyond running sessions: the usable context, the
//! vocabulary, the tokens that end a message, the draft model's description, whether more sequence
//! states fit the memory budget, a route trace of a run, the startup line's essentials, and whether
//! storage is failing reads.
//!
//! Contract: front ends (`cli`, `serve`) ask these methods, never the engine's parts (checkpoint,
//! roster, trunk, backend, memory plan); each answer is a plain value computed from the opened
//! engine, so a front end cannot depend on how the engine is built (tests/structure.rs checks it).

use super::Engine;
use crate::model::tokenizer::Tokenizer;
use crate::stats::Stats;
use crate::store::placement::RouteTrace;

impl Engine {
    /// Tokens of context one sequence may hold: the context reserved per sequence, or fewer where
    /// the memory budget holds less (also capped by the model's maximum); no session grows past it.
    pub fn context_bound(&self) -> usize {
        self.plan.context_bound
    }

    /// What caps [`Engine::context_bound`], for a front end's message: the context reserved per
    /// sequence (naming its setting) or the memory budget.
    pub fn context_limit(&self) -> String {
        self.plan.context_limit()
    }

    /// Whether the expert source fails reads now (drives given up, holders suspect), and how far
    /// the model's checksums are recorded: `/health`.
    pub fn storage_health(&self) -> crate::store::StorageHealth {
        let mut h = crate::store::health(self.source());
        h.checksums = Some(self.ck.verification());
        h
    }

    /// The model's vocabulary size: token ids are below it.
    pub fn vocab(&self) -> usize {
        self.cfg.vocab
    }

    /// The tokens that end generation: the chat format's end-of-message token (when `tok` has it),
    /// then the config's `eos_token_id` (when there is one), then the tokenizer's `[EOS]`.
    pub fn stop_tokens(&self, tok: Option<&Tokenizer>) -> Vec<u32> {
        let mut stops: Vec<u32> =
            tok.and_then(|t| t.special_id("<|end_of_msg|>")).into_iter().chain(self.cfg.eos_token).collect();
        // The document separator ends a plain continuation too (as llama.cpp's end-of-generation
        // tokens do): past it the model starts another document.
        if let Some(eos) = tok.and_then(|t| t.special_id("[EOS]"))
            && !stops.contains(&eos)
        {
            stops.push(eos);
        }
        stops
    }

    /// The DSpark draft model's description (its layers, taps and memory), when one is loaded.
    pub fn draft_model_description(&self) -> Option<String> {
        self.draft.as_ref().map(|d| d.describe())
    }

    /// Whether `states` sequence states holding `tokens` tokens in all fit the memory budget beside
    /// the trunk, the expert cache, the read slots and the activations (the plan reserves one).
    pub fn states_fit(&self, states: u64, tokens: u64) -> bool {
        let p = &self.plan;
        let free = p.budget.saturating_sub(p.trunk + p.expert_cache + p.staging + p.activations);
        states.saturating_mul(p.state_fixed).saturating_add(p.state_per_token.saturating_mul(tokens)) <= free
    }

    /// The startup line's essentials (the full one is [`Engine::startup_line`]): the model, its
    /// layers and experts, the trunk, the memory budget and expert cache, the context, the backend.
    pub fn startup_brief(&self) -> String {
        let random = if crate::model::synth::is_synthetic(&self.dir) { " [RANDOM WEIGHTS]" } else { "" };
        let seqs = match self.plan.sequences {
            1 => String::new(),
            n => format!(" x {n} sequences"),
        };
        format!(
            "deltafin: {}{random} | {} layers ({} MoE x {} experts) | {} | memory {}, expert cache {} | context <= {} tokens{seqs} | {}{}",
            self.dir.display(),
            self.cfg.layers,
            self.cfg.moe_layers(),
            self.cfg.experts,
            self.trunk_label(),
            crate::util::human_bytes(self.plan.budget),
            crate::util::human_bytes(self.plan.expert_cache),
            self.plan.context_bound,
            self.backend_used(),
            if self.config.prefetch { " | prefetch on" } else { "" },
        )
    }

    /// The routes counted in `stats`, marked as recorded on this model (for `place --policy hot`).
    pub fn route_trace(&self, stats: &Stats) -> RouteTrace {
        stats.route_trace().for_model(&self.ck)
    }
}
