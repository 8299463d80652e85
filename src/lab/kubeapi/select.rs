//! What a list or watch asks for, as kube-apiserver reads it: field
//! selectors on the fields the stand-in knows (`metadata.name`,
//! `metadata.namespace`, and a pod's `spec.nodeName`), and equality or
//! existence label selectors. Anything else is refused with 400, never
//! silently ignored: a client that relies on it would otherwise pass here
//! and fail against a real server, or the other way round.

use serde_json::Value;

use super::Kind;

/// One requirement on an object.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    /// A field (`metadata.name`, ...) equals (or, `false`, differs from) a value.
    Field(&'static str, String, bool),
    /// A label equals (or differs from) a value.
    Label(String, String, bool),
    /// A label is set (or, `false`, not).
    Has(String, bool),
}

/// Every requirement of a request's `fieldSelector` and `labelSelector`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector(Vec<Requirement>);

/// The fields a selector may name, per kind, with where they are.
fn field(kind: Kind, name: &str) -> Option<&'static str> {
    match (kind, name) {
        (_, "metadata.name") => Some("metadata.name"),
        (Kind::Pod | Kind::DaemonSet, "metadata.namespace") => Some("metadata.namespace"),
        (Kind::Pod, "spec.nodeName") => Some("spec.nodeName"),
        _ => None,
    }
}

fn at<'v>(obj: &'v Value, path: &str) -> &'v Value {
    path.split('.').fold(obj, |v, k| &v[k])
}

/// `a=b`, `a==b` or `a!=b`: the key, the value and whether it is equality.
fn term(t: &str) -> Option<(&str, &str, bool)> {
    if let Some((k, v)) = t.split_once("!=") {
        return Some((k.trim(), v.trim(), false));
    }
    let (k, v) = t.split_once("==").or_else(|| t.split_once('='))?;
    Some((k.trim(), v.trim(), true))
}

impl Selector {
    /// Reads `fieldSelector` and `labelSelector`; the error is the message
    /// of a 400.
    pub fn parse(kind: Kind, fields: Option<&str>, labels: Option<&str>) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for t in fields
            .unwrap_or("")
            .split(',')
            .filter(|t| !t.trim().is_empty())
        {
            let Some((k, v, eq)) = term(t) else {
                return Err(format!(
                    "invalid field selector: {t:?}: expected key=value or key!=value"
                ));
            };
            let Some(path) = field(kind, k) else {
                return Err(format!("field label not supported: {k}"));
            };
            reqs.push(Requirement::Field(path, v.to_string(), eq));
        }
        let labels = labels.unwrap_or("");
        if labels.contains('(') {
            return Err(format!(
                "unable to parse requirement: set-based label selectors ({labels:?}) are not served by this stand-in"
            ));
        }
        for t in labels.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let (key, req) = match (term(t), t.strip_prefix('!')) {
                (Some((k, v, eq)), _) => (k, Requirement::Label(k.into(), v.into(), eq)),
                (None, Some(k)) => (k.trim(), Requirement::Has(k.trim().into(), false)),
                (None, None) => (t, Requirement::Has(t.into(), true)),
            };
            let valid = !key.is_empty()
                && key
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b));
            if !valid {
                return Err(format!(
                    "unable to parse requirement: invalid label key {key:?}"
                ));
            }
            reqs.push(req);
        }
        Ok(Selector(reqs))
    }

    /// The pod's node, when the selector names one (the stand-in's
    /// request log shows it).
    pub fn node(&self) -> Option<&str> {
        self.0.iter().find_map(|r| match r {
            Requirement::Field("spec.nodeName", v, true) => Some(v.as_str()),
            _ => None,
        })
    }

    pub fn matches(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        self.0.iter().all(|r| match r {
            Requirement::Field(path, v, eq) => (at(obj, path).as_str().unwrap_or("") == v) == *eq,
            Requirement::Label(k, v, eq) => {
                (labels[k.as_str()].as_str() == Some(v.as_str())) == *eq
            }
            Requirement::Has(k, has) => labels.get(k.as_str()).is_some() == *has,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn selectors_select_and_what_is_not_served_is_refused() {
        let pod = json!({"metadata": {"name": "a", "namespace": "default", "labels": {"app": "web"}},
                         "spec": {"nodeName": "n1"}});
        let sel = |f: &str, l: &str| Selector::parse(Kind::Pod, Some(f), Some(l));
        assert!(sel("spec.nodeName=n1", "").unwrap().matches(&pod));
        assert!(!sel("spec.nodeName=n2", "").unwrap().matches(&pod));
        assert!(sel("spec.nodeName!=n2,metadata.name==a", "app=web")
            .unwrap()
            .matches(&pod));
        assert!(sel("", "app").unwrap().matches(&pod));
        assert!(!sel("", "!app").unwrap().matches(&pod));
        assert!(!sel("", "app!=web").unwrap().matches(&pod));
        assert_eq!(sel("spec.nodeName=n1", "").unwrap().node(), Some("n1"));
        assert_eq!(
            sel("status.phase=Running", "").unwrap_err(),
            "field label not supported: status.phase"
        );
        assert!(sel("", "app in (web,api)").is_err());
        assert!(Selector::parse(Kind::Namespace, Some("spec.nodeName=n1"), None).is_err());
    }
}
