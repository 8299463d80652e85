//! What the agent asks the API server about its own standing: whether its
//! DaemonSet remains (so an exit is an upgrade and the CNI plugin stays),
//! and a token of its own account for the plugin that outlives its pod.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    Node, NodeSelectorRequirement, NodeSelectorTerm, Pod, PodSpec, ServiceAccount,
};
use kube::api::{Api, PostParams};

use super::{within_budget, Cluster};

impl Cluster {
    /// A token of the ServiceAccount `namespace/account` for the CNI plugin,
    /// asked of the API (TokenRequest) for `life` and bound to no pod: it
    /// keeps working after this agent's pod is deleted (an upgrade), until
    /// it expires or the account is deleted (an uninstall). The agent pod's
    /// own token, which istio-cni hands its plugin, is refused by the API
    /// server as soon as that pod is gone. Returns the token and how long
    /// the server says it lives.
    pub async fn plugin_token(
        &self,
        namespace: &str,
        account: &str,
        life: Duration,
    ) -> Result<(String, Duration), String> {
        let api = Api::<ServiceAccount>::namespaced(self.client.clone(), namespace);
        let request = TokenRequest {
            spec: TokenRequestSpec {
                expiration_seconds: Some(i64::try_from(life.as_secs()).unwrap_or(i64::MAX)),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer =
            within_budget(api.create_token_request(account, &PostParams::default(), &request))
                .await
                .map_err(|e| format!("TokenRequest for {namespace}/{account}: {e}"))?;
        let status = answer.status.ok_or_else(|| {
            format!("TokenRequest for {namespace}/{account}: no token in the answer")
        })?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let until = Duration::from_secs(
            u64::try_from(status.expiration_timestamp.0.as_second()).unwrap_or(0),
        );
        Ok((status.token, until.saturating_sub(now)))
    }

    /// Whether the DaemonSet that owns the agent's pod `namespace/pod` is
    /// still there (not deleted, not being deleted) and still selects this
    /// node: then an exit is an upgrade or a restart, and the CNI plugin must
    /// stay in place so pods created meanwhile fail closed instead of
    /// starting outside the mesh. When the API cannot say, the plugin stays
    /// too. A deleted DaemonSet, a deleted node, or a node the DaemonSet's
    /// node selector or required node affinity no longer matches gets no
    /// agent back, so its plugin goes and new pods start unmeshed.
    ///
    /// Only 401 (the agent's account no longer authenticates: deleted, as
    /// by an uninstall) counts as gone. A 403 proves the account still
    /// exists and only its rights went, which an uninstall passes through
    /// on its way to 401 (Helm deletes the bindings before the account) and
    /// a ClusterRole edited by mistake stays in: the agent asks again for up
    /// to [`FORBIDDEN_WAIT`], and if the answer is still 403 the plugin
    /// stays. 429, 5xx and no answer keep it too.
    pub async fn daemonset_remains(&self, namespace: &str, pod: &str) -> bool {
        let deadline = tokio::time::Instant::now() + FORBIDDEN_WAIT;
        loop {
            match self.daemonset_verdict(namespace, pod).await {
                Ok(remains) => return remains,
                Err(e) if e.forbidden && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(FORBIDDEN_WAIT / 10).await;
                }
                Err(e) => {
                    tracing::warn!(error = %e.reason, "cannot tell whether the agent's DaemonSet remains; keeping the CNI plugin");
                    return true;
                }
            }
        }
    }

    async fn daemonset_verdict(&self, namespace: &str, pod: &str) -> Result<bool, GetError> {
        let pods = Api::<Pod>::namespaced(self.client.clone(), namespace);
        let Some(own) = get_within(&pods, pod).await.or_else(unauthorized_is_gone)? else {
            return Ok(false);
        };
        let owner = own.metadata.owner_references.unwrap_or_default();
        let Some(ds) = owner.iter().find(|o| o.kind == "DaemonSet") else {
            return Ok(false);
        };
        let dss = Api::<DaemonSet>::namespaced(self.client.clone(), namespace);
        let ds = match get_within(&dss, &ds.name)
            .await
            .or_else(unauthorized_is_gone)?
        {
            Some(d) if d.metadata.deletion_timestamp.is_none() => d,
            _ => return Ok(false),
        };
        // No right to read nodes (an older ClusterRole) is no verdict:
        // the DaemonSet exists, so the plugin stays.
        let nodes = Api::<Node>::all(self.client.clone());
        let node = match get_within(&nodes, &self.node).await {
            Ok(Some(node)) => node,
            Ok(None) => return Ok(false),
            Err(e) => {
                return Err(GetError {
                    forbidden: false,
                    ..e
                })
            }
        };
        let template = ds.spec.and_then(|s| s.template.spec);
        Ok(schedules_on(template.as_ref(), &node))
    }
}

/// How long an exiting agent asks again while the API answers 403 (see
/// [`Cluster::daemonset_remains`]).
pub const FORBIDDEN_WAIT: Duration = Duration::from_secs(5);

/// Whether a pod with `spec` may be placed on `node` by its labels and name:
/// the node selector and the required node affinity, as the scheduler reads
/// them. Taints are not weighed: a DaemonSet's pods tolerate the node
/// conditions, and a taint added for a while (a drain) must not uninstall.
pub fn schedules_on(spec: Option<&PodSpec>, node: &Node) -> bool {
    let Some(spec) = spec else { return true };
    let no_labels = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&no_labels);
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let selector_ok = spec
        .node_selector
        .as_ref()
        .is_none_or(|sel| sel.iter().all(|(k, v)| labels.get(k) == Some(v)));
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    // Terms are ORed; a term's requirements are ANDed; an empty term matches nothing.
    let affinity_ok = required.is_none_or(|r| {
        r.node_selector_terms
            .iter()
            .any(|t| term_matches(t, labels, name))
    });
    selector_ok && affinity_ok
}

fn term_matches(term: &NodeSelectorTerm, labels: &BTreeMap<String, String>, name: &str) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    exprs
        .iter()
        .all(|r| requirement_matches(r, labels.get(&r.key).map(String::as_str)))
        && fields
            .iter()
            .all(|r| r.key == "metadata.name" && requirement_matches(r, Some(name)))
}

fn requirement_matches(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    let compare = |f: fn(i64, i64) -> bool| match (value.and_then(number), values.first()) {
        (Some(v), Some(bound)) => number(bound).is_some_and(|b| f(v, b)),
        _ => false,
    };
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => !value.is_some_and(|v| values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => compare(|v, b| v > b),
        "Lt" => compare(|v, b| v < b),
        _ => false,
    }
}

/// Why a GET got no object and no "not found" either.
#[derive(Debug)]
struct GetError {
    /// 401: the caller's account no longer authenticates (deleted).
    unauthorized: bool,
    /// 403: the account exists and may not read this (its rights are gone,
    /// or never were).
    forbidden: bool,
    reason: String,
}

/// A GET within [`API_BUDGET`]: `None` when the object is not there.
async fn get_within<K>(api: &Api<K>, name: &str) -> Result<Option<K>, GetError>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    within_budget(api.get_opt(name)).await.map_err(|e| {
        let code = match &e {
            kube::Error::Api(s) => s.code,
            _ => 0,
        };
        GetError {
            unauthorized: code == 401,
            forbidden: code == 403,
            reason: format!("{name}: {e}"),
        }
    })
}

/// For objects the agent's own account reads: a 401 means that account is
/// gone, as after an uninstall, so the object counts as gone too.
fn unauthorized_is_gone<K>(e: GetError) -> Result<Option<K>, GetError> {
    if e.unauthorized {
        Ok(None)
    } else {
        Err(e)
    }
}
