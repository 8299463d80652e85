//! The L4 data path: per-pod listeners (outbound 15001, inbound plaintext
//! 15006, inbound HBONE 15008), the HBONE pool, byte copying, metrics and the
//! side ports. It reads mesh state only through `StateHandle` snapshots and
//! never parses config or talks to a control plane itself.
//!
//! The rooms: `app` wires a proxy from its config; `pods` builds and starts
//! one pod; `inpod` takes pods from the agent over ZDS; `outbound`,
//! `inbound`, `hbone`, `pool`, `tls_stream`, `copy`, `splice` carry connections (`together`: an HBONE
//! connection and its streams in one task; `gate`: futures a connection's
//! task polls only when they wake); `route` decides where a
//! connection goes (pure, over a state snapshot); `rbac` decides whether;
//! `dns` answers the pod's queries; `metrics` and `admin` report.

mod activity;
mod admin;
mod app;
mod budget;
mod config_dump;
mod copy;
mod dns;
mod gate;
mod hbone;
mod hostname;
mod inbound;
mod inpod;
mod metrics;
mod open;
mod outbound;
mod own;
pub mod pod;
mod pods;
mod pool;
mod profile;
mod proxy_protocol;
pub mod rbac;
pub mod reauth;
mod record;
// Pure decisions over a state snapshot, public so benches/ can drive them.
pub mod route;
mod splice;
mod timewait;
mod tls_stream;
mod together;
pub mod tunnel;

pub use app::{run, start, ProxyHandle};
// Pure wire-protocol pieces (no I/O), public so fuzz/ can drive them.
pub use dns::{reply as dns_reply, Asker as DnsAsker, Reply as DnsReply};
pub use hbone::{
    forwarded_for, forwarded_host, validate_connect, Baggage, ConnectRejection, ConnectRequest,
};
pub use hostname::{parse_answer as dns_answer, Refused as DnsAnswerRefused};
