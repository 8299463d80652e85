//! PATCH as kube-apiserver applies it: the request's content type decides
//! how (merge patch, strategic merge patch, JSON patch); a body that does
//! not decode is 400, a JSON patch that cannot apply is 422, a content
//! type the stand-in does not serve is 415. The `status` subresource
//! changes status and metadata only; the resource itself, all but status.

use http::StatusCode;
use serde_json::Value;

/// RFC 7386: keys set, `null` removes, anything that is not an object
/// replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Some(fields) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    for (k, v) in fields {
        if v.is_null() {
            if let Some(t) = target.as_object_mut() {
                t.remove(k);
            }
        } else {
            merge_patch(&mut target[k.as_str()], v);
        }
    }
}

/// An RFC 6901 pointer's tokens.
fn tokens(pointer: &str) -> Result<Vec<String>, String> {
    if pointer.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = pointer.strip_prefix('/') else {
        return Err(format!("invalid path {pointer:?}"));
    };
    Ok(rest
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn at_path<'v>(doc: &'v mut Value, path: &[String]) -> Result<&'v mut Value, String> {
    let mut at = doc;
    for t in path {
        at = match at {
            Value::Object(m) => m.get_mut(t),
            Value::Array(a) => t.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
            _ => None,
        }
        .ok_or_else(|| format!("path element {t:?} not found"))?;
    }
    Ok(at)
}

fn add(doc: &mut Value, path: &[String], value: Value) -> Result<(), String> {
    let Some((last, up)) = path.split_last() else {
        *doc = value;
        return Ok(());
    };
    match at_path(doc, up)? {
        Value::Object(m) => {
            m.insert(last.clone(), value);
            Ok(())
        }
        Value::Array(a) if last == "-" => {
            a.push(value);
            Ok(())
        }
        Value::Array(a) => match last.parse::<usize>() {
            Ok(i) if i <= a.len() => {
                a.insert(i, value);
                Ok(())
            }
            _ => Err(format!("array index {last:?} out of range")),
        },
        _ => Err("parent is not a container".into()),
    }
}

fn remove(doc: &mut Value, path: &[String]) -> Result<Value, String> {
    let Some((last, up)) = path.split_last() else {
        return Err("cannot remove the whole document".into());
    };
    match at_path(doc, up)? {
        Value::Object(m) => m.remove(last).ok_or_else(|| format!("{last:?} not found")),
        Value::Array(a) => match last.parse::<usize>() {
            Ok(i) if i < a.len() => Ok(a.remove(i)),
            _ => Err(format!("array index {last:?} out of range")),
        },
        _ => Err("parent is not a container".into()),
    }
}

/// RFC 6902, all six operations; the document is changed only if every
/// operation applies.
pub fn json_patch(doc: &mut Value, ops: &[Value]) -> Result<(), String> {
    let mut out = doc.clone();
    for op in ops {
        let path = tokens(op["path"].as_str().ok_or("an operation without a path")?)?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or("an operation without a value")
        };
        let from = || -> Result<Vec<String>, String> {
            tokens(op["from"].as_str().ok_or("an operation without from")?)
        };
        match op["op"].as_str() {
            Some("add") => add(&mut out, &path, value()?)?,
            Some("remove") => {
                remove(&mut out, &path)?;
            }
            Some("replace") => {
                remove(&mut out, &path)?;
                add(&mut out, &path, value()?)?;
            }
            Some("test") => {
                if *at_path(&mut out, &path)? != value()? {
                    return Err(format!("test failed at {:?}", op["path"]));
                }
            }
            Some("move") => {
                let v = remove(&mut out, &from()?)?;
                add(&mut out, &path, v)?;
            }
            Some("copy") => {
                let v = at_path(&mut out, &from()?)?.clone();
                add(&mut out, &path, v)?;
            }
            other => return Err(format!("unknown operation {other:?}")),
        }
    }
    *doc = out;
    Ok(())
}

/// What a PATCH is answered with when it cannot apply: status, reason
/// and message, as kube-apiserver words them.
pub type Refused = (StatusCode, &'static str, String);

/// `current` with the PATCH `body` of `content_type` applied; `status`
/// when the request is for the `status` subresource.
pub fn apply(
    current: &Value,
    content_type: &str,
    body: &[u8],
    status: bool,
) -> Result<Value, Refused> {
    let media = content_type.split(';').next().unwrap_or("").trim();
    let decoded = || {
        serde_json::from_slice::<Value>(body).map_err(|e| {
            (
                StatusCode::BAD_REQUEST,
                "BadRequest",
                format!("error decoding patch: {e}"),
            )
        })
    };
    let mut updated = current.clone();
    match media {
        // Maps merge as in a merge patch; a list is replaced whole (the
        // real server merges lists by their patch merge key).
        "application/merge-patch+json" | "application/strategic-merge-patch+json" => {
            let patch = decoded()?;
            if !patch.is_object() {
                return Err((
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "error decoding patch: a merge patch is a JSON object".into(),
                ));
            }
            merge_patch(&mut updated, &patch);
        }
        "application/json-patch+json" => {
            let Value::Array(ops) = decoded()? else {
                return Err((
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "error decoding patch: a JSON patch is an array of operations".into(),
                ));
            };
            json_patch(&mut updated, &ops)
                .map_err(|e| (StatusCode::UNPROCESSABLE_ENTITY, "Invalid", e))?;
        }
        "application/apply-patch+yaml" => {
            return Err((
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                "server-side apply is not served by this stand-in".into(),
            ))
        }
        _ => {
            return Err((
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                format!("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (got {media:?})"),
            ))
        }
    }
    // What the subresource (or the resource) may not change is put back,
    // as the API server's update strategies do.
    if status {
        for k in ["spec", "apiVersion", "kind"] {
            updated[k] = current[k].clone();
        }
        let meta = &current["metadata"];
        for k in [
            "ownerReferences",
            "deletionTimestamp",
            "name",
            "namespace",
            "uid",
        ] {
            match meta.get(k) {
                Some(v) => updated["metadata"][k] = v.clone(),
                None => {
                    if let Some(m) = updated["metadata"].as_object_mut() {
                        m.remove(k);
                    }
                }
            }
        }
    } else {
        updated["status"] = current["status"].clone();
    }
    Ok(updated)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_sets_and_removes_keys() {
        let mut v = json!({"metadata": {"annotations": {"a": "1", "b": "2"}}});
        merge_patch(
            &mut v,
            &json!({"metadata": {"annotations": {"a": null, "c": "3"}}}),
        );
        assert_eq!(
            v,
            json!({"metadata": {"annotations": {"b": "2", "c": "3"}}})
        );
    }

    #[test]
    fn the_content_type_decides_and_the_status_subresource_keeps_the_spec() {
        let pod = json!({"metadata": {"name": "a", "annotations": {"x": "1"}},
                         "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}});
        let merge = br#"{"metadata": {"annotations": {"y": "2"}}, "spec": {"nodeName": "n2"}}"#;
        let via_status = apply(&pod, "application/merge-patch+json", merge, true).unwrap();
        assert_eq!(
            via_status["metadata"]["annotations"],
            json!({"x": "1", "y": "2"})
        );
        assert_eq!(
            via_status["spec"]["nodeName"], "n1",
            "status keeps the spec"
        );
        let via_pod = apply(
            &pod,
            "application/merge-patch+json",
            br#"{"status": {"phase": "Failed"}}"#,
            false,
        )
        .unwrap();
        assert_eq!(
            via_pod["status"]["phase"], "Running",
            "the resource keeps the status"
        );
        let ops = br#"[{"op": "test", "path": "/metadata/annotations/x", "value": "1"},
                      {"op": "add", "path": "/metadata/annotations/z", "value": "3"},
                      {"op": "remove", "path": "/metadata/annotations/x"}]"#;
        let patched = apply(&pod, "application/json-patch+json", ops, true).unwrap();
        assert_eq!(patched["metadata"]["annotations"], json!({"z": "3"}));
        let failing = br#"[{"op": "test", "path": "/metadata/annotations/x", "value": "2"}]"#;
        assert_eq!(
            apply(&pod, "application/json-patch+json", failing, true)
                .unwrap_err()
                .0,
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(
            apply(&pod, "application/merge-patch+json", b"{not json", true)
                .unwrap_err()
                .0,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            apply(&pod, "application/json", merge, true).unwrap_err().0,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        assert_eq!(
            apply(&pod, "application/apply-patch+yaml", merge, true)
                .unwrap_err()
                .0,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
    }
}
