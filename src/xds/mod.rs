//! Mesh state: resource types, the snapshot store the data path reads, and
//! the sources that fill it: the delta xDS client and the local config file.

mod ahead;
pub mod client;
pub mod convert;
pub mod delta;
pub mod local;
mod metrics;
mod store;
mod stream;
pub mod types;
mod yielding;

pub use store::{
    best_service, Claims, Endpoint, ListEntry, PolicyView, Refused, ResourceError, State,
    StateHandle,
};
