//! Links, addresses and routes inside a network namespace over rtnetlink, in this process.
//!
//! A restore readdresses the sandbox side of its slot on the wake path; an `ip` process for
//! that took 24–72 ms with 1,000 sandboxes alive on two busy cores (its start, not its work).
//! Here a short-lived thread joins the namespace and opens the netlink socket there (the
//! socket stays in that namespace), and the requests go over it from this runtime.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use rtnetlink::packet_route::route::RouteProtocol;
use rtnetlink::{Handle, LinkUnspec, RouteMessageBuilder};

use crate::netns::in_netns;
use crate::{NetError, Result};

/// An interface's address and the namespace's default route, as [`address`] sets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addressing<'a> {
    pub dev: &'a str,
    pub addr: Ipv4Addr,
    pub prefix: u8,
    pub gateway: Ipv4Addr,
}

/// In the namespace at `ns_path`: `lo` and `a.dev` up, `a.addr/a.prefix` on `a.dev` (replacing
/// an address already there), and the default route via `a.gateway` (replacing one already
/// there). What `ip -batch` of `link set lo up`, `addr replace`, `link set up` and `route
/// replace default` does.
pub async fn address(ns_path: &Path, a: Addressing<'_>) -> Result<()> {
    let dev = a.dev.to_string();
    let rt = tokio::runtime::Handle::current();
    let (conn, handle, lo, index) = in_netns(ns_path, move || {
        // The socket registers with the runtime's reactor when it is made.
        let _entered = rt.enter();
        let (conn, handle, _) = rtnetlink::new_connection()?;
        let lo = nix::net::if_::if_nametoindex("lo").map_err(std::io::Error::from)?;
        let index = nix::net::if_::if_nametoindex(dev.as_str()).map_err(|e| {
            let e = std::io::Error::from(e);
            std::io::Error::new(e.kind(), format!("interface {dev}: {e}"))
        })?;
        Ok((conn, handle, lo, index))
    })
    .await
    .map_err(|e| NetError::Config(format!("addressing in {}: {e}", ns_name(ns_path))))?;
    let conn = tokio::spawn(conn);
    let r = requests(&handle, lo, index, a).await;
    conn.abort();
    r.map_err(|e| NetError::Config(format!("addressing {} in {}: {e}", a.dev, ns_name(ns_path))))
}

async fn requests(
    handle: &Handle,
    lo: u32,
    index: u32,
    a: Addressing<'_>,
) -> std::result::Result<(), rtnetlink::Error> {
    let up = |i| {
        handle
            .link()
            .set(LinkUnspec::new_with_index(i).up().build())
    };
    up(lo).execute().await?;
    handle
        .address()
        .add(index, IpAddr::V4(a.addr), a.prefix)
        .replace()
        .execute()
        .await?;
    up(index).execute().await?;
    handle
        .route()
        .add(
            RouteMessageBuilder::<Ipv4Addr>::new()
                .gateway(a.gateway)
                .protocol(RouteProtocol::Boot)
                .build(),
        )
        .replace()
        .execute()
        .await
}

/// A namespace's name for messages (its file name, not the host path).
fn ns_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::run;

    /// A namespace whose `eth0` has no address (what runsc leaves), its veth peer holding
    /// the gateway's address in a second namespace (`<name>-gw`).
    async fn bare_namespace(name: &str) -> std::path::PathBuf {
        let gw = format!("{name}-gw");
        let script = [
            format!("netns add {name}"),
            format!("netns add {gw}"),
            format!("-n {name} link add eth0 type veth peer name gw0 netns {gw}"),
            format!("-n {gw} addr add 169.254.0.22/30 dev gw0"),
            format!("-n {gw} link set gw0 up"),
        ];
        for (i, line) in script.iter().enumerate() {
            if i < 2 {
                let ns = line.trim_start_matches("netns add ");
                let _ = run("ip", &["netns", "del", ns], None).await;
            }
            let args: Vec<&str> = line.split(' ').collect();
            run("ip", &args, None).await.unwrap();
        }
        Path::new("/run/netns").join(name)
    }

    async fn show(name: &str, what: &[&str]) -> String {
        let mut args = vec!["-n", name];
        args.extend(what);
        run("ip", &args, None).await.unwrap()
    }

    #[tokio::test]
    async fn addresses_a_bare_interface_and_is_idempotent() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root (network namespaces)");
        }
        let name = format!("kiln-rtnl-{}", std::process::id());
        let ns = bare_namespace(&name).await;
        let a = Addressing {
            dev: "eth0",
            addr: Ipv4Addr::new(169, 254, 0, 21),
            prefix: 30,
            gateway: Ipv4Addr::new(169, 254, 0, 22),
        };
        // Twice: the second replaces what the first set (a restore after a restore).
        for _ in 0..2 {
            address(&ns, a).await.unwrap();
        }
        let addrs = show(&name, &["-4", "-o", "addr", "show", "dev", "eth0"]).await;
        assert_eq!(addrs.matches("169.254.0.21/30").count(), 1, "{addrs}");
        let links = show(&name, &["-o", "link", "show"]).await;
        for dev in ["lo:", "eth0@"] {
            let line = links.lines().find(|l| l.contains(dev)).unwrap();
            assert!(line.contains(",UP"), "{dev} is not up: {line}");
        }
        let routes = show(&name, &["-4", "route", "show", "default"]).await;
        assert_eq!(
            routes.trim(),
            "default via 169.254.0.22 dev eth0",
            "{routes}"
        );
        // A device the namespace does not have is an error naming it and the namespace.
        let err = address(&ns, Addressing { dev: "eth9", ..a })
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&name) && msg.contains("interface eth9"),
            "{msg}"
        );
        for ns in [name.clone(), format!("{name}-gw")] {
            run("ip", &["netns", "del", &ns], None).await.unwrap();
        }
    }
}
