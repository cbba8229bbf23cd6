//! An append-only cache of rows (the MLA latent cache of one layer, K3's or the drafter's) whose prefix a backend may
//! mirror in device memory, so that attention uploads only the rows added since its last call.
//!
//! Contract: the host vector always holds the current values; a [`Mirror`] holds a device copy
//! of its first `valid` floats. Appending leaves that prefix valid, truncating below `valid`
//! shortens it, and there is no other way to change the values, so a mirror can never hold a
//! stale value inside its valid prefix. Cloning copies the host values only.

use std::sync::{Mutex, MutexGuard};

/// A backend's device buffer behind a [`Mirror`].
pub trait DeviceMirror: Send + Sync {
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A device copy of the first `valid` floats of an [`AppendBuf`].
pub struct Mirror {
    pub copy: Box<dyn DeviceMirror>,
    pub valid: usize,
}

#[derive(Default)]
pub struct AppendBuf {
    host: Vec<f32>,
    mirror: Mutex<Option<Mirror>>,
}

impl AppendBuf {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn extend_from_slice(&mut self, rows: &[f32]) {
        self.host.extend_from_slice(rows);
    }

    /// Keeps the first `len` floats.
    pub fn truncate(&mut self, len: usize) {
        self.host.truncate(len);
        if let Some(m) = self.mirror.get_mut().unwrap_or_else(|p| p.into_inner()) {
            m.valid = m.valid.min(len);
        }
    }

    /// The device mirror, for the backend that keeps it (locked while it is brought up to date
    /// and used).
    pub fn mirror(&self) -> MutexGuard<'_, Option<Mirror>> {
        self.mirror.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::ops::Deref for AppendBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.host
    }
}

impl From<Vec<f32>> for AppendBuf {
    fn from(host: Vec<f32>) -> Self {
        AppendBuf { host, mirror: Mutex::new(None) }
    }
}

impl Clone for AppendBuf {
    fn clone(&self) -> Self {
        AppendBuf::from(self.host.clone())
    }
}

impl std::fmt::Debug for AppendBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppendBuf").field("len", &self.host.len()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake;
    impl DeviceMirror for Fake {
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    #[test]
    fn truncation_shortens_the_valid_prefix_and_appends_do_not() {
        let mut b = AppendBuf::from(vec![1.0, 2.0, 3.0, 4.0]);
        *b.mirror() = Some(Mirror { copy: Box::new(Fake), valid: 4 });
        b.extend_from_slice(&[5.0, 6.0]);
        assert_eq!(b.mirror().as_ref().map(|m| m.valid), Some(4));
        b.truncate(5);
        assert_eq!(b.mirror().as_ref().map(|m| m.valid), Some(4));
        b.truncate(2);
        assert_eq!(b.mirror().as_ref().map(|m| m.valid), Some(2));
        assert_eq!(&*b, &[1.0, 2.0]);
        assert!(b.clone().mirror().is_none(), "a clone has no mirror");
    }
}
