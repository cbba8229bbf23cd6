//! The memory budget: one number (`--memory-gb`, default from the machine) split into the resident
//! trunk, the expert cache, per-sequence state and activations, and the context length that fits.
//!
//! Contract: [`MemoryPlan::new`] fails with a clear message when the trunk and fixed state do not fit;
//! otherwise `context_bound` tokens of cache fit in what is left. The plan is computed before any
//! work starts and printed on the startup line.

use crate::k3::state::SeqState;
use crate::model::K3Config;
use crate::util::human_bytes;

#[derive(Clone, Debug)]
pub struct MemoryPlan {
    pub budget: u64,
    pub trunk: u64,
    /// The draft model's weights and one session's drafter cache (0 without a draft model).
    pub draft: u64,
    pub expert_cache: u64,
    /// Slots for reads in flight (besides the cache).
    pub staging: u64,
    pub state_fixed: u64,
    pub state_per_token: u64,
    pub activations: u64,
    /// Tokens of context that fit (also capped by the model's maximum).
    pub context_bound: usize,
}

#[derive(Debug, thiserror::Error)]
#[error(
    "memory budget {} is too small: the resident trunk needs {}, the draft model {}, the expert cache {}, fixed sequence state {} and activations {} (raise {} or lower {})",
    human_bytes(*budget), human_bytes(*trunk), human_bytes(*draft), human_bytes(*expert_cache), human_bytes(*state_fixed), human_bytes(*activations),
    crate::setting::Setting::MemoryGb, crate::setting::Setting::ExpertCacheGb
)]
pub struct BudgetError {
    pub budget: u64,
    pub trunk: u64,
    pub draft: u64,
    pub expert_cache: u64,
    pub state_fixed: u64,
    pub activations: u64,
}

/// Sequences that do not fit in the memory budget together (see [`MemoryPlan::sequences_fit`]).
#[derive(Debug, thiserror::Error)]
#[error(
    "{count} sequences of {tokens} tokens in all need {} of sequence state together, but the memory budget {} leaves {} beside the trunk, expert cache and activations (run fewer sequences together or shorter ones, or raise {})",
    human_bytes(*need), human_bytes(*budget), human_bytes(*free), crate::setting::Setting::MemoryGb
)]
pub struct SequencesError {
    pub count: usize,
    pub tokens: usize,
    pub need: u64,
    pub free: u64,
    pub budget: u64,
}

/// Memory this machine can give us: MemAvailable, capped by the limit of our memory cgroup
/// (v1 or v2) when there is one; 8 GiB where neither can be read.
pub fn machine_available() -> u64 {
    let avail = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
    });
    match (avail, cgroup_limit()) {
        (Some(a), Some(l)) => a.min(l),
        (Some(a), None) => a,
        (None, Some(l)) => l,
        (None, None) => 8 << 30,
    }
}

/// The tightest memory limit on this process's cgroup or any of its ancestors (v1 or v2), if any.
fn cgroup_limit() -> Option<u64> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let read = |p: &str| std::fs::read_to_string(p).ok().and_then(|t| t.trim().parse::<u64>().ok());
    let mut best: Option<u64> = None;
    let mut take = |l: Option<u64>| {
        // cgroup v1 reports "no limit" as a huge number.
        if let Some(l) = l.filter(|&l| l < (1u64 << 60)) {
            best = Some(best.map_or(l, |b| b.min(l)));
        }
    };
    for line in cg.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(ctrl), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let (root, file) = if ctrl.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")
        } else if ctrl.is_empty() {
            ("/sys/fs/cgroup", "memory.max")
        } else {
            continue;
        };
        // Our cgroup, each ancestor, and the mount root (containers without a cgroup namespace
        // see their own cgroup there).
        let mut p = std::path::PathBuf::from(path);
        loop {
            take(read(&format!("{root}{}/{file}", p.display().to_string().trim_end_matches('/'))));
            if !p.pop() {
                break;
            }
        }
        take(read(&format!("{root}/{file}")));
        // v1 also knows the effective limit through the hierarchy.
        if let Ok(stat) = std::fs::read_to_string(format!("{root}{path}/memory.stat")) {
            take(stat.lines().find_map(|l| l.strip_prefix("hierarchical_memory_limit ")?.trim().parse().ok()));
        }
    }
    best
}

/// Bytes of f32 activations for a batch of `rows` rows (generous: the widest intermediates of
/// one layer, the MoE slots, and logits for one row).
pub fn activation_bytes(c: &K3Config, rows: usize) -> u64 {
    let widest = [
        c.hidden,
        c.kda_dim(),
        c.dense_inter,
        c.shared_experts * c.expert_inter,
        c.mla_heads * (c.qk_nope + c.qk_rope),
    ]
    .into_iter()
    .max()
    .unwrap_or(c.hidden);
    let per_row = 16 * c.hidden + 8 * widest + c.top_k * c.expert_latent + 4 * c.expert_inter;
    (4 * (rows * per_row + c.vocab)) as u64
}

impl MemoryPlan {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        c: &K3Config,
        budget: u64,
        trunk: u64,
        draft: u64,
        expert_cache: u64,
        staging: u64,
        prefill_rows: usize,
        outputs: u64,
    ) -> Result<Self, BudgetError> {
        let (fixed, per_token) = SeqState::footprint(c);
        let (state_fixed, state_per_token) = (fixed as u64, per_token.max(1) as u64);
        let activations = activation_bytes(c, prefill_rows.max(1)) + outputs;
        let committed = trunk + draft + expert_cache + staging + state_fixed + activations;
        if committed > budget {
            return Err(BudgetError {
                budget,
                trunk,
                draft,
                expert_cache: expert_cache + staging,
                state_fixed,
                activations,
            });
        }
        let context_bound = (((budget - committed) / state_per_token) as usize).min(c.max_context);
        Ok(MemoryPlan {
            budget,
            trunk,
            draft,
            expert_cache,
            staging,
            state_fixed,
            state_per_token,
            activations,
            context_bound,
        })
    }

    /// Checks that sequences of `lens` tokens each fit beside the rest of the plan, all at once
    /// (a batch holds every sequence's state together): the error names the budget.
    pub fn sequences_fit(&self, lens: &[usize]) -> Result<(), SequencesError> {
        let free =
            self.budget.saturating_sub(self.trunk + self.draft + self.expert_cache + self.staging + self.activations);
        let need: u64 = lens
            .iter()
            .map(|&l| self.state_fixed.saturating_add(self.state_per_token.saturating_mul(l as u64)))
            .fold(0u64, u64::saturating_add);
        if need > free {
            return Err(SequencesError {
                count: lens.len(),
                tokens: lens.iter().sum(),
                need,
                free,
                budget: self.budget,
            });
        }
        Ok(())
    }

    /// "trunk 12 MiB + expert cache 0 B + read slots 70 MiB + state 1.2 MiB + 2.3 KiB/token + activations 3 MiB of 20 GiB"
    pub fn summary(&self) -> String {
        let draft = if self.draft > 0 { format!(" + draft model {}", human_bytes(self.draft)) } else { String::new() };
        format!(
            "trunk {}{draft} + expert cache {} + read slots {} + state {} + {}/token + activations {} of {}",
            human_bytes(self.trunk),
            human_bytes(self.expert_cache),
            human_bytes(self.staging),
            human_bytes(self.state_fixed),
            human_bytes(self.state_per_token),
            human_bytes(self.activations),
            human_bytes(self.budget)
        )
    }
}
