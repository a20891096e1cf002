//! E2B's `network.rules`: per host (a domain, `*.domain`, an IPv4 address or CIDR), an ordered
//! list of rules whose `transform.headers` are set on every HTTPS request to that host (a
//! header of the same name is replaced). Header values may hold `${e2b.secrets.NAME}`
//! placeholders, resolved per team when a request is sent, and
//! `${e2b.identity.tokens.NAME}` placeholders, a workload identity token minted per request.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use http::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{json, Map, Value};

use super::{SecretSource, TokenSource};
use crate::target::{domain_matches, Target};

const SECRET_PREFIX: &str = "${e2b.secrets.";
const IDENTITY_PREFIX: &str = "${e2b.identity.";
const TOKEN_PREFIX: &str = "${e2b.identity.tokens.";

/// A piece of a header value.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seg {
    Text(String),
    Secret(String),
    Token(String),
}

/// The name of a placeholder starting `t` (after its prefix), and what follows it.
fn placeholder<'a>(raw: &str, t: &'a str, what: &str) -> Result<(&'a str, &'a str), String> {
    let end = t
        .find('}')
        .ok_or_else(|| format!("{raw:?}: a ${{{what}…}} placeholder has no closing '}}'"))?;
    let name = &t[..end];
    if name.is_empty() || name.chars().any(|c| c.is_control() || c == '{') {
        return Err(format!(
            "{raw:?}: {name:?} is not a usable name in ${{{what}…}}"
        ));
    }
    Ok((name, &t[end + 1..]))
}

/// A header value with its placeholders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueTemplate {
    raw: String,
    segs: Vec<Seg>,
}

impl ValueTemplate {
    fn parse(raw: &str) -> Result<Self, String> {
        let mut segs = Vec::new();
        let mut rest = raw;
        while let Some(i) = rest.find("${") {
            let (head, tail) = rest.split_at(i);
            if !head.is_empty() {
                segs.push(Seg::Text(head.into()));
            }
            if let Some(t) = tail.strip_prefix(TOKEN_PREFIX) {
                let (name, after) = placeholder(raw, t, "e2b.identity.tokens.")?;
                segs.push(Seg::Token(name.into()));
                rest = after;
            } else if tail.starts_with(IDENTITY_PREFIX) {
                return Err(format!(
                    "{raw:?}: the only workload identity placeholder is \
                     ${{e2b.identity.tokens.NAME}}"
                ));
            } else if let Some(t) = tail.strip_prefix(SECRET_PREFIX) {
                let (name, after) = placeholder(raw, t, "e2b.secrets.")?;
                segs.push(Seg::Secret(name.to_lowercase()));
                rest = after;
            } else {
                segs.push(Seg::Text("${".into()));
                rest = &tail[2..];
            }
        }
        if !rest.is_empty() {
            segs.push(Seg::Text(rest.into()));
        }
        if segs.iter().all(|s| matches!(s, Seg::Text(_))) {
            HeaderValue::from_str(raw)
                .map_err(|_| format!("{raw:?} is not a valid header value"))?;
        }
        Ok(Self {
            raw: raw.into(),
            segs,
        })
    }

    /// The value with its placeholders resolved for `team` (tokens minted by `tokens`).
    async fn resolve(
        &self,
        team: &str,
        secrets: &dyn SecretSource,
        tokens: Option<&dyn TokenSource>,
    ) -> Result<HeaderValue, String> {
        let mut out = String::new();
        for s in &self.segs {
            match s {
                Seg::Text(t) => out.push_str(t),
                Seg::Token(name) => match tokens {
                    Some(t) => out.push_str(&t.mint(name)?),
                    None => {
                        return Err(format!(
                            "workload identity token {name:?}: the sandbox has no iam tokens"
                        ))
                    }
                },
                Seg::Secret(name) => match secrets.value(team, name).await? {
                    Some(v) => out.push_str(&v),
                    None => return Err(format!("secret {name:?} does not exist (any more)")),
                },
            }
        }
        let mut v = HeaderValue::from_str(&out).map_err(|_| {
            "a resolved header value holds characters a header may not carry (a line break?)"
                .to_string()
        })?;
        v.set_sensitive(true);
        Ok(v)
    }
}

/// One rule: the headers it sets.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rule {
    pub headers: Vec<(HeaderName, ValueTemplate)>,
}

/// The rules of one host key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRules {
    /// The key as given (lower-cased).
    pub key: String,
    target: Target,
    pub rules: Vec<Rule>,
}

impl HostRules {
    /// Header names these rules set (for the audit record), in order, once each.
    pub fn header_names(&self) -> Vec<String> {
        let mut seen = Vec::<String>::new();
        for (n, _) in self.rules.iter().flat_map(|r| &r.headers) {
            if !seen.iter().any(|s| s == n.as_str()) {
                seen.push(n.as_str().to_string());
            }
        }
        seen
    }

    /// Sets the rules' headers on `h` (later rules win), placeholders resolved for `team`
    /// and workload identity tokens minted by `tokens`.
    pub async fn apply(
        &self,
        h: &mut HeaderMap,
        team: &str,
        secrets: &dyn SecretSource,
        tokens: Option<&dyn TokenSource>,
    ) -> Result<(), String> {
        for (name, tmpl) in self.rules.iter().flat_map(|r| &r.headers) {
            let v = tmpl
                .resolve(team, secrets, tokens)
                .await
                .map_err(|e| format!("header {name}: {e}"))?;
            h.insert(name.clone(), v);
        }
        Ok(())
    }
}

/// A sandbox's `network.rules`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RuleSet {
    pub hosts: Vec<HostRules>,
}

fn bad(m: String) -> String {
    format!("network.rules: {m}")
}

impl RuleSet {
    /// Parses E2B's `{host: [{transform: {headers: {name: value}}}]}`.
    pub fn parse(v: &Value) -> Result<Self, String> {
        let map = match v {
            Value::Null => return Ok(Self::default()),
            Value::Object(m) => m,
            _ => return Err(bad("expected an object of host → rule list".into())),
        };
        let mut hosts = Vec::new();
        for (key, list) in map {
            let target = Target::parse(key).map_err(|e| bad(format!("host {key:?}: {e}")))?;
            let items = list
                .as_array()
                .ok_or_else(|| bad(format!("{key:?}: expected a list of rules")))?;
            let mut rules = Vec::new();
            for item in items {
                rules.push(parse_rule(key, item)?);
            }
            hosts.push(HostRules {
                key: key.to_ascii_lowercase(),
                target,
                rules,
            });
        }
        Ok(Self { hosts })
    }

    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// The names `pick` takes from the placeholders of every header value.
    fn names(&self, pick: fn(&Seg) -> Option<&String>) -> BTreeSet<String> {
        self.hosts
            .iter()
            .flat_map(|h| &h.rules)
            .flat_map(|r| &r.headers)
            .flat_map(|(_, t)| &t.segs)
            .filter_map(pick)
            .cloned()
            .collect()
    }

    /// Every secret a placeholder names.
    pub fn secret_names(&self) -> BTreeSet<String> {
        self.names(|s| match s {
            Seg::Secret(n) => Some(n),
            _ => None,
        })
    }

    /// Every workload identity token a placeholder names.
    pub fn token_names(&self) -> BTreeSet<String> {
        self.names(|s| match s {
            Seg::Token(n) => Some(n),
            _ => None,
        })
    }

    /// The domain keys (they make the egress proxy see HTTPS connections).
    pub fn has_hosts(&self) -> bool {
        !self.hosts.is_empty()
    }

    /// The host whose key matches a connection to `ip` named `name` (SNI), the most specific
    /// first: the exact name, then `*.` patterns (longest first), then addresses and CIDRs
    /// (longest prefix first).
    pub fn matching(&self, name: Option<&str>, ip: Ipv4Addr) -> Option<&HostRules> {
        self.hosts
            .iter()
            .filter_map(|h| {
                let rank = match &h.target {
                    Target::Domain(d) if !name.is_some_and(|n| domain_matches(d, n)) => None,
                    Target::Domain(d) if !d.starts_with("*.") => Some(1000),
                    Target::Domain(d) => Some(500 + d.len()),
                    Target::Net(c) if c.contains(ip) => Some(usize::from(c.prefix_len())),
                    Target::Net(_) => None,
                };
                rank.map(|r| (r, h))
            })
            .max_by_key(|(r, _)| *r)
            .map(|(_, h)| h)
    }

    /// The API's view: as given, placeholders and all (never a resolved value).
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        for h in &self.hosts {
            let key = h.target.api_string();
            let rules: Vec<Value> = h
                .rules
                .iter()
                .map(|r| {
                    let headers: Map<String, Value> = r
                        .headers
                        .iter()
                        .map(|(n, t)| (n.as_str().to_string(), json!(t.raw)))
                        .collect();
                    json!({"transform": {"headers": headers}})
                })
                .collect();
            m.insert(key, Value::Array(rules));
        }
        Value::Object(m)
    }
}

fn parse_rule(key: &str, item: &Value) -> Result<Rule, String> {
    let obj = item
        .as_object()
        .ok_or_else(|| bad(format!("{key:?}: a rule is an object")))?;
    if let Some(other) = obj.keys().find(|k| *k != "transform") {
        return Err(bad(format!("{key:?}: unknown rule field {other:?}")));
    }
    let mut rule = Rule::default();
    let Some(t) = obj.get("transform").filter(|t| !t.is_null()) else {
        return Ok(rule);
    };
    let t = t
        .as_object()
        .ok_or_else(|| bad(format!("{key:?}: transform is an object")))?;
    if let Some(other) = t.keys().find(|k| *k != "headers") {
        return Err(bad(format!(
            "{key:?}: transform field {other:?} is not supported (headers only)"
        )));
    }
    let Some(h) = t.get("headers").filter(|h| !h.is_null()) else {
        return Ok(rule);
    };
    let h = h
        .as_object()
        .ok_or_else(|| bad(format!("{key:?}: headers is an object of name → value")))?;
    for (name, value) in h {
        let n = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| bad(format!("{key:?}: {name:?} is not a header name")))?;
        if matches!(
            n.as_str(),
            "host" | "content-length" | "transfer-encoding" | "connection" | "upgrade"
        ) {
            return Err(bad(format!(
                "{key:?}: header {name:?} cannot be set by a rule"
            )));
        }
        let v = value
            .as_str()
            .ok_or_else(|| bad(format!("{key:?}: the value of {name:?} is not a string")))?;
        rule.headers.push((
            n,
            ValueTemplate::parse(v).map_err(|e| bad(format!("{key:?}: {e}")))?,
        ));
    }
    Ok(rule)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::Pin;

    struct Fixed;
    impl SecretSource for Fixed {
        fn value<'a>(
            &'a self,
            team: &'a str,
            name: &'a str,
        ) -> Pin<Box<dyn Future<Output = Result<Option<String>, String>> + Send + 'a>> {
            Box::pin(
                async move { Ok((team == "red" && name == "svc").then(|| "s3cr3t".to_string())) },
            )
        }
    }

    struct Minted;
    impl TokenSource for Minted {
        fn mint(&self, name: &str) -> Result<String, String> {
            match name {
                "aws" => Ok("jwt.for.aws".into()),
                _ => Err(format!("no token {name:?}")),
            }
        }
    }

    #[tokio::test]
    async fn identity_placeholders_mint_per_request() {
        let v = json!({"id.test": [{"transform": {"headers": {
            "Authorization": "Bearer ${e2b.identity.tokens.aws}",
            "X-Both": "${e2b.secrets.svc}/${e2b.identity.tokens.aws}"}}}]});
        let rs = RuleSet::parse(&v).unwrap();
        assert_eq!(rs.token_names().into_iter().collect::<Vec<_>>(), ["aws"]);
        assert_eq!(rs.secret_names().into_iter().collect::<Vec<_>>(), ["svc"]);
        let h = rs
            .matching(Some("id.test"), Ipv4Addr::new(198, 51, 100, 1))
            .unwrap();
        let mut hm = HeaderMap::new();
        h.apply(&mut hm, "red", &Fixed, Some(&Minted))
            .await
            .unwrap();
        assert_eq!(hm["authorization"], "Bearer jwt.for.aws");
        assert_eq!(hm["x-both"], "s3cr3t/jwt.for.aws");
        assert!(hm["authorization"].is_sensitive());
        let e = h.apply(&mut hm, "red", &Fixed, None).await.unwrap_err();
        assert!(e.contains("no iam tokens"), "{e}");
        let echo = rs.to_json().to_string();
        assert!(echo.contains("${e2b.identity.tokens.aws}") && !echo.contains("jwt.for"));
        for bad in [
            "${e2b.identity.tokens.}",
            "${e2b.identity.tokens.aws",
            "${e2b.identity.other.aws}",
            "${e2b.identity.tokens.a{b}",
        ] {
            let v = json!({"a.test": [{"transform": {"headers": {"X": bad}}}]});
            assert!(RuleSet::parse(&v).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn rules_parse_match_and_resolve() {
        let v = json!({
            "API.example.test": [
                {"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.SVC}", "X-A": "1"}}},
                {"transform": {"headers": {"X-A": "2 ${not.a.secret}"}}}
            ],
            "198.51.100.0/24": [{"transform": {}}]
        });
        let rs = RuleSet::parse(&v).unwrap();
        assert_eq!(rs.secret_names().into_iter().collect::<Vec<_>>(), ["svc"]);
        let ip = Ipv4Addr::new(198, 51, 100, 9);
        let h = rs.matching(Some("api.example.test"), ip).unwrap();
        assert_eq!(h.header_names(), ["authorization", "x-a"]);
        assert_eq!(rs.matching(None, ip).unwrap().key, "198.51.100.0/24");
        assert!(rs
            .matching(Some("other.test"), Ipv4Addr::new(203, 0, 113, 1))
            .is_none());
        let mut hm = HeaderMap::new();
        hm.insert("authorization", HeaderValue::from_static("mine"));
        h.apply(&mut hm, "red", &Fixed, None).await.unwrap();
        assert_eq!(hm["authorization"], "Bearer s3cr3t");
        assert!(hm["authorization"].is_sensitive());
        assert_eq!(hm["x-a"], "2 ${not.a.secret}");
        assert!(h
            .apply(&mut hm, "blue", &Fixed, None)
            .await
            .unwrap_err()
            .contains("\"svc\""));
        let echo = rs.to_json();
        assert_eq!(
            echo["api.example.test"][0]["transform"]["headers"]["authorization"],
            "Bearer ${e2b.secrets.SVC}"
        );
        assert!(!echo.to_string().contains("s3cr3t"));
        for bad in [
            json!({"a.test": {}}),
            json!({"a.test": [{"transform": {"headers": {"bad name": "x"}}}]}),
            json!({"a.test": [{"transform": {"headers": {"Host": "x"}}}]}),
            json!({"a.test": [{"transform": {"headers": {"X": "${e2b.secrets.x"}}}]}),
            json!({"a.test": [{"transform": {"headers": {"X": "${e2b.identity.x}"}}}]}),
            json!({"a.test": [{"transform": {"body": {}}}]}),
            json!({"not a host!": []}),
        ] {
            assert!(RuleSet::parse(&bad).is_err(), "{bad}");
        }
    }
}
