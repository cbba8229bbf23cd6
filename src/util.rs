//! Small shared helpers: atomic file writes and f32 safetensors output.

use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` atomically: temp file in the same directory, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Serialises one f32 tensor as a safetensors file, atomically.
pub fn write_f32_safetensors(path: &Path, name: &str, shape: &[usize], data: &[f32]) -> std::io::Result<()> {
    let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.to_vec(), &bytes)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let out = safetensors::serialize([(name, view)], None).map_err(|e| std::io::Error::other(e.to_string()))?;
    write_atomic(path, &out)
}

/// deltafin's cache directory: `$DELTAFIN_CACHE`, else `$XDG_CACHE_HOME/deltafin`, else
/// `~/.cache/deltafin`.
pub fn cache_dir() -> std::path::PathBuf {
    if let Some(d) = std::env::var_os("DELTAFIN_CACHE") {
        return d.into();
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return std::path::PathBuf::from(d).join("deltafin");
    }
    match std::env::var_os("HOME") {
        Some(h) => std::path::PathBuf::from(h).join(".cache/deltafin"),
        None => std::path::PathBuf::from(".deltafin-cache"),
    }
}

/// Human-readable byte count (binary units).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{b} B") } else { format!("{v:.1} {}", UNITS[u]) }
}
