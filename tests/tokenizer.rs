//! Tokenizer exactness against the Python `tiktoken` library (PyPI), encoding as Kimi's published
//! tokenization_kimi.py does. The real K3 rank file cannot be downloaded here, so the test rank
//! file is the first 163,584 ranks of OpenAI's o200k_base vocabulary as bundled in the
//! `tiktoken-rs` crate (`assets/o200k_base.tiktoken`) — the same size as K3's base vocabulary —
//! with K3's 256 reserved specials after it.

mod common;
use common::{Rng, python};
use deltafin::model::tokenizer::{Tokenizer, k3_tokenizer_config};
use std::path::{Path, PathBuf};
use std::process::Command;

const K3_BASE: usize = 163_584;

/// `assets/o200k_base.tiktoken` of the tiktoken-rs package cargo fetched for the dev-dependency.
fn o200k_path() -> PathBuf {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(out.status.success(), "cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let pkg = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "tiktoken-rs")
        .expect("tiktoken-rs dev-dependency");
    let manifest = PathBuf::from(pkg["manifest_path"].as_str().unwrap());
    manifest.parent().unwrap().join("assets/o200k_base.tiktoken")
}

/// A K3-shaped tokenizer directory in `dir`.
fn write_test_tokenizer(dir: &Path) {
    let text = std::fs::read_to_string(o200k_path()).unwrap();
    let lines: Vec<&str> = text.lines().take(K3_BASE).collect();
    assert_eq!(lines.len(), K3_BASE);
    std::fs::write(dir.join("tiktoken.model"), lines.join("\n") + "\n").unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_vec_pretty(&k3_tokenizer_config(K3_BASE)).unwrap(),
    )
    .unwrap();
}

/// Random text from many scripts and symbol classes.
fn random_unicode(rng: &mut Rng, chars: usize) -> String {
    const RANGES: &[(u32, u32)] = &[
        (0x20, 0x7e), // ASCII
        (0x20, 0x7e),
        (0x20, 0x7e),
        (0x09, 0x0d),     // tab, newlines, CR
        (0x1c, 0x20),     // separators Python calls whitespace
        (0xa0, 0xff),     // Latin-1
        (0x100, 0x17f),   // Latin extended
        (0x300, 0x36f),   // combining marks
        (0x391, 0x3c9),   // Greek
        (0x410, 0x44f),   // Cyrillic
        (0x5d0, 0x5ea),   // Hebrew
        (0x620, 0x64a),   // Arabic
        (0x660, 0x669),   // Arabic-Indic digits
        (0x905, 0x939),   // Devanagari
        (0xe01, 0xe30),   // Thai
        (0x1100, 0x1112), // Hangul jamo
        (0x2000, 0x200b), // spaces
        (0x2010, 0x2027), // punctuation
        (0x3000, 0x3002), // ideographic space, punctuation
        (0x3041, 0x3096), // Hiragana
        (0x30a1, 0x30fa), // Katakana
        (0x4e00, 0x9fa5), // Han
        (0x4e00, 0x9fa5),
        (0xac00, 0xd7a3),   // Hangul syllables
        (0xff10, 0xff19),   // fullwidth digits
        (0xff21, 0xff3a),   // fullwidth Latin
        (0x1f300, 0x1f64f), // emoji
        (0x1f680, 0x1f6c5),
        (0x1d400, 0x1d433), // mathematical letters
    ];
    let mut s = String::with_capacity(chars * 3);
    for _ in 0..chars {
        let (a, b) = RANGES[rng.below(RANGES.len())];
        let c = a + rng.below((b - a + 1) as usize) as u32;
        s.push(char::from_u32(c).unwrap());
    }
    s
}

fn corpus() -> Vec<String> {
    let english = "The quick brown fox doesn't jump; it's 'lazy' and WE'LL see. I'm sure they've said \"no\" — \
                   but you'd think otherwise. CamelCaseWords, snake_case_words, UPPER-CASE, MixedCASEExample.\n";
    let code = "fn main() {\r\n\tlet x: Vec<u32> = (0..10).map(|i| i * 2).collect();\r\n    println!(\"{x:?}\");\r\n}\n\
                def f(a, b=3):\n    return {'k': [a, b], \"v\": None}  # comment\n\n\n\tif x >= 0x1F and y != 1e-9:\n\t\tpass\n";
    let mut v: Vec<String> = vec![
        String::new(),
        "Hello".into(),
        " Hello world".into(),
        english.repeat(3),
        code.repeat(2),
        "你好，世界！这是一个测试。中文字符和English混合。".into(),
        "日本語のテキスト、ひらがなとカタカナ。한국어 텍스트입니다.".into(),
        "emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇯🇵🇫🇷 ❤️ ✨".into(),
        "   leading and trailing   \n\n\n   \t\t  \r\n \u{a0}\u{3000}x  ".into(),
        "digits 1234567890 3.14159 1,000,000 ١٢٣٤٥ １２３ 0x7fffffff 2026-11-29".into(),
        "mixed: Hello世界Привет мир مرحبا 😀 שלום नमस्ते e\u{301}te\u{301} Ελληνικά".into(),
        "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>[BOS][EOS]<|reserved_token_163600|>".into(),
        "control \u{0}\u{1}\u{1c}\u{1d}\u{1e}\u{1f} chars \u{85} \u{2028}\u{2029}".into(),
        "don't DON'T Don'T 's 'S 're 'RE".into(),
        " ".repeat(30_000) + "tail",
        "x".repeat(60_000),
        format!("{}\n{}", "\t".repeat(26_000), "ab".repeat(20_000)),
    ];
    let mut rng = Rng(2026);
    v.push(random_unicode(&mut rng, 120_000));
    v.push(random_unicode(&mut rng, 5_000));
    // Over 400,000 characters: Kimi's encoder cuts it into chunks.
    v.push(english.repeat(4_500));
    let mut big = String::new();
    while big.len() < 150_000 {
        big.push_str(english);
        big.push_str(code);
        big.push_str(&random_unicode(&mut rng, 200));
    }
    v.push(big);
    v
}

#[test]
fn token_ids_match_python_tiktoken() {
    let tmp = tempfile::tempdir().unwrap();
    write_test_tokenizer(tmp.path());
    let texts = corpus();
    let corpus_path = tmp.path().join("corpus.json");
    std::fs::write(&corpus_path, serde_json::to_vec(&texts).unwrap()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tokenizer/kimi_tiktoken_ids.py");
    let out = python()
        .arg(&script)
        .arg(tmp.path().join("tiktoken.model"))
        .arg(tmp.path().join("tokenizer_config.json"))
        .arg(&corpus_path)
        .output()
        .expect("python3 must be installed");
    assert!(out.status.success(), "python tiktoken failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let want: Vec<Vec<u32>> = serde_json::from_slice(&out.stdout).unwrap();

    let cache = tmp.path().join("cache");
    let tok = Tokenizer::load(tmp.path(), Some(&cache)).unwrap();
    assert_eq!(tok.n_base() as usize, K3_BASE);
    let mut total = 0usize;
    for (i, (text, want)) in texts.iter().zip(&want).enumerate() {
        let got = tok.encode(text);
        if &got != want {
            let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
            panic!(
                "text #{i} ({} chars): ids differ at index {at}: ours {:?} vs tiktoken {:?}",
                text.chars().count(),
                &got[at.saturating_sub(2)..(at + 3).min(got.len())],
                &want[at.saturating_sub(2)..(at + 3).min(want.len())]
            );
        }
        assert!(got.iter().all(|&id| id < tok.n_base()), "text #{i}: ordinary text produced a special id");
        assert_eq!(tok.decode(&got).unwrap(), *text, "text #{i}: decode(encode(x)) != x");
        total += text.len();
    }
    println!("{} texts, {total} bytes: identical ids", texts.len());
    // A second load comes from the converted-tokenizer cache and must agree.
    assert!(std::fs::read_dir(&cache).unwrap().count() == 1);
    let again = Tokenizer::load(tmp.path(), Some(&cache)).unwrap();
    assert_eq!(again.encode(&texts[3]), want[3]);
}
