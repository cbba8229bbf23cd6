//! A small byte-level BPE trainer for synthetic models: learns tiktoken-style ranks from a
//! built-in text (split with Kimi's pattern) so that `synth` checkpoints ship a real, working
//! tokenizer. Deterministic: ties go to the lexicographically smallest merged token.

use super::tokenizer::KIMI_PATTERN;
use std::collections::HashMap;

/// Text the synthetic tokenizers learn from (English prose, a little code and other scripts).
pub const TRAINING_TEXT: &str = r#"deltafin runs a very large mixture of experts model on one machine. The model has many layers, and each
layer holds hundreds of experts, but every token uses only a few of them. The experts live on solid state drives;
the engine reads the ones a token needs, exactly as they were shipped, and keeps the rest of the model in memory.
Reading is the slow part, so the engine is mostly a scheduler of reads: it asks for every expert a layer needs at
once, computes each one as soon as it arrives, and never reads the same bytes twice when it can avoid it.
When a prompt arrives, all of its tokens pass through a layer together, so each expert is read one time for the
whole prompt instead of once per token. The answer is the same, bit for bit, whatever the order in which the
drives return their data, however many threads compute, and whether the cache is cold or warm.
Hello! How are you today? I'm fine, thanks. What's the weather like? It's sunny and warm, with a light breeze.
The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2026 3.14159 42.
fn main() {
    let experts = vec![1, 2, 3];
    for e in &experts {
        println!("expert {e}");
    }
}
def forward(x, weights):
    return [w * x for w in weights]
{"role": "user", "content": "Hello"} <div class="note">markup</div> a + b = c; x -> y; if (a == b) { return; }
你好，世界。今天天气很好。模型在一台机器上运行。
こんにちは、世界。これはテストです。 안녕하세요 세계. Привет, мир! Bonjour le monde. ¡Hola, mundo! Grüße.
"#;

/// Learns `n_base` byte-level tokens (the 256 bytes first); if the text runs out of pairs to merge,
/// the rest are filler tokens that merges never produce.
pub fn train_ranks(text: &str, n_base: usize) -> Vec<Vec<u8>> {
    let mut vocab = learn_merges(text, n_base);
    // Fillers: made-up syllables, so random-weight output still reads like text.
    let mut have: std::collections::HashSet<Vec<u8>> = vocab.iter().cloned().collect();
    let (cons, vow) = (b"bcdfghjklmnprstvz", b"aeiou");
    let mut n = 0u64;
    while vocab.len() < n_base {
        // splitmix64 of the counter picks the syllables.
        n += 1;
        let mut x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
        let mut t = if x.is_multiple_of(2) { vec![b' '] } else { Vec::new() };
        x /= 2;
        let syllables = 1 + x % 3;
        x /= 3;
        for _ in 0..syllables {
            t.push(cons[(x % cons.len() as u64) as usize]);
            x /= cons.len() as u64;
            t.push(vow[(x % vow.len() as u64) as usize]);
            x /= vow.len() as u64;
        }
        if have.insert(t.clone()) {
            vocab.push(t);
        }
    }
    vocab
}

/// The 256 byte tokens plus up to `max - 256` merges learned from `text` (pairs seen twice or more).
pub fn learn_merges(text: &str, max: usize) -> Vec<Vec<u8>> {
    let mut vocab: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let re = fancy_regex::Regex::new(KIMI_PATTERN).expect("the Kimi pattern compiles");
    let mut counts: HashMap<&str, u64> = HashMap::new();
    for m in re.find_iter(text).flatten() {
        *counts.entry(m.as_str()).or_insert(0) += 1;
    }
    let mut words: Vec<(Vec<u32>, u64)> = {
        let mut w: Vec<(&str, u64)> = counts.into_iter().collect();
        w.sort();
        w.into_iter().map(|(s, c)| (s.bytes().map(u32::from).collect(), c)).collect()
    };
    while vocab.len() < max {
        let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
        for (w, c) in &words {
            for p in w.windows(2) {
                *pairs.entry((p[0], p[1])).or_insert(0) += c;
            }
        }
        let best = pairs
            .into_iter()
            .filter(|&(_, c)| c >= 2)
            .map(|((a, b), c)| {
                let mut merged = vocab[a as usize].clone();
                merged.extend_from_slice(&vocab[b as usize]);
                (c, merged, (a, b))
            })
            .max_by(|x, y| x.0.cmp(&y.0).then_with(|| y.1.cmp(&x.1)));
        let Some((_, merged, (a, b))) = best else { break };
        let id = vocab.len() as u32;
        vocab.push(merged);
        for (w, _) in words.iter_mut() {
            let mut i = 0;
            while i + 1 < w.len() {
                if w[i] == a && w[i + 1] == b {
                    w[i] = id;
                    w.remove(i + 1);
                }
                i += 1;
            }
        }
    }
    vocab
}

/// The rank file text (`base64 rank` per line).
pub fn rank_file(vocab: &[Vec<u8>]) -> String {
    use base64::Engine as _;
    let mut s = String::new();
    for (r, t) in vocab.iter().enumerate() {
        s.push_str(&base64::engine::general_purpose::STANDARD.encode(t));
        s.push(' ');
        s.push_str(&r.to_string());
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_merges_deterministically() {
        let a = train_ranks(TRAINING_TEXT, 2000);
        assert_eq!(a, train_ranks(TRAINING_TEXT, 2000));
        assert_eq!(a.len(), 2000);
        let distinct: std::collections::HashSet<&Vec<u8>> = a.iter().collect();
        assert_eq!(distinct.len(), a.len(), "tokens are distinct");
        let learned = learn_merges(TRAINING_TEXT, 2000);
        assert!(learned.iter().any(|t| t == b" the"), "a common word should be learned");
        // Every merged token is made of two lower-ranked tokens.
        let rank: HashMap<&[u8], usize> = learned.iter().enumerate().map(|(r, t)| (t.as_slice(), r)).collect();
        for (r, t) in learned.iter().enumerate().skip(256) {
            assert!(
                (1..t.len())
                    .any(|k| rank.get(&t[..k]).is_some_and(|&x| x < r) && rank.get(&t[k..]).is_some_and(|&x| x < r))
            );
        }
    }
}
