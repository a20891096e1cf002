//! A sandbox's ingress settings, in E2B's terms: who may reach its ports other than the
//! agent's (`allowPublicTraffic=false` gives the sandbox a `trafficAccessToken`) and the
//! `Host` requests to them carry (`maskRequestHost`). They belong to the sandbox record (the
//! server's store), not to the egress policy a driver enforces.

/// Ingress of one sandbox; the default is E2B's: public ports, kiln's own `Host`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ingress {
    /// The token traffic to the sandbox's ports must carry; `None`: public.
    pub traffic_token: Option<String>,
    /// The `Host` of requests to the sandbox's ports, `${PORT}` standing for the port;
    /// `None`: kiln's default.
    pub mask_request_host: Option<String>,
}

impl Ingress {
    /// Whether traffic to the sandbox's ports needs no token.
    pub fn is_public(&self) -> bool {
        self.traffic_token.is_none()
    }

    /// The `Host` a request to `port` carries when a mask is set.
    pub fn masked_host(&self, port: u16) -> Option<String> {
        self.mask_request_host
            .as_ref()
            .map(|m| m.replace("${PORT}", &port.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_names_the_port() {
        let i = Ingress {
            traffic_token: Some("t".into()),
            mask_request_host: Some("svc-${PORT}.internal".into()),
        };
        assert!(!i.is_public());
        assert_eq!(i.masked_host(8080).as_deref(), Some("svc-8080.internal"));
        assert!(Ingress::default().is_public());
        assert_eq!(Ingress::default().masked_host(80), None);
    }
}
