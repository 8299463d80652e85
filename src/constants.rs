//! Ports, marks, addresses and protocol constants shared by every role.
//!
//! Each value is named once here (docs/wire.md §1) so the in-pod rules, the proxy
//! and the tests cannot disagree. Nothing here does I/O.

/// Outbound capture listener inside each pod netns.
pub const OUTBOUND_PORT: u16 = 15001;
/// Inbound plaintext capture listener inside each pod netns.
pub const INBOUND_PLAINTEXT_PORT: u16 = 15006;
/// Inbound HBONE (mTLS + HTTP/2 CONNECT) listener inside each pod netns.
pub const HBONE_PORT: u16 = 15008;
/// DNS proxy port inside each pod netns.
pub const DNS_PORT: u16 = 15053;
/// Proxy admin port (localhost).
pub const ADMIN_PORT: u16 = 15000;
/// Proxy metrics port.
pub const METRICS_PORT: u16 = 15020;
/// Proxy readiness port.
pub const READINESS_PORT: u16 = 15021;

/// Ports a peer may never ask the proxy to deliver to: they are the proxy's own.
pub const PROXY_OWN_PORTS: [u16; 3] = [OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, HBONE_PORT];

/// Ports of the proxy itself, in a pod's netns (its listeners) or in a
/// dedicated proxy's (its side ports): a connection a pod sends to one of
/// them on loopback or its own address is a self call, refused, never
/// passed through (it would reach the proxy again, in a loop).
pub const SELF_CALL_PORTS: [u16; 7] = [
    OUTBOUND_PORT,
    INBOUND_PLAINTEXT_PORT,
    HBONE_PORT,
    DNS_PORT,
    ADMIN_PORT,
    METRICS_PORT,
    READINESS_PORT,
];

/// `SO_MARK` on every socket the proxy opens for a pod (1337).
pub const PROXY_MARK: u32 = 0x539;
/// Mask the in-pod rules match the proxy mark with.
pub const MARK_MASK: u32 = 0xfff;
/// Connmark given to connections the proxy opened with a spoofed source.
pub const CONNMARK: u32 = 0x111;
/// Routing table that sends connmarked return traffic to the local stack.
pub const ROUTE_TABLE: u32 = 100;
/// Priority of the `ip rule` for [`CONNMARK`].
pub const RULE_PRIORITY: u32 = 32764;

/// Source the host SNATs kubelet probes to (IPv4).
pub const PROBE_SNAT_V4: &str = "169.254.7.127";
/// Source the host SNATs kubelet probes to (IPv6).
pub const PROBE_SNAT_V6: &str = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff";

/// The name container runtimes give a pod's network interface (`CNI_IFNAME`).
pub const POD_INTERFACE: &str = "eth0";

/// ALPN protocol spoken on HBONE connections.
pub const HBONE_ALPN: &[u8] = b"h2";
