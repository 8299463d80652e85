//! Node plumbing: the in-pod redirection rules (and, later, the CNI plugin,
//! the agent, the conflist installer and the ZDS server).

pub mod redirect;
