//! Ambit: the node dataplane of an ambient service mesh in one binary.
//!
//! Modules form a ladder (DESIGN §2, STYLE): `config` imports nothing else;
//! `xds` and `identity` build state from config; `cni` and `proxy` consume
//! state; `lab` and `demo` assemble everything for a single host; `main`
//! only dispatches.

pub mod cni;
pub mod config;
pub mod constants;
pub mod controlplane;
pub mod demo;
pub mod grpc;
pub mod identity;
pub mod lab;
pub mod logging;
pub mod netns;
pub mod node;
pub mod proto;
pub mod proxy;
pub mod xds;
pub mod zds;

/// The version printed by `ambit version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
