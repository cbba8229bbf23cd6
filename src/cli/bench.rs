//! `deltafin bench`: measurements that print one JSON record per run (machine, command, git
//! revision, counters). `bench io` reads one expert set through the expert store and through fio
//! replaying exactly the same reads (same files, offsets, lengths, total queue depth, O_DIRECT,
//! io_uring) in the same run, and reports both rates and their ratio.

use super::load;
use crate::store::ExpertSource;
use crate::store::expert_store::{ExpertStore, StoreOptions};
use crate::store::placement::{Manifest, manifest_path, manifest_spec, shard_spec};
use crate::store::reader::ReaderKind;
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Expert reads through the store vs fio on the same reads.
    Io(IoArgs),
    /// Compute kernels at K3's real shapes: MXFP4 experts, bf16 projections, KDA state update.
    Kernels(KernelArgs),
    /// An exact prompt, cold, then decode steps: counters, timers, bound ratios; ladders and plots.
    Run(Box<super::bench_run::RunBenchArgs>),
}

#[derive(Args)]
pub struct KernelArgs {
    /// Prompt rows for the matrix-matrix and KDA measurements.
    #[arg(long, default_value_t = 512)]
    rows: usize,
    /// KDA heads (K3: 96).
    #[arg(long, default_value_t = 96)]
    heads: usize,
    /// Which kernels: the CPU's, or the GPU's (wgpu; any adapter, lavapipe included).
    #[arg(long, value_enum, ignore_case = true, default_value_t = crate::backend::BackendKind::Cpu)]
    backend: crate::backend::BackendKind,
    /// Dispatches averaged per GPU measurement.
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Development: also time every `*.wgsl` in DIR as the one-row MXFP4 kernel (entry `matvec`)
    /// on the `--matvec-rows` x 3584 matrix, with whether its output bits equal the shipped
    /// kernel's (GPU only).
    #[arg(long, value_name = "DIR", hide = true)]
    matvec_variants: Option<PathBuf>,
    /// Development: rows of the GPU's MXFP4 matvec matrix and of the variants' (a multiple of 16;
    /// default 49152, one layer's 16 routed w1; 98304 is their w1 and w3 as one decode dispatch;
    /// GPU only).
    #[arg(long, value_name = "N", hide = true)]
    matvec_rows: Option<usize>,
    /// Development: also time every `*.wgsl` in DIR as the MXFP4 matmul (entry `matmul`) on one
    /// expert's w1 times `--rows` input rows, with whether its output bits equal the shipped
    /// kernel's (GPU only).
    #[arg(long, value_name = "DIR", hide = true)]
    matmul_variants: Option<PathBuf>,
    #[command(flatten)]
    pub threads: super::Threads,
}

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    cmd: BenchCmd,
}

#[derive(Args)]
pub struct IoArgs {
    /// Model directory (uses MODEL/placement.json when present, else the shards).
    #[arg(long)]
    model: PathBuf,
    /// Placement manifest (default: MODEL/placement.json if present).
    #[arg(long)]
    placement: Option<PathBuf>,
    /// Bytes of distinct experts to read, in GB (capped by the model's experts).
    #[arg(long, default_value_t = 2.0, value_parser = super::parse_gb_positive)]
    gb: f64,
    /// Reads in flight per drive when there is no placement.
    #[arg(long, default_value_t = 4, value_parser = super::parse_qd)]
    qd: usize,
    /// How the store reads (as for `run --reader`).
    #[arg(long, value_enum, default_value_t = ReaderKind::Auto)]
    reader: ReaderKind,
    /// The fio binary that replays the same reads (Debian/Ubuntu: apt-get install fio).
    #[arg(long, default_value = "fio")]
    fio: String,
    /// Runs of each side (alternating); the best rate of each is reported.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Label added to the record (e.g. "3 dirs").
    #[arg(long)]
    label: Option<String>,
}

impl BenchArgs {
    /// `--threads` of `bench kernels` and `bench run` (reads alone need none).
    pub fn threads(&self) -> Option<usize> {
        match &self.cmd {
            BenchCmd::Kernels(k) => k.threads.threads,
            BenchCmd::Run(r) => r.threads.threads,
            BenchCmd::Io(_) => None,
        }
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    match a.cmd {
        BenchCmd::Io(io) => bench_io(io),
        BenchCmd::Kernels(k) => bench_kernels(k),
        BenchCmd::Run(r) => super::bench_run::run(*r),
    }
}

fn bench_io(a: IoArgs) -> Result<()> {
    let opened = load::open(&a.model)?;
    let layout = opened.roster.expert_layout.clone().context("the model has no routed experts")?;
    let manifest_path = manifest_path(a.placement.as_deref(), &a.model);
    let manifest = manifest_path.as_ref().map(|p| Manifest::load(p)).transpose()?;
    // The expert set: experts of every MoE layer in a fixed shuffled order, up to --gb.
    let layers: Vec<usize> = (0..opened.cfg.layers).filter(|&l| opened.roster.experts[l].is_some()).collect();
    let mut all: Vec<(usize, u32)> =
        layers.iter().flat_map(|&l| (0..opened.cfg.experts as u32).map(move |e| (l, e))).collect();
    let mut rng = crate::util::XorShift(0x9E37_79B9);
    for i in (1..all.len()).rev() {
        all.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let want = ((a.gb * 1e9) as u64 / layout.len as u64).max(1) as usize;
    all.truncate(want);
    let mut by_layer: std::collections::BTreeMap<usize, Vec<u32>> = Default::default();
    for &(l, e) in &all {
        by_layer.entry(l).or_default().push(e);
    }

    let make_spec = || -> Result<_> {
        Ok(match &manifest {
            Some(m) => manifest_spec(m, &opened.ck, &opened.roster, layout.clone())?,
            None => shard_spec(&opened.ck, &opened.roster, &a.model, a.qd, 1.0).context("no experts")?,
        })
    };
    let (drives, qd_total) = match &manifest {
        Some(m) => (m.drives.len(), m.drives.iter().map(|d| d.qd).sum::<usize>()),
        None => (1, a.qd),
    };

    // Alternate ours and fio so drift in the device (or the host's cache) hits both alike.
    let mut ours: Vec<f64> = Vec::new();
    let mut theirs: Vec<f64> = Vec::new();
    let mut reader_name = String::new();
    let mut bytes_read = 0u64;
    let mut fio_error = None;
    for _ in 0..a.repeat.max(1) {
        // Ours: the store with no cache, reading every expert of the set once, no compute.
        let store = ExpertStore::open(
            make_spec()?,
            StoreOptions {
                cache_bytes: 0,
                reader: a.reader,
                prefetch_depth: 0,
                record_reads: true,
                heat: None,
                hedge: false,
            },
        )?;
        let t0 = Instant::now();
        for (&l, es) in &by_layer {
            store.fetch(l, es, &mut |_, _: crate::store::Landed<'_>| Ok(crate::store::Flow::Continue))?;
        }
        let secs = t0.elapsed().as_secs_f64();
        let r = store.report();
        bytes_read = r.expert_bytes_read.unwrap_or(0);
        ours.push(bytes_read as f64 / secs / 1e9);
        reader_name = r.drives.first().map(|d| d.reader.clone()).unwrap_or_default();
        let log = store.read_log();
        drop(store);
        // fio: replay the exact reads, same total queue depth.
        if fio_error.is_none() {
            match fio_replay(&a.fio, &log, qd_total) {
                Ok(g) => theirs.push(g),
                Err(e) => fio_error = Some(format!("{e:#}")),
            }
        }
    }
    if let Some(e) = &fio_error {
        eprintln!("deltafin bench io: fio comparison unavailable: {e}");
    }
    let best = |v: &[f64]| v.iter().copied().fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
    let ours_best = best(&ours).unwrap_or(0.0);
    let fio_gbps = best(&theirs);
    let record = crate::stats::bench_record(
        "io",
        serde_json::json!({
            "label": a.label,
            "model": a.model.display().to_string(),
            "placement": manifest_path.map(|p| p.display().to_string()),
            "drives": drives,
            "qd_total": qd_total,
            "reader": reader_name,
            "experts": all.len(),
            "expert_bytes": layout.len,
            "bytes_read": bytes_read,
            "deltafin_gbps": ours_best,
            "fio_gbps": fio_gbps,
            "deltafin_runs_gbps": ours,
            "fio_runs_gbps": theirs,
            "ratio_of_medians": median(&theirs).map(|f| median(&ours).unwrap_or(0.0) / f),
            "ratio": fio_gbps.map(|f| ours_best / f),
        }),
    );
    println!("{record}");
    Ok(())
}

/// Replays `reads` with fio (io_uring, O_DIRECT, `iodepth`); returns GB/s.
fn fio_replay(fio: &str, reads: &[(PathBuf, u64, u64)], iodepth: usize) -> Result<f64> {
    if reads.is_empty() {
        bail!("no reads to replay");
    }
    if let Some((p, _, _)) = reads.iter().find(|(p, _, _)| p.to_string_lossy().chars().any(char::is_whitespace)) {
        bail!("fio's iolog format cannot name {} (it contains whitespace)", p.display());
    }
    let dir = tempfile_dir()?;
    let result = fio_run(fio, reads, iodepth, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn fio_run(fio: &str, reads: &[(PathBuf, u64, u64)], iodepth: usize, dir: &Path) -> Result<f64> {
    let log_path = dir.join("replay.iolog");
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&log_path)?);
        writeln!(f, "fio version 2 iolog")?;
        let mut files: Vec<&Path> = reads.iter().map(|(p, _, _)| p.as_path()).collect();
        files.sort();
        files.dedup();
        for p in &files {
            writeln!(f, "{} add", p.display())?;
            writeln!(f, "{} open", p.display())?;
        }
        for (p, off, len) in reads {
            writeln!(f, "{} read {off} {len}", p.display())?;
        }
        for p in &files {
            writeln!(f, "{} close", p.display())?;
        }
    }
    let out = std::process::Command::new(fio)
        .args(["--name=replay", "--ioengine=io_uring", "--direct=1", "--output-format=json"])
        .arg(format!("--read_iolog={}", log_path.display()))
        .arg(format!("--iodepth={iodepth}"))
        .output()
        .with_context(|| format!("cannot run `{fio}` (install fio, e.g. apt-get install fio)"))?;
    if !out.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // fio may print notes before the JSON object.
    let json_start = text.find('{').context("fio printed no JSON")?;
    let j: serde_json::Value = serde_json::from_str(&text[json_start..]).context("cannot parse fio's JSON")?;
    let bw = j["jobs"][0]["read"]["bw_bytes"].as_f64().context("fio JSON has no read bandwidth")?;
    Ok(bw / 1e9)
}

/// The most prompt rows `bench kernels` takes.
const MAX_KERNEL_ROWS: usize = 16_384;

fn bench_kernels(a: KernelArgs) -> Result<()> {
    if a.rows == 0 || a.heads == 0 || a.reps == 0 {
        bail!("--rows, --heads and --reps must be at least 1 (got {}, {} and {})", a.rows, a.heads, a.reps);
    }
    // The prompt-sized products hold `rows` x 7168 f32 inputs: 470 MB at the limit.
    if a.rows > MAX_KERNEL_ROWS {
        bail!("--rows {}: at most {MAX_KERNEL_ROWS} (a prompt of that many tokens)", a.rows);
    }
    for (flag, dir) in [("--matvec-variants", &a.matvec_variants), ("--matmul-variants", &a.matmul_variants)] {
        if let Some(dir) = dir
            && !dir.is_dir()
        {
            bail!("{flag} {}: not a directory of .wgsl files", dir.display());
        }
    }
    let mr = a.matvec_rows.unwrap_or(16 * 3072);
    if mr == 0 || !mr.is_multiple_of(16) {
        bail!("--matvec-rows must be a positive multiple of 16, got {mr}");
    }
    if let Some(g) = open_gpu(a.backend)? {
        return bench_kernels_gpu(&a, &g, mr);
    }
    if a.matvec_variants.is_some() || a.matvec_rows.is_some() || a.matmul_variants.is_some() {
        bail!("--matvec-variants, --matvec-rows and --matmul-variants are for the GPU's kernels: add --backend gpu");
    }
    use crate::backend::{Bf16Mat, Mxfp4Mat};
    use crate::cpu::{matmul_bf16, matmul_mxfp4, matvec_bf16, matvec_mxfp4};
    let mut rng = crate::util::XorShift(0x9E37_79B9_7F4A_7C15);
    let mut bytes = |n: usize| -> Vec<u8> { (0..n).map(|_| rng.next_u64() as u8).collect() };
    let time = |f: &mut dyn FnMut()| {
        f();
        let t = Instant::now();
        let mut n = 0;
        while n < 3 || t.elapsed().as_secs_f64() < 1.0 {
            f();
            n += 1;
        }
        t.elapsed().as_secs_f64() / n as f64
    };
    // One K3 expert matrix: w1 [3072, 3584] MXFP4 (scales near 2^-6 keep values tame).
    let (rows, cols) = (3072usize, 3584usize);
    let packed = bytes(rows * cols / 2);
    let scales = vec![121u8; rows * cols / 32];
    let w = Mxfp4Mat::new(&packed, &scales, rows, cols);
    let xv: Vec<f32> = (0..cols * a.rows).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
    let mut out = vec![0f32; rows * a.rows];
    let mv = time(&mut || matvec_mxfp4(&w, &xv[..cols], &mut out[..rows]));
    let m_rows = (a.rows * 16 / 896).max(1);
    let mm = time(&mut || matmul_mxfp4(&w, &xv[..cols * m_rows], &mut out[..rows * m_rows]));
    // A bf16 projection of the trunk: [12288, 7168].
    let (br, bc) = (12288usize, 7168usize);
    // Normal bf16 values in +-[0.5, 1) x 2^-4 (random denormals would measure microcode assists).
    let bw = bytes(br * bc * 2).chunks(2).flat_map(|c| [c[0], (c[1] & 0x80) | 0x3d]).collect::<Vec<u8>>();
    let b = Bf16Mat::from_vec(bw.clone(), br, bc);
    let bx: Vec<f32> = (0..bc * 4).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect();
    let mut bout = vec![0f32; br * 4];
    let bv = time(&mut || matvec_bf16(&b, &bx[..bc], &mut bout[..br]));
    let bm = time(&mut || matmul_bf16(&b, &bx, &mut bout));
    // A prompt-sized product: routed_expert_down_proj [3584, 7168] on `rows` rows.
    let (dr, dc) = (3584usize, 7168usize);
    let dw = bw[..dr * dc * 2].to_vec();
    let dm = Bf16Mat::from_vec(dw.clone(), dr, dc);
    let dx: Vec<f32> = (0..dc * a.rows).map(|i| ((i % 11) as f32 - 5.0) / 5.0).collect();
    let mut dout = vec![0f32; dr * a.rows];
    let dmm = time(&mut || matmul_bf16(&dm, &dx, &mut dout));
    let mxx: Vec<f32> = (0..cols * a.rows).map(|i| ((i % 7) as f32 - 3.0) / 3.0).collect();
    let mut mxo = vec![0f32; rows * a.rows];
    let mxm = time(&mut || matmul_mxfp4(&w, &mxx, &mut mxo));
    let kda_rec = crate::cpu::kda::time_state_update(a.rows, a.heads, 128, false);
    let kda_chunk = crate::cpu::kda::time_state_update(a.rows, a.heads, 128, true);
    let macs = (rows * cols) as f64;
    let (peak, peak_lanes) = crate::cpu::peak::fma_peak(0.5);
    let peak_g = peak / 1e9;
    let prompt_gmac = macs * a.rows as f64 / mxm / 1e9;
    let expert_gmac = macs * m_rows as f64 / mm / 1e9;
    let record = crate::stats::bench_record(
        "kernels",
        serde_json::json!({
            "threads": rayon::current_num_threads(),
            "fma_peak_gfma_s": peak_g,
            "fma_peak_lanes": peak_lanes,
            "mxfp4_matmul_fraction_of_peak": expert_gmac / peak_g,
            "mxfp4_matmul_prompt_fraction_of_peak": prompt_gmac / peak_g,
            "mxfp4_matvec_3072x3584_s": mv,
            "mxfp4_matvec_gmac_s": macs / mv / 1e9,
            "mxfp4_matvec_weight_gb_s": (packed.len() + scales.len()) as f64 / mv / 1e9,
            "mxfp4_matmul_rows": m_rows,
            "mxfp4_matmul_gmac_s": expert_gmac,
            "bf16_matvec_12288x7168_s": bv,
            "bf16_matvec_weight_gb_s": bw.len() as f64 / bv / 1e9,
            "bf16_matmul4_gmac_s": (br * bc * 4) as f64 / bm / 1e9,
            "bf16_matmul_prompt_gmac_s": (dr * dc * a.rows) as f64 / dmm / 1e9,
            "mxfp4_matmul_prompt_gmac_s": prompt_gmac,
            "kda_rows": a.rows,
            "kda_heads": a.heads,
            "kda_recurrent_s": kda_rec,
            "kda_chunked_s": kda_chunk,
        }),
    );
    println!("{record}");
    Ok(())
}

/// The GPU kernels at K3's shapes: the MXFP4 matvec over one MoE layer's 16 routed w1 matrices
/// (49152 x 3584, larger than any GPU's L2; `--matvec-rows` for other heights) and the bf16
/// trunk matvec (12288 x 7168), each against a plain read of the same bytes; one expert's w1 alone (3072 x 3584); the `rows`-row MXFP4
/// matmul on one expert's w1 and bf16 matmul on `routed_expert_down_proj` (3584 x 7168), each
/// also as a fraction of the adapter's measured f32 FMA peak. `round_trip_us`: one tiny product's upload, submission and readback.
#[cfg(feature = "gpu")]
fn bench_kernels_gpu(a: &KernelArgs, g: &crate::backend::gpu::GpuBackend, mr: usize) -> Result<()> {
    use crate::backend::gpu::BenchKind;
    use crate::backend::{Backend, Device};
    let reps = a.reps;
    let mc = 3584usize;
    let mx_bytes = (mr * mc / 2 + mr * mc / 32) as f64;
    let (er, ec) = (3072usize, 3584usize);
    let (br, bc) = (12288usize, 7168usize);
    let bf_bytes = (br * bc * 2) as f64;
    let (dr, dc) = (3584usize, 7168usize);
    let mut rec = serde_json::Map::new();
    let mut put = |k: &str, v: serde_json::Value| {
        rec.insert(k.to_string(), v);
    };
    put("backend", "gpu".into());
    put("adapter", g.describe().into());
    put("fma_fused", g.fma_is_fused().into());
    put("reps", reps.into());
    put(
        "plain_read",
        "vec4<u32> per thread per load, 4 loads in flight, consecutive threads on consecutive 16 bytes".into(),
    );
    let (mv, mread) = g.time_product(BenchKind::Mxfp4, mr, mc, 1, reps);
    let (ev, _) = g.time_product(BenchKind::Mxfp4, er, ec, 1, reps);
    let (bv, bread) = g.time_product(BenchKind::Bf16, br, bc, 1, reps);
    put("mxfp4_matvec_shape", serde_json::json!([mr, mc]));
    put("mxfp4_matvec_s", mv.into());
    put("mxfp4_matvec_weight_gb_s", (mx_bytes / mv / 1e9).into());
    put("mxfp4_plain_read_gb_s", (mx_bytes / mread / 1e9).into());
    put("mxfp4_matvec_vs_read", (mread / mv).into());
    put("mxfp4_matvec_3072x3584_s", ev.into());
    put("bf16_matvec_12288x7168_s", bv.into());
    put("bf16_matvec_weight_gb_s", (bf_bytes / bv / 1e9).into());
    put("bf16_plain_read_gb_s", (bf_bytes / bread / 1e9).into());
    put("bf16_matvec_vs_read", (bread / bv).into());
    let (mm, _) = g.time_product(BenchKind::Mxfp4, er, ec, a.rows, reps.div_ceil(4));
    let (bm, _) = g.time_product(BenchKind::Bf16, dr, dc, a.rows, reps.div_ceil(4));
    let mx_gmac = (er * ec * a.rows) as f64 / mm / 1e9;
    let bf_gmac = (dr * dc * a.rows) as f64 / bm / 1e9;
    let peak_g = g.fma_peak(reps) / 1e9;
    put("mxfp4_matmul_rows", a.rows.into());
    put("mxfp4_matmul_gmac_s", mx_gmac.into());
    put("bf16_matmul_shape", serde_json::json!([dr, dc]));
    put("bf16_matmul_gmac_s", bf_gmac.into());
    put("fma_peak", "32 independent f32 fma chains per thread, no loads (fma_peak in kernels/matmul.wgsl)".into());
    put("fma_peak_gfma_s", peak_g.into());
    put("mxfp4_matmul_fraction_of_peak", (mx_gmac / peak_g).into());
    put("bf16_matmul_fraction_of_peak", (bf_gmac / peak_g).into());
    // One tiny product with its upload, submission and readback: what every GPU call costs beyond
    // its work (a decode step makes about ten per layer).
    let w = crate::backend::Bf16Mat::from_vec(vec![0x3c; 16 * 64 * 2], 16, 64);
    let (x, mut o) = (vec![0.5f32; 64], vec![0f32; 16]);
    for _ in 0..20 {
        g.matmul_bf16(&w, &x, &mut o)?;
    }
    let calls = 500;
    let t = std::time::Instant::now();
    for _ in 0..calls {
        g.matmul_bf16(&w, &x, &mut o)?;
    }
    put("round_trip_us", (t.elapsed().as_secs_f64() / calls as f64 * 1e6).into());
    if let Some(dir) = &a.matvec_variants {
        for v in variant_timings(dir, g.time_matvec_variants(dir, mr, mc, reps)) {
            let n = &v.name;
            match v.secs {
                Some(s) => {
                    put(&format!("variant_{n}_gb_s"), (mx_bytes / s / 1e9).into());
                    put(&format!("variant_{n}_vs_read"), (v.read_secs / s).into());
                    put(&format!("variant_{n}_bits_equal"), v.bits_equal.into());
                }
                None => put(&format!("variant_{n}_error"), v.error.unwrap_or_default().into()),
            }
        }
    }
    if let Some(dir) = &a.matmul_variants {
        for v in variant_timings(dir, g.time_matmul_variants(dir, er, ec, a.rows, reps.div_ceil(4))) {
            let n = &v.name;
            match v.secs {
                Some(s) => {
                    let gmac = (er * ec * a.rows) as f64 / s / 1e9;
                    put(&format!("matmul_variant_{n}_gmac_s"), gmac.into());
                    put(&format!("matmul_variant_{n}_fraction_of_peak"), (gmac / peak_g).into());
                    put(&format!("matmul_variant_{n}_bits_equal"), v.bits_equal.into());
                }
                None => put(&format!("matmul_variant_{n}_error"), v.error.unwrap_or_default().into()),
            }
        }
    }
    let record = crate::stats::bench_record("kernels", serde_json::Value::Object(rec));
    println!("{record}");
    Ok(())
}

/// The timings of `dir`'s variants, with a warning for each that failed and for a directory
/// without any.
#[cfg(feature = "gpu")]
fn variant_timings(
    dir: &std::path::Path,
    variants: Vec<crate::backend::gpu::VariantTiming>,
) -> Vec<crate::backend::gpu::VariantTiming> {
    if variants.len() == 1 {
        eprintln!("deltafin: warning: {}: no .wgsl file there", dir.display());
    }
    for v in &variants {
        if let Some(e) = &v.error {
            // Line numbers in parse errors count what the harness puts in front of the file.
            eprintln!(
                "deltafin: warning: variant {} in {} failed: {e} (line numbers in shader errors count \
                 products.wgsl and the harness's text before the file, unless it says `// standalone`)",
                v.name,
                dir.display()
            );
        }
    }
    variants
}

/// The GPU whose kernels `bench kernels` times: with `--backend gpu` any adapter (lavapipe
/// included), with `auto` a real GPU if there is one (else None: the CPU's kernels, as for the
/// engine), with `cpu` None.
#[cfg(feature = "gpu")]
fn open_gpu(kind: crate::backend::BackendKind) -> Result<Option<crate::backend::gpu::GpuBackend>> {
    use crate::backend::{BackendKind, gpu::GpuBackend};
    match kind {
        BackendKind::Cpu => Ok(None),
        BackendKind::Gpu => Ok(Some(GpuBackend::new(true)?)),
        BackendKind::Auto => match GpuBackend::new(false) {
            Ok(g) => Ok(Some(g)),
            Err(e) => {
                tracing::info!("--backend auto: {e}; timing the CPU's kernels");
                Ok(None)
            }
        },
    }
}

#[cfg(not(feature = "gpu"))]
fn bench_kernels_gpu(_: &KernelArgs, g: &std::convert::Infallible, _: usize) -> Result<()> {
    match *g {}
}

#[cfg(not(feature = "gpu"))]
fn open_gpu(kind: crate::backend::BackendKind) -> Result<Option<std::convert::Infallible>> {
    match kind {
        crate::backend::BackendKind::Gpu => Err(crate::backend::BackendError::NotBuilt.into()),
        _ => Ok(None),
    }
}

fn median(v: &[f64]) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (!s.is_empty()).then(|| if s.len() % 2 == 1 { s[s.len() / 2] } else { (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0 })
}

fn tempfile_dir() -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("deltafin-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
