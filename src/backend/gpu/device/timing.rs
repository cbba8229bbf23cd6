//! Device timestamps around compute passes, for profiling (`DELTAFIN_GPU_TIMESTAMPS=1`).
//!
//! Contract: timing is off unless asked for and the adapter has timestamp queries; a stamp that
//! cannot be read adds no time and never fails the pass it timed.

use super::{Gpu, READBACK};

/// Timestamps around one compute pass (profiling: `DELTAFIN_GPU_TIMESTAMPS=1` on an adapter
/// with timestamp queries): written at the pass's start and end, resolved and copied to `read`
/// in the same submission, read once it has run.
pub(in crate::backend::gpu) struct Stamp {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    read: wgpu::Buffer,
}

impl Stamp {
    /// The pass descriptor's timestamp writes for this stamp (None: not timing).
    pub fn writes(s: &Option<Stamp>) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        s.as_ref().map(|s| wgpu::ComputePassTimestampWrites {
            query_set: &s.set,
            beginning_of_pass_write_index: Some(0),
            end_of_pass_write_index: Some(1),
        })
    }
}

static TIMESTAMPS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Times the passes of GPU backends opened after the call, as `DELTAFIN_GPU_TIMESTAMPS=1` does.
pub fn set_timestamps(on: bool) {
    TIMESTAMPS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether passes should be timed on the device: `DELTAFIN_GPU_TIMESTAMPS` 1 / true / yes / on,
/// or [`set_timestamps`] (possible when the adapter has timestamp queries). Another value says so
/// in a warning and times nothing.
pub(super) fn timestamps_wanted() -> bool {
    if TIMESTAMPS.load(std::sync::atomic::Ordering::Relaxed) {
        return true;
    }
    let Ok(v) = std::env::var("DELTAFIN_GPU_TIMESTAMPS") else { return false };
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => true,
        "" | "0" | "false" | "no" | "off" => false,
        _ => {
            tracing::warn!("DELTAFIN_GPU_TIMESTAMPS={v:?} is not 1 or 0; passes are not timed");
            false
        }
    }
}

impl Gpu {
    /// Whether compute passes are timed on the device ([`Stamp`]).
    pub(in crate::backend::gpu) fn timed(&self) -> bool {
        self.timestamp_period.is_some()
    }

    /// A stamp for the next pass, or None when passes are not timed.
    pub(in crate::backend::gpu) fn stamp(&self) -> Option<Stamp> {
        self.timestamp_period?;
        let set = self.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("pass time"),
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        });
        let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pass time resolve"),
            size: 16,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let read = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pass time read"),
            size: 16,
            usage: READBACK,
            mapped_at_creation: false,
        });
        Some(Stamp { set, resolve, read })
    }

    /// Encodes the copy of `s`'s timestamps after its pass (before the submission).
    pub(in crate::backend::gpu) fn stamp_resolve(&self, enc: &mut wgpu::CommandEncoder, s: &Option<Stamp>) {
        if let Some(s) = s {
            enc.resolve_query_set(&s.set, 0..2, &s.resolve, 0);
            enc.copy_buffer_to_buffer(&s.resolve, 0, &s.read, 0, 16);
        }
    }

    /// Adds the time between `s`'s timestamps to the device time, once `submission` (None: the
    /// latest), which carried them, has run.
    pub(in crate::backend::gpu) fn stamp_read(&self, s: Option<Stamp>, submission: Option<wgpu::SubmissionIndex>) {
        let (Some(s), Some(period)) = (s, self.timestamp_period) else { return };
        s.read.map_async(wgpu::MapMode::Read, .., |_| {});
        if self.device.poll(wgpu::PollType::Wait { submission_index: submission, timeout: None }).is_err() {
            return;
        }
        let ticks = match s.read.get_mapped_range(..) {
            Ok(view) => {
                let tick = |i: usize| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&view[i * 8..i * 8 + 8]);
                    u64::from_le_bytes(b)
                };
                tick(1).saturating_sub(tick(0))
            }
            // Not mapped (the map failed): no time, and nothing to unmap.
            Err(_) => return,
        };
        s.read.unmap();
        let ns = (ticks as f64 * period as f64) as u64;
        self.traffic.device_ns.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
    }
}
