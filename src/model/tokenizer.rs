//! K3's tokenizer as shipped: `tiktoken.model` (base64 token bytes + rank per line) plus the 256
//! reserved specials of `tokenizer_config.json` (ids n_base .. n_base+255), split by Kimi's regex.
//!
//! Contract: `encode` never produces a special id from text (user text containing `<|open|>` is
//! ordinary bytes); `encode_with_specials` recognises exactly the special strings (used on the
//! chat template's output, whose user parts are escaped first, see `chat`). Ordinary text is
//! encoded by the `tokenizers` crate: the tiktoken ranks are converted once into a byte-level BPE
//! (vocab + merges ranked by the merged token's rank, whole-piece lookup first), and the converted
//! tokenizer is cached as JSON. Decoding uses the exact token bytes; [`StreamDecoder`] holds back
//! incomplete UTF-8 sequences split across tokens.

use base64::Engine as _;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Kimi's pre-tokenisation pattern (`pat_str` of `tokenization_kimi.py`).
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Number of reserved special tokens after the base vocabulary.
pub const NUM_SPECIALS: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: line {line}: {msg}", path.display())]
    RankFile { path: PathBuf, line: usize, msg: String },
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },
    #[error("building the BPE tokenizer failed: {0}")]
    Build(String),
    #[error("token id {0} is outside the vocabulary")]
    UnknownId(u32),
}

pub struct Tokenizer {
    bpe: tokenizers::Tokenizer,
    /// Bytes of every base token, indexed by rank.
    token_bytes: Vec<Vec<u8>>,
    /// Special names, indexed by id - n_base.
    specials: Vec<String>,
    special_ids: HashMap<String, u32>,
    /// Longest special name first, for greedy matching.
    special_order: Vec<(String, u32)>,
    /// Bytes that start some special name.
    special_first: [bool; 256],
    /// The most bytes one token stands for (a special counts its name's bytes).
    max_token_bytes: usize,
}

/// GPT-2 style byte -> printable char mapping used by byte-level BPE.
fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        map[b as usize] = if printable {
            char::from_u32(b).unwrap_or('?')
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap_or('?')
        };
    }
    map
}

fn byte_level(bytes: &[u8], map: &[char; 256]) -> String {
    bytes.iter().map(|&b| map[b as usize]).collect()
}

/// tiktoken's byte-pair merge: repeatedly merge the adjacent pair whose concatenation has the
/// lowest rank (below `max_rank`); returns the parts' byte ranges.
fn bpe_parts(piece: &[u8], ranks: &HashMap<&[u8], u32>, max_rank: u32) -> Vec<(usize, usize)> {
    let mut parts: Vec<(usize, usize)> = (0..piece.len()).map(|i| (i, i + 1)).collect();
    loop {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..parts.len().saturating_sub(1) {
            if let Some(&r) = ranks.get(&piece[parts[i].0..parts[i + 1].1])
                && r < max_rank
                && best.is_none_or(|(br, _)| r < br)
            {
                best = Some((r, i));
            }
        }
        match best {
            None => return parts,
            Some((_, i)) => {
                parts[i].1 = parts[i + 1].1;
                parts.remove(i + 1);
            }
        }
    }
}

/// Reads a tiktoken rank file: `base64(token) rank` per line, ranks 0..n without gaps.
pub fn read_rank_file(path: &Path) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })?;
    parse_rank_file(path, &text)
}

/// Parses rank-file text (see [`read_rank_file`]); `path` is only used in error messages.
pub fn parse_rank_file(path: &Path, text: &str) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let mut tokens: Vec<Option<Vec<u8>>> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let err = |msg: String| TokenizerError::RankFile { path: path.to_path_buf(), line: i + 1, msg };
        if line.trim().is_empty() {
            continue;
        }
        let mut it = line.split_whitespace();
        let (Some(b64), Some(rank), None) = (it.next(), it.next(), it.next()) else {
            return Err(err("expected `<base64 token> <rank>`".into()));
        };
        let bytes =
            base64::engine::general_purpose::STANDARD.decode(b64).map_err(|e| err(format!("bad base64: {e}")))?;
        let rank: usize = rank.parse().map_err(|_| err(format!("bad rank `{rank}`")))?;
        if rank > 10_000_000 {
            return Err(err(format!("rank {rank} is implausibly large")));
        }
        if tokens.len() <= rank {
            tokens.resize(rank + 1, None);
        }
        if tokens[rank].replace(bytes).is_some() {
            return Err(err(format!("rank {rank} appears twice")));
        }
    }
    tokens
        .into_iter()
        .enumerate()
        .map(|(r, t)| {
            t.ok_or_else(|| TokenizerError::RankFile {
                path: path.to_path_buf(),
                line: 0,
                msg: format!("rank {r} is missing"),
            })
        })
        .collect()
}

/// The special tokens K3 names, as (offset after the base vocabulary, name). BOS, end of message
/// (generation stops there), the chat markup, the DSpark mask and padding sit where K3 has them
/// (163584 + offset); `synth` writes this layout for synthetic models.
pub const K3_SPECIALS: [(usize, &str); 9] = [
    (0, "[BOS]"),
    (1, "[EOS]"),
    (2, "<|end_of_msg|>"),
    (3, "<|open|>"),
    (4, "<|sep|>"),
    (5, "<|close|>"),
    (6, "<|kimi_image_placeholder|>"),
    (253, "[MASK]"),
    (255, "[PAD]"),
];

/// A `tokenizer_config.json` in the shipped format for a base vocabulary of `n_base` tokens.
pub fn k3_tokenizer_config(n_base: usize) -> serde_json::Value {
    let mut dec = serde_json::Map::new();
    for (off, name) in K3_SPECIALS {
        dec.insert(
            (n_base + off).to_string(),
            serde_json::json!({"content": name, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true}),
        );
    }
    serde_json::json!({
        "added_tokens_decoder": dec,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "model_max_length": 1048576,
    })
}

/// Special token names from `tokenizer_config.json`'s `added_tokens_decoder`; unnamed ids get
/// `<|reserved_token_{id}|>`.
pub fn read_specials(path: &Path, n_base: usize) -> Result<Vec<String>, TokenizerError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })?;
    parse_specials(path, &text, n_base)
}

/// Parses `tokenizer_config.json` text (see [`read_specials`]); `path` is only used in errors.
pub fn parse_specials(path: &Path, text: &str, n_base: usize) -> Result<Vec<String>, TokenizerError> {
    let err = |msg: String| TokenizerError::Config { path: path.to_path_buf(), msg };
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| err(format!("malformed JSON: {e}")))?;
    let mut names: Vec<String> = (0..NUM_SPECIALS).map(|i| format!("<|reserved_token_{}|>", n_base + i)).collect();
    if let Some(dec) = v.get("added_tokens_decoder") {
        let dec = dec.as_object().ok_or_else(|| err("`added_tokens_decoder` must be an object".into()))?;
        for (id, entry) in dec {
            let id: usize =
                id.parse().map_err(|_| err(format!("added_tokens_decoder key `{id}` is not a token id")))?;
            let content = entry
                .get("content")
                .and_then(|c| c.as_str())
                .ok_or_else(|| err(format!("added_tokens_decoder.{id}.content is missing")))?;
            if id < n_base || id >= n_base + NUM_SPECIALS {
                return Err(err(format!(
                    "special token id {id} is outside {n_base}..{} (after the {n_base} ranks of tiktoken.model)",
                    n_base + NUM_SPECIALS
                )));
            }
            names[id - n_base] = content.to_string();
        }
    }
    Ok(names)
}

impl Tokenizer {
    /// Loads `dir/tiktoken.model` + `dir/tokenizer_config.json`, using (or filling) the
    /// converted-tokenizer cache in `cache_dir`.
    pub fn load(dir: &Path, cache_dir: Option<&Path>) -> Result<Self, TokenizerError> {
        let rank_path = dir.join("tiktoken.model");
        let token_bytes = read_rank_file(&rank_path)?;
        let specials = read_specials(&dir.join("tokenizer_config.json"), token_bytes.len())?;
        let key = cache_key(&rank_path, &specials)?;
        let cached = cache_dir.map(|d| d.join(format!("tokenizer-{key}.json")));
        let bpe = match cached.as_ref().filter(|p| p.exists()).and_then(|p| tokenizers::Tokenizer::from_file(p).ok()) {
            Some(t) => t,
            None => {
                let t = build_bpe(&token_bytes)?;
                if let Some(p) = &cached
                    && let Ok(json) = t.to_string(false)
                {
                    let _ = std::fs::create_dir_all(p.parent().unwrap_or(Path::new(".")));
                    let _ = crate::util::write_atomic(p, json.as_bytes());
                }
                t
            }
        };
        Ok(Self::assemble(bpe, token_bytes, specials))
    }

    /// Builds from in-memory ranks and specials (no cache).
    pub fn from_parts(token_bytes: Vec<Vec<u8>>, specials: Vec<String>) -> Result<Self, TokenizerError> {
        let bpe = build_bpe(&token_bytes)?;
        Ok(Self::assemble(bpe, token_bytes, specials))
    }

    fn assemble(bpe: tokenizers::Tokenizer, token_bytes: Vec<Vec<u8>>, specials: Vec<String>) -> Self {
        let n_base = token_bytes.len() as u32;
        let special_ids: HashMap<String, u32> =
            specials.iter().enumerate().map(|(i, s)| (s.clone(), n_base + i as u32)).collect();
        let mut special_order: Vec<(String, u32)> = special_ids.iter().map(|(s, &i)| (s.clone(), i)).collect();
        special_order.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut special_first = [false; 256];
        for s in &specials {
            if let Some(&b) = s.as_bytes().first() {
                special_first[b as usize] = true;
            }
        }
        let max_token_bytes =
            token_bytes.iter().map(Vec::len).chain(specials.iter().map(String::len)).max().unwrap_or(1).max(1);
        Tokenizer { bpe, token_bytes, specials, special_ids, special_order, special_first, max_token_bytes }
    }

    /// The fewest tokens a text of `bytes` bytes can encode to: no token stands for more than the
    /// longest token's bytes. Lets a caller refuse a text too long for the context before paying
    /// for its BPE.
    pub fn min_tokens(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.max_token_bytes)
    }

    pub fn n_base(&self) -> u32 {
        self.token_bytes.len() as u32
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len() + self.specials.len()
    }

    /// Id of a special token by name, e.g. `<|end_of_msg|>`.
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.special_ids.get(name).copied()
    }

    pub fn is_special(&self, id: u32) -> bool {
        id >= self.n_base() && (id as usize) < self.vocab_size()
    }

    /// Ordinary text to ids: special-token strings in `text` are plain bytes. No BOS is added.
    /// Like Kimi's `tokenization_kimi.py`, the text is cut into 400,000-character chunks and runs
    /// of more than 25,000 whitespace (or non-whitespace) characters are cut before BPE.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        for chunk in char_chunks(text, MAX_ENCODE_CHARS) {
            for piece in split_long_runs(chunk, MAX_RUN_CHARS) {
                out.extend(self.encode_piece(piece));
            }
        }
        out
    }

    fn encode_piece(&self, text: &str) -> Vec<u32> {
        if text.is_empty() {
            return Vec::new();
        }
        match self.bpe.encode(text, false) {
            Ok(enc) => enc.get_ids().to_vec(),
            // The BPE covers all 256 bytes, so encoding cannot fail on valid UTF-8.
            Err(e) => unreachable!("byte-level BPE failed on valid UTF-8: {e}"),
        }
    }

    /// Text whose special-token strings are real specials (the chat template's output).
    pub fn encode_with_specials(&self, text: &str) -> Vec<u32> {
        self.encode_with_specials_mapped(text, |s| s.to_string())
    }

    /// As `encode_with_specials`, passing each ordinary segment through `map` before BPE.
    pub fn encode_with_specials_mapped(&self, text: &str, map: impl Fn(&str) -> String) -> Vec<u32> {
        let mut out = Vec::new();
        let mut plain_start = 0;
        let mut i = 0;
        while i < text.len() {
            if self.special_first[text.as_bytes()[i] as usize]
                && let Some((name, id)) = self.special_order.iter().find(|(s, _)| text[i..].starts_with(s.as_str()))
            {
                out.extend(self.encode(&map(&text[plain_start..i])));
                out.push(*id);
                i += name.len();
                plain_start = i;
                continue;
            }
            i += text[i..].chars().next().map_or(1, char::len_utf8);
        }
        out.extend(self.encode(&map(&text[plain_start..])));
        out
    }

    /// True for the unnamed `<|reserved_token_N|>` specials.
    pub fn is_reserved(&self, id: u32) -> bool {
        self.is_special(id) && self.specials[(id - self.n_base()) as usize].starts_with("<|reserved_token_")
    }

    /// Names of the special tokens, in id order.
    pub fn special_names(&self) -> &[String] {
        &self.specials
    }

    /// The bytes a token stands for (a special's name for specials).
    pub fn token_bytes(&self, id: u32) -> Result<&[u8], TokenizerError> {
        let n = self.n_base();
        if id < n {
            Ok(&self.token_bytes[id as usize])
        } else {
            self.specials.get((id - n) as usize).map(|s| s.as_bytes()).ok_or(TokenizerError::UnknownId(id))
        }
    }

    /// Ids to text (invalid UTF-8 is replaced).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// Kimi's encode works on chunks of at most this many characters.
const MAX_ENCODE_CHARS: usize = 400_000;
/// ... and cuts runs of whitespace or non-whitespace longer than this.
const MAX_RUN_CHARS: usize = 25_000;

/// Python's `str.isspace()`: Unicode White_Space plus the separators U+001C..U+001F.
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Consecutive pieces of at most `n` characters.
fn char_chunks(text: &str, n: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = rest.char_indices().nth(n).map_or(rest.len(), |(i, _)| i);
        let (head, tail) = rest.split_at(end);
        rest = tail;
        Some(head)
    })
}

/// Cuts `s` wherever a run of whitespace (or of non-whitespace) would exceed `max` characters;
/// yields at least one (possibly empty) piece, as Kimi's `_split_whitespaces_or_nonwhitespaces`.
fn split_long_runs(s: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut run_len = 0usize;
    let mut run_space = s.chars().next().is_some_and(py_isspace);
    let mut start = 0usize;
    for (i, c) in s.char_indices() {
        let space = py_isspace(c);
        if space != run_space {
            run_len = 1;
            run_space = space;
        } else {
            run_len += 1;
            if run_len > max {
                out.push(&s[start..i]);
                start = i;
                run_len = 1;
            }
        }
    }
    out.push(&s[start..]);
    out
}

fn cache_key(rank_path: &Path, specials: &[String]) -> Result<String, TokenizerError> {
    use sha2::Digest;
    let bytes =
        std::fs::read(rank_path).map_err(|source| TokenizerError::Io { path: rank_path.to_path_buf(), source })?;
    let mut h = sha2::Sha256::new();
    h.update(b"deltafin-bpe-v1\0");
    h.update(KIMI_PATTERN.as_bytes());
    h.update(&bytes);
    for s in specials {
        h.update(s.as_bytes());
        h.update([0]);
    }
    Ok(h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect())
}

/// Converts tiktoken ranks to a byte-level BPE: each multi-byte token's merge is the final merge
/// tiktoken performs on the token's own bytes (using lower ranks only), prioritised by the token's
/// rank; whole pieces found in the vocabulary are taken directly, as tiktoken does.
fn build_bpe(token_bytes: &[Vec<u8>]) -> Result<tokenizers::Tokenizer, TokenizerError> {
    use tokenizers::models::bpe::{BPE, Vocab};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    let map = byte_to_char();
    let ranks: HashMap<&[u8], u32> = token_bytes.iter().enumerate().map(|(r, b)| (b.as_slice(), r as u32)).collect();
    for b in 0..=255u8 {
        if !ranks.contains_key(&[b][..]) {
            return Err(TokenizerError::Build(format!("tiktoken.model has no token for byte {b:#04x}")));
        }
    }
    let mut vocab = Vocab::default();
    let mut merges = Vec::new();
    for (r, t) in token_bytes.iter().enumerate() {
        vocab.insert(byte_level(t, &map), r as u32);
        if t.len() >= 2 {
            let parts = bpe_parts(t, &ranks, r as u32);
            if let [(a, b), (c, d)] = parts[..] {
                merges.push((byte_level(&t[a..b], &map), byte_level(&t[c..d], &map)));
            }
        }
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(true)
        .build()
        .map_err(|e| TokenizerError::Build(e.to_string()))?;
    let split =
        Split::new(SplitPattern::Regex(KIMI_PATTERN.to_string()), tokenizers::SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(Sequence::new(vec![split.into(), ByteLevel::new(false, false, false).into()])));
    Ok(tok)
}

/// Incremental decoder for streaming: emits text only up to the last complete UTF-8 character, so
/// no piece it returns ends inside a character; bytes that can never form one (an invalid byte, or
/// a character cut short by the next token) become U+FFFD, as in [`Tokenizer::decode`].
#[derive(Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// Adds a token's bytes; returns the text that is now complete. Invalid bytes become U+FFFD;
    /// only an incomplete character at the very end is held back.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(good).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{fffd}');
                            rest = &bad[n..];
                        }
                        // Incomplete character at the end: keep it for the next token.
                        None => {
                            rest = bad;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Ends the stream: an unfinished character left at the end can never complete, so its bytes
    /// are dropped rather than shown as U+FFFD. Returns how many bytes were dropped.
    pub fn finish(&mut self) -> usize {
        let n = self.pending.len();
        self.pending.clear();
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Tokenizer {
        // bytes + a few merges: "ab" (256), "abc" (257), "<|" (258)
        let mut t: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        t.push(b"ab".to_vec());
        t.push(b"abc".to_vec());
        t.push(b"<|".to_vec());
        let mut sp: Vec<String> = (0..NUM_SPECIALS).map(|i| format!("<|reserved_token_{}|>", 259 + i)).collect();
        sp[0] = "<|open|>".into();
        sp[1] = "<|op|>".into();
        Tokenizer::from_parts(t, sp).unwrap()
    }

    #[test]
    fn user_text_never_becomes_special() {
        let t = tiny();
        let ids = t.encode("x<|open|>y");
        assert!(ids.iter().all(|&i| i < t.n_base()), "{ids:?}");
        assert_eq!(t.decode(&ids).unwrap(), "x<|open|>y");
        let ids = t.encode_with_specials("x<|open|>y<|op|>");
        assert_eq!(ids, vec![b'x' as u32, 259, b'y' as u32, 260]);
    }

    #[test]
    fn merges_follow_ranks() {
        let t = tiny();
        assert_eq!(t.encode("abc"), vec![257]);
        assert_eq!(t.encode("abd"), vec![256, b'd' as u32]);
    }

    #[test]
    fn long_runs_are_cut_like_kimi() {
        let s = format!("{}{}ab", " ".repeat(7), "x".repeat(5));
        // Cuts happen only when a run grows past the limit, not at every change of kind.
        assert_eq!(split_long_runs(&s, 3), vec!["   ", "   ", " xxx", "xxa", "b"]);
        assert_eq!(split_long_runs("", 3), vec![""]);
        assert_eq!(split_long_runs("\u{1c}\u{1c}\u{1c}\u{1c}", 3), vec!["\u{1c}\u{1c}\u{1c}", "\u{1c}"]);
        let chunks: Vec<&str> = char_chunks("h\u{e9}llo", 2).collect();
        assert_eq!(chunks, vec!["h\u{e9}", "ll", "o"]);
    }

    #[test]
    fn stream_decoder_holds_split_characters() {
        let mut d = StreamDecoder::default();
        let euro = "€".as_bytes();
        assert_eq!(d.push(&euro[..1]), "");
        assert_eq!(d.push(&euro[1..2]), "");
        assert_eq!(d.push(&euro[2..]), "€");
        assert_eq!(d.push(b"a\xff"), "a\u{fffd}");
        // Ending mid-character: the unfinished bytes are dropped, not shown as U+FFFD.
        assert_eq!(d.push(&euro[..2]), "");
        assert_eq!(d.finish(), 2);
        assert_eq!(d.push(b"x"), "x", "nothing of the dropped bytes is left");
        assert_eq!(d.finish(), 0);
        // An invalid byte does not swallow a valid character that follows it across tokens.
        let mut d = StreamDecoder::default();
        let mut got = d.push(&[0xE2]);
        got += &d.push(&[0xE2, 0x82]);
        got += &d.push(&[0xAC]);
        assert_eq!(d.finish(), 0);
        assert_eq!(got, String::from_utf8_lossy(&[0xE2, 0xE2, 0x82, 0xAC]));
        // A four-byte character split over three tokens, then one cut off at the end.
        let mut d = StreamDecoder::default();
        let smile = "😀".as_bytes();
        let pieces: Vec<String> =
            [&smile[..1], &smile[1..3], &smile[3..], b"ok", &smile[..3]].iter().map(|b| d.push(b)).collect();
        assert_eq!(pieces, ["", "", "😀", "ok", ""]);
        assert_eq!(d.finish(), 3);
    }
}
