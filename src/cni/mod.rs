//! Node plumbing: the CNI plugin, the node agent, the conflist installer, the
//! in-pod redirection rules and the agent's side of ZDS.

pub mod agent;
pub mod hostprobe;
pub mod install;
pub mod kube;
pub mod loopback;
pub mod plugin;
pub mod plugin_main;
pub mod redirect;
pub mod zds_server;
