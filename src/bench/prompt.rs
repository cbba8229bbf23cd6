//! The prompts benchmarks run: a fixed text through the model's tokenizer, or ids from a file.
//!
//! Contract: [`tokens`] gives the same ids for the same model and length on every run (the
//! built-in training text, repeated; a fixed pseudo-random sequence for a model without a
//! tokenizer), so records of one model compare.

use super::BenchError;
use crate::model::ModelFiles;
use std::path::Path;

/// A fixed prompt of `n` tokens: the model's tokenizer on built-in text when it has one, else a
/// fixed pseudo-random id sequence.
pub fn tokens(files: &ModelFiles, n: usize) -> Result<Vec<u32>, BenchError> {
    if files.dir.join("tiktoken.model").exists() {
        let tok = crate::engine::load_tokenizer(&files.dir)?;
        let mut ids = Vec::new();
        while ids.len() < n {
            ids.extend(tok.encode(crate::model::bpe_train::TRAINING_TEXT));
        }
        ids.truncate(n);
        return Ok(ids);
    }
    let mut rng = crate::util::XorShift(0x9E37_79B9);
    Ok((0..n).map(|_| (rng.next_u64() % files.cfg.vocab as u64) as u32).collect())
}

/// Prompt ids from `path`: a JSON array of integers, or integers separated by whitespace or commas.
pub fn ids_from(path: &Path) -> Result<Vec<u32>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|source| BenchError::Io { path: path.to_path_buf(), source })?;
    let bad = |problem: String| BenchError::PromptIds { path: path.to_path_buf(), problem };
    let ids: Vec<u32> = if text.trim_start().starts_with('[') {
        serde_json::from_str(&text).map_err(|e| bad(format!("expected a JSON array of token ids: {e}")))?
    } else {
        text.split(|c: char| c.is_whitespace() || c == ',')
            .filter(|t| !t.is_empty())
            .map(|t| t.parse::<u32>().map_err(|_| bad(format!("{t:?} is not a token id"))))
            .collect::<Result<_, _>>()?
    };
    if ids.is_empty() {
        return Err(bad("no token ids".into()));
    }
    Ok(ids)
}
