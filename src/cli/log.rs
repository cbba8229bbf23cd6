//! Library diagnostics on stderr: `tracing` events as "deltafin: warning: ..." lines, filtered by
//! `DELTAFIN_LOG` (e.g. "info", "debug", "deltafin::store=trace"; warnings by default).

/// Diagnostics as "deltafin: warning: ..." lines on stderr.
pub struct Prefixed;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for Prefixed
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut w: tracing_subscriber::fmt::format::Writer<'_>,
        ev: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let level = match *ev.metadata().level() {
            tracing::Level::ERROR => "error",
            tracing::Level::WARN => "warning",
            tracing::Level::INFO => "info",
            tracing::Level::DEBUG => "debug",
            tracing::Level::TRACE => "trace",
        };
        write!(w, "deltafin: {level}: ")?;
        ctx.field_format().format_fields(w.by_ref(), ev)?;
        writeln!(w)
    }
}

/// The filter `DELTAFIN_LOG` asks for: a level (`error`, `warn`, `info`, `debug`, `trace`, `off`;
/// `verbose` and `quiet` as llama.cpp users say them: info and error), or filter directives with a
/// target (`deltafin::store=debug`). Anything else is said once on stderr and the default (warn)
/// used — never a filter that silently shows nothing.
fn filter(value: Option<&str>) -> (String, Option<String>) {
    const LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else { return ("warn".into(), None) };
    let lower = v.to_ascii_lowercase();
    let alias = match lower.as_str() {
        "verbose" => Some("info"),
        "quiet" => Some("error"),
        "warning" => Some("warn"),
        _ => None,
    };
    if let Some(a) = alias {
        return (a.into(), None);
    }
    let directive_ok = |d: &str| {
        let d = d.trim();
        LEVELS.contains(&d)
            || d.split_once('=').is_some_and(|(t, l)| !t.trim().is_empty() && LEVELS.contains(&l.trim()))
    };
    if lower.split(',').all(directive_ok) {
        return (lower, None);
    }
    let why = format!(
        "deltafin: warning: DELTAFIN_LOG={v:?} is not a level (error, warn, info, debug, trace, off, verbose, quiet) \
         or a filter such as deltafin::store=debug; showing warnings"
    );
    ("warn".into(), Some(why))
}

/// Installs the subscriber (once, at start).
pub fn init() {
    let (f, note) = filter(std::env::var("DELTAFIN_LOG").ok().as_deref());
    if let Some(n) = note {
        eprintln!("{n}");
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .event_format(Prefixed)
        .with_env_filter(tracing_subscriber::EnvFilter::new(f))
        .init();
}

#[cfg(test)]
mod tests {
    use super::filter;

    #[test]
    fn levels_aliases_and_directives_are_taken_and_anything_else_is_said() {
        assert_eq!(filter(None), ("warn".into(), None));
        assert_eq!(filter(Some("verbose")).0, "info");
        assert_eq!(filter(Some("DEBUG")).0, "debug");
        assert_eq!(filter(Some("deltafin::store=debug,warn")).0, "deltafin::store=debug,warn");
        let (f, note) = filter(Some("loud"));
        assert_eq!(f, "warn");
        assert!(note.is_some_and(|n| n.contains("DELTAFIN_LOG=\"loud\"")));
    }
}
