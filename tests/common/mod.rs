//! Shared helpers for the integration tests: fixture paths, reference data, a small PRNG and
//! model loading through the library.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub const FIXTURES: [&str; 3] = ["k3-tiny-a", "k3-tiny-b", "k3-tiny-c"];

pub fn fixture(name: &str) -> PathBuf {
    hermetic();
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

/// Deterministic test randomness: the library's splitmix64 stream from the seed held here.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        deltafin::sample::splitmix64(&mut self.0)
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

/// A program some tests drive that a fresh machine may lack: where it is looked for and how to
/// get it.
pub struct Tool {
    pub name: &'static str,
    /// An environment variable that names the program's path (looked at first), if any.
    pub path_var: Option<&'static str>,
    /// Program names searched on PATH, in order.
    pub names: &'static [&'static str],
    /// How to get it, printed when it is missing.
    pub how: &'static str,
    /// `VAR=1` turns a missing tool into a failure instead of a skip (`.ci/run` sets it where it
    /// installs the tool); `DELTAFIN_REQUIRE_TOOLS=1` does so for every tool.
    pub require_var: &'static str,
}

/// Headless Chromium, for the chat page test (tests/serve.rs).
pub const CHROMIUM: Tool = Tool {
    name: "Chromium",
    path_var: Some("DELTAFIN_CHROMIUM"),
    names: &["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"],
    how: "Debian/Ubuntu: apt-get install chromium; or set DELTAFIN_CHROMIUM=/path/to/chrome",
    require_var: "DELTAFIN_REQUIRE_CHROMIUM",
};

/// curl, the plain HTTP client of the server tests (SSE framing, metrics).
pub const CURL: Tool = Tool {
    name: "curl",
    path_var: None,
    names: &["curl"],
    how: "Debian/Ubuntu: apt-get install curl",
    require_var: "DELTAFIN_REQUIRE_CURL",
};

/// The path of `t`, or None after printing why `test` is skipped — unless the tool is required
/// (its `require_var` or `DELTAFIN_REQUIRE_TOOLS` is 1), when the test fails with the same text.
pub fn tool(t: &Tool, test: &str) -> Option<PathBuf> {
    if let Some(p) = t.path_var.and_then(std::env::var_os) {
        return Some(p.into());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = t.names.iter().flat_map(|n| std::env::split_paths(&path).map(move |d| d.join(n))).find(|p| p.is_file());
    if found.is_none() {
        let required =
            [t.require_var, "DELTAFIN_REQUIRE_TOOLS"].iter().any(|v| std::env::var(v).is_ok_and(|x| x == "1"));
        let why = format!("{} not found on PATH ({})", t.name, t.how);
        if required {
            panic!(
                "{test}: {why}; {}=1 or DELTAFIN_REQUIRE_TOOLS=1 is set, so it fails instead of skipping",
                t.require_var
            );
        }
        skipped(test, &format!("{why}; set {}=1 to make this a failure", t.require_var));
    }
    found
}

/// Prints "SKIPPED test: why" straight to the process's stderr, past the test harness's output
/// capture, so a skip shows in `cargo test`'s output even when the test passes.
pub fn skipped(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// Says once per test binary that its GPU tests pass without running: no adapter (`err`) here.
pub fn no_gpu(file: &str, err: &dyn std::fmt::Display) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        skipped(
            &format!("the GPU tests of {file}"),
            &format!(
                "no usable GPU adapter ({err}); Mesa's lavapipe runs them on the CPU \
                 (Debian/Ubuntu: apt-get install mesa-vulkan-drivers libvulkan1)"
            ),
        )
    });
}

/// Copies a fixture's model files (not the reference outputs) into a fresh temp dir.
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        let n = e.file_name().to_string_lossy().to_string();
        // A copy is another directory: it records its own checksums at first open. Hidden files
        // are deltafin's records and the temps another test may be writing (and renaming) there.
        if !n.starts_with("reference") && !n.starts_with('.') {
            std::fs::copy(e.path(), tmp.path().join(&n)).unwrap();
        }
    }
    tmp
}

/// Records `dir`'s files as they are now as its checksums (`verify --rehash`): for a test that
/// changed a model on purpose. Without it the change is what deltafin reports as damage (the
/// record of an earlier open, or of the same model in another directory, says what the bytes were).
pub fn rerecord(dir: &Path) {
    let ck = deltafin::model::Checkpoint::open_for_verify(dir).unwrap();
    ck.verify(true, &mut |_, _| {}).unwrap();
}

/// Runs a command that must succeed (with UTF-8 stdout); returns (stdout, stderr).
pub fn run_ok(c: &mut std::process::Command) -> (String, String) {
    let o = c.output().unwrap();
    let (out, err) = (String::from_utf8(o.stdout).unwrap(), String::from_utf8_lossy(&o.stderr).into_owned());
    assert!(o.status.success(), "command failed ({:?}):\n{err}", o.status);
    (out, err)
}

/// Library calls in this test process use its own cache, the one [`deltafin_cmd`] gives the
/// binary: what one test records (checksum records of its models, route heat) never reaches
/// another test process or the user's `~/.cache/deltafin`.
pub fn hermetic() {
    deltafin::util::use_cache_dir(test_home().join("deltafin-cache"));
}

/// The binary's path. Tests run it through [`deltafin_cmd`], which keeps it out of the user's caches.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_deltafin")
}

/// The binary as every test runs it: `HOME` and deltafin's cache (`DELTAFIN_CACHE`) are this test
/// process's own directory under the target dir, so no test writes into the user's
/// `~/.cache/deltafin` (route heat, converted tokenizers, the demo) or reads what is there; a test
/// that needs a fresh cache sets `DELTAFIN_CACHE` again. tests/hermetic.rs checks that every test
/// starts the binary this way.
///
/// Where the tests themselves run under an emulator (`.ci/aarch64.sh`: aarch64 tests under
/// qemu-user, with no binfmt_misc to start an aarch64 binary directly), `DELTAFIN_TEST_RUNNER`
/// names the program and arguments, split at whitespace, that start the binary the same way.
pub fn deltafin_cmd() -> std::process::Command {
    let home = test_home();
    let runner = std::env::var("DELTAFIN_TEST_RUNNER").unwrap_or_default();
    let mut runner = runner.split_whitespace();
    let mut c = match runner.next() {
        Some(program) => {
            let mut c = std::process::Command::new(program);
            c.args(runner).arg(bin());
            c
        }
        None => std::process::Command::new(bin()),
    };
    c.env("HOME", home).env("DELTAFIN_CACHE", home.join("deltafin-cache")).env_remove("XDG_CACHE_HOME");
    c
}

/// This process's `HOME` for the binary: `TARGET/tmp/home-PID`, made on first use; the directories
/// of test processes that have ended are removed then.
pub fn test_home() -> &'static Path {
    static HOME: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    HOME.get_or_init(|| {
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let alive = |pid: &str| Path::new("/proc").join(pid).exists() || !Path::new("/proc/self").exists();
        for e in std::fs::read_dir(tmp).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("home-")
                && !alive(pid)
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let home = tmp.join(format!("home-{}", std::process::id()));
        std::fs::create_dir_all(&home).unwrap();
        // Library calls in this process (a model opened in-process records its checksums in the
        // cache) use the same cache as the binary it starts: never the user's.
        deltafin::util::use_cache_dir(home.join("deltafin-cache"));
        home
    })
}

pub fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

use deltafin::engine::{Engine, EngineConfig, ExpertsFrom, GenerateOptions};
use deltafin::k3::KdaMode;
use deltafin::model::{Checkpoint, K3Config, Roster};
use deltafin::store::{ExpertSource, Flow, Landed, ShardExperts};
use std::sync::Arc;

/// A model directory opened through the library (config, mapped checkpoint, checked roster).
pub struct Model {
    pub dir: PathBuf,
    pub cfg: K3Config,
    pub ck: Arc<Checkpoint>,
    pub roster: Roster,
}

pub fn open_model(dir: &Path) -> Model {
    hermetic();
    let cfg = K3Config::load(dir).unwrap();
    let ck = Arc::new(Checkpoint::open(dir).unwrap());
    let roster = Roster::build(&cfg, &ck).unwrap();
    Model { dir: dir.to_path_buf(), cfg, ck, roster }
}

impl Model {
    /// Experts sliced from the mapped shards (the in-memory reference source).
    pub fn mmap_source(&self) -> ShardExperts {
        ShardExperts::new(Arc::clone(&self.ck), &self.roster).unwrap()
    }
}

/// Engine options for tests: experts from the mapped shards, a fixed 4 GB budget.
pub fn test_config(dir: &Path, kda: KdaMode) -> EngineConfig {
    hermetic();
    EngineConfig {
        model: dir.to_path_buf(),
        experts_from: ExpertsFrom::Mmap,
        memory_gb: Some(4.0),
        kda,
        ..Default::default()
    }
}

/// An engine over the mapped shards.
pub fn engine(dir: &Path) -> Arc<Engine> {
    hermetic();
    Engine::open(test_config(dir, KdaMode::Recurrent)).unwrap()
}

/// An engine that reads experts from `src`.
pub fn engine_with(dir: &Path, src: Arc<dyn ExpertSource>) -> Arc<Engine> {
    hermetic();
    Engine::open_with_source(test_config(dir, KdaMode::Recurrent), src).unwrap()
}

/// Logits at every position of `tokens`, from a fresh session.
pub fn score(e: &Arc<Engine>, tokens: &[u32]) -> Vec<f32> {
    e.new_session().score(tokens).unwrap()
}

/// Greedy generation: prefill `prompt`, then decode one token at a time.
pub fn greedy(e: &Arc<Engine>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = e.new_session();
    s.prefill(prompt).unwrap();
    s.generate(&GenerateOptions { max_new: n, stop: Vec::new() }, &mut |_| true).unwrap().tokens
}

/// Every expert of `ids` in `layer` as owned bytes (in arrival order).
pub fn fetch_all(src: &dyn ExpertSource, layer: usize, ids: &[u32]) -> Vec<(u32, Vec<u8>)> {
    let mut out = Vec::new();
    src.fetch(layer, ids, &mut |e: u32, b: Landed<'_>| {
        out.push((e, b.bytes().to_vec()));
        Ok(Flow::Continue)
    })
    .unwrap();
    out
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A `python` command with the oracles' packages (tests/requirements.txt): `tests/pyenv.py` finds
/// or creates the environment under the target directory on first use (locked, so test binaries
/// started together do not race) and every later call reuses it. The base interpreter is
/// `$PYTHON`, else `python3`.
pub fn python() -> std::process::Command {
    hermetic();
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

/// Largest per-position relative L2 error of the logits in `logits_file` (tensor `logits`) against
/// the independent fp64 reference run on the model in `dir` for `prompt`.
pub fn reference_rel_error(dir: &Path, prompt: &[u32], logits_file: &Path) -> f64 {
    let script = format!(
        "import sys, numpy as np; sys.path.insert(0, {ref_dir:?}); from k3_reference import Reference, read_safetensors\n\
         r = Reference({dir:?}); want = r.logits({prompt:?}); got = read_safetensors({out:?})['logits']\n\
         print(float(np.max(np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1))))",
        ref_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference").display().to_string(),
        dir = dir.display().to_string(),
        out = logits_file.display().to_string(),
    );
    let o = python().args(["-c", &script]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
}

/// Writes a small random model with `deltafin synth` (3 layers, 8 experts, top-2; `seed` as given).
pub fn synth_small(dir: &Path, seed: Option<&str>) {
    hermetic();
    let mut c = deltafin_cmd();
    c.args(["synth", "--out"]).arg(dir).args(["--layers", "3", "--experts", "8", "--top-k", "2"]);
    if let Some(s) = seed {
        c.args(["--seed", s]);
    }
    run_ok(&mut c);
}

use deltafin::store::expert_store::{ExpertStore, StoreOptions};
use deltafin::store::io::reader::ReaderKind;
use deltafin::store::placement::{Manifest, PlaceOptions, Policy, RouteTrace, ShardUse};

/// Places `m`'s experts on `drives` (drive i given `gbps(i)` GB/s, queue depth 2).
pub fn place_model(
    m: &Model,
    drives: &[PathBuf],
    gbps: impl Fn(usize) -> f64,
    policy: Policy,
    shards: ShardUse,
    trace: Option<RouteTrace>,
) -> Manifest {
    hermetic();
    let o = PlaceOptions {
        model_dir: &m.dir,
        drives: drives.iter().enumerate().map(|(i, d)| (d.clone(), Some(gbps(i)))).collect(),
        policy,
        shards,
        trace,
        qd: 2,
        measure: &|_, _| unreachable!("speeds are given"),
        measure_shards: &|_| Ok(0.5),
        progress: &|_, _| {},
    };
    deltafin::store::placement::place(&m.cfg, &m.ck, &m.roster, &o).unwrap()
}

/// The store over a placement.
pub fn manifest_store(
    m: &Model,
    man: &Manifest,
    cache_bytes: u64,
    reader: ReaderKind,
    prefetch_depth: usize,
) -> Arc<ExpertStore> {
    hermetic();
    let spec =
        deltafin::store::placement::manifest_spec(man, &m.ck, &m.roster, m.roster.expert_layout.clone().unwrap())
            .unwrap();
    Arc::new(
        ExpertStore::open(spec, StoreOptions { cache_bytes, reader, prefetch_depth, ..Default::default() }).unwrap(),
    )
}

/// The readers a store test runs each case with: io_uring and the pread pool on Linux, the pread
/// pool elsewhere (io_uring is Linux-only; macOS reads with pread and F_NOCACHE).
pub fn readers() -> &'static [ReaderKind] {
    if cfg!(target_os = "linux") { &[ReaderKind::Uring, ReaderKind::Pread] } else { &[ReaderKind::Pread] }
}

/// The store over the model's own shards (one drive).
pub fn shard_store(m: &Model, cache_bytes: u64, qd: usize, prefetch_depth: usize) -> Arc<ExpertStore> {
    hermetic();
    shard_store_with_heat(m, cache_bytes, qd, prefetch_depth, None)
}

/// [`shard_store`] seeded with (and saving) the route heat at `heat`.
pub fn shard_store_with_heat(
    m: &Model,
    cache_bytes: u64,
    qd: usize,
    prefetch_depth: usize,
    heat: Option<PathBuf>,
) -> Arc<ExpertStore> {
    let spec = deltafin::store::placement::shard_spec(&m.ck, &m.roster, &m.dir, qd, 1.0).unwrap();
    Arc::new(
        ExpertStore::open(
            spec,
            StoreOptions {
                cache_bytes,
                reader: ReaderKind::Auto,
                prefetch_depth,
                record_reads: false,
                heat,
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

/// Flips one byte in every record of `drive`'s pack of `layer`: a copy whose checksums fail.
pub fn corrupt_pack(man: &Manifest, drive: usize, layer: usize) {
    let path = man.pack_path(drive, layer);
    let h = deltafin::store::pack::read_header(&path).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    for e in &h.entries {
        bytes[e.offset as usize + 7] ^= 0x55;
    }
    std::fs::write(&path, &bytes).unwrap();
}

/// `n` drive directories `ROOT/d0 .. ROOT/d{n-1}` (created by `place`).
pub fn drive_dirs(root: &Path, n: usize) -> Vec<PathBuf> {
    hermetic();
    (0..n).map(|i| root.join(format!("d{i}"))).collect()
}

/// A copy of fixture `name` whose token embeddings are scaled by 64: the embedding then dominates
/// the residual stream, the next token depends mostly on the current one, and greedy decode falls
/// into short cycles — the repetition n-gram drafts need (the fixtures themselves never repeat).
pub fn repeating_copy(name: &str) -> tempfile::TempDir {
    let tmp = copy_fixture(name);
    for e in std::fs::read_dir(tmp.path()).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            edit_bf16_tensors(&path, &|n| n.ends_with("embed_tokens.weight"), &mut |_, _, x| x * 64.0);
        }
    }
    rerecord(tmp.path());
    tmp
}

/// Rewrites in place every BF16 tensor of the safetensors file `path` whose name `select` picks:
/// element i becomes `f(name, i, old)` (rounded to bf16). Returns how many tensors changed.
pub fn edit_bf16_tensors(
    path: &Path,
    select: &dyn Fn(&str) -> bool,
    f: &mut dyn FnMut(&str, usize, f32) -> f32,
) -> usize {
    let mut b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let mut changed = 0;
    for (k, v) in h.as_object().unwrap() {
        if k == "__metadata__" || !select(k) {
            continue;
        }
        assert_eq!(v["dtype"], "BF16", "{k}");
        let (s, e) = (v["data_offsets"][0].as_u64().unwrap() as usize, v["data_offsets"][1].as_u64().unwrap() as usize);
        for (i, c) in b[8 + n + s..8 + n + e].chunks_exact_mut(2).enumerate() {
            let x = f(k, i, half::bf16::from_le_bytes([c[0], c[1]]).to_f32());
            c.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes());
        }
        changed += 1;
    }
    std::fs::write(path, b).unwrap();
    // Changed on purpose: the directory's checksum record no longer describes the file (what
    // `deltafin verify --rehash` is for); the next open records it again.
    if let Some(dir) = path.parent() {
        let _ = std::fs::remove_file(dir.join(".deltafin-checksums.json"));
    }
    changed
}

pub mod served;
