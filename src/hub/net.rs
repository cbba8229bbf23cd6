//! The hub client's view of the network, apart from the hub's conventions (`client`): how a
//! failed request is classified (the hub cannot be reached, the request cannot be made, or the
//! transfer broke and is worth retrying), whether `HF_HUB_OFFLINE` is set, what a usable endpoint
//! is, and URL arithmetic (origins, redirects, percent-encoding, repo file paths).
//!
//! Contract: imports nothing of `hub`, so `client` (which turns a [`Failure`] into its error) and
//! the rest may use it.

/// What a failed request means for retrying it.
#[derive(Debug)]
pub enum Failure {
    /// The hub cannot be reached at all: the name does not resolve, the connection is refused or
    /// unroutable, nothing answers the connection. Retried once, not for minutes.
    Unreachable(String),
    /// The request cannot be made (not a usable URL, TLS refused): final.
    Final(String),
    /// The transfer broke (reset, read timeout, protocol error): worth retrying.
    Transient(String),
}

/// Classifies a failed request (see [`Failure`]).
pub fn classify(e: ureq::Error) -> Failure {
    use std::io::ErrorKind as K;
    match e {
        ureq::Error::HostNotFound => Failure::Unreachable("the host name does not resolve (DNS)".into()),
        ureq::Error::ConnectionFailed => Failure::Unreachable("the connection failed".into()),
        ureq::Error::Timeout(ureq::Timeout::Connect | ureq::Timeout::Resolve) => {
            Failure::Unreachable("no answer to the connection (timed out)".into())
        }
        ureq::Error::Io(io)
            if matches!(
                io.kind(),
                K::ConnectionRefused | K::HostUnreachable | K::NetworkUnreachable | K::AddrNotAvailable
            ) =>
        {
            Failure::Unreachable(io.to_string())
        }
        // The system resolver's failure reaches us as an uncategorised I/O error.
        ureq::Error::Io(io) if io.to_string().contains("failed to lookup address") => {
            Failure::Unreachable(format!("the host name does not resolve (DNS: {io})"))
        }
        ureq::Error::BadUri(m) => Failure::Final(format!("not a usable URL: {m}")),
        e @ (ureq::Error::Tls(_) | ureq::Error::Rustls(_) | ureq::Error::Pem(_) | ureq::Error::InvalidProxyUrl) => {
            Failure::Final(e.to_string())
        }
        e => Failure::Transient(e.to_string()),
    }
}

/// `HF_HUB_OFFLINE` as `huggingface_hub` reads it: 1, true, yes or on (any case).
pub fn offline_from_env() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .is_ok_and(|v| ["1", "true", "yes", "on"].contains(&v.trim().to_ascii_lowercase().as_str()))
}

/// Checks that `endpoint` is `http(s)://HOST[:PORT][/...]`; Err says what is wrong.
pub fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let (scheme, rest) = endpoint.split_once("://").ok_or("no scheme")?;
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return Err(format!("scheme {scheme:?} is not http or https"));
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (name, port) = match host.rsplit_once(':').filter(|_| !host.ends_with(']')) {
        Some((n, p)) => (n, Some(p)),
        None => (host, None),
    };
    if name.is_empty() || name.chars().any(|c| c.is_whitespace()) {
        return Err("no host".into());
    }
    if let Some(p) = port
        && p.parse::<u16>().is_err()
    {
        return Err(format!("port {p:?} is not a number up to 65535"));
    }
    Ok(())
}

/// `scheme://host:port`, lowercase, with the default port filled in.
pub fn origin(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("http", url));
    let scheme = scheme.to_ascii_lowercase();
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h).to_ascii_lowercase();
    let has_port =
        host.rsplit_once(':').is_some_and(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()) && !host.ends_with(']'));
    if has_port {
        format!("{scheme}://{host}")
    } else {
        let port = if scheme == "https" { 443 } else { 80 };
        format!("{scheme}://{host}:{port}")
    }
}

/// Resolves a `Location` against the URL it came from.
pub fn join_url(base: &str, loc: &str) -> String {
    if loc.contains("://") {
        return loc.to_string();
    }
    let (scheme, rest) = base.split_once("://").unwrap_or(("http", base));
    if let Some(l) = loc.strip_prefix("//") {
        return format!("{scheme}://{l}");
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    if loc.starts_with('/') {
        return format!("{scheme}://{authority}{loc}");
    }
    let path = rest[authority.len()..].split(['?', '#']).next().unwrap_or("");
    let dir = path.rsplit_once('/').map_or("", |(d, _)| d);
    format!("{scheme}://{authority}{dir}/{loc}")
}

/// Percent-encodes a path, keeping `/`.
pub fn encode_path(p: &str) -> String {
    p.split('/').map(encode_segment).collect::<Vec<_>>().join("/")
}

/// Percent-encodes one path segment (a revision like `refs/pr/1` becomes one segment).
pub fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A repo file path must stay inside the directory it is written to.
pub fn check_file_path(p: &str) -> Result<(), String> {
    if p.is_empty() || p.starts_with('/') || p.contains('\\') || p.contains('\0') {
        return Err("not a relative path".into());
    }
    if p.split('/').any(|s| s.is_empty() || s == "." || s == "..") {
        return Err("has an empty, `.` or `..` component".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_http_urls_with_a_host() {
        for ok in ["https://huggingface.co", "http://127.0.0.1:8080", "http://[::1]:80/x", "HTTPS://hf-mirror.com/"] {
            assert_eq!(check_endpoint(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("huggingface.co", "no scheme"),
            ("ftp://x", "not http"),
            ("http://", "no host"),
            ("http://h:99999", "port"),
        ] {
            assert!(check_endpoint(bad).unwrap_err().contains(why), "{bad}");
        }
    }
}
