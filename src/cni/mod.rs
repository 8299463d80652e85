//! Node plumbing: the CNI plugin, the node agent, the conflist installer, the
//! in-pod redirection rules (and which virtual interfaces a pod may name in
//! them) and the agent's side of ZDS.

pub mod agent;
pub mod hostprobe;
mod install;
mod kube;
pub mod loopback;
pub mod nft;
// The plugin's pure stdin/env logic: public so fuzz/ can drive it.
pub mod plugin;
pub mod plugin_main;
pub mod redirect;
pub mod rules;
pub mod virtual_interfaces;
mod zds_server;
