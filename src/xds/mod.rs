//! Mesh state: resource types, the snapshot store the data path reads, and
//! the sources that fill it (the local config file now; delta xDS later).

pub mod client;
pub mod convert;
pub mod local;
pub mod store;
pub mod types;

pub use store::{State, StateHandle};
