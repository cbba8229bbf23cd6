use super::*;

/// `text`'s pieces, the template's specials by name (every other character its own token, so a
/// tag's text arrives split as a model's would).
fn pieces(text: &str) -> Vec<Piece<'_>> {
    let specials = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"];
    let mut out = Vec::new();
    let mut rest = text;
    'outer: while !rest.is_empty() {
        for s in specials {
            if let Some(r) = rest.strip_prefix(s) {
                out.push(Piece::Special(&rest[..s.len()]));
                rest = r;
                continue 'outer;
            }
        }
        let n = rest.chars().next().map_or(1, char::len_utf8);
        out.push(Piece::Text(&rest[..n]));
        rest = &rest[n..];
    }
    out
}

/// The calls and the content text of a whole answer.
fn parse(text: &str) -> (Vec<(String, Value)>, String) {
    let mut p = ToolCallParser::new(7);
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut take = |ev: Vec<ToolEvent>| {
        for e in ev {
            match e {
                ToolEvent::Call { index, call } => {
                    assert_eq!(index, calls.len());
                    let args: Value = serde_json::from_str(&call.arguments).expect("arguments are JSON");
                    calls.push((call.name, args));
                }
                ToolEvent::Text(t) => content.push_str(&t),
            }
        }
    };
    for piece in pieces(text) {
        take(p.push(piece));
    }
    take(p.finish());
    assert_eq!(p.calls().len(), calls.len());
    (calls, content)
}

const HEAD: &str = "<|open|>response<|sep|>Let me look.<|close|>response<|sep|>";

#[test]
fn typed_arguments_and_json_blocks_become_json_objects() {
    let text = format!(
        "{HEAD}<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
         <|open|>argument key=\"city\" type=\"string\"<|sep|>Paris, \"FR\"<|close|>argument<|sep|>\
         <|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>\
         <|open|>argument key=\"opts\" type=\"object\"<|sep|>{{\"unit\":\"C\"}}<|close|>argument<|sep|>\
         <|close|>call<|sep|><|open|>call tool=\"a&amp;b&quot;\" index=\"2\"<|sep|>\
         <|open|>json type=\"object\"<|sep|> {{\"q\": [1, 2]}} <|close|>json<|sep|><|close|>call<|sep|>\
         <|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
    );
    let (calls, content) = parse(&text);
    assert_eq!(content, "");
    assert_eq!(calls[0].0, "get_weather");
    assert_eq!(calls[0].1, serde_json::json!({"city": "Paris, \"FR\"", "days": 3, "opts": {"unit": "C"}}));
    assert_eq!(calls[1], ("a&b\"".to_string(), serde_json::json!({"q": [1, 2]})));
}

#[test]
fn a_call_without_arguments_has_an_empty_object() {
    let (calls, _) = parse(
        "<|open|>tools<|sep|><|open|>call tool=\"now\" index=\"1\"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
    );
    assert_eq!(calls, vec![("now".to_string(), serde_json::json!({}))]);
}

#[test]
fn ids_are_distinct_and_fixed_by_the_seed() {
    assert_eq!(call_id(1, 0), call_id(1, 0));
    assert_ne!(call_id(1, 0), call_id(1, 1));
    assert_ne!(call_id(1, 0), call_id(2, 0));
    assert!(call_id(0, 0).starts_with("call_") && call_id(0, 0).len() == 29);
}

#[test]
fn hostile_output_degrades_to_content() {
    let call = "<|open|>call tool=\"f\" index=\"1\"<|sep|>";
    let good =
        format!("{call}<|open|>argument key=\"x\" type=\"number\"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>");
    for (name, body, calls) in [
        (
            "unterminated call",
            format!("<|open|>tools<|sep|>{call}<|open|>argument key=\"x\" type=\"string\"<|sep|>abc"),
            0,
        ),
        (
            "invalid JSON block",
            format!(
                "<|open|>tools<|sep|>{call}<|open|>json type=\"object\"<|sep|>{{\"x\": <|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
            ),
            0,
        ),
        (
            "a JSON block that is not an object",
            format!(
                "<|open|>tools<|sep|>{call}<|open|>json type=\"object\"<|sep|>[1]<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
            ),
            0,
        ),
        (
            "a number that is not one",
            format!(
                "<|open|>tools<|sep|>{call}<|open|>argument key=\"x\" type=\"number\"<|sep|>ten<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
            ),
            0,
        ),
        (
            "an unknown type",
            format!(
                "<|open|>tools<|sep|>{call}<|open|>argument key=\"x\" type=\"date\"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
            ),
            0,
        ),
        (
            "a repeated key",
            format!(
                "<|open|>tools<|sep|>{call}<|open|>argument key=\"x\" type=\"string\"<|sep|>1<|close|>argument<|sep|><|open|>argument key=\"x\" type=\"string\"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
            ),
            0,
        ),
        (
            "a call with no name",
            "<|open|>tools<|sep|><|open|>call index=\"1\"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>".to_string(),
            0,
        ),
        (
            "a bad attribute",
            "<|open|>tools<|sep|><|open|>call tool=\"f<|sep|><|close|>call<|sep|><|close|>tools<|sep|>".to_string(),
            0,
        ),
        ("text between calls", format!("<|open|>tools<|sep|>{good}oops{good}<|close|>tools<|sep|>"), 1),
        ("an end of message inside a call", format!("<|open|>tools<|sep|>{call}<|end_of_msg|>"), 0),
        (
            "a second good call after a broken one is content",
            format!("<|open|>tools<|sep|>{good}{call}<|open|>bogus<|sep|>{good}<|close|>tools<|sep|>"),
            1,
        ),
        ("a close without open", "<|open|>tools<|sep|><|close|>call<|sep|><|close|>tools<|sep|>".to_string(), 0),
    ] {
        let (got, content) = parse(&format!("{HEAD}{body}"));
        assert_eq!(got.len(), calls, "{name}: {got:?}");
        assert!(!content.is_empty(), "{name}: the broken text is shown");
        assert!(body.ends_with(&content) || content.starts_with("<|open|>"), "{name}: {content:?}");
    }
    // Text before a call is the answer's (the parser only reads tools sections).
    let (got, content) = parse(&format!("Sure.<|open|>tools<|sep|>{good}<|close|>tools<|sep|>"));
    assert_eq!((got.len(), content.as_str()), (1, ""));
    // Two calls, and a truncated tools section with whole calls only: no text.
    let (got, content) = parse(&format!("<|open|>tools<|sep|>{good}{good}"));
    assert_eq!((got.len(), content.as_str()), (2, ""));
}

#[test]
fn arbitrary_pieces_never_panic() {
    let alphabet = [
        "<|open|>",
        "<|close|>",
        "<|sep|>",
        "<|end_of_msg|>",
        "tools",
        "call tool=\"f\"",
        "json",
        "argument key=\"k\" type=\"string\"",
        "{",
        "}",
        "\"",
        " ",
        "x",
        "&quot;",
    ];
    let mut s = 1u64;
    for _ in 0..2000 {
        let mut text = String::from("<|open|>tools<|sep|>");
        for _ in 0..(crate::sample::splitmix64(&mut s) % 40) {
            text.push_str(alphabet[(crate::sample::splitmix64(&mut s) % alphabet.len() as u64) as usize]);
        }
        let (calls, _) = parse(&text);
        for (_, args) in calls {
            assert!(args.is_object());
        }
    }
}
