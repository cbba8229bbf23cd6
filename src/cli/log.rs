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

/// Installs the subscriber (once, at start).
pub fn init() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .event_format(Prefixed)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("DELTAFIN_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
}
