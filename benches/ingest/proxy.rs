//! The full push into a real proxy: the `ambit` binary, dedicated, in a
//! lab pod, takes a whole mesh from this bench's delta xDS server off a
//! socket, as it takes istiod's. The proxy process's own peak RSS
//! (VmHWM), everything it held on the way included: the encoded message
//! as received, what was decoded of it, the state. The time from the
//! proxy's start to ready (its first push of both types applied), which
//! includes this bench's server copying and encoding the push on the same
//! CPUs, and the proxy's own timings of the addresses' response from its
//! debug line: how long it took to arrive, and to apply.

use std::sync::Arc;
use std::time::Instant;

use ambit::lab::{write_ca, Lab};

use super::churn::{lab_workload, proxy_spec, serve, Source};
use super::{policy, resource, response, service, workload, ADDRESS, AUTHORIZATION};

/// The kB figure of `field` (`VmHWM`, `VmRSS`) in `/proc/<pid>/status`.
fn status_kb(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// One proxy takes a mesh of `workloads` workloads (services a tenth,
/// policies a hundredth, the proxy's own pod among the workloads).
pub fn proxy_push(workloads: usize) {
    let (services, policies) = ((workloads / 10).max(1), (workloads / 100).max(1));
    println!("\n== the full push of {workloads} workloads into a real proxy ==");
    // Another build of the proxy, to compare two in one sitting.
    let binary = std::env::var("AMBIT_INGEST_BINARY")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_ambit").to_string());
    let mut lab = Lab::new("ingest-push", &binary).expect("lab (run as root)");
    let ca = write_ca(&lab.dir, "ca", "cluster.local").unwrap();
    let pod = lab.add_pod("client").unwrap();
    let mut addresses: Vec<_> = (0..workloads)
        .map(|i| workload(i, services, "v1"))
        .chain((0..services).map(service))
        .map(|(name, body)| resource(ADDRESS, name, body))
        .collect();
    addresses.push(lab_workload(&pod));
    let source = Source {
        push: Arc::new(response(ADDRESS, addresses)),
        policies: Arc::new(response(
            AUTHORIZATION,
            (0..policies)
                .map(policy)
                .map(|(name, body)| resource(AUTHORIZATION, name, body))
                .collect(),
        )),
        updates: tokio::sync::broadcast::channel(1).0,
    };
    let encoded = prost::Message::encoded_len(&*source.push);
    let runtime = serve(&lab, source);
    let mut spec = proxy_spec(&lab, &pod, &ca);
    // The push is one response, as istiod sends it: above the default
    // limit (256 MiB) at a million workloads.
    spec.extra_env.push((
        "AMBIT_XDS_MAX_MESSAGE_SIZE".into(),
        (encoded + (1 << 20)).max(256 << 20).to_string(),
    ));
    // The client's line for each response applied, with its timings.
    spec.extra_env
        .push(("RUST_LOG".into(), "info,ambit::xds::client=debug".into()));
    let t = Instant::now();
    let binary = std::path::PathBuf::from(binary);
    lab.start_proxy_waiting(&binary, &pod, &spec, std::time::Duration::from_secs(300))
        .expect("proxy ready");
    let ready = t.elapsed();
    let pid = lab.pid("proxy-client").expect("the proxy's pid");
    let (peak, now) = (status_kb(pid, "VmHWM"), status_kb(pid, "VmRSS"));
    runtime.shutdown_background();
    let log = std::fs::read_to_string(lab.log_path("proxy-client")).unwrap_or_default();
    // A build that logs no timings prints "-" for them, not a zero.
    let push = log
        .lines()
        .find(|l| l.contains("xDS response applied") && l.contains(ADDRESS));
    let field = |name: &str| -> String {
        push.and_then(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
                .map(str::to_string)
        })
        .unwrap_or_else(|| "-".into())
    };
    let (received, applied) = (field("received_ms"), field("applied_ms"));
    println!(
        "ready in {:.2} s; the addresses' response ({:.0} MB encoded) arrived in {received} ms \
         and was applied in {applied} ms; the proxy's peak RSS {:.0} MB, {:.0} MB once ready",
        ready.as_secs_f64(),
        encoded as f64 / (1024.0 * 1024.0),
        peak as f64 / 1024.0,
        now as f64 / 1024.0
    );
    println!(
        "ingest: proxy workloads={workloads} ready_ms={} received_ms={received} \
         applied_ms={applied} proxy_peak_rss_mb={:.0} proxy_rss_mb={:.0}",
        ready.as_millis(),
        peak as f64 / 1024.0,
        now as f64 / 1024.0
    );
}
