//! Process-wide `tracing` setup for the long-lived roles: text or JSON to
//! stderr, with a filter that can be changed while running (`/logging`).

use std::io::IsTerminal;
use std::sync::OnceLock;

use tracing_subscriber::{reload, EnvFilter};

use crate::config::proxy::LogFormat;

type Handle = reload::Handle<EnvFilter, tracing_subscriber::Registry>;

static FILTER: OnceLock<(Handle, std::sync::Mutex<String>)> = OnceLock::new();

pub fn init(format: LogFormat, filter: &str) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let (level, handle) =
        reload::Layer::new(EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info")));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let registry = tracing_subscriber::registry().with(level);
    let done = match format {
        LogFormat::Json => registry.with(fmt.json()).try_init(),
        LogFormat::Text => registry.with(fmt).try_init(),
    };
    if done.is_ok() {
        let _ = FILTER.set((handle, std::sync::Mutex::new(filter.to_string())));
    }
}

/// The filter in force.
pub fn current() -> String {
    FILTER
        .get()
        .map(|(_, f)| f.lock().unwrap_or_else(|e| e.into_inner()).clone())
        .unwrap_or_default()
}

/// Replaces the filter (`info`, `ambit=debug,h2=warn`, ...); a bad one changes nothing.
pub fn set(filter: &str) -> Result<(), String> {
    let (handle, current) = FILTER.get().ok_or("logging is not initialised")?;
    let parsed = EnvFilter::try_new(filter).map_err(|e| format!("bad filter {filter:?}: {e}"))?;
    handle.reload(parsed).map_err(|e| e.to_string())?;
    *current.lock().unwrap_or_else(|e| e.into_inner()) = filter.to_string();
    tracing::info!(filter, "log level changed");
    Ok(())
}
