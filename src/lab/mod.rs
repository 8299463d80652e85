//! A node on this host made of network namespaces, for the demo, the
//! end-to-end tests and the benchmarks: a "node" netns holding a bridge, and
//! "pods" as netns on veths into it. Everything is created under unique names
//! and removed when the [`Lab`] is dropped, panics included, so labs can run
//! side by side and leave nothing behind.
//!
//! The rooms: `topology` (the node, pods, processes), `sandbox` (the
//! process and cgroup that hold each pod's netns, as kubelet leaves them,
//! and the pods' UIDs), `traffic` (drivers), `probes` (kernel state),
//! `cni_call` (plugins as a runtime calls them),
//! `node` (a whole `ambit node` with the real CNI chain), and, for tests
//! only, `kubeapi` (a Kubernetes API server stand-in), `waypoint` (an
//! HBONE server that records what it is sent), `gateway` (an east-west
//! gateway that carries the inner tunnel as it is and keeps what it relays), `attacker` (hostile mesh
//! peers) and `frames` (a peer streaming HTTP/2 control frames).

#[cfg(feature = "testing")]
pub mod attacker;
mod cni_call;
#[cfg(feature = "testing")]
pub mod frames;
#[cfg(feature = "testing")]
pub mod gateway;
#[cfg(feature = "testing")]
pub mod kubeapi;
pub mod node;
mod probes;
mod sandbox;
mod topology;
mod traffic;
#[cfg(feature = "testing")]
pub mod waypoint;

pub use cni_call::CniCall;
pub use probes::{
    aborts, anon_kb, cpu_seconds, established, iptables_save, istio_rules, nft_istio_rules,
    passive_opens, rss_kb, set_default_congestion_control, stdout_in, time_waits, Established,
};
pub use sandbox::pod_uid;
pub use topology::{
    write_ca, write_serving_ca, Lab, LabNetwork, LabPod, ProxySpec, BRIDGE, SUBNET,
};
pub use traffic::{
    close_first_echo, connect_from, echo_roundtrip, http_get, http_get_in, http_request_in, iperf3,
    short_connection, short_connections, BusyLoops, EchoServer, Ends, Iperf, ShortRun,
};
