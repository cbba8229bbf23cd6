//! The oracle drafter, for benchmarks: proposes K3's own greedy continuation recorded by an
//! earlier run, so every draft is accepted and a run shows what batching alone gives.
//!
//! Contract: `propose(context, k)` returns the recorded tokens after `context` while `context`
//! is a prefix of the recording (checked on its length and last token), else nothing.

use super::Drafter;
use crate::backend::BackendError;

#[derive(Clone, Debug)]
pub struct OracleDrafter {
    /// Prompt + recorded output.
    truth: Vec<u32>,
}

impl OracleDrafter {
    pub fn new(truth: Vec<u32>) -> Self {
        OracleDrafter { truth }
    }
}

impl Drafter for OracleDrafter {
    fn name(&self) -> &str {
        "oracle"
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, BackendError> {
        let n = context.len();
        if n == 0 || n > self.truth.len() || context[n - 1] != self.truth[n - 1] {
            return Ok(Vec::new());
        }
        Ok(self.truth[n..(n + k).min(self.truth.len())].to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_the_recording_and_stops_off_it() {
        let mut d = OracleDrafter::new(vec![1, 2, 3, 4, 5]);
        assert_eq!(d.propose(&[1, 2], 2).unwrap(), vec![3, 4]);
        assert_eq!(d.propose(&[1, 2, 3, 4], 7).unwrap(), vec![5]);
        assert!(d.propose(&[1, 2, 3, 4, 5], 2).unwrap().is_empty());
        assert!(d.propose(&[1, 9], 2).unwrap().is_empty());
        assert!(d.propose(&[], 2).unwrap().is_empty());
    }
}
