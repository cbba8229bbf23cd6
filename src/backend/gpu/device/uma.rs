//! Unified memory: whether routed experts are written once, straight into device-visible buffers
//! that the kernels read (no staging buffer, no copy on the device), or staged and copied.
//!
//! Rule: the adapter shares memory with the host when wgpu reports it integrated (on Metal from
//! `hasUnifiedMemory`, so every Apple silicon GPU; on Vulkan from the physical device type) or a
//! CPU (lavapipe, SwiftShader), and it offers `MAPPABLE_PRIMARY_BUFFERS` (storage buffers the host
//! maps for writing; Metal gives them shared storage, Vulkan host-visible memory). Only then are
//! such buffers as fast for the kernels as any other: on a discrete GPU they would sit in host
//! memory and every product would read its weights across the bus.
//!
//! `DELTAFIN_GPU_UMA` overrides the rule for backends opened afterwards: `off` (or `0`) stages every
//! expert; `on` (or `1`) writes in place on any adapter with the feature, a discrete one included
//! (slow there, but the same bits: for tests); `auto` (the default) follows the rule.

/// How the backend chooses between writing experts in place and staging them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UmaMode {
    /// In place where the adapter shares memory with the host (the module's rule).
    #[default]
    Auto,
    /// In place on any adapter that can map storage buffers.
    On,
    /// Always through a staging buffer and a copy on the device.
    Off,
}

/// The variable that overrides the rule.
pub const UMA_ENV: &str = "DELTAFIN_GPU_UMA";

impl UmaMode {
    /// `DELTAFIN_GPU_UMA`'s value (unset: auto; a value it does not know: auto, with a warning).
    pub fn from_env() -> Self {
        match std::env::var(UMA_ENV) {
            Ok(v) => Self::parse(&v).unwrap_or_else(|| {
                tracing::warn!("{UMA_ENV}={v:?}: give on, off or auto; using auto");
                UmaMode::Auto
            }),
            Err(_) => UmaMode::Auto,
        }
    }

    fn parse(v: &str) -> Option<Self> {
        match v.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Some(UmaMode::Auto),
            "1" | "on" | "yes" | "true" => Some(UmaMode::On),
            "0" | "off" | "no" | "false" => Some(UmaMode::Off),
            _ => None,
        }
    }
}

/// Whether an adapter of `device_type` shares its memory with the host.
pub fn shares_host_memory(device_type: wgpu::DeviceType) -> bool {
    matches!(device_type, wgpu::DeviceType::IntegratedGpu | wgpu::DeviceType::Cpu)
}

/// Whether experts are written in place on an adapter of `device_type` that has (`mappable`) or
/// lacks `MAPPABLE_PRIMARY_BUFFERS`, under `mode`; with a warning when `on` cannot be honoured.
pub fn in_place(mode: UmaMode, device_type: wgpu::DeviceType, mappable: bool) -> (bool, Option<String>) {
    match mode {
        UmaMode::Off => (false, None),
        UmaMode::Auto => (mappable && shares_host_memory(device_type), None),
        UmaMode::On if mappable => (true, None),
        UmaMode::On => (
            false,
            Some(format!(
                "{UMA_ENV}=on: the adapter cannot map storage buffers (MAPPABLE_PRIMARY_BUFFERS); experts are staged"
            )),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wgpu::DeviceType as D;

    #[test]
    fn unified_memory_is_integrated_or_cpu_adapters_that_map_storage_buffers() {
        // Apple silicon (Metal reports it integrated), an iGPU, lavapipe: in place.
        for t in [D::IntegratedGpu, D::Cpu] {
            assert_eq!(in_place(UmaMode::Auto, t, true), (true, None), "{t:?}");
            assert!(!in_place(UmaMode::Auto, t, false).0, "{t:?} without the feature");
            assert!(!in_place(UmaMode::Off, t, true).0, "{t:?} off");
        }
        // A discrete GPU only when forced.
        for t in [D::DiscreteGpu, D::VirtualGpu, D::Other] {
            assert!(!in_place(UmaMode::Auto, t, true).0, "{t:?}");
            assert_eq!(in_place(UmaMode::On, t, true), (true, None), "{t:?} forced");
        }
        let (on, why) = in_place(UmaMode::On, D::Cpu, false);
        assert!(!on && why.is_some_and(|w| w.contains("MAPPABLE_PRIMARY_BUFFERS")));
    }

    #[test]
    fn the_override_takes_on_off_and_auto() {
        for (v, m) in [("on", UmaMode::On), ("1", UmaMode::On), (" OFF ", UmaMode::Off), ("0", UmaMode::Off)] {
            assert_eq!(UmaMode::parse(v), Some(m), "{v:?}");
        }
        assert_eq!(UmaMode::parse("auto"), Some(UmaMode::Auto));
        assert_eq!(UmaMode::parse(""), Some(UmaMode::Auto));
        assert_eq!(UmaMode::parse("maybe"), None);
    }
}
