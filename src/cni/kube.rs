//! Kubernetes enrollment: the agent watches its node's pods and every
//! namespace, decides enrollment from labels the way Istio ambient does, and
//! marks captured pods with the `ambient.istio.io/redirection` annotation.
//!
//! The decision itself ([`should_enroll`]) is pure; [`Cluster`] keeps the
//! watched objects in memory (kube-runtime reflectors, which relist on 410
//! Gone) and wakes the agent on every change.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use crate::backoff::Backoff;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;
use kube::Client;
use serde_json::json;

mod standing;
#[cfg(test)]
use standing::schedules_on;

/// Label on a namespace or pod: `ambient` enrolls, `none` (on a pod) opts out.
pub const DATAPLANE_MODE: &str = "istio.io/dataplane-mode";
/// Annotation the agent sets (via `pods/status`) on the pods it captured.
pub const REDIRECTION: &str = "ambient.istio.io/redirection";
/// Annotation of a pod that has an Istio sidecar; such pods are never enrolled.
pub const SIDECAR_STATUS: &str = "sidecar.istio.io/status";

/// A pod the agent should hold, as the API describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub ips: Vec<IpAddr>,
    /// Per-pod changes to the node's redirection rules.
    pub overrides: RuleOverrides,
}

/// What a pod's annotations change in its redirection rules, as in Istio:
/// `ambient.istio.io/dns-capture: "false"` keeps its DNS away from the
/// proxy, `ambient.istio.io/bypass-inbound-capture: "true"` leaves its
/// inbound traffic alone, and `istio.io/reroute-virtual-interfaces:
/// "a,b"` sends TCP arriving on those interfaces (a VM's) to the proxy as
/// outbound traffic.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RuleOverrides {
    #[serde(default)]
    pub no_dns_capture: bool,
    #[serde(default)]
    pub bypass_inbound: bool,
    #[serde(default)]
    pub virtual_interfaces: Vec<String>,
}

impl RuleOverrides {
    pub fn of(pod: &Pod) -> Self {
        let annotation = |k: &str| {
            pod.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(k))
                .map(String::as_str)
        };
        RuleOverrides {
            no_dns_capture: annotation("ambient.istio.io/dns-capture") == Some("false"),
            bypass_inbound: annotation("ambient.istio.io/bypass-inbound-capture") == Some("true"),
            virtual_interfaces: annotation("istio.io/reroute-virtual-interfaces")
                .map(crate::config::parse_list)
                .unwrap_or_default(),
        }
    }

    /// The node's options with this pod's changes.
    pub fn apply(
        &self,
        mut opts: super::redirect::RedirectOptions,
    ) -> super::redirect::RedirectOptions {
        opts.dns_capture &= !self.no_dns_capture;
        opts.bypass_inbound |= self.bypass_inbound;
        opts.virtual_interfaces = self.virtual_interfaces.clone();
        opts
    }
}

fn label<'a>(labels: &'a Option<BTreeMap<String, String>>, key: &str) -> Option<&'a str> {
    labels.as_ref()?.get(key).map(String::as_str)
}

/// Istio ambient's default selector: the pod labelled `ambient`, or its
/// namespace labelled `ambient` and the pod not labelled `none`. Pods on the
/// host network or with a sidecar never match.
pub fn selected(pod: &Pod, namespace: Option<&Namespace>) -> bool {
    if pod
        .spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false)
    {
        return false;
    }
    let annotated = pod.metadata.annotations.as_ref();
    if annotated.is_some_and(|a| a.contains_key(SIDECAR_STATUS)) {
        return false;
    }
    match label(&pod.metadata.labels, DATAPLANE_MODE) {
        Some("ambient") => true,
        Some("none") => false,
        _ => {
            namespace.is_some_and(|n| label(&n.metadata.labels, DATAPLANE_MODE) == Some("ambient"))
        }
    }
}

/// Whether the pod has finished for good (its netns is about to go).
pub fn terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// The whole rule: not in an excluded namespace, not finished, selected.
pub fn should_enroll(pod: &Pod, namespace: Option<&Namespace>, excluded: &[String]) -> bool {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    !excluded.iter().any(|e| e == ns) && !terminal(pod) && selected(pod, namespace)
}

/// The pod's IPs from its status (`podIPs`, else `podIP`).
pub fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(status) = &pod.status else {
        return Vec::new();
    };
    let listed = status
        .pod_ips
        .iter()
        .flatten()
        .filter_map(|p| p.ip.parse().ok());
    let single = status.pod_ip.iter().filter_map(|p| p.parse().ok());
    let mut ips: Vec<IpAddr> = Vec::new();
    for ip in listed.chain(single) {
        if !ips.contains(&ip) {
            ips.push(ip);
        }
    }
    ips
}

/// The pod as the agent records it.
pub fn wanted(pod: &Pod) -> Wanted {
    let m = &pod.metadata;
    Wanted {
        uid: m.uid.clone().unwrap_or_default(),
        name: m.name.clone().unwrap_or_default(),
        namespace: m.namespace.clone().unwrap_or_else(|| "default".into()),
        service_account: pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "default".into()),
        ips: pod_ips(pod),
        overrides: RuleOverrides::of(pod),
    }
}

/// The value of the pod's redirection annotation, if any.
pub fn redirection(pod: &Pod) -> Option<&str> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(REDIRECTION)
        .map(String::as_str)
}

/// The node's pods and all namespaces, kept current by watches.
pub struct Cluster {
    client: Client,
    /// This node's name.
    node: String,
    pods: Store<Pod>,
    namespaces: Store<Namespace>,
    /// Notified on every watch event; the agent reconciles after it.
    pub changed: Arc<tokio::sync::Notify>,
}

impl Cluster {
    /// Connects (KUBECONFIG or the in-cluster service account), starts the
    /// watches and waits until both have listed once.
    pub async fn start(node: &str) -> anyhow::Result<Arc<Cluster>> {
        anyhow::ensure!(
            !node.is_empty(),
            "node_name (NODE_NAME) must be set to enroll pods from Kubernetes"
        );
        let client = Client::try_default()
            .await
            .context("Kubernetes client (from KUBECONFIG or the in-cluster service account)")?;
        let changed = Arc::new(tokio::sync::Notify::new());
        let (pods, writer) = reflector::store();
        let on_node = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let stream =
            reflector::reflector(writer, watcher(Api::<Pod>::all(client.clone()), on_node));
        tokio::spawn(follow(stream, changed.clone(), "pods"));
        let (namespaces, writer) = reflector::store();
        let stream = reflector::reflector(
            writer,
            watcher(Api::<Namespace>::all(client.clone()), Default::default()),
        );
        tokio::spawn(follow(stream, changed.clone(), "namespaces"));
        let synced = async {
            pods.wait_until_ready().await?;
            namespaces.wait_until_ready().await
        };
        tokio::select! {
            r = synced => r.context("watch ended before its first list")?,
            _ = async {
                loop {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    tracing::warn!("still waiting for the first list of pods and namespaces from the API server");
                }
            } => {}
        }
        tracing::info!(
            node,
            pods = pods.state().len(),
            "Kubernetes pods and namespaces synced"
        );
        Ok(Arc::new(Cluster {
            client,
            node: node.to_string(),
            pods,
            namespaces,
            changed,
        }))
    }

    fn namespace(&self, name: &str) -> Option<Arc<Namespace>> {
        self.namespaces.get(&ObjectRef::new(name))
    }

    /// The watched pod `namespace/name`.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Arc<Pod>> {
        self.pods.get(&ObjectRef::new(name).within(namespace))
    }

    /// Every watched pod.
    pub fn pods(&self) -> Vec<Arc<Pod>> {
        self.pods.state()
    }

    /// Whether the watched pod should be enrolled.
    pub fn should_enroll(&self, pod: &Pod, excluded: &[String]) -> bool {
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        should_enroll(pod, self.namespace(ns).as_deref(), excluded)
    }

    /// The pod a CNI ADD names, with whether it should be enrolled. The
    /// watch usually has it already (the pod is bound to the node before its
    /// sandbox is made); otherwise the API is asked directly.
    /// A pod whose uid is not `uid` (when the runtime gave one) is a stale
    /// predecessor of the same name, not this pod.
    pub async fn lookup(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        excluded: &[String],
    ) -> Result<Option<(Pod, bool)>, kube::Error> {
        let same = |p: &Pod| uid.is_empty() || p.metadata.uid.as_deref() == Some(uid);
        for _ in 0..10 {
            if let Some(pod) = self.pod(namespace, name).filter(|p| same(p)) {
                let enroll = self.should_enroll(&pod, excluded);
                return Ok(Some(((*pod).clone(), enroll)));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let Some(pod) = self.get_pod(namespace, name).await?.filter(|p| same(p)) else {
            return Ok(None);
        };
        let ns = match self.namespace(namespace) {
            Some(ns) => Some((*ns).clone()),
            None => {
                within_budget(Api::<Namespace>::all(self.client.clone()).get_opt(namespace)).await?
            }
        };
        let enroll = should_enroll(&pod, ns.as_ref(), excluded);
        Ok(Some((pod, enroll)))
    }

    /// The pod as the API server has it now (bypassing the watch).
    pub async fn get_pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>, kube::Error> {
        within_budget(Api::<Pod>::namespaced(self.client.clone(), namespace).get_opt(name)).await
    }

    /// Sets (`Some`) or removes (`None`) the redirection annotation with a
    /// merge patch on `pods/status`. A pod that is gone is not an error.
    pub async fn annotate(
        &self,
        namespace: &str,
        name: &str,
        value: Option<&str>,
    ) -> Result<(), kube::Error> {
        let patch = json!({"metadata": {"annotations": {REDIRECTION: value}}});
        let api = Api::<Pod>::namespaced(self.client.clone(), namespace);
        match within_budget(api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// How long one request to the API server may take. The client sets no
/// read timeout (it serves long-lived streams too), so a request sent to
/// a server that never answers waits forever; a request the agent waits
/// on (a CNI ADD's lookup, a reconcile pass, the exit) must fail well
/// before the kubelet's grace period (30 s) ends, or the agent is killed
/// in the middle of its exit.
pub const API_BUDGET: Duration = Duration::from_secs(5);

/// `request` if the API server answers within [`API_BUDGET`], an error
/// that says so if not.
async fn within_budget<T>(
    request: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, kube::Error> {
    match tokio::time::timeout(API_BUDGET, request).await {
        Ok(answer) => answer,
        Err(_) => Err(kube::Error::Service(
            format!("no answer from the API server within {API_BUDGET:?}").into(),
        )),
    }
}

/// First and longest wait before a failed list or watch is tried again (as
/// kube-rs's and client-go's defaults).
const WATCH_RETRY: (Duration, Duration) = (Duration::from_millis(800), Duration::from_secs(30));

/// A watch refused with 410 Gone (its resourceVersion is older than the API
/// server's watch cache, as after the server restarted) lists again at once
/// if the last such came longer ago than this; sooner, it backs off like any
/// failure, so a server answering 410 to every watch is not listed in a loop.
const GONE_RELIST_EVERY: Duration = Duration::from_secs(30);

/// How long to wait before the watch is tried again after `error`: nothing
/// for a 410 Gone when the last came more than [`GONE_RELIST_EVERY`] ago
/// (a relist is the remedy, not a wait), else the next backoff delay.
fn watch_retry_delay(
    error: &watcher::Error,
    backoff: &mut Backoff,
    last_gone: &mut Option<std::time::Instant>,
    now: std::time::Instant,
) -> Duration {
    let gone = matches!(error, watcher::Error::WatchError(s) if s.code == 410);
    if gone && last_gone.is_none_or(|t| now.duration_since(t) >= GONE_RELIST_EVERY) {
        *last_gone = Some(now);
        return Duration::ZERO;
    }
    backoff.next_delay()
}

/// Drives a watch stream, waking the reconciler on every change. Failures
/// are retried after a backoff (reset by any event), except a 410 Gone,
/// which lists again at once: without that, a flip of a pod's label made
/// while the API server restarted waited out the backoff of the failed
/// connects before it (5.5 to 7.3 s in the soak).
async fn follow<S, K>(stream: S, changed: Arc<tokio::sync::Notify>, what: &'static str)
where
    S: futures_util::Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let mut stream = std::pin::pin!(stream);
    let mut backoff = Backoff::new(WATCH_RETRY.0, WATCH_RETRY.1);
    let mut last_gone = None;
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Init) => {
                backoff.reset();
                tracing::debug!(what, "listing")
            }
            Ok(_) => {
                backoff.reset();
                changed.notify_one()
            }
            Err(e) => {
                let delay =
                    watch_retry_delay(&e, &mut backoff, &mut last_gone, std::time::Instant::now());
                tracing::warn!(what, error = %e, ?delay, "watch failed; retrying");
                tokio::time::sleep(delay).await;
            }
        }
    }
    tracing::error!(what, "watch stream ended");
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{Node, PodSpec};

    use super::*;

    #[test]
    fn a_410_gone_lists_again_at_once_but_not_in_a_loop_and_other_failures_back_off() {
        let gone = || {
            let mut s = kube::core::Status::failure("too old resource version", "Expired");
            s.code = 410;
            watcher::Error::WatchError(Box::new(s))
        };
        let refused = || watcher::Error::NoResourceVersion;
        let mut backoff = Backoff::new(WATCH_RETRY.0, WATCH_RETRY.1);
        let mut last_gone = None;
        let t0 = std::time::Instant::now();
        // The server was down: connects back off, 0.4 to 1.2 s, then twice that.
        let first = watch_retry_delay(&refused(), &mut backoff, &mut last_gone, t0);
        let second = watch_retry_delay(&refused(), &mut backoff, &mut last_gone, t0);
        assert!(first >= Duration::from_millis(400) && first <= Duration::from_millis(1200));
        assert!(second >= Duration::from_millis(800));
        // Back, it refuses the old resourceVersion: list again now.
        assert_eq!(
            watch_retry_delay(&gone(), &mut backoff, &mut last_gone, t0),
            Duration::ZERO
        );
        // Another 410 soon after backs off instead.
        let t1 = t0 + Duration::from_secs(1);
        assert!(watch_retry_delay(&gone(), &mut backoff, &mut last_gone, t1) > Duration::ZERO);
        // Long after, a 410 lists at once again.
        let t2 = t1 + GONE_RELIST_EVERY;
        assert_eq!(
            watch_retry_delay(&gone(), &mut backoff, &mut last_gone, t2),
            Duration::ZERO
        );
    }

    fn pod(labels: &[(&str, &str)], annotations: &[(&str, &str)], host_network: bool) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": "web-1", "namespace": "shop", "uid": "u1",
                "labels": labels.iter().cloned().collect::<BTreeMap<_, _>>(),
                "annotations": annotations.iter().cloned().collect::<BTreeMap<_, _>>(),
            },
            "spec": {"containers": [], "hostNetwork": host_network, "serviceAccountName": "web"},
            "status": {"phase": "Running", "podIP": "10.0.0.5", "podIPs": [{"ip": "10.0.0.5"}, {"ip": "fd00::5"}]},
        }))
        .expect("pod")
    }

    fn ns(labels: &[(&str, &str)]) -> Namespace {
        serde_json::from_value(json!({"metadata": {
            "name": "shop",
            "labels": labels.iter().cloned().collect::<BTreeMap<_, _>>(),
        }}))
        .expect("namespace")
    }

    #[test]
    fn labels_decide_enrollment_as_istio_ambient_does() {
        let ambient = ns(&[(DATAPLANE_MODE, "ambient")]);
        let plain = ns(&[]);
        let cases = [
            (pod(&[], &[], false), Some(&ambient), true),
            (pod(&[], &[], false), Some(&plain), false),
            (pod(&[], &[], false), None, false),
            (
                pod(&[(DATAPLANE_MODE, "none")], &[], false),
                Some(&ambient),
                false,
            ),
            (
                pod(&[(DATAPLANE_MODE, "ambient")], &[], false),
                Some(&plain),
                true,
            ),
            (
                pod(&[(DATAPLANE_MODE, "other")], &[], false),
                Some(&ambient),
                true,
            ),
            (
                pod(&[(DATAPLANE_MODE, "ambient")], &[], true),
                Some(&ambient),
                false,
            ),
            (
                pod(
                    &[(DATAPLANE_MODE, "ambient")],
                    &[(SIDECAR_STATUS, "{}")],
                    false,
                ),
                Some(&ambient),
                false,
            ),
        ];
        for (i, (p, n, want)) in cases.iter().enumerate() {
            assert_eq!(selected(p, *n), *want, "case {i}");
        }
    }

    #[test]
    fn excluded_and_finished_pods_are_never_enrolled() {
        let ambient = ns(&[(DATAPLANE_MODE, "ambient")]);
        let p = pod(&[], &[], false);
        assert!(should_enroll(&p, Some(&ambient), &["kube-system".into()]));
        assert!(!should_enroll(&p, Some(&ambient), &["shop".into()]));
        let mut done = p.clone();
        done.status.as_mut().expect("status").phase = Some("Succeeded".into());
        assert!(!should_enroll(&done, Some(&ambient), &[]));
    }

    #[test]
    fn wanted_takes_identity_and_addresses_from_the_pod() {
        let w = wanted(&pod(&[], &[(REDIRECTION, "enabled")], false));
        assert_eq!(
            (
                w.uid.as_str(),
                w.namespace.as_str(),
                w.service_account.as_str()
            ),
            ("u1", "shop", "web")
        );
        assert_eq!(
            w.ips,
            vec![
                "10.0.0.5".parse::<IpAddr>().expect("ip"),
                "fd00::5".parse().expect("ip")
            ]
        );
        assert_eq!(
            redirection(&pod(&[], &[(REDIRECTION, "enabled")], false)),
            Some("enabled")
        );
    }

    #[test]
    fn a_daemonset_schedules_on_a_node_by_selector_and_required_affinity() {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "node-a", "labels": {"pool": "mesh", "gen": "5"}}
        }))
        .unwrap();
        let on = |spec: serde_json::Value| {
            let spec: PodSpec = serde_json::from_value(spec).unwrap();
            schedules_on(Some(&spec), &node)
        };
        let term = |exprs: serde_json::Value| {
            json!({"containers": [], "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": exprs}}}})
        };
        assert!(schedules_on(None, &node));
        assert!(on(json!({"containers": []})));
        assert!(on(
            json!({"containers": [], "nodeSelector": {"pool": "mesh"}})
        ));
        assert!(!on(
            json!({"containers": [], "nodeSelector": {"pool": "other"}})
        ));
        assert!(!on(
            json!({"containers": [], "nodeSelector": {"zone": "a"}})
        ));
        let expr = |key: &str, op: &str, values: &[&str]| {
            term(json!([{"matchExpressions": [{"key": key, "operator": op, "values": values}]}]))
        };
        assert!(on(expr("pool", "In", &["x", "mesh"])));
        assert!(!on(expr("pool", "NotIn", &["mesh"])));
        assert!(
            on(expr("zone", "NotIn", &["a"])),
            "NotIn holds for a missing label"
        );
        assert!(on(expr("pool", "Exists", &[])));
        assert!(on(expr("zone", "DoesNotExist", &[])));
        assert!(on(expr("gen", "Gt", &["4"])));
        assert!(!on(expr("gen", "Lt", &["5"])));
        assert!(!on(expr("pool", "Gt", &["1"])), "Gt on a non-number");
        // Terms are ORed, an empty term matches nothing, fields match the name.
        assert!(on(term(json!([
            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["x"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}
        ]))));
        assert!(!on(term(json!([{}]))));
        assert!(!on(term(json!([
            {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node-a"]}]}
        ]))));
    }

    #[test]
    fn annotations_change_the_pods_rules_as_in_istio() {
        use super::super::redirect::RedirectOptions;
        let node = RedirectOptions::default();
        let plain = RuleOverrides::of(&pod(&[], &[], false));
        assert_eq!(plain, RuleOverrides::default());
        assert_eq!(plain.apply(node.clone()), node);
        let o = RuleOverrides::of(&pod(
            &[],
            &[
                ("ambient.istio.io/dns-capture", "false"),
                ("ambient.istio.io/bypass-inbound-capture", "true"),
            ],
            false,
        ));
        let got = o.apply(node.clone());
        assert!(!got.dns_capture && got.bypass_inbound && got.ipv6);
        let vms = RuleOverrides::of(&pod(
            &[],
            &[("istio.io/reroute-virtual-interfaces", " vm0, ,kv1 ")],
            false,
        ));
        assert_eq!(
            vms.apply(node.clone()).virtual_interfaces,
            ["vm0", "kv1"],
            "trimmed, empty entries skipped"
        );
        // An annotation cannot turn DNS capture on where the node has it off.
        let off = RedirectOptions {
            dns_capture: false,
            ..node
        };
        let on = RuleOverrides::of(&pod(
            &[],
            &[("ambient.istio.io/dns-capture", "true")],
            false,
        ));
        assert!(!on.apply(off).dns_capture);
    }
}
