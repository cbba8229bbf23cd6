//! Shared helpers for the integration tests: fixture paths, reference data, a small PRNG and
//! model loading through the library.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub const FIXTURES: [&str; 3] = ["k3-tiny-a", "k3-tiny-b", "k3-tiny-c"];

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

pub struct Reference {
    pub prompt: Vec<u32>,
    pub greedy: Vec<u32>,
    /// [T, vocab]
    pub logits: Vec<f32>,
    pub vocab: usize,
}

pub fn reference(name: &str) -> Reference {
    let dir = fixture(name);
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let ids = |k: &str| j[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    let (logits, shape) = read_f32_tensor(&dir.join("reference.safetensors"), "logits");
    Reference { prompt: ids("prompt_ids"), greedy: ids("greedy_ids"), logits, vocab: shape[1] }
}

pub fn read_f32_tensor(path: &Path, name: &str) -> (Vec<f32>, Vec<usize>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    let v = t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    (v, t.shape().to_vec())
}

/// Largest per-row relative L2 error of `got` against `want` (both [rows, cols]).
pub fn max_rel_l2(got: &[f32], want: &[f32], cols: usize) -> (f64, usize) {
    assert_eq!(got.len(), want.len());
    let mut worst = (0f64, 0usize);
    for (r, (g, w)) in got.chunks(cols).zip(want.chunks(cols)).enumerate() {
        let num: f64 = g.iter().zip(w).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
        let den: f64 = w.iter().map(|b| (*b as f64).powi(2)).sum();
        let e = (num / den).sqrt();
        if e > worst.0 {
            worst = (e, r);
        }
    }
    worst
}

/// splitmix64: deterministic test randomness without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// Copies a fixture's model files (not the reference outputs) into a fresh temp dir.
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        let n = e.file_name().to_string_lossy().to_string();
        if !n.starts_with("reference") {
            std::fs::copy(e.path(), tmp.path().join(&n)).unwrap();
        }
    }
    tmp
}

/// Runs a command that must succeed (with UTF-8 stdout); returns (stdout, stderr).
pub fn run_ok(c: &mut std::process::Command) -> (String, String) {
    let o = c.output().unwrap();
    let (out, err) = (String::from_utf8(o.stdout).unwrap(), String::from_utf8_lossy(&o.stderr).into_owned());
    assert!(o.status.success(), "command failed ({:?}):\n{err}", o.status);
    (out, err)
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_deltafin")
}

pub fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

use deltafin::k3::{ForwardStats, K3, Logits};
use deltafin::model::{Checkpoint, K3Config, Roster};
use deltafin::store::{ExpertSource, ShardExperts};

/// A model directory opened through the library (config, mapped checkpoint, checked roster).
pub struct Model {
    pub dir: PathBuf,
    pub cfg: K3Config,
    pub ck: Checkpoint,
    pub roster: Roster,
}

pub fn open_model(dir: &Path) -> Model {
    let cfg = K3Config::load(dir).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let roster = Roster::build(&cfg, &ck).unwrap();
    Model { dir: dir.to_path_buf(), cfg, ck, roster }
}

/// Opens a model directory and runs `f` with the model (experts read from the mapped shards).
pub fn with_model<R>(dir: &Path, f: impl FnOnce(&mut K3) -> R) -> R {
    let m = open_model(dir);
    let src = ShardExperts::new(&m.ck, &m.roster).unwrap();
    let mut k3 = K3::new(m.cfg.clone(), &m.ck, &m.roster, Some(&src as &dyn ExpertSource)).unwrap();
    f(&mut k3)
}

/// Logits at every position of `tokens` in one forward call.
pub fn score(m: &K3, tokens: &[u32]) -> Vec<f32> {
    let mut st = m.new_state();
    m.forward(&mut st, tokens, Logits::All, &mut ForwardStats::default()).unwrap()
}

/// Greedy generation: prefill `prompt`, then decode one token at a time.
pub fn greedy(m: &K3, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut st = m.new_state();
    let mut fs = ForwardStats::default();
    let mut logits = m.forward(&mut st, prompt, Logits::Last, &mut fs).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = deltafin::k3::argmax(&logits);
        out.push(t);
        logits = m.forward(&mut st, &[t], Logits::Last, &mut fs).unwrap();
    }
    out
}

/// A `python` command with the oracles' packages (tests/requirements.txt): `tests/pyenv.py` finds
/// or creates the environment under the target directory on first use (locked, so test binaries
/// started together do not race) and every later call reuses it. The base interpreter is
/// `$PYTHON`, else `python3`.
pub fn python() -> std::process::Command {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let path = PYTHON.get_or_init(|| {
        let base = std::env::var_os("PYTHON").unwrap_or_else(|| "python3".into());
        // CARGO_TARGET_TMPDIR is TARGET/tmp; the environment lives beside it in TARGET.
        let target = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap_or(Path::new("target")).to_path_buf();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pyenv.py");
        let o = std::process::Command::new(&base)
            .arg(&script)
            .arg(&target)
            .stderr(std::process::Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {} (Python 3 is needed by the oracle tests): {e}", base.display()));
        assert!(o.status.success(), "{} failed to set up the tests' Python environment", script.display());
        PathBuf::from(String::from_utf8_lossy(&o.stdout).trim())
    });
    std::process::Command::new(path)
}
