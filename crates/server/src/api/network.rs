//! The network part of E2B's API: create's `allow_internet_access` and `network` (the wire
//! shape, the egress policy and the ingress settings it makes), and what get_info reports. `PUT
//! /sandboxes/{id}/network` is [`super::net_update`].

use kiln_net::upstream::EgressProxyConfig;
use kiln_net::{EgressPolicy, Ingress};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{ApiError, ApiResult};

/// `network` of a create request (and the body of `PUT .../network`, a subset).
#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct NetworkJson {
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub dns_servers: Option<Vec<String>>,
    pub allow_public_traffic: Option<bool>,
    pub mask_request_host: Option<String>,
    pub https_ports: Option<Vec<u16>>,
    pub rules: Option<Value>,
    pub egress_proxy: Option<Value>,
}

fn present(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    }
}

/// The egress policy of a request: `None` when it names none (the server's default).
pub fn policy_of(
    allow_internet_access: Option<bool>,
    net: Option<&NetworkJson>,
) -> ApiResult<Option<EgressPolicy>> {
    if allow_internet_access.is_none() && net.is_none() {
        return Ok(None);
    }
    let empty = NetworkJson::default();
    let n = net.unwrap_or(&empty);
    let v = |l: &Option<Vec<String>>| l.clone().unwrap_or_default();
    let mut policy = EgressPolicy::from_lists(
        allow_internet_access.unwrap_or(true),
        &v(&n.allow_out),
        &v(&n.deny_out),
        &v(&n.dns_servers),
    )
    .map_err(|e| ApiError::bad_request(e.to_string()))?;
    if let Some(v) = n.egress_proxy.as_ref().filter(|_| present(&n.egress_proxy)) {
        policy.egress_proxy = Some(EgressProxyConfig::parse(v).map_err(ApiError::bad_request)?);
    }
    policy.https_ports = n.https_ports.clone().unwrap_or_default();
    if policy.https_ports.contains(&0) {
        return Err(ApiError::bad_request("httpsPorts: 0 is not a port"));
    }
    check_mask(n)?;
    Ok(Some(policy))
}

/// Refuses a `maskRequestHost` that does not make a valid `Host` header.
fn check_mask(n: &NetworkJson) -> ApiResult<()> {
    match &n.mask_request_host {
        Some(mask)
            if mask.is_empty()
                || http::HeaderValue::from_str(&mask.replace("${PORT}", "1")).is_err() =>
        {
            Err(ApiError::bad_request(format!(
                "maskRequestHost {mask:?} is not a valid Host header value"
            )))
        }
        _ => Ok(()),
    }
}

/// The ingress settings of a create's `network`: `allowPublicTraffic=false` mints the
/// sandbox's traffic access token; `maskRequestHost` must make a valid `Host` header.
pub fn ingress_of(net: Option<&NetworkJson>) -> ApiResult<Ingress> {
    let Some(n) = net else {
        return Ok(Ingress::default());
    };
    check_mask(n)?;
    Ok(Ingress {
        traffic_token: (n.allow_public_traffic == Some(false)).then(|| crate::auth::random_hex(16)),
        mask_request_host: n.mask_request_host.clone(),
    })
}

/// `allowInternetAccess` and `network` of get_info, from the egress policy in force and the
/// sandbox's ingress settings.
pub fn info(policy: Option<&EgressPolicy>, ingress: &Ingress) -> (bool, Value) {
    match policy {
        None => (false, Value::Null),
        Some(p) => (p.allow_internet_access, {
            let mut v = json!({
                "allowOut": EgressPolicy::list_strings(&p.allow_out),
                "denyOut": EgressPolicy::list_strings(&p.deny_out),
                "dnsServers": p.dns_servers.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
                "allowPublicTraffic": ingress.is_public(),
                "httpsPorts": p.https_ports,
                "maskRequestHost": ingress.mask_request_host,
            });
            // Only when set: the SDK cannot parse a null `rules`.
            if let Some(t) = &p.transforms {
                v["rules"] = t.rules.to_json();
            }
            if let Some(x) = &p.egress_proxy {
                v["egressProxy"] = x.info_json();
            }
            v
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    #[test]
    fn request_policies() {
        assert!(policy_of(None, None).unwrap().is_none());
        let p = policy_of(Some(false), None).unwrap().unwrap();
        assert!(!p.allow_internet_access);
        let n = NetworkJson {
            allow_out: Some(vec!["198.51.100.0/24".into()]),
            deny_out: Some(vec!["0.0.0.0/0".into()]),
            ..Default::default()
        };
        let p = policy_of(None, Some(&n)).unwrap().unwrap();
        assert!(p.allow_internet_access);
        let public = Ingress::default();
        assert_eq!(info(Some(&p), &public).1["allowOut"][0], "198.51.100.0/24");
        let bad = NetworkJson {
            deny_out: Some(vec!["not an address!".into()]),
            ..Default::default()
        };
        assert_eq!(
            policy_of(None, Some(&bad)).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        let dom = NetworkJson {
            allow_out: Some(vec!["*.example.com".into()]),
            https_ports: Some(vec![8443]),
            ..Default::default()
        };
        let p = policy_of(None, Some(&dom)).unwrap().unwrap();
        assert_eq!(p.domains(), vec!["*.example.com"]);
        assert_eq!(p.https_ports, vec![8443]);
        assert_eq!(info(Some(&p), &public).1["httpsPorts"][0], 8443);
        assert_eq!(info(None, &public), (false, Value::Null));
        let private = NetworkJson {
            allow_public_traffic: Some(false),
            ..Default::default()
        };
        let p = policy_of(None, Some(&private)).unwrap().unwrap();
        let i = ingress_of(Some(&private)).unwrap();
        assert_eq!(i.traffic_token.as_ref().map(String::len), Some(32));
        assert_eq!(info(Some(&p), &i).1["allowPublicTraffic"], false);
        assert_eq!(info(Some(&p), &public).1["allowPublicTraffic"], true);
    }

    #[test]
    fn request_ingress() {
        assert_eq!(ingress_of(None).unwrap(), Ingress::default());
        assert_eq!(
            ingress_of(Some(&NetworkJson::default())).unwrap(),
            Ingress::default()
        );
        let masked = NetworkJson {
            mask_request_host: Some("app-${PORT}.local".into()),
            allow_public_traffic: Some(true),
            ..Default::default()
        };
        let i = ingress_of(Some(&masked)).unwrap();
        assert!(i.is_public());
        assert_eq!(i.masked_host(3000).as_deref(), Some("app-3000.local"));
        assert_eq!(
            info(Some(&EgressPolicy::default()), &i).1["maskRequestHost"],
            "app-${PORT}.local"
        );
        for bad in ["", "bad\nhost"] {
            let n = NetworkJson {
                mask_request_host: Some(bad.replace("\\n", "\n")),
                ..Default::default()
            };
            assert_eq!(
                ingress_of(Some(&n)).unwrap_err().status,
                StatusCode::BAD_REQUEST
            );
        }
    }
}
