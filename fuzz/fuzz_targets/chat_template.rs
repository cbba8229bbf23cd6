//! Chat-template inputs. With a NUL, the input is a template source, NUL, a messages JSON list;
//! without, it is a messages JSON list rendered through K3's own template. A last byte after either
//! picks the thinking effort and whether to add the generation prompt. Compile and render must return a
//! value or a typed error (never panic or hang); caller text never becomes special ids.
#![no_main]
use deltafin::model::chat::{ChatOptions, ChatTemplate, Thinking};
use deltafin_fuzz::{demo_tokenizer, split_nul};
use libfuzzer_sys::fuzz_target;
use std::path::Path;
use std::sync::OnceLock;

const K3_TEMPLATE: &str = include_str!("../../tests/chat/k3_chat_template.jinja");

fuzz_target!(|data: &[u8]| {
    let tok = demo_tokenizer();
    let Some((&last, body)) = data.split_last() else { return };
    static K3: OnceLock<Option<ChatTemplate>> = OnceLock::new();
    let own;
    let (t, messages) = match split_nul(body) {
        (src, Some(m)) => {
            let src = String::from_utf8_lossy(src).into_owned();
            let Ok(t) = ChatTemplate::from_source(Path::new("chat_template.jinja"), src, tok) else { return };
            own = t;
            (&own, m)
        }
        (m, None) => {
            let k3 = K3.get_or_init(|| {
                ChatTemplate::from_source(Path::new("k3_chat_template.jinja"), K3_TEMPLATE.to_string(), tok).ok()
            });
            let Some(t) = k3.as_ref() else { panic!("K3's chat template must compile") };
            (t, m)
        }
    };
    let Ok(messages) = serde_json::from_slice::<serde_json::Value>(messages) else { return };
    let thinking = [Thinking::Off, Thinking::Low, Thinking::High, Thinking::Max][(last & 3) as usize];
    let opts = ChatOptions { thinking, add_generation_prompt: last & 4 == 0, tools: None };
    let rendered = t.render(&messages, &opts);
    let encoded = t.encode(tok, &messages, &opts);
    assert_eq!(rendered.is_ok(), encoded.is_ok());
    if let (Ok(text), Ok(ids)) = (rendered, encoded) {
        // Specials come only from the template's own text: never more than the rendered text has.
        let specials = ids.iter().filter(|&&i| tok.is_special(i)).count();
        assert!(specials <= tok.encode_with_specials(&text).iter().filter(|&&i| tok.is_special(i)).count());
    }
});
