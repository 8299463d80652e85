//! Who is calling the control plane, and which identities they may ask its
//! CA for. A bearer token names the caller: one node (its own token, a file
//! named after the node in `node_tokens_dir`), the any-node token
//! (`token_file`), or anyone when no token is configured at all. A node may
//! have the identity of a workload the control plane's config places on that
//! node and nothing else; the any-node token and an open control plane may
//! have the identity of any workload in the config, never one that no
//! workload has.
//!
//! The decisions ([`Tokens::caller`], [`may_have`]) are pure; the only I/O is
//! reading the token files: when a call comes and what was read is older
//! than [`TOKENS_RECHECK`], so a rotated or revoked token takes effect
//! within a second, and a flood of calls costs one read a second, not one
//! per call. Tokens are never logged nor printed.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::{Request, Status};

use crate::identity::Identity;
use crate::xds::State;

/// Who a call comes from, as its token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// No token is configured: whoever reaches the port.
    Anyone,
    /// The any-node token (`token_file`).
    AnyNode,
    /// One node's token, named by its file in `node_tokens_dir`.
    Node(String),
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Caller::Anyone => f.write_str("anyone (no token configured)"),
            Caller::AnyNode => f.write_str("the any-node token"),
            Caller::Node(node) => write!(f, "node {node}"),
        }
    }
}

/// Why a call's token was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    #[error("missing or wrong bearer token")]
    WrongToken,
    #[error(
        "this token is configured for several nodes ({0}); each node needs a token of its own"
    )]
    SharedNodeToken(String),
}

/// Why a caller may not have an identity.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NotAllowed {
    #[error("{identity} is outside trust domain {trust_domain}, the only one this CA signs for")]
    TrustDomain {
        identity: String,
        trust_domain: String,
    },
    #[error("{caller} may not have {identity}: no workload on that node has it")]
    NotOnNode { caller: String, identity: String },
    #[error("no workload in the control plane's config has {identity}")]
    NoWorkload { identity: String },
}

/// How old the tokens a call is checked against may be.
pub const TOKENS_RECHECK: Duration = Duration::from_secs(1);

/// Where the tokens are configured, and what was last read there.
#[derive(Clone, Default)]
pub struct TokenFiles {
    /// `token_file`: the any-node token.
    pub any_node: Option<PathBuf>,
    /// `node_tokens_dir`: file `<node name>` holds that node's token.
    pub node_dir: Option<PathBuf>,
    /// The tokens last read, and when (shared by every clone).
    pub read_last: Arc<Mutex<Option<ReadAt>>>,
}

/// Tokens as read at an instant.
pub type ReadAt = (Instant, Arc<Tokens>);

impl fmt::Debug for TokenFiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenFiles")
            .field("any_node", &self.any_node)
            .field("node_dir", &self.node_dir)
            .finish_non_exhaustive()
    }
}

/// The tokens as read at one call. No `Debug`: it holds secrets.
#[derive(Default)]
pub struct Tokens {
    /// Whether any token is configured; if so, a call without a matching
    /// one is refused, even when every configured file turned out empty.
    pub required: bool,
    pub any_node: Option<String>,
    /// (node name, token); never an empty token.
    pub nodes: Vec<(String, String)>,
}

impl TokenFiles {
    /// Who sent `req` (for the log, `call` names the RPC). A refusal is
    /// logged and answered `Unauthenticated`; unreadable token configuration
    /// is `Unavailable`.
    #[allow(clippy::result_large_err)] // tonic's own error type, returned straight to tonic
    pub fn authenticate<T>(&self, req: &Request<T>, call: &str) -> Result<Caller, Status> {
        let bearer = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .unwrap_or_default();
        let tokens = self.current().map_err(|reason| {
            tracing::error!(call, %reason, "control-plane tokens unreadable: refusing the call");
            Status::unavailable("the control plane cannot read its token configuration")
        })?;
        tokens.caller(bearer).map_err(|refusal| {
            tracing::warn!(src.addr = ?peer(req), call, reason = %refusal, "call refused");
            Status::unauthenticated(refusal.to_string())
        })
    }

    /// The tokens to check a call against: those last read, unless older
    /// than [`TOKENS_RECHECK`]; then read again. A failed read is not kept.
    pub fn current(&self) -> Result<Arc<Tokens>, String> {
        let mut last = self.read_last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, tokens)) = last.as_ref() {
            if at.elapsed() < TOKENS_RECHECK {
                return Ok(tokens.clone());
            }
        }
        let tokens = Arc::new(self.read()?);
        *last = Some((Instant::now(), tokens.clone()));
        Ok(tokens)
    }

    /// Reads the configured tokens now. Empty files count as no token (an
    /// empty bearer must never match); a node file that cannot be read is
    /// skipped with a warning, so one bad file does not lock out every node.
    pub fn read(&self) -> Result<Tokens, String> {
        let mut tokens = Tokens {
            required: self.any_node.is_some() || self.node_dir.is_some(),
            ..Default::default()
        };
        if let Some(path) = &self.any_node {
            let token = std::fs::read_to_string(path)
                .map_err(|e| format!("token_file {}: {e}", path.display()))?;
            let token = token.trim();
            tokens.any_node = (!token.is_empty()).then(|| token.to_string());
        }
        if let Some(dir) = &self.node_dir {
            tokens.nodes = read_node_dir(dir)?;
        }
        Ok(tokens)
    }

    /// Says once, at start, how callers are told apart, and warns where
    /// that is weak.
    pub fn log_setup(&self, listen: SocketAddr) {
        let tokens = match self.read() {
            Ok(t) => t,
            Err(reason) => {
                tracing::error!(%reason, "control-plane tokens unreadable: every call is refused until they are");
                return;
            }
        };
        if !tokens.required {
            tracing::warn!(addr = %listen, "no token configured (token_file, node_tokens_dir): anyone who reaches the control plane gets the mesh state and a certificate for any workload in it");
            return;
        }
        if self.any_node.is_some() && tokens.any_node.is_none() {
            tracing::warn!("token_file is empty: it admits nobody");
        }
        if let Some(dir) = &self.node_dir {
            let nodes: Vec<&str> = tokens.nodes.iter().map(|(n, _)| n.as_str()).collect();
            tracing::info!(dir = %dir.display(), nodes = ?nodes, "node tokens: each node gets certificates only for its own workloads");
        }
        if tokens.any_node.is_some() {
            tracing::warn!("token_file is an any-node token: whoever holds it can get a certificate for every workload; give each node its own token in node_tokens_dir");
        }
    }
}

/// The node tokens in `dir`: one regular file per node, named after it.
/// Names starting with `.` are skipped (a Kubernetes Secret volume keeps its
/// `..data` links there; the keys are links into it, and are followed).
fn read_node_dir(dir: &Path) -> Result<Vec<(String, String)>, String> {
    let unreadable = |e: std::io::Error| format!("node_tokens_dir {}: {e}", dir.display());
    let mut nodes = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(unreadable)? {
        let entry = entry.map_err(unreadable)?;
        let path = entry.path();
        let Some(node) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if node.starts_with('.') || !path.is_file() {
            continue;
        }
        match std::fs::read_to_string(&path) {
            Ok(token) if !token.trim().is_empty() => {
                nodes.push((node, token.trim().to_string()));
            }
            Ok(_) => {
                tracing::warn!(path = %path.display(), "empty node token file: that node is admitted by nothing")
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "node token file unreadable: skipped")
            }
        }
    }
    nodes.sort();
    Ok(nodes)
}

impl Tokens {
    /// Who holds `bearer`. Every configured token is compared, each in
    /// constant time, so how long this takes says nothing about which token
    /// matched or how much of one. A node's token wins over the any-node one
    /// if they are the same; one token for two nodes names neither.
    pub fn caller(&self, bearer: &str) -> Result<Caller, Refusal> {
        if !self.required {
            return Ok(Caller::Anyone);
        }
        let mut matched: Vec<&str> = Vec::new();
        for (node, token) in &self.nodes {
            if same_secret(bearer.as_bytes(), token.as_bytes()) {
                matched.push(node);
            }
        }
        let any_node = self
            .any_node
            .as_deref()
            .is_some_and(|t| same_secret(bearer.as_bytes(), t.as_bytes()));
        match matched.as_slice() {
            [node] => Ok(Caller::Node(node.to_string())),
            [] if any_node => Ok(Caller::AnyNode),
            [] => Err(Refusal::WrongToken),
            several => Err(Refusal::SharedNodeToken(several.join(", "))),
        }
    }
}

/// Compares two secrets in time that depends on their lengths only, never
/// on where they first differ, so a caller cannot find a token byte by byte.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    let longest = a.len().max(b.len());
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..longest {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff);
    }
    diff == 0
}

/// Whether `caller` may have a certificate for `id`: a node only if a
/// workload the state places on that node has `id`; the any-node token and
/// an open control plane if any workload has it; nobody outside
/// `trust_domain`.
pub fn may_have(
    caller: &Caller,
    id: &Identity,
    state: &State,
    trust_domain: &str,
) -> Result<(), NotAllowed> {
    if id.trust_domain != trust_domain {
        return Err(NotAllowed::TrustDomain {
            identity: id.to_string(),
            trust_domain: trust_domain.to_string(),
        });
    }
    let mut holders = state
        .workloads()
        .filter(|w| w.identity(trust_domain) == *id);
    let allowed = match caller {
        Caller::Node(node) => holders.any(|w| w.node == *node),
        Caller::AnyNode | Caller::Anyone => holders.next().is_some(),
    };
    if allowed {
        return Ok(());
    }
    Err(match caller {
        Caller::Node(_) => NotAllowed::NotOnNode {
            caller: caller.to_string(),
            identity: id.to_string(),
        },
        Caller::AnyNode | Caller::Anyone => NotAllowed::NoWorkload {
            identity: id.to_string(),
        },
    })
}

/// The address a call came from, for the log: the TLS listener records it
/// as its connection info.
pub fn peer<T>(req: &Request<T>) -> Option<SocketAddr> {
    req.remote_addr().or_else(|| {
        req.extensions()
            .get::<Option<SocketAddr>>()
            .copied()
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_match_only_when_equal() {
        assert!(same_secret(b"s3cret", b"s3cret"));
        assert!(!same_secret(b"s3cret", b"s3creT"));
        assert!(
            !same_secret(b"s3cret", b"s3cre"),
            "a prefix is not the token"
        );
        assert!(!same_secret(b"", b"s3cret"));
        assert!(same_secret(b"", b""));
    }

    fn tokens() -> Tokens {
        Tokens {
            required: true,
            any_node: Some("admin-token".into()),
            nodes: vec![
                ("node-a".into(), "token-a".into()),
                ("node-b".into(), "token-b".into()),
            ],
        }
    }

    #[test]
    fn a_token_names_its_node_the_any_node_token_names_none() {
        let t = tokens();
        assert_eq!(t.caller("token-a"), Ok(Caller::Node("node-a".into())));
        assert_eq!(t.caller("token-b"), Ok(Caller::Node("node-b".into())));
        assert_eq!(t.caller("admin-token"), Ok(Caller::AnyNode));
        for wrong in ["", "token-", "token-c", "admin-token2"] {
            assert_eq!(t.caller(wrong), Err(Refusal::WrongToken), "{wrong:?}");
        }
        let open = Tokens::default();
        assert_eq!(open.caller(""), Ok(Caller::Anyone));
        let nothing_usable = Tokens {
            required: true,
            ..Default::default()
        };
        assert_eq!(
            nothing_usable.caller(""),
            Err(Refusal::WrongToken),
            "configured but empty admits nobody, not everybody"
        );
        let shared = Tokens {
            required: true,
            any_node: None,
            nodes: vec![("a".into(), "same".into()), ("b".into(), "same".into())],
        };
        assert!(matches!(
            shared.caller("same"),
            Err(Refusal::SharedNodeToken(_))
        ));
    }

    fn state() -> State {
        crate::xds::local::parse(
            Path::new("mesh.yaml"),
            "workloads:\n\
             - {uid: a1, name: web-a, namespace: shop, serviceAccount: web, workloadIps: [\"10.0.0.1\"], protocol: HBONE, node: node-a}\n\
             - {uid: b1, name: db-b, namespace: shop, serviceAccount: db, workloadIps: [\"10.0.0.2\"], protocol: HBONE, node: node-b}\n\
             - {uid: b2, name: web-b, namespace: shop, serviceAccount: web, workloadIps: [\"10.0.0.3\"], protocol: HBONE, node: node-b}\n",
        )
        .unwrap()
    }

    #[test]
    fn a_node_token_may_have_only_identities_of_workloads_on_its_node() {
        let st = state();
        let (web, db) = (
            Identity::new("cluster.local", "shop", "web"),
            Identity::new("cluster.local", "shop", "db"),
        );
        let a = Caller::Node("node-a".into());
        assert_eq!(may_have(&a, &web, &st, "cluster.local"), Ok(()));
        let err = may_have(&a, &db, &st, "cluster.local").unwrap_err();
        assert!(
            matches!(err, NotAllowed::NotOnNode { .. }),
            "node-a asking for node-b's pod: {err}"
        );
        assert!(err
            .to_string()
            .contains("node node-a may not have spiffe://cluster.local/ns/shop/sa/db"));
        let b = Caller::Node("node-b".into());
        assert_eq!(may_have(&b, &db, &st, "cluster.local"), Ok(()));
        assert_eq!(
            may_have(&b, &web, &st, "cluster.local"),
            Ok(()),
            "an identity with pods on both nodes"
        );
        assert!(may_have(&Caller::Node("node-c".into()), &web, &st, "cluster.local").is_err());
    }

    #[test]
    fn nobody_may_have_an_identity_no_workload_has_or_another_trust_domain() {
        let st = state();
        let admin = Identity::new("cluster.local", "istio-system", "istiod");
        for caller in [
            Caller::AnyNode,
            Caller::Anyone,
            Caller::Node("node-a".into()),
        ] {
            assert!(
                may_have(&caller, &admin, &st, "cluster.local").is_err(),
                "{caller}"
            );
        }
        assert_eq!(
            may_have(
                &Caller::AnyNode,
                &Identity::new("cluster.local", "shop", "db"),
                &st,
                "cluster.local"
            ),
            Ok(())
        );
        let foreign = Identity::new("evil.example", "shop", "web");
        assert!(matches!(
            may_have(&Caller::AnyNode, &foreign, &st, "cluster.local"),
            Err(NotAllowed::TrustDomain { .. })
        ));
    }

    #[test]
    fn node_tokens_are_read_from_files_named_after_the_nodes() {
        let dir = std::env::temp_dir().join(format!("ambit-node-tokens-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("..data")).unwrap();
        std::fs::write(dir.join("node-a"), "token-a\n").unwrap();
        std::fs::write(dir.join("node-b"), "  \n").unwrap();
        std::fs::write(dir.join("..data/node-c"), "token-c").unwrap();
        std::os::unix::fs::symlink(dir.join("..data/node-c"), dir.join("node-c")).unwrap();
        let files = TokenFiles {
            node_dir: Some(dir.clone()),
            ..TokenFiles::default()
        };
        let t = files.read().unwrap();
        let nodes: Vec<&str> = t.nodes.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            nodes,
            ["node-a", "node-c"],
            "empty files and dot names skipped"
        );
        assert_eq!(t.caller("token-c"), Ok(Caller::Node("node-c".into())));
        assert_eq!(t.caller(""), Err(Refusal::WrongToken));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            files.read().is_err(),
            "a missing directory is an error, not an open door"
        );
    }

    #[test]
    fn tokens_are_read_at_most_once_a_second_and_a_rotation_is_seen_after() {
        let dir = std::env::temp_dir().join(format!("ambit-token-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "old").unwrap();
        let files = TokenFiles {
            any_node: Some(path.clone()),
            ..TokenFiles::default()
        };
        assert_eq!(files.current().unwrap().caller("old"), Ok(Caller::AnyNode));
        // Rotated (and then unreadable): the calls of the next second are
        // checked against what was read, without touching the file.
        std::fs::write(&path, "new").unwrap();
        assert_eq!(
            files.clone().current().unwrap().caller("old"),
            Ok(Caller::AnyNode)
        );
        // What was read a second ago is read again.
        let age = |files: &TokenFiles| {
            if let Some((at, _)) = files.read_last.lock().unwrap().as_mut() {
                *at -= TOKENS_RECHECK;
            }
        };
        age(&files);
        let now = files.current().unwrap();
        assert_eq!(now.caller("new"), Ok(Caller::AnyNode));
        assert_eq!(now.caller("old"), Err(Refusal::WrongToken));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(files.current().unwrap().caller("new"), Ok(Caller::AnyNode));
        age(&files);
        assert!(
            files.current().is_err(),
            "a token file gone refuses every call"
        );
    }
}
