//! Installing the plugin on the host: `ambit-cni` copied atomically into the
//! CNI bin dir, and our entry appended last to the first valid config in the
//! CNI conf dir (a `.conf` becomes a `.conflist`), written atomically with its
//! mode kept. Also the check the agent's repair loop runs, and uninstall.
//!
//! The conflist edit itself ([`insert_entry`], [`remove_entry`]) is pure.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// Plugin type and file name of our binary.
pub const PLUGIN_TYPE: &str = "ambit-cni";

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{path}: {reason}")]
    Io { path: PathBuf, reason: String },
    #[error("{path}: not a valid CNI config: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("no CNI config in {0} yet (waiting for the primary CNI)")]
    NoPrimary(PathBuf),
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> InstallError + '_ {
    move |e| InstallError::Io {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

/// The primary network as a conflist, with our entry last (any older one removed).
/// `is_conf` says the input is a single-plugin `.conf`.
pub fn insert_entry(config: &Value, is_conf: bool, entry: &Value) -> Result<Value, String> {
    let mut list = if is_conf {
        let obj = config.as_object().ok_or("expected a JSON object")?;
        if !obj.contains_key("type") {
            return Err("a .conf needs a \"type\"".into());
        }
        json!({
            "cniVersion": obj.get("cniVersion").cloned().unwrap_or(json!("0.3.1")),
            "name": obj.get("name").cloned().unwrap_or(json!("k8s-pod-network")),
            "plugins": [config.clone()],
        })
    } else {
        config.clone()
    };
    let plugins = list
        .get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or("a .conflist needs a \"plugins\" list")?;
    if plugins.is_empty() {
        return Err("\"plugins\" is empty".into());
    }
    plugins.retain(|p| p.get("type").and_then(Value::as_str) != Some(PLUGIN_TYPE));
    plugins.push(entry.clone());
    Ok(list)
}

/// The conflist without our entry.
pub fn remove_entry(config: &Value) -> Value {
    let mut c = config.clone();
    if let Some(plugins) = c.get_mut("plugins").and_then(Value::as_array_mut) {
        plugins.retain(|p| p.get("type").and_then(Value::as_str) != Some(PLUGIN_TYPE));
    }
    c
}

/// Whether the conflist ends with our entry equal to `entry`.
pub fn has_entry(config: &Value, entry: &Value) -> bool {
    config
        .get("plugins")
        .and_then(Value::as_array)
        .and_then(|p| p.last())
        == Some(entry)
}

/// The lexically first valid `.conf`/`.conflist` in `dir`.
pub fn primary_config(dir: &Path) -> Result<(PathBuf, Value, bool), InstallError> {
    let mut names: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("conf" | "conflist" | "json")
            )
        })
        .collect();
    names.sort();
    for path in names {
        let Ok(text) = fs::read_to_string(&path) else {
            continue;
        };
        let Ok(value) = serde_json::from_str::<Value>(&text) else {
            continue;
        };
        let is_conf = value.get("plugins").is_none();
        if insert_entry(&value, is_conf, &json!({"type": PLUGIN_TYPE})).is_ok() {
            return Ok((path, value, is_conf));
        }
    }
    Err(InstallError::NoPrimary(dir.to_path_buf()))
}

/// Writes `contents` to `path` through a temporary file and a rename, with `mode`.
pub fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> Result<(), InstallError> {
    // An unpredictable name, created exclusively (O_EXCL: an existing file
    // or symlink there is never opened), so nobody who can write the
    // directory can make this root process write through a planted link.
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("ambit");
    let (tmp, mut f) = (0..8)
        .find_map(|_| {
            let tmp = path.with_file_name(format!(".{name}.{:016x}.tmp", fastrand::u64(..)));
            let opened = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&tmp);
            match opened {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => None,
                other => Some(other.map(|f| (tmp.clone(), f)).map_err(io_err(&tmp))),
            }
        })
        .unwrap_or_else(|| {
            Err(io_err(path)(std::io::Error::other(
                "no free temporary name",
            )))
        })?;
    let written = f
        .write_all(contents)
        .and_then(|_| f.sync_all())
        .map_err(io_err(&tmp))
        .and_then(|_| {
            fs::set_permissions(&tmp, fs::Permissions::from_mode(mode)).map_err(io_err(&tmp))
        })
        .and_then(|_| fs::rename(&tmp, path).map_err(io_err(path)));
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

/// [`write_atomic`] unless `path` already holds exactly `contents`.
pub fn write_if_changed(path: &Path, contents: &[u8], mode: u32) -> Result<(), InstallError> {
    if fs::read(path).is_ok_and(|old| old == contents) {
        return Ok(());
    }
    write_atomic(path, contents, mode)
}

/// Installs (or repairs) the binary and the conflist entry. Returns whether anything changed.
pub fn install(
    bin_dir: &Path,
    conf_dir: &Path,
    binary: &Path,
    entry: &Value,
) -> Result<bool, InstallError> {
    let mut changed = false;
    let target = bin_dir.join(PLUGIN_TYPE);
    let src_len = fs::metadata(binary).map_err(io_err(binary))?.len();
    if fs::metadata(&target).map(|m| m.len()).ok() != Some(src_len) {
        fs::create_dir_all(bin_dir).map_err(io_err(bin_dir))?;
        let bytes = fs::read(binary).map_err(io_err(binary))?;
        write_atomic(&target, &bytes, 0o755)?;
        changed = true;
    }
    let (path, value, is_conf) = primary_config(conf_dir)?;
    if is_conf || !has_entry(&value, entry) {
        let list =
            insert_entry(&value, is_conf, entry).map_err(|reason| InstallError::Invalid {
                path: path.clone(),
                reason,
            })?;
        let mode = fs::metadata(&path)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0o644);
        let out = if is_conf {
            path.with_extension("conflist")
        } else {
            path.clone()
        };
        let text = serde_json::to_string_pretty(&list).map_err(|e| InstallError::Invalid {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        write_atomic(&out, text.as_bytes(), mode)?;
        if out != path {
            fs::remove_file(&path).map_err(io_err(&path))?;
        }
        changed = true;
    }
    Ok(changed)
}

/// Removes our entry and binary (a clean uninstall).
pub fn uninstall(bin_dir: &Path, conf_dir: &Path) -> Result<(), InstallError> {
    if let Ok((path, value, false)) = primary_config(conf_dir) {
        let mode = fs::metadata(&path)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0o644);
        let text = serde_json::to_string_pretty(&remove_entry(&value)).unwrap_or_default();
        write_atomic(&path, text.as_bytes(), mode)?;
    }
    let target = bin_dir.join(PLUGIN_TYPE);
    match fs::remove_file(&target) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err(&target)(e)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_atomic_write_never_follows_a_planted_link_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("ambit-atomic-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        fs::write(&victim, "untouched").unwrap();
        let path = dir.join("10-net.conflist");
        // The name the old code used, and any other guessable one, linked to a victim.
        for guess in [
            format!(".10-net.conflist.tmp.{}", std::process::id()),
            ".10-net.conflist.tmp".into(),
        ] {
            std::os::unix::fs::symlink(&victim, dir.join(guess)).unwrap();
        }
        write_atomic(&path, b"{}", 0o600).unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "untouched");
        assert_eq!(fs::read_to_string(&path).unwrap(), "{}");
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let left: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp") && !n.starts_with(".10-net.conflist.tmp"))
            .collect();
        assert!(left.is_empty(), "temporaries left: {left:?}");
        fs::remove_dir_all(&dir).ok();
    }

    fn entry() -> Value {
        json!({"type": PLUGIN_TYPE, "name": "ambit", "cni_agent_run_dir": "/var/run/ambit"})
    }

    #[test]
    fn appends_last_and_replaces_an_old_entry() {
        let list = json!({"cniVersion": "1.0.0", "name": "net", "plugins": [{"type": "bridge"}, {"type": PLUGIN_TYPE, "old": true}, {"type": "portmap"}]});
        let out = insert_entry(&list, false, &entry()).unwrap();
        let types: Vec<&str> = out["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap())
            .collect();
        assert_eq!(types, ["bridge", "portmap", PLUGIN_TYPE]);
        assert!(has_entry(&out, &entry()));
        assert_eq!(
            insert_entry(&out, false, &entry()).unwrap(),
            out,
            "idempotent"
        );
        assert!(!has_entry(&remove_entry(&out), &entry()));
    }

    #[test]
    fn conf_becomes_conflist() {
        let conf =
            json!({"cniVersion": "0.4.0", "name": "mynet", "type": "bridge", "bridge": "cni0"});
        let out = insert_entry(&conf, true, &entry()).unwrap();
        assert_eq!(out["name"], "mynet");
        assert_eq!(out["cniVersion"], "0.4.0");
        assert_eq!(out["plugins"][0]["bridge"], "cni0");
        assert_eq!(out["plugins"][1], entry());
        assert!(insert_entry(&json!({"name": "x"}), true, &entry()).is_err());
        assert!(insert_entry(&json!({"plugins": []}), false, &entry()).is_err());
    }

    #[test]
    fn install_repairs_and_uninstall_cleans() {
        let dir = std::env::temp_dir().join(format!("ambit-install-{}", std::process::id()));
        let (bin, conf) = (dir.join("bin"), dir.join("net.d"));
        fs::create_dir_all(&conf).unwrap();
        assert!(matches!(
            install(&bin, &conf, &std::env::current_exe().unwrap(), &entry()),
            Err(InstallError::NoPrimary(_))
        ));
        fs::write(
            conf.join("10-bridge.conf"),
            r#"{"cniVersion":"1.0.0","name":"n","type":"bridge"}"#,
        )
        .unwrap();
        fs::set_permissions(
            conf.join("10-bridge.conf"),
            fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        fs::write(conf.join("99-junk.conflist"), "not json").unwrap();
        let exe = std::env::current_exe().unwrap();
        assert!(install(&bin, &conf, &exe, &entry()).unwrap());
        assert!(
            !install(&bin, &conf, &exe, &entry()).unwrap(),
            "second install changes nothing"
        );
        let path = conf.join("10-bridge.conflist");
        assert!(!conf.join("10-bridge.conf").exists());
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600,
            "file mode kept"
        );
        // Another writer drops our entry: the next install repairs it.
        fs::write(
            &path,
            r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"}]}"#,
        )
        .unwrap();
        assert!(install(&bin, &conf, &exe, &entry()).unwrap());
        let v: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        assert!(has_entry(&v, &entry()));
        uninstall(&bin, &conf).unwrap();
        let v: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["plugins"].as_array().unwrap().len(), 1);
        assert!(!bin.join(PLUGIN_TYPE).exists());
        fs::remove_dir_all(&dir).ok();
    }
}
