//! The memory budget: one number (`--memory-gb`, default from the machine) split into the resident
//! trunk, the expert cache, per-sequence state and activations, and the context length that fits.
//!
//! Contract: [`MemoryPlan::new`] fails with a clear message when the trunk and fixed state do not fit;
//! otherwise `context_bound` tokens of cache fit in what is left, at most the context reserved per
//! sequence ([`MemoryPlan::with_context`]: no sequence grows past it). The plan is computed before any
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
    /// Tokens of context one sequence may hold: the context reserved per sequence, or fewer
    /// where less fits (also capped by the model's maximum).
    pub context_bound: usize,
    /// Tokens of context reserved per sequence (`EngineConfig::context`; see [`Self::with_context`]).
    pub context: usize,
    /// Sequences the plan reserves state for (`EngineConfig::sequences`).
    pub sequences: usize,
    /// The model's maximum context.
    pub max_context: usize,
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
#[derive(Clone, Debug, thiserror::Error)]
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

/// Where the machine's memory cannot be read at all: a budget most machines can give.
const UNKNOWN_AVAILABLE: u64 = 8 << 30;

/// Memory this machine can give us (the default budget). Linux: MemAvailable, capped by the limit
/// of our memory cgroup (v1 or v2) when there is one. macOS: what `vm_stat` counts as free,
/// inactive, purgeable and speculative pages, at most `hw.memsize` (3/4 of `hw.memsize` where the
/// page counts cannot be read). 8 GiB where neither can be read.
#[cfg(target_os = "macos")]
pub fn machine_available() -> u64 {
    match (crate::util::machine_memory(), reclaimable_pages()) {
        (Some(total), Some(free)) => free.min(total),
        (Some(total), None) => total / 4 * 3,
        (None, free) => free.unwrap_or(UNKNOWN_AVAILABLE),
    }
}

/// macOS: bytes of free, inactive, purgeable and speculative pages (`host_statistics64`, as
/// `vm_stat` reads them): what can be had without paging anything out.
#[cfg(target_os = "macos")]
fn reclaimable_pages() -> Option<u64> {
    // SAFETY: an all-zero vm_statistics64 is a valid value of the plain integer struct.
    let mut v: libc::vm_statistics64 = unsafe { std::mem::zeroed() };
    let mut count = libc::HOST_VM_INFO64_COUNT;
    // SAFETY: host_statistics64 writes at most `count` integers into `v`, which is that large;
    // mach_host_self returns this task's send right to its host (deprecated in libc in favour of
    // the mach2 crate, the same call).
    #[allow(deprecated)]
    let r = unsafe {
        libc::host_statistics64(
            libc::mach_host_self(),
            libc::HOST_VM_INFO64,
            (&raw mut v).cast::<libc::integer_t>(),
            &mut count,
        )
    };
    if r != libc::KERN_SUCCESS {
        return None;
    }
    // SAFETY: sysconf reads a system constant.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
    let pages = [v.free_count, v.inactive_count, v.purgeable_count, v.speculative_count];
    Some(pages.iter().map(|&n| u64::from(n)).sum::<u64>() * page)
}

/// Memory this machine can give us (the default budget). Linux: MemAvailable, capped by the limit
/// of our memory cgroup (v1 or v2) when there is one; 8 GiB where neither can be read.
#[cfg(not(target_os = "macos"))]
pub fn machine_available() -> u64 {
    match (crate::util::meminfo("MemAvailable:"), cgroup_limit()) {
        (Some(a), Some(l)) => a.min(l),
        (Some(a), None) => a,
        (None, Some(l)) => l,
        (None, None) => UNKNOWN_AVAILABLE,
    }
}

/// The tightest memory limit on this process's cgroup or any of its ancestors (v1 or v2), if any.
#[cfg(not(target_os = "macos"))]
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

/// Tokens of context a sequence may hold by default: the model's maximum, up to this.
pub const DEFAULT_CONTEXT: usize = 32_768;

/// The context reserved per sequence: `asked`, checked against the model's maximum (Err: what is
/// wrong with it), or [`DEFAULT_CONTEXT`] capped by the maximum.
pub fn reserved_context(c: &K3Config, asked: Option<usize>) -> Result<usize, String> {
    match asked {
        None => Ok(c.max_context.clamp(1, DEFAULT_CONTEXT)),
        Some(0) => Err("give the tokens of context each sequence may hold (>= 1)".into()),
        Some(n) if n > c.max_context => Err(format!("the model holds at most {} tokens of context", c.max_context)),
        Some(n) => Ok(n),
    }
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

/// What the expert cache is sized from: every other part of the budget, and the slot one cached
/// expert takes. The one formula the engine's startup and `deltafin plan` share
/// ([`Split::expert_cache`]; tests/plan_agrees.rs holds them to it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// The memory budget (for `plan`: the machine's memory less the OS's share).
    pub budget: u64,
    pub trunk: u64,
    pub draft: u64,
    /// Slots for the expert reads in flight (besides the cache).
    pub staging: u64,
    /// The sequence states reserved: every sequence at its full context ([`state_reserve`]).
    pub states: u64,
    /// Activations ([`activation_bytes`]) and the results kept for output.
    pub activations: u64,
    /// Bytes one cached expert takes: its slot.
    pub slot: u64,
    /// Routed experts of the model: the cache never holds more.
    pub experts: u64,
}

impl Split {
    /// Everything but the expert cache.
    pub fn committed(&self) -> u64 {
        self.trunk + self.draft + self.staging + self.states + self.activations
    }

    /// The expert cache this split leaves: 90% of what the rest leaves of the budget (headroom for
    /// allocator slack), in whole slots, never more than every expert.
    pub fn expert_cache(&self) -> u64 {
        let cache = (self.budget.saturating_sub(self.committed()) as f64 * 0.9) as u64;
        self.with_cache(cache)
    }

    /// `bytes` of expert cache in whole slots, never more than every expert (a size given as a
    /// setting is held to the same).
    pub fn with_cache(&self, bytes: u64) -> u64 {
        bytes.checked_div(self.slot).map_or(0, |n| n.min(self.experts) * self.slot)
    }
}

/// Bytes of state reserved for `sequences` sequences of `context` tokens each.
pub fn state_reserve(c: &K3Config, context: usize, sequences: usize) -> u64 {
    let (fixed, per_token) = SeqState::footprint(c);
    (fixed as u64 + per_token as u64 * context as u64) * sequences.max(1) as u64
}

impl MemoryPlan {
    /// The plan of `split` with `expert_cache` bytes of expert cache (`Split::expert_cache` or
    /// `Split::with_cache`); one sequence's state counted at its fixed size, the context it may hold
    /// from what is left.
    pub fn new(c: &K3Config, split: &Split, expert_cache: u64) -> Result<Self, BudgetError> {
        let Split { budget, trunk, draft, staging, activations, .. } = *split;
        let (fixed, per_token) = SeqState::footprint(c);
        let (state_fixed, state_per_token) = (fixed as u64, per_token.max(1) as u64);
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
            context: context_bound,
            sequences: 1,
            max_context: c.max_context,
        })
    }

    /// The plan with `context` tokens reserved for each of `sequences` sequences: no sequence
    /// may grow past it (`context_bound` is the smaller of it and what fits).
    pub fn with_context(mut self, context: usize, sequences: usize) -> Self {
        self.context = context;
        self.sequences = sequences.max(1);
        self.context_bound = self.context_bound.min(context);
        self
    }

    /// What caps `context_bound`, for messages: the setting, or the memory budget when less fits.
    pub fn context_limit(&self) -> String {
        use crate::setting::Setting;
        if self.context_bound >= self.max_context {
            "the model's maximum".into()
        } else if self.context_bound >= self.context {
            format!("the context reserved per sequence: raise {}", Setting::Context)
        } else {
            format!("what the memory budget leaves; raise {} or lower {}", Setting::MemoryGb, Setting::ExpertCacheGb)
        }
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

/// What `deltafin plan` assumes besides the memory budget.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct PlanInputs {
    pub memory_bytes: u64,
    /// Kept for the OS and everything else on the machine.
    pub os_bytes: u64,
    /// Tokens of context reserved for one sequence's MLA cache.
    pub context: usize,
    /// Prompt rows processed together (activations).
    pub prefill_rows: usize,
    /// Sequential read rate of one drive, bytes per second.
    pub drive_bytes_per_s: f64,
    /// Escapes per coded value (measured by `pack-trunk` on a trained model's trunk).
    pub escape_fraction: f64,
}

/// One trunk encoding's line of the plan.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PlanRow {
    pub trunk: &'static str,
    pub exact: bool,
    pub trunk_bytes: u64,
    pub state_bytes: u64,
    pub activation_bytes: u64,
    pub os_bytes: u64,
    pub expert_cache_bytes: u64,
    pub cached_experts: u64,
    /// Expected hit rate of the expert cache: the fraction of all experts it holds (routes taken
    /// as uniform; skewed real routes hit more, so this is the pessimistic end).
    pub hit_rate: f64,
    /// Slots for the reads in flight of one drive at queue depth 4 (besides the cache).
    pub read_slot_bytes: u64,
    /// The least memory this encoding runs in: trunk, state, activations, read slots and the OS's
    /// share, with no expert cache.
    pub min_memory_bytes: u64,
    /// Whether `min_memory_bytes` fits the machine's memory: when false, the model cannot run
    /// here with this trunk and the decode bounds are not reachable.
    pub fits: bool,
    /// Decode lower bound in seconds per token for 1, 2, 4 and 8 drives: the routed bytes a token
    /// misses, read at the drives' combined rate.
    pub decode_s_per_token: Vec<(usize, f64)>,
}

/// The queue depth `deltafin plan` assumes for its one drive (the store's default).
pub const PLAN_QUEUE_DEPTH: usize = 4;

/// The memory plan of model `c` under each trunk encoding (bf16, coded, int8): the budget split
/// as the engine splits it at startup ([`Split`]), with no draft model and one sequence.
pub fn plan_encodings(c: &K3Config, p: &PlanInputs) -> Vec<PlanRow> {
    let (mats, vec_values) = crate::model::roster::trunk_shapes(c);
    let vecs = 4 * vec_values as u64;
    let bf16: u64 = mats.iter().map(|(_, r, k)| (2 * r * k) as u64).sum::<u64>() + vecs;
    let coded: u64 = mats
        .iter()
        .map(|(_, r, k)| {
            let values = (r * k) as f64;
            (r * k + r * crate::backend::coded::idx_row(*k) + 4 * (r + 1) + 8) as u64
                + (values * p.escape_fraction) as u64
        })
        .sum::<u64>()
        + vecs;
    let int8: u64 = mats.iter().map(|(_, r, k)| (r * k + 4 * r) as u64).sum::<u64>() + vecs;
    let state = state_reserve(c, p.context, 1);
    let act = activation_bytes(c, p.prefill_rows);
    let expert = c.expert_bytes() as u64;
    let slot = crate::store::expert_store::slot_size(c.expert_bytes()) as u64;
    let all_experts = (c.moe_layers() * c.experts) as u64;
    let token_bytes = (c.moe_layers() * c.top_k) as f64 * expert as f64;
    // One drive at queue depth 4, no prefetch: its reads in flight and two spare (`staging_slots`).
    let read_slots = (PLAN_QUEUE_DEPTH + 2) as u64 * slot;
    [("bf16", true, bf16), ("coded", true, coded), ("int8", false, int8)]
        .into_iter()
        .map(|(name, exact, trunk)| {
            let min_memory = trunk + state + act + read_slots + p.os_bytes;
            let split = Split {
                budget: p.memory_bytes.saturating_sub(p.os_bytes),
                trunk,
                draft: 0,
                staging: read_slots,
                states: state,
                activations: act,
                slot,
                experts: all_experts,
            };
            let cache = split.expert_cache();
            let cached = cache / slot.max(1);
            let hit = cached as f64 / all_experts.max(1) as f64;
            let decode = [1usize, 2, 4, 8]
                .into_iter()
                .map(|n| (n, token_bytes * (1.0 - hit) / (n as f64 * p.drive_bytes_per_s)))
                .collect();
            PlanRow {
                trunk: name,
                exact,
                trunk_bytes: trunk,
                state_bytes: state,
                activation_bytes: act,
                os_bytes: p.os_bytes,
                expert_cache_bytes: cache,
                cached_experts: cached,
                hit_rate: hit,
                read_slot_bytes: read_slots,
                min_memory_bytes: min_memory,
                fits: min_memory <= p.memory_bytes,
                decode_s_per_token: decode,
            }
        })
        .collect()
}

// The wired limit (macOS): memory the GPU may keep wired. Metal's working set on Apple silicon is
// bounded by it; model memory past it is paged, and decoded 40-150x slower in peers' measurements.

/// macOS's wired limit for the GPU: `iogpu.wired_limit_mb` when set, else macOS's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WiredLimit {
    pub bytes: u64,
    /// The machine's memory (`hw.memsize`).
    pub ram: u64,
    /// `iogpu.wired_limit_mb` as set (0: not set, `bytes` is macOS's default, estimated).
    pub sysctl_mb: u64,
}

/// Memory a raised limit leaves to macOS and everything else.
const WIRED_OS_RESERVE: u64 = 8 << 30;

impl WiredLimit {
    /// The limit on a machine of `ram` bytes with `iogpu.wired_limit_mb` = `sysctl_mb`. Unset (0),
    /// macOS's default: two thirds of memory up to 32 GiB, three quarters above (what Metal's
    /// `recommendedMaxWorkingSetSize` reports on such Macs; recent macOS has been reported to
    /// give more, so the estimate errs low).
    pub fn new(ram: u64, sysctl_mb: u64) -> Self {
        let bytes = if sysctl_mb > 0 {
            sysctl_mb << 20
        } else if ram <= 32 << 30 {
            ram / 3 * 2
        } else {
            ram / 4 * 3
        };
        WiredLimit { bytes, ram, sysctl_mb }
    }

    /// None when `gpu_bytes` of GPU memory fit under the limit; else what to tell the user: the
    /// numbers and the `sysctl` that raises the limit, or, when even a raised one leaves macOS too
    /// little, to use less GPU memory.
    pub fn check(&self, gpu_bytes: u64) -> Option<String> {
        use crate::setting::Setting;
        if gpu_bytes <= self.bytes {
            return None;
        }
        let limit = match self.sysctl_mb {
            0 => format!("macOS's default, about {} (iogpu.wired_limit_mb is 0)", human_bytes(self.bytes)),
            mb => format!("{} (iogpu.wired_limit_mb={mb})", human_bytes(self.bytes)),
        };
        let most = self.ram.saturating_sub(WIRED_OS_RESERVE);
        // The need plus 1 GiB, in whole GiB.
        let want_mb = (gpu_bytes + (1 << 30)).div_ceil(1 << 30) * 1024;
        let lower = format!("lower {} or {}", Setting::GpuCacheGb, Setting::MemoryGb);
        let fix = if want_mb << 20 <= most {
            format!(
                "raise it with `sudo sysctl iogpu.wired_limit_mb={want_mb}` (until the next reboot; it leaves {} to macOS), or {lower}",
                human_bytes(self.ram.saturating_sub(want_mb << 20))
            )
        } else {
            format!("a higher limit would leave macOS less than {}: {lower}", human_bytes(WIRED_OS_RESERVE))
        };
        Some(format!(
            "the GPU would hold about {} of this Mac's {}, more than macOS keeps wired for it, {limit}; the rest is paged and runs many times slower: {fix}",
            human_bytes(gpu_bytes),
            human_bytes(self.ram)
        ))
    }

    /// This Mac's limit (None where the sysctls cannot be read).
    #[cfg(target_os = "macos")]
    pub fn read() -> Option<Self> {
        Some(WiredLimit::new(sysctl_u64(c"hw.memsize")?, sysctl_u64(c"iogpu.wired_limit_mb").unwrap_or(0)))
    }
}

/// What to tell the user when `gpu_bytes` of GPU memory exceed the wired limit (only on macOS,
/// where GPU memory is the machine's memory; elsewhere None).
pub fn wired_limit_warning(gpu_bytes: u64) -> Option<String> {
    #[cfg(target_os = "macos")]
    {
        WiredLimit::read()?.check(gpu_bytes)
    }
    #[cfg(not(target_os = "macos"))]
    {
        let _ = gpu_bytes;
        None
    }
}

/// An integer sysctl of 4 or 8 bytes.
#[cfg(target_os = "macos")]
fn sysctl_u64(name: &std::ffi::CStr) -> Option<u64> {
    let mut buf = [0u8; 8];
    let mut len = buf.len();
    // SAFETY: `buf` is valid for `len` bytes, which sysctlbyname writes at most (and updates);
    // no new value is set (null, 0).
    let r = unsafe { libc::sysctlbyname(name.as_ptr(), buf.as_mut_ptr().cast(), &mut len, std::ptr::null_mut(), 0) };
    match (r, len) {
        (0, 4) => Some(u64::from(u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]))),
        (0, 8) => Some(u64::from_ne_bytes(buf)),
        _ => None,
    }
}

#[cfg(test)]
mod wired_tests {
    use super::WiredLimit;
    const GIB: u64 = 1 << 30;

    #[test]
    fn the_default_limit_is_two_thirds_of_a_small_mac_and_three_quarters_of_a_large_one() {
        assert_eq!(WiredLimit::new(16 * GIB, 0).bytes, 16 * GIB / 3 * 2);
        assert_eq!(WiredLimit::new(32 * GIB, 0).bytes, 32 * GIB / 3 * 2);
        assert_eq!(WiredLimit::new(128 * GIB, 0).bytes, 96 * GIB);
        // Set: exactly what it says, above or below the default.
        assert_eq!(WiredLimit::new(128 * GIB, 114_688).bytes, 112 * GIB);
        assert_eq!(WiredLimit::new(128 * GIB, 4096).bytes, 4 * GIB);
    }

    #[test]
    fn a_plan_over_the_limit_names_the_sysctl_that_raises_it() {
        let mac = WiredLimit::new(128 * GIB, 0);
        assert_eq!(mac.check(96 * GIB), None);
        let msg = mac.check(100 * GIB + 5).unwrap();
        let cache = crate::setting::Setting::GpuCacheGb.to_string();
        // 100 GiB and 5 bytes, plus 1 GiB, in whole GiB.
        assert!(msg.contains("sudo sysctl iogpu.wired_limit_mb=104448"), "{msg}");
        assert!(msg.contains("iogpu.wired_limit_mb is 0") && msg.contains(&cache), "{msg}");
        let set = WiredLimit::new(128 * GIB, 65_536);
        let msg = set.check(70 * GIB).unwrap();
        assert!(msg.contains("iogpu.wired_limit_mb=65536)") && msg.contains("wired_limit_mb=72704"), "{msg}");
        // More than a raised limit could give while leaving macOS its 8 GiB: no sysctl to suggest.
        let msg = mac.check(121 * GIB).unwrap();
        assert!(!msg.contains("sudo sysctl") && msg.contains(&cache), "{msg}");
        let small = WiredLimit::new(16 * GIB, 0).check(11 * GIB).unwrap();
        assert!(!small.contains("sudo sysctl"), "{small}");
    }
}
