//! A session on disk: its committed sequence — every KDA layer's recurrent state and conv tails,
//! every MLA layer's latent cache, the tokens, the logits after the last one — with what a front
//! end needs to go on (the sampler's parameters and generator state, tokens emitted but not yet
//! fed, its own notes), tied to the model that made it.
//!
//! Contract: [`Session::save_state`] writes the file atomically and durably (temp file, fsync,
//! rename, directory fsync: a crash leaves the old file or the new one, never a mix), and
//! [`Engine::load_session`] gives back a session whose next forwards and picks are bit-identical
//! to those of the session that was saved. A file is loaded only if everything checks: the magic,
//! the format version ([`FORMAT`]), the header's own xxh3, the model's fingerprint, the trunk and
//! KDA mode (both change the numbers), the layer shapes, the exact length, and the xxh3 of the
//! whole file; anything else is a [`StateFileError`] naming the file and what was expected.
//!
//! Layout (little-endian):
//! ```text
//! "DFSTATE\n"  u32 FORMAT  u32 header length  header (JSON)  u64 xxh3(header)
//! body: tokens u32 x n, logits f32 x vocab (if any), per layer in order:
//!       KDA: S f32 x heads*dk*dv, conv tails f32 x 3*(width-1)*P;  MLA: latents f32 x n*(kv_lora+rope)
//! u64 xxh3 of every byte before it
//! ```

use super::{Engine, Session};
use crate::backend::BackendError;
use crate::k3::KdaMode;
use crate::k3::kda::KdaState;
use crate::k3::mla::MlaState;
use crate::k3::state::{LayerState, SeqState};
use crate::model::config::AttnKind;
use crate::sample::{Sampler, SamplingSpec};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use xxhash_rust::xxh3::{Xxh3Default, xxh3_64};

/// The state file format this build writes and reads.
pub const FORMAT: u32 = 1;
const MAGIC: &[u8; 8] = b"DFSTATE\n";
/// A header longer than this is not one of ours (the notes of a long chat fit many times over).
const MAX_HEADER: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    #[error("cannot read the state file {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot write the state file {}: {source}", path.display())]
    Write { path: PathBuf, source: std::io::Error },
    #[error("{} is not a deltafin state file (expected it to begin with \"DFSTATE\")", .0.display())]
    NotState(PathBuf),
    #[error(
        "{} is a state file of format {got}; this deltafin reads format {FORMAT} (the state must be made again: re-run the conversation)",
        path.display()
    )]
    Version { path: PathBuf, got: u32 },
    #[error("{} is corrupt: {what} (refusing to load it)", path.display())]
    Corrupt { path: PathBuf, what: String },
    #[error(
        "{} was saved by model {saved}, and this engine runs model {have} (fingerprints): a state continues only on the model that made it",
        path.display()
    )]
    OtherModel { path: PathBuf, saved: String, have: String },
    #[error("{} was saved with {what} {saved}, and this engine uses {have}: the numbers would differ", path.display())]
    Mismatch { path: PathBuf, what: &'static str, saved: String, have: String },
    #[error("{} holds {tokens} tokens, more than this engine's context of {context} tokens per sequence (raise the context)", path.display())]
    Context { path: PathBuf, tokens: usize, context: usize },
    #[error("cannot read the session's state back from the device: {0}")]
    Backend(#[from] BackendError),
}

/// What a front end keeps beside the sequence.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct SessionNotes {
    /// The sampler where it stopped (None: the front end chooses anew).
    pub sampler: Option<SamplerPosition>,
    /// Tokens emitted but not fed (a generation's last token): the next turn feeds them first.
    pub unfed: Vec<u32>,
    /// The front end's own record (a chat's messages, ...).
    pub meta: serde_json::Value,
}

/// A sampler's parameters and generator state ([`Sampler::position`]).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SamplerPosition {
    pub params: SamplingSpec,
    pub rng: u64,
    pub picks: u64,
}

impl SamplerPosition {
    pub fn of(s: &Sampler) -> Self {
        let (params, rng, picks) = s.position();
        SamplerPosition { params, rng, picks }
    }

    /// The sampler, continuing where it was saved.
    pub fn sampler(&self) -> Sampler {
        Sampler::resume(self.params.clone(), self.rng, self.picks)
    }
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Header {
    /// The model's fingerprint (`model::fingerprint`).
    model: String,
    trunk: String,
    kda: KdaMode,
    /// One letter a layer: K (KDA) or M (MLA).
    layers: String,
    kda_state: usize,
    kda_tail: usize,
    mla_row: usize,
    vocab: usize,
    tokens: usize,
    logits: bool,
    notes: SessionNotes,
    /// The deltafin that wrote it (for people; not checked).
    writer: String,
}

impl Header {
    fn of(e: &Engine, tokens: usize, logits: bool, notes: SessionNotes) -> Self {
        let c = &e.cfg;
        Header {
            model: e.model_fingerprint(),
            trunk: e.trunk.name().into(),
            kda: e.config.kda,
            layers: c.attn.iter().map(|a| if *a == AttnKind::Kda { 'K' } else { 'M' }).collect(),
            kda_state: c.kda_heads * c.kda_head_dim * c.kda_head_dim,
            kda_tail: (c.conv_width - 1) * c.kda_dim(),
            mla_row: c.kv_lora + c.qk_rope,
            vocab: c.vocab,
            tokens,
            logits,
            notes,
            writer: format!("deltafin {}", env!("CARGO_PKG_VERSION")),
        }
    }

    /// Body bytes this header announces.
    fn body_len(&self) -> u64 {
        let per_layer: u64 = (self.layers.bytes())
            .map(|k| match k {
                b'K' => (self.kda_state + 3 * self.kda_tail) as u64,
                _ => (self.tokens * self.mla_row) as u64,
            })
            .sum();
        4 * (self.tokens as u64 + if self.logits { self.vocab as u64 } else { 0 } + per_layer)
    }
}

/// A writer that hashes what passes through it.
struct Hashed<W> {
    w: W,
    h: Xxh3Default,
}

impl<W: Write> Hashed<W> {
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.h.update(b);
        self.w.write_all(b)
    }

    fn f32s(&mut self, v: &[f32]) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(4 * v.len().min(1 << 16));
        for c in v.chunks(1 << 16) {
            buf.clear();
            c.iter().for_each(|x| buf.extend_from_slice(&x.to_le_bytes()));
            self.put(&buf)?;
        }
        Ok(())
    }
}

impl Session {
    /// Writes this session's committed sequence and `notes` to `path` (see the module contract);
    /// returns the file's size. Pending (unverified) rows are not saved.
    pub fn save_state(&self, path: &Path, notes: &SessionNotes) -> Result<u64, StateFileError> {
        let (state, tokens, logits) = self.saved_parts();
        let e = self.engine();
        let n = state.pos;
        let head = Header::of(e, n, logits.is_some(), notes.clone());
        // Read device-held states back first: a failed readback writes nothing.
        let mut kda = Vec::new();
        for l in &state.layers {
            if let LayerState::Kda(k) = l {
                kda.push(k.s.host_values()?);
            }
        }
        let json = serde_json::to_vec(&head).map_err(|e| std::io::Error::other(e.to_string()));
        let json = json.map_err(|source| StateFileError::Write { path: path.into(), source })?;
        let mut size = 0;
        let mut write = |f: &mut std::fs::File| -> std::io::Result<()> {
            let mut w = Hashed { w: BufWriter::with_capacity(1 << 20, f), h: Xxh3Default::new() };
            w.put(MAGIC)?;
            w.put(&FORMAT.to_le_bytes())?;
            w.put(&(json.len() as u32).to_le_bytes())?;
            w.put(&json)?;
            w.put(&xxh3_64(&json).to_le_bytes())?;
            let ids: Vec<u8> = tokens[..n].iter().flat_map(|t| t.to_le_bytes()).collect();
            w.put(&ids)?;
            if let Some(l) = logits {
                w.f32s(l)?;
            }
            let mut kda = kda.iter();
            for l in &state.layers {
                match l {
                    LayerState::Kda(k) => {
                        w.f32s(kda.next().map_or(&[][..], |s| &s[..]))?;
                        k.tail.iter().try_for_each(|t| w.f32s(t))?;
                    }
                    // Pending rows past the committed ones are not part of the sequence.
                    LayerState::Mla(m) => w.f32s(&m.latent[..n * head.mla_row])?,
                }
            }
            let sum = w.h.digest();
            w.w.write_all(&sum.to_le_bytes())?;
            w.w.flush()?;
            size = 8 + 4 + 4 + json.len() as u64 + 8 + head.body_len() + 8;
            Ok(())
        };
        crate::util::write_atomic_with(path, &mut write)
            .map_err(|source| StateFileError::Write { path: path.into(), source })?;
        Ok(size)
    }
}

/// What a state file's checked header says, and (when asked) its tokens — for a front end to size
/// an engine's context or to match prompts against saved sessions. Only the header is checked
/// here; [`Engine::load_session`] checks everything before anything is used.
#[derive(Clone, Debug)]
pub struct Peeked {
    /// The model's fingerprint.
    pub model: String,
    pub tokens: usize,
    /// The tokens themselves (empty unless asked for).
    pub ids: Vec<u32>,
    pub notes: SessionNotes,
}

/// Reads `path`'s header (and its tokens when `ids`); see [`Peeked`].
pub fn peek(path: &Path, ids: bool) -> Result<Peeked, StateFileError> {
    let read = |source| StateFileError::Read { path: path.into(), source };
    let f = crate::util::open_regular(path).map_err(read)?;
    let len = f.metadata().map_err(read)?.len();
    let mut f = BufReader::new(f);
    let mut fixed = [0u8; 16];
    if len < 16 || f.read_exact(&mut fixed).is_err() || &fixed[..8] != MAGIC {
        return Err(StateFileError::NotState(path.into()));
    }
    let version = u32::from_le_bytes([fixed[8], fixed[9], fixed[10], fixed[11]]);
    if version != FORMAT {
        return Err(StateFileError::Version { path: path.into(), got: version });
    }
    let hlen = u32::from_le_bytes([fixed[12], fixed[13], fixed[14], fixed[15]]) as u64;
    let corrupt = |what: String| StateFileError::Corrupt { path: path.into(), what };
    if hlen > MAX_HEADER || 16 + hlen + 8 > len {
        return Err(corrupt(format!("a header of {hlen} bytes in a file of {len} bytes")));
    }
    let mut json = vec![0u8; hlen as usize + 8];
    f.read_exact(&mut json).map_err(read)?;
    let sum = u64::from_le_bytes(std::array::from_fn(|i| json[hlen as usize + i]));
    json.truncate(hlen as usize);
    if sum != xxh3_64(&json) {
        return Err(corrupt("the header's checksum does not match".into()));
    }
    let head: Header = serde_json::from_slice(&json).map_err(|e| corrupt(format!("its header does not parse: {e}")))?;
    let mut out = Vec::new();
    if ids {
        if 16 + hlen + 8 + 4 * head.tokens as u64 > len {
            return Err(corrupt(format!("truncated ({len} bytes)")));
        }
        let mut b = vec![0u8; 4 * head.tokens];
        f.read_exact(&mut b).map_err(read)?;
        out = b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    }
    Ok(Peeked { model: head.model, tokens: head.tokens, ids: out, notes: head.notes })
}

/// Every id in `ids` is below `vocab`; else what is wrong, for a `Corrupt` error.
fn check_ids(ids: &[u32], what: &str, vocab: usize) -> Result<(), String> {
    match ids.iter().position(|&t| t as usize >= vocab) {
        Some(i) => Err(format!("{what} hold id {} at {i}, past the vocabulary of {vocab}", ids[i])),
        None => Ok(()),
    }
}

impl Engine {
    /// The model's fingerprint (`model::fingerprint`), which state files are tied to.
    pub fn model_fingerprint(&self) -> String {
        crate::model::fingerprint::fingerprint(&self.ck)
    }

    /// A session read back from a state file written by [`Session::save_state`] on this model,
    /// with its notes; every check of the module contract passes or nothing is loaded.
    pub fn load_session(self: &Arc<Self>, path: &Path) -> Result<(Session, SessionNotes), StateFileError> {
        let read = |source| StateFileError::Read { path: path.into(), source };
        let corrupt = |what: String| StateFileError::Corrupt { path: path.into(), what };
        let f = crate::util::open_regular(path).map_err(read)?;
        let len = f.metadata().map_err(read)?.len();
        let mut r = BufReader::with_capacity(1 << 20, f);
        let mut h = Xxh3Default::new();
        let take =
            |r: &mut BufReader<std::fs::File>, h: &mut Xxh3Default, n: usize| -> Result<Vec<u8>, StateFileError> {
                let mut b = vec![0u8; n];
                r.read_exact(&mut b).map_err(|e| match e.kind() {
                    std::io::ErrorKind::UnexpectedEof => corrupt(format!("truncated ({len} bytes)")),
                    _ => read(e),
                })?;
                h.update(&b);
                Ok(b)
            };
        let magic = take(&mut r, &mut h, 8).map_err(|_| StateFileError::NotState(path.into()))?;
        if magic != MAGIC {
            return Err(StateFileError::NotState(path.into()));
        }
        let u32_at = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let u64_at = |b: &[u8]| u64::from_le_bytes(std::array::from_fn(|i| b[i]));
        let fixed = take(&mut r, &mut h, 8)?;
        let (version, hlen) = (u32_at(&fixed[..4]), u32_at(&fixed[4..]) as u64);
        if version != FORMAT {
            return Err(StateFileError::Version { path: path.into(), got: version });
        }
        if hlen > MAX_HEADER || 16 + hlen + 8 > len {
            return Err(corrupt(format!("a header of {hlen} bytes in a file of {len} bytes")));
        }
        let json = take(&mut r, &mut h, hlen as usize)?;
        let hsum = u64_at(&take(&mut r, &mut h, 8)?);
        if hsum != xxh3_64(&json) {
            return Err(corrupt("the header's checksum does not match".into()));
        }
        let head: Header =
            serde_json::from_slice(&json).map_err(|e| corrupt(format!("its header does not parse: {e}")))?;
        self.check_header(path, &head)?;
        let want = 16 + hlen + 8 + head.body_len() + 8;
        if len != want {
            return Err(corrupt(format!("{len} bytes, expected {want} (truncated or appended to)")));
        }
        let ids = take(&mut r, &mut h, 4 * head.tokens)?;
        let tokens: Vec<u32> = ids.chunks_exact(4).map(u32_at).collect();
        check_ids(&tokens, "its tokens", head.vocab).map_err(corrupt)?;
        let mut f32s = |n: usize| -> Result<Vec<f32>, StateFileError> {
            let b = take(&mut r, &mut h, 4 * n)?;
            Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        };
        let logits = if head.logits { Some(f32s(head.vocab)?) } else { None };
        let mut layers = Vec::with_capacity(head.layers.len());
        for k in head.layers.bytes() {
            layers.push(match k {
                b'K' => {
                    let s = f32s(head.kda_state)?;
                    let tail = [f32s(head.kda_tail)?, f32s(head.kda_tail)?, f32s(head.kda_tail)?];
                    LayerState::Kda(KdaState { s: s.into(), tail })
                }
                _ => LayerState::Mla(MlaState { latent: f32s(head.tokens * head.mla_row)?.into() }),
            });
        }
        let sum = h.digest();
        let mut trailer = [0u8; 8];
        r.read_exact(&mut trailer).map_err(read)?;
        if u64::from_le_bytes(trailer) != sum {
            return Err(corrupt("the checksum of its contents does not match (a changed or damaged byte)".into()));
        }
        let state = SeqState::from_layers(head.tokens, self.plan.context_bound, layers);
        Ok((Session::from_saved(Arc::clone(self), state, tokens, logits), head.notes))
    }

    /// The header's model, numbers and shapes are this engine's, and its notes hold what the
    /// command line would accept (sampler values in range, ids in the vocabulary).
    fn check_header(&self, path: &Path, head: &Header) -> Result<(), StateFileError> {
        let corrupt = |what: String| StateFileError::Corrupt { path: path.into(), what };
        check_ids(&head.notes.unfed, "its unfed tokens", head.vocab).map_err(corrupt)?;
        if let Some(s) = &head.notes.sampler {
            s.params.check().map_err(|e| corrupt(format!("its sampler: {e}")))?;
        }
        let have = Header::of(self, head.tokens, head.logits, SessionNotes::default());
        let short = |f: &str| crate::model::fingerprint::short(f).to_string();
        if head.model != have.model {
            return Err(StateFileError::OtherModel {
                path: path.into(),
                saved: short(&head.model),
                have: short(&have.model),
            });
        }
        let mismatch =
            |what, saved: String, have: String| StateFileError::Mismatch { path: path.into(), what, saved, have };
        if head.trunk != have.trunk {
            return Err(mismatch("the trunk", head.trunk.clone(), have.trunk));
        }
        if head.kda != have.kda {
            return Err(mismatch("KDA mode", format!("{:?}", head.kda), format!("{:?}", have.kda)));
        }
        let shape = |h: &Header| format!("{} {}x{}x{}x{}", h.layers, h.kda_state, h.kda_tail, h.mla_row, h.vocab);
        if shape(head) != shape(&have) {
            return Err(mismatch("layer shapes", shape(head), shape(&have)));
        }
        if head.tokens > self.plan.context_bound {
            return Err(StateFileError::Context {
                path: path.into(),
                tokens: head.tokens,
                context: self.plan.context_bound,
            });
        }
        Ok(())
    }
}
