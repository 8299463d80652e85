//! Calling CNI plugins as a container runtime does, for the tests' pods.

use std::io::{self, Write};
use std::path::Path;
use std::process::Stdio;

use crate::netns::Netns;

/// Runs a CNI conflist for one container exactly as a runtime does: ADD runs
/// the plugins in order, each getting the previous result as `prevResult`
/// (plus the list's `name` and `cniVersion`); DEL runs them in reverse. The
/// plugins run inside `node` (where the bridge lives). Returns the last result.
pub struct CniCall<'a> {
    pub node: &'a Netns,
    pub conflist: &'a serde_json::Value,
    pub cni_path: &'a str,
    pub container_id: &'a str,
    pub netns_path: &'a Path,
    pub cni_args: &'a str,
}

impl CniCall<'_> {
    pub fn run(&self, command: &str) -> io::Result<serde_json::Value> {
        let plugins = self.conflist["plugins"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let ordered: Vec<_> = if command == "DEL" {
            plugins.into_iter().rev().collect()
        } else {
            plugins
        };
        let mut prev: Option<serde_json::Value> = None;
        for plugin in ordered {
            let ty = plugin["type"].as_str().unwrap_or_default().to_string();
            let mut conf = plugin.clone();
            conf["name"] = self.conflist["name"].clone();
            conf["cniVersion"] = self.conflist["cniVersion"].clone();
            if let Some(p) = &prev {
                conf["prevResult"] = p.clone();
            }
            let exe = self
                .cni_path
                .split(':')
                .map(|d| Path::new(d).join(&ty))
                .find(|p| p.exists())
                .ok_or_else(|| {
                    io::Error::other(format!("plugin {ty} not found in {}", self.cni_path))
                })?;
            let mut child = self
                .node
                .command(&exe)
                .env("CNI_COMMAND", command)
                .env("CNI_CONTAINERID", self.container_id)
                .env("CNI_NETNS", self.netns_path)
                .env("CNI_IFNAME", "eth0")
                .env("CNI_PATH", self.cni_path)
                .env("CNI_ARGS", self.cni_args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()?;
            child
                .stdin
                .take()
                .map(|mut i| i.write_all(conf.to_string().as_bytes()))
                .transpose()?;
            let out = child.wait_with_output()?;
            if !out.status.success() {
                return Err(io::Error::other(format!(
                    "{ty} {command} failed ({}): {} {}",
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
            if command == "ADD" {
                prev = Some(
                    serde_json::from_slice(&out.stdout)
                        .map_err(|e| io::Error::other(format!("{ty} result: {e}")))?,
                );
            }
        }
        Ok(prev.unwrap_or(serde_json::Value::Null))
    }
}
