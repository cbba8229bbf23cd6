//! Any valid checkpoint loads: the same tiny model written canonically, with shard boundaries
//! inside experts, and with each expert's records scattered over three shards gives identical
//! logits bit for bit; small tensors stored as BF16 instead of F32 are converted exactly; a tensor
//! in two shards is a clear error; a placement of a scattered model still reads one range per expert.

mod common;
use common::*;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::BTreeMap;
use std::path::Path;

/// Every tensor of a fixture: name -> (dtype, shape, bytes).
type Tensor = (Dtype, Vec<usize>, Vec<u8>);
type Tensors = BTreeMap<String, Tensor>;

fn read_all(dir: &Path) -> Tensors {
    let m = open_model(dir);
    let mut out = Tensors::new();
    for name in m.ck.tensor_names() {
        let e = m.ck.get(name).unwrap();
        out.insert(name.to_string(), (e.dtype, e.shape.clone(), m.ck.bytes(e).to_vec()));
    }
    out
}

/// Writes `tensors` into shards as `assign` says (shard index per name), plus the index and the
/// fixture's other files.
fn write_model(src: &Path, dst: &Path, tensors: &Tensors, assign: &dyn Fn(usize, &str) -> usize, shards: usize) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let n = e.file_name().to_string_lossy().to_string();
        // Not the source's checksum record either: these are other files (their own, at first open).
        if !n.starts_with("reference")
            && !n.starts_with('.')
            && !n.ends_with(".safetensors")
            && !n.ends_with(".index.json")
        {
            std::fs::copy(e.path(), dst.join(&n)).unwrap();
        }
    }
    let mut per: Vec<Vec<(&String, &Tensor)>> = vec![Vec::new(); shards];
    for (i, (name, t)) in tensors.iter().enumerate() {
        per[assign(i, name)].push((name, t));
    }
    let mut weight_map = serde_json::Map::new();
    for (s, list) in per.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", s + 1, shards);
        let views: Vec<(String, TensorView)> = list
            .iter()
            .map(|(n, (d, shape, b))| ((*n).clone(), TensorView::new(*d, shape.clone(), b).unwrap()))
            .collect();
        std::fs::write(dst.join(&file), safetensors::serialize(views, None).unwrap()).unwrap();
        for (n, _) in list {
            weight_map.insert((*n).clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dst.join("model.safetensors.index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
}

fn expert_record(name: &str) -> Option<usize> {
    let i = name.find(".experts.")?;
    let rest = &name[i..];
    [
        "w1.weight_packed",
        "w1.weight_scale",
        "w3.weight_packed",
        "w3.weight_scale",
        "w2.weight_packed",
        "w2.weight_scale",
    ]
    .iter()
    .position(|p| rest.ends_with(p))
}

fn logits(dir: &Path, prompt: &[u32]) -> Vec<u32> {
    let e = engine(dir);
    let mut all = bits(&score(&e, prompt));
    all.extend(greedy(&e, prompt, 6));
    all
}

#[test]
fn canonical_split_and_scattered_layouts_give_identical_bits() {
    let src = fixture("k3-tiny-a");
    let r = reference("k3-tiny-a");
    let prompt = &r.prompt[..48];
    let want = logits(&src, prompt);
    let tensors = read_all(&src);
    let tmp = tempfile::tempdir().unwrap();
    // (a) canonical: one shard, the writer's own order.
    let a = tmp.path().join("a");
    write_model(&src, &a, &tensors, &|_, _| 0, 1);
    // (b) shard boundaries inside experts: a new shard every 7 tensors (experts have 6 records).
    let b = tmp.path().join("b");
    write_model(&src, &b, &tensors, &|i, _| (i / 7) % 5, 5);
    // (c) each expert's six records over three shards.
    let c = tmp.path().join("c");
    write_model(&src, &c, &tensors, &|_, n| expert_record(n).map_or(0, |p| p % 3), 3);
    for (label, dir) in [("canonical", &a), ("boundaries inside experts", &b), ("scattered", &c)] {
        let m = open_model(dir);
        let pieces: usize = m.roster.experts.iter().flatten().flatten().map(|l| l.extents.len()).max().unwrap();
        if label != "canonical" {
            assert!(pieces > 1, "{label}: the layout really splits experts");
        }
        assert_eq!(logits(dir, prompt), want, "{label}: logits differ from the shipped layout");
        // Through the store (O_DIRECT pieces, assembled) too.
        let spec = deltafin::store::placement::shard_spec(&m.ck, &m.roster, dir, 2, 1.0).unwrap();
        let store =
            std::sync::Arc::new(deltafin::store::expert_store::ExpertStore::open(spec, Default::default()).unwrap());
        let e = engine_with(dir, store.clone());
        let mut got = bits(&score(&e, prompt));
        got.extend(greedy(&e, prompt, 6));
        assert_eq!(got, want, "{label}: logits through the store differ");
    }
    // A placement of the scattered model keeps every expert contiguous: one read per expert.
    let m = open_model(&c);
    std::fs::create_dir_all(tmp.path().join("d0")).unwrap();
    run_ok(
        deltafin_cmd()
            .args(["place", "--model"])
            .arg(&c)
            .arg("--drive")
            .arg(format!("{}=1.0", tmp.path().join("d0").display())),
    );
    let _ = m;
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(&c)
        .args([
            "--prompt-ids",
            &ids_arg(prompt),
            "--max-new",
            "6",
            "--ignore-eos",
            "--format",
            "json",
            "-q",
            "--expert-cache-gb",
            "0",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // The model's own shards stay a second copy: a read late on the pack drive (a loaded machine)
    // may be hedged there, in as many ranges as the scattered layout has, never more than once.
    let (packs, shards): (Vec<_>, Vec<_>) =
        j["stats"]["drives"].as_array().unwrap().iter().partition(|d| d["root"].as_str().unwrap().ends_with("d0"));
    let reads = |ds: &[&serde_json::Value]| ds.iter().map(|d| d["reads"].as_u64().unwrap()).sum::<u64>();
    let fetched = j["stats"]["experts_fetched"].as_u64().unwrap();
    let hedged = j["stats"]["hedged_reads"].as_u64().unwrap_or(0);
    assert_eq!(reads(&packs), fetched, "one read per expert from the packs (no cache): {}", j["stats"]);
    assert!(reads(&shards) <= hedged * 8, "the shards are read only by hedges: {}", j["stats"]);
    let out: Vec<u32> = j["output_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    assert_eq!(out, greedy(&engine(&src), prompt, 6));
}

#[test]
fn small_tensors_stored_as_bf16_convert_exactly() {
    let src = fixture("k3-tiny-b");
    let r = reference("k3-tiny-b");
    let prompt = &r.prompt[..32];
    let mut tensors = read_all(&src);
    // Round conv taps and A_log to BF16 values; write them once as F32 and once as BF16.
    let mut as_f32 = tensors.clone();
    for (name, (dtype, _, bytes)) in tensors.iter_mut() {
        if (name.contains("conv1d") || name.ends_with("A_log")) && *dtype == Dtype::F32 {
            let vals: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let b16: Vec<u8> = vals.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
            let f32r: Vec<u8> = vals.iter().flat_map(|v| half::bf16::from_f32(*v).to_f32().to_le_bytes()).collect();
            as_f32.get_mut(name).unwrap().2 = f32r;
            *dtype = Dtype::BF16;
            *bytes = b16;
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let (d_bf16, d_f32) = (tmp.path().join("bf16"), tmp.path().join("f32"));
    write_model(&src, &d_bf16, &tensors, &|_, _| 0, 1);
    write_model(&src, &d_f32, &as_f32, &|_, _| 0, 1);
    assert_eq!(logits(&d_bf16, prompt), logits(&d_f32, prompt), "BF16 storage converts exactly to the same f32 values");
    // And the model as stored (BF16 taps) matches the fp64 reference run on the same files.
    let got = tmp.path().join("got.safetensors");
    let l = score(&engine(&d_bf16), prompt);
    deltafin::util::write_f32_safetensors(&got, "logits", &[prompt.len(), r.vocab], &l).unwrap();
    let err = reference_rel_error(&d_bf16, prompt, &got);
    assert!(err <= 1e-4, "BF16-stored small tensors: relative error vs the fp64 reference {err}");
}

#[test]
fn a_tensor_in_two_shards_is_a_clear_error() {
    let src = fixture("k3-tiny-a");
    let tensors = read_all(&src);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("dup");
    write_model(&src, &d, &tensors, &|_, _| 0, 2);
    // Put one tensor into the (otherwise empty) second shard as well.
    let (name, (dt, shape, bytes)) = tensors.iter().next().unwrap();
    let views = vec![(name.clone(), TensorView::new(*dt, shape.clone(), bytes).unwrap())];
    std::fs::write(d.join("model-00002-of-00002.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
    let idx = d.join("model.safetensors.index.json");
    let mut j: serde_json::Value = serde_json::from_slice(&std::fs::read(&idx).unwrap()).unwrap();
    j["weight_map"][name.as_str()] = "model-00002-of-00002.safetensors".into();
    std::fs::write(&idx, serde_json::to_vec(&j).unwrap()).unwrap();
    let err = deltafin::model::Checkpoint::open(&d).err().expect("a duplicate tensor is refused").to_string();
    assert!(err.contains(name.as_str()) && err.contains("exactly one shard"), "{err}");
}
