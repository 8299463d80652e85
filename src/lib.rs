//! Ambit: the node dataplane of an ambient service mesh in one binary.
//!
//! Modules form a ladder (docs/architecture.md §2): `config` imports nothing
//! else; `xds` and `identity` build state from config; `cni` and `proxy`
//! consume state; `lab` and `demo` assemble everything for a single host;
//! `main` only dispatches. Shared below them all: `alloc` (the allocator's
//! settings), `backoff` (retry delays),
//! `sideport` (the HTTP server of the side ports), `resident` (giving
//! back start-up's pages of the binary), `unix_bind` (owner-only
//! Unix sockets), `watch` (files watched with inotify), `netns`,
//! `constants`.
//!
//! Features: `lab` (on by default) builds the network-namespace lab that
//! `ambit demo` and the tests use; `testing` adds test fakes (the Kubernetes
//! API stand-in) that never ship in the image.

pub mod alloc;
mod backoff;
pub mod cni;
pub mod config;
pub mod constants;
pub mod controlplane;
#[cfg(feature = "lab")]
pub mod demo;
mod grpc;
pub mod identity;
#[cfg(feature = "lab")]
pub mod lab;
mod limits;
pub mod logging;
pub mod netns;
pub mod node;
pub mod proto;
pub mod proxy;
mod resident;
mod sideport;
mod unix_bind;
mod watch;
pub mod xds;
mod zds;

/// The version printed by `ambit version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
