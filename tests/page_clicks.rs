//! The chat page clicked as a person clicks it: headless Chromium (Debian's package; `.ci/run`
//! installs it and requires this test to run) driven over the DevTools protocol by
//! tests/serve/page_clicks.py — real mouse clicks on the message box, Send, Stop and New chat, and
//! the Enter key — against `deltafin serve --demo`. Stop ends the streaming answer (nothing more
//! arrives, the server ends the generation), and a message sent after New chat is answered.

mod common;
use common::served::Served;
use common::*;

#[test]
fn chat_page_send_stop_new_chat_and_enter_clicked_in_headless_chromium() {
    const TEST: &str = "chat_page_send_stop_new_chat_and_enter_clicked_in_headless_chromium";
    let Some(browser) = tool(&CHROMIUM, TEST) else {
        return;
    };
    let s = Served::start(&["--demo", "--api-key", "pagekey", "--memory-gb", "2"]);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve/page_clicks.py");
    let o = python().arg(script).arg(&browser).arg(format!("http://{}", s.addr)).arg("pagekey").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "the clicked page failed: {}\n{out}\nserver log:\n{}",
        String::from_utf8_lossy(&o.stderr),
        s.log.lock().unwrap()
    );
    let seen: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(seen["stopped_at_chars"].as_u64().is_some_and(|n| n >= 3), "{seen}");
    assert!(seen["second_answer_chars"].as_u64().is_some_and(|n| n > 0), "{seen}");
    assert_eq!(seen["user_messages"], 1, "New chat left only the second message: {seen}");
}
