//! The connections a pod has open now, for the config dump's
//! `workloadState.<uid>.connections` (what `istioctl ztunnel-config
//! connections` lists): inbound and outbound, as ztunnel writes them. A
//! connection is listed once it is carried and unlisted when it ends; the
//! cost is one short lock to list and one to unlist, none per byte.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

/// ztunnel's protocol names: `HBONE` or `TCP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Hbone,
    Tcp,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Protocol::Hbone => "HBONE",
            Protocol::Tcp => "TCP",
        }
    }
}

/// One open connection. Outbound: the client, where it connected and
/// where the proxy sent it. Inbound: the peer, the service it asked for
/// (an HBONE CONNECT through a waypoint names none; ztunnel's
/// `originalDst`), and the pod's address it reached.
#[derive(Debug, Clone)]
struct Open {
    src: SocketAddr,
    original_dst: Option<String>,
    actual_dst: SocketAddr,
    protocol: Protocol,
}

#[derive(Debug, Default)]
struct Table {
    inbound: HashMap<u64, Open>,
    outbound: HashMap<u64, Open>,
}

/// A pod's open connections.
#[derive(Debug, Default)]
pub struct OpenConnections {
    next: AtomicU64,
    table: Mutex<Table>,
}

/// Keeps a connection listed; unlists it when dropped.
pub struct Listed {
    open: Arc<OpenConnections>,
    id: u64,
    outbound: bool,
}

impl Drop for Listed {
    fn drop(&mut self) {
        let mut t = self.open.lock();
        let side = if self.outbound {
            &mut t.outbound
        } else {
            &mut t.inbound
        };
        side.remove(&self.id);
        // A burst's table is given back once it is mostly empty.
        if side.capacity() > 64 && side.len() < side.capacity() / 4 {
            side.shrink_to(side.len() * 2);
        }
    }
}

impl OpenConnections {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn list(self: &Arc<Self>, outbound: bool, open: Open) -> Listed {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut t = self.lock();
        if outbound {
            t.outbound.insert(id, open);
        } else {
            t.inbound.insert(id, open);
        }
        Listed {
            open: self.clone(),
            id,
            outbound,
        }
    }

    /// Lists an outbound connection from `src` to `original_dst`, sent to
    /// `actual_dst`.
    pub fn outbound(
        self: &Arc<Self>,
        src: SocketAddr,
        original_dst: SocketAddr,
        actual_dst: SocketAddr,
        protocol: Protocol,
    ) -> Listed {
        let open = Open {
            src,
            original_dst: Some(original_dst.to_string()),
            actual_dst,
            protocol,
        };
        self.list(true, open)
    }

    /// Lists an inbound connection from `src` to the pod's `actual_dst`.
    pub fn inbound(
        self: &Arc<Self>,
        src: SocketAddr,
        original_dst: Option<String>,
        actual_dst: SocketAddr,
        protocol: Protocol,
    ) -> Listed {
        let open = Open {
            src,
            original_dst,
            actual_dst,
            protocol,
        };
        self.list(false, open)
    }

    /// ztunnel's `connections` object: `inbound` and `outbound` lists,
    /// each sorted (ztunnel's are in no order).
    pub fn dump(&self) -> Value {
        let t = self.lock();
        let mut inbound: Vec<_> = t.inbound.values().cloned().collect();
        let mut outbound: Vec<_> = t.outbound.values().cloned().collect();
        drop(t);
        let key = |o: &Open| (o.src, o.actual_dst);
        inbound.sort_by_key(key);
        outbound.sort_by_key(key);
        let list = |side: &[Open]| -> Vec<Value> {
            side.iter()
                .map(|o| {
                    json!({
                        "src": o.src.to_string(),
                        "originalDst": o.original_dst,
                        "actualDst": o.actual_dst.to_string(),
                        "protocol": o.protocol.name(),
                    })
                })
                .collect()
        };
        json!({"inbound": list(&inbound), "outbound": list(&outbound)})
    }

    /// How many are listed, inbound and outbound.
    pub fn counts(&self) -> (usize, usize) {
        let t = self.lock();
        (t.inbound.len(), t.outbound.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_listed_while_its_guard_lives() {
        let open = Arc::new(OpenConnections::default());
        let a = "10.0.0.3:40000".parse().unwrap();
        let out = open.outbound(
            a,
            "10.96.0.10:80".parse().unwrap(),
            "10.0.0.4:8080".parse().unwrap(),
            Protocol::Hbone,
        );
        let inb = open.inbound(
            "10.0.0.5:41000".parse().unwrap(),
            None,
            "10.0.0.3:8080".parse().unwrap(),
            Protocol::Tcp,
        );
        assert_eq!(open.counts(), (1, 1));
        let d = open.dump();
        assert_eq!(
            d["outbound"][0],
            json!({"src": "10.0.0.3:40000", "originalDst": "10.96.0.10:80",
                   "actualDst": "10.0.0.4:8080", "protocol": "HBONE"})
        );
        assert_eq!(d["inbound"][0]["originalDst"], Value::Null);
        assert_eq!(d["inbound"][0]["protocol"], "TCP");
        drop(out);
        assert_eq!(open.counts(), (1, 0));
        drop(inb);
        assert_eq!(open.counts(), (0, 0));
    }
}
