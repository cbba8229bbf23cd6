//! A recurrent state (the KDA state S of one layer) that a backend may keep in its own memory
//! between calls, so that decode does not move it over the bus on every token.
//!
//! Contract: a [`StateBuf`] always has one current copy of its values — the host vector, a
//! backend's device copy, or both when they are equal. Reading on the host
//! ([`StateBuf::host_values`], [`StateBuf::host`]) reads a device-only copy back first; writing on
//! the host ([`StateBuf::host_mut`], [`StateBuf::overwrite`]) makes the host copy the only current
//! one. A backend that writes the state on its device marks that ([`StateBuf::set_device`],
//! [`StateBuf::mark_device_written`]). A backend uses only the device copies it made (it knows
//! its own by [`DeviceCopy::as_any`]); any other backend sees only the host values. A failed readback is an
//! error ([`DeviceCopy::read`]) and leaves the device copy the current one. [`StateBuf::try_clone`]
//! gives a host-only copy of the current values.

use super::BackendError;
use std::borrow::Cow;

/// A backend's copy of a state in its device memory.
pub trait DeviceCopy: Send + Sync {
    /// Reads the values (the state's length) back into `out`; a failed readback is an error
    /// (`out` then holds no valid values).
    fn read(&self, out: &mut [f32]) -> Result<(), BackendError>;
    /// For the owning backend to reach its buffer.
    fn as_any(&self) -> &dyn std::any::Any;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Current {
    Host,
    Device,
    Both,
}

pub struct StateBuf {
    host: Vec<f32>,
    device: Option<Box<dyn DeviceCopy>>,
    current: Current,
}

impl StateBuf {
    pub fn zeros(len: usize) -> Self {
        StateBuf { host: vec![0.0; len], device: None, current: Current::Host }
    }

    pub fn len(&self) -> usize {
        self.host.len()
    }

    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// Whether the values are held in device memory (and not only on the host).
    pub fn on_device(&self) -> bool {
        self.current != Current::Host
    }

    /// The values: borrowed from the host copy, or read back from the device when only it holds them.
    pub fn host_values(&self) -> Result<Cow<'_, [f32]>, BackendError> {
        match (&self.device, self.current) {
            (Some(d), Current::Device) => {
                let mut v = vec![0.0; self.host.len()];
                d.read(&mut v)?;
                Ok(Cow::Owned(v))
            }
            _ => Ok(Cow::Borrowed(&self.host)),
        }
    }

    /// The values on the host, read back from the device first if only it holds them.
    pub fn host(&mut self) -> Result<&[f32], BackendError> {
        self.sync()?;
        Ok(&self.host)
    }

    /// The values for writing on the host (the device copy, if any, no longer counts). On an
    /// error the buffer is as before.
    pub fn host_mut(&mut self) -> Result<&mut [f32], BackendError> {
        self.sync()?;
        self.current = Current::Host;
        Ok(&mut self.host)
    }

    /// A host-only copy of the current values (read back from the device when only it holds
    /// them).
    pub fn try_clone(&self) -> Result<Self, BackendError> {
        Ok(StateBuf::from(self.host_values()?.into_owned()))
    }

    /// The host vector for a write of every value: nothing is read back.
    pub fn overwrite(&mut self) -> &mut [f32] {
        self.current = Current::Host;
        &mut self.host
    }

    /// The device copy when it holds the current values.
    pub fn current_device(&self) -> Option<&dyn DeviceCopy> {
        match self.current {
            Current::Host => None,
            _ => self.device.as_deref(),
        }
    }

    /// Any device copy, current or not: storage a backend may overwrite and then mark written.
    pub fn device(&self) -> Option<&dyn DeviceCopy> {
        self.device.as_deref()
    }

    /// Replaces the device copy with `copy`, which now alone holds the values.
    pub fn set_device(&mut self, copy: Box<dyn DeviceCopy>) {
        self.device = Some(copy);
        self.current = Current::Device;
    }

    /// The device copy (from [`StateBuf::device`]) was written whole and alone holds the values.
    pub fn mark_device_written(&mut self) {
        if self.device.is_some() {
            self.current = Current::Device;
        }
    }

    fn sync(&mut self) -> Result<(), BackendError> {
        if let (Some(d), Current::Device) = (&self.device, self.current) {
            // A failed read leaves the host vector with no valid values: it stays not current.
            d.read(&mut self.host)?;
            self.current = Current::Both;
        }
        Ok(())
    }
}

impl From<Vec<f32>> for StateBuf {
    fn from(host: Vec<f32>) -> Self {
        StateBuf { host, device: None, current: Current::Host }
    }
}

impl std::fmt::Debug for StateBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateBuf").field("len", &self.host.len()).field("current", &self.current).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A device copy in plain memory that counts its readbacks.
    struct Fake {
        values: Vec<f32>,
        reads: AtomicUsize,
    }

    impl DeviceCopy for Fake {
        fn read(&self, out: &mut [f32]) -> Result<(), BackendError> {
            self.reads.fetch_add(1, Ordering::Relaxed);
            out.copy_from_slice(&self.values);
            Ok(())
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    fn reads(s: &StateBuf) -> usize {
        s.device().and_then(|d| d.as_any().downcast_ref::<Fake>()).map_or(0, |f| f.reads.load(Ordering::Relaxed))
    }

    #[test]
    fn device_values_come_back_once_and_host_writes_win() -> Result<(), BackendError> {
        let mut s = StateBuf::zeros(3);
        assert!(!s.on_device());
        s.set_device(Box::new(Fake { values: vec![1.0, 2.0, 3.0], reads: AtomicUsize::new(0) }));
        assert!(s.on_device());
        assert_eq!(&*s.host_values()?, &[1.0, 2.0, 3.0]);
        assert_eq!(s.try_clone()?.host()?, &[1.0, 2.0, 3.0]);
        assert_eq!(reads(&s), 2, "an immutable read cannot keep what it read");
        assert_eq!(s.host()?, &[1.0, 2.0, 3.0]);
        assert_eq!(s.host()?, &[1.0, 2.0, 3.0]);
        assert_eq!(reads(&s), 3, "a synced host copy is not read again");
        assert!(s.current_device().is_some(), "both copies are equal");
        s.host_mut()?[0] = 9.0;
        assert!(!s.on_device() && s.current_device().is_none());
        assert_eq!(&*s.host_values()?, &[9.0, 2.0, 3.0]);
        s.mark_device_written();
        assert_eq!(&*s.host_values()?, &[1.0, 2.0, 3.0], "the device copy was marked current again");
        s.overwrite().copy_from_slice(&[4.0, 5.0, 6.0]);
        assert_eq!(reads(&s), 4);
        assert_eq!(s.host()?, &[4.0, 5.0, 6.0]);
        Ok(())
    }

    /// A device copy whose readback fails.
    struct Broken;

    impl DeviceCopy for Broken {
        fn read(&self, _out: &mut [f32]) -> Result<(), BackendError> {
            Err(BackendError::NotBuilt)
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    #[test]
    fn a_failed_readback_is_an_error_and_leaves_the_device_copy_current() {
        let mut s = StateBuf::from(vec![1.0, 2.0]);
        s.set_device(Box::new(Broken));
        assert!(s.host_values().is_err() && s.try_clone().is_err());
        assert!(s.host().is_err() && s.host_mut().is_err());
        assert!(s.current_device().is_some(), "the host vector did not become current");
    }
}
