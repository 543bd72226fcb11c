//! Which network devices kvtier's UCX contexts may use (issue 26 §1): only those behind the
//! interface of the address the operator named (a node's `--data-addr`; for a client its
//! `node_address`, else the address it reaches its master from), intersected with what the
//! operator asked for in `UCX_NET_DEVICES`.
//!
//! Owns: [`plan`] (the `NET_DEVICES` value [`super::plane::Context::bound_to`] sets with
//! `ucp_config_modify` before `ucp_init`), its pure parts over a sysfs root
//! ([`rdma_ports_of`], [`devices_for`], [`intersect`]) and [`client_address`].
//!
//! Why: UCX's default device list is every device the host has, and its `tcp` transport (only
//! loaded under the insecure test hook, see [`super::lanes`]) listens on each of them. kvtier
//! promises that nothing of its own listens on an interface the operator did not name, and
//! RDMA ports of another fabric are no more the operator's choice than sockets are.
//!
//! Invariants:
//! - A wildcard (`0.0.0.0`, `::`) names no interface: no UCX, with the reason; it never means
//!   "all devices".
//! - RDMA: the ports whose GID table names the interface
//!   (`/sys/class/infiniband/<dev>/ports/<n>/gid_attrs/ndevs/*`: RoCE), else, for an IPoIB
//!   interface (whose GIDs name no netdev), the port `dev_port + 1` of the devices under
//!   `/sys/class/net/<if>/device/infiniband/`, or a device's only port. A device with several
//!   ports and no way to tell which one is the interface's gives none (never a guess).
//! - Without the insecure hook only RDMA ports are named (UCX's socket transports are not
//!   loaded then); under the hook the interface name too, so UCX's `tcp` lane listens there
//!   only.
//! - An explicit `UCX_NET_DEVICES` (anything but unset, empty or `all`) is intersected, never
//!   overridden silently: an empty intersection is no UCX lane, with both lists in the reason.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::Path;

/// The sysfs root the real plans read.
pub const SYSFS: &str = "/sys";

/// The entries of directory `dir`, sorted (empty if it cannot be read).
fn names(dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Port numbers of RDMA device `dev` under `sysfs`, ascending.
fn ports_of(sysfs: &Path, dev: &str) -> Vec<u32> {
    let mut ports: Vec<u32> = names(&sysfs.join("class/infiniband").join(dev).join("ports"))
        .iter()
        .filter_map(|p| p.parse().ok())
        .collect();
    ports.sort_unstable();
    ports
}

/// The RDMA ports (`dev:port`, UCX's device names) behind network interface `interface`,
/// read from the sysfs tree at `sysfs` (see the module doc for the rules).
pub fn rdma_ports_of(sysfs: &Path, interface: &str) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    // RoCE: every GID entry names the netdev it belongs to.
    for dev in names(&sysfs.join("class/infiniband")) {
        for port in ports_of(sysfs, &dev) {
            let ndevs = sysfs
                .join("class/infiniband")
                .join(&dev)
                .join("ports")
                .join(port.to_string())
                .join("gid_attrs/ndevs");
            let named = names(&ndevs).iter().any(|entry| {
                std::fs::read_to_string(ndevs.join(entry)).is_ok_and(|s| s.trim() == interface)
            });
            if named {
                found.push(format!("{dev}:{port}"));
            }
        }
    }
    if !found.is_empty() {
        return found;
    }
    // IPoIB: the GIDs name no netdev; the interface's own device names its RDMA device.
    let net = sysfs.join("class/net").join(interface);
    let dev_port = std::fs::read_to_string(net.join("dev_port"))
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok());
    for dev in names(&net.join("device/infiniband")) {
        let ports = ports_of(sysfs, &dev);
        let port = match (dev_port, ports.as_slice()) {
            (Some(p), _) if ports.contains(&(p + 1)) => Some(p + 1),
            (_, [only]) => Some(*only),
            _ => None,
        };
        if let Some(port) = port {
            found.push(format!("{dev}:{port}"));
        }
    }
    found
}

/// The devices a UCX context may use for `interface`: its RDMA ports and, under the insecure
/// test hook (socket transports loaded), the interface itself.
pub fn devices_for(sysfs: &Path, interface: &str, insecure: bool) -> Vec<String> {
    let mut devices = rdma_ports_of(sysfs, interface);
    if insecure {
        devices.push(interface.to_string());
    }
    devices
}

/// `derived` intersected with the operator's `UCX_NET_DEVICES` (`None`, empty or `all`: no
/// restriction of its own), as UCX's comma-separated value; `Err(why)` when nothing is left.
/// `what` says where `derived` came from, for the reason.
pub fn intersect(derived: &[String], operator: Option<&str>, what: &str) -> Result<String, String> {
    let asked: Option<Vec<&str>> = operator
        .map(str::trim)
        .filter(|op| !op.is_empty() && *op != "all")
        .map(|op| {
            op.split(',')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .collect()
        });
    let kept: Vec<&str> = derived
        .iter()
        .map(String::as_str)
        .filter(|d| asked.as_ref().is_none_or(|a| a.contains(d)))
        .collect();
    if kept.is_empty() {
        return Err(match operator {
            Some(op) if asked.is_some() => format!(
                "UCX_NET_DEVICES={op} names none of the devices behind {what} (those are: \
                 {}), and kvtier's UCX uses no others",
                if derived.is_empty() {
                    "none".to_string()
                } else {
                    derived.join(",")
                }
            ),
            _ => format!(
                "no UCX device behind {what} (no RDMA port's GID names it, and no RDMA device \
                 sits under it): kvtier's UCX uses no other interface's devices"
            ),
        });
    }
    Ok(kept.join(","))
}

/// The `NET_DEVICES` value for a UCX context bound to the interface `interface` (found for
/// address `ip`): [`devices_for`] over `sysfs`, intersected with `operator`.
pub fn plan_for(
    sysfs: &Path,
    ip: IpAddr,
    interface: &str,
    insecure: bool,
    operator: Option<&str>,
) -> Result<String, String> {
    let derived = devices_for(sysfs, interface, insecure);
    intersect(
        &derived,
        operator,
        &format!("interface {interface} (of {ip})"),
    )
}

/// The `NET_DEVICES` value for a UCX context that may use only the interface of `ip`, or why
/// there is none (a wildcard, no interface with that address, nothing behind it, or nothing
/// in common with `UCX_NET_DEVICES`).
pub fn plan(ip: IpAddr) -> Result<String, String> {
    if ip.is_unspecified() {
        return Err(format!(
            "{ip} is a wildcard address: it names no interface, and kvtier's UCX binds only to \
             the interface of an address the operator named"
        ));
    }
    let interface = super::netif::interface_of(ip)?;
    let operator = std::env::var("UCX_NET_DEVICES").ok();
    plan_for(
        Path::new(SYSFS),
        ip,
        &interface,
        super::lanes::insecure_hook(),
        operator.as_deref(),
    )
}

/// The local address a client's UCX binds to: the IP of its `node_address` (the local node's
/// data address, when the config names one as an IP), else the address this host reaches the
/// first master from (the kernel's route choice: a connected UDP socket sends nothing).
pub fn client_address(node_address: Option<&str>, masters: &[String]) -> Result<IpAddr, String> {
    if let Some(addr) = node_address.and_then(|a| a.parse::<SocketAddr>().ok()) {
        if !addr.ip().is_unspecified() {
            return Ok(addr.ip());
        }
    }
    let master = masters.first().ok_or("no master address to route to")?;
    let target = master
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve master address {master:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("master address {master:?} resolves to nothing"))?;
    let any: SocketAddr = if target.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(any).map_err(|e| format!("cannot open a UDP socket: {e}"))?;
    socket
        .connect(target)
        .map_err(|e| format!("no route to master {master} ({target}): {e}"))?;
    let local = socket
        .local_addr()
        .map_err(|e| format!("cannot read the route's local address: {e}"))?;
    Ok(local.ip())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::path::PathBuf;

    /// A fake sysfs tree under a temporary directory.
    struct Tree(tempfile::TempDir);

    impl Tree {
        fn new() -> Tree {
            Tree(tempfile::tempdir().unwrap())
        }
        fn root(&self) -> PathBuf {
            self.0.path().to_path_buf()
        }
        fn write(&self, rel: &str, text: &str) {
            let path = self.0.path().join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
        fn dir(&self, rel: &str) {
            fs::create_dir_all(self.0.path().join(rel)).unwrap();
        }
        /// RDMA device `dev` with `ports`, each port's GIDs naming the netdevs given.
        fn rdma(&self, dev: &str, ports: &[(u32, &[&str])]) {
            for (port, ndevs) in ports {
                let base = format!("class/infiniband/{dev}/ports/{port}/gid_attrs/ndevs");
                self.dir(&base);
                for (i, ndev) in ndevs.iter().enumerate() {
                    self.write(&format!("{base}/{i}"), &format!("{ndev}\n"));
                }
            }
        }
        fn netdev(&self, name: &str) {
            self.write(&format!("class/net/{name}/operstate"), "up\n");
        }
    }

    #[test]
    fn roce_ports_are_found_through_their_gid_netdevs() {
        let t = Tree::new();
        t.rdma("mlx5_0", &[(1, &["eth0", "eth0"])]);
        t.rdma("mlx5_1", &[(1, &["eth1"])]);
        t.netdev("eth0");
        t.netdev("eth1");
        assert_eq!(rdma_ports_of(&t.root(), "eth0"), vec!["mlx5_0:1"]);
        assert_eq!(rdma_ports_of(&t.root(), "eth1"), vec!["mlx5_1:1"]);
    }

    #[test]
    fn of_several_ports_only_the_interfaces_own_is_kept() {
        let t = Tree::new();
        // One dual-port adapter, each port its own netdev (RoCE), plus a VLAN on port 2.
        t.rdma(
            "mlx4_0",
            &[(1, &["ens1f0"]), (2, &["ens1f1", "ens1f1.100", "ens1f1"])],
        );
        assert_eq!(rdma_ports_of(&t.root(), "ens1f0"), vec!["mlx4_0:1"]);
        assert_eq!(rdma_ports_of(&t.root(), "ens1f1"), vec!["mlx4_0:2"]);
        assert_eq!(rdma_ports_of(&t.root(), "ens1f1.100"), vec!["mlx4_0:2"]);
        // A name that only starts like one of them is not it.
        assert!(rdma_ports_of(&t.root(), "ens1f").is_empty());
    }

    #[test]
    fn ipoib_interfaces_map_through_their_device_and_dev_port() {
        let t = Tree::new();
        // IPoIB: the GID table names no netdev.
        t.rdma("mlx4_0", &[(1, &[]), (2, &[])]);
        t.rdma("mlx5_2", &[(1, &[])]);
        t.dir("class/net/ib0/device/infiniband/mlx4_0");
        t.write("class/net/ib0/dev_port", "0\n");
        t.dir("class/net/ib1/device/infiniband/mlx4_0");
        t.write("class/net/ib1/dev_port", "1\n");
        // A single-port device needs no dev_port.
        t.dir("class/net/ib2/device/infiniband/mlx5_2");
        // Several ports and no dev_port: which one is unknown, so none.
        t.dir("class/net/ib3/device/infiniband/mlx4_0");
        assert_eq!(rdma_ports_of(&t.root(), "ib0"), vec!["mlx4_0:1"]);
        assert_eq!(rdma_ports_of(&t.root(), "ib1"), vec!["mlx4_0:2"]);
        assert_eq!(rdma_ports_of(&t.root(), "ib2"), vec!["mlx5_2:1"]);
        assert!(rdma_ports_of(&t.root(), "ib3").is_empty());
    }

    #[test]
    fn an_interface_without_rdma_has_no_device_unless_the_hook_is_on() {
        let t = Tree::new();
        t.rdma("mlx5_0", &[(1, &["eth0"])]);
        t.netdev("eth0");
        t.netdev("veth7");
        t.netdev("lo");
        assert!(rdma_ports_of(&t.root(), "veth7").is_empty());
        let ip: IpAddr = "10.0.0.7".parse().unwrap();
        let why = plan_for(&t.root(), ip, "veth7", false, None).unwrap_err();
        assert!(why.contains("interface veth7 (of 10.0.0.7)"), "{why}");
        // Under the insecure hook the interface itself (UCX's tcp lane listens only there).
        assert_eq!(
            plan_for(&t.root(), ip, "veth7", true, None).unwrap(),
            "veth7"
        );
        assert_eq!(
            plan_for(&t.root(), ip, "eth0", true, None).unwrap(),
            "mlx5_0:1,eth0"
        );
        assert_eq!(
            plan_for(&t.root(), ip, "eth0", false, None).unwrap(),
            "mlx5_0:1"
        );
        // No sysfs at all (a container): the same.
        let none = Path::new("/nonexistent-kvtier-sysfs");
        assert!(plan_for(none, ip, "lo", false, None).is_err());
        assert_eq!(plan_for(none, ip, "lo", true, None).unwrap(), "lo");
    }

    #[test]
    fn the_operators_list_is_intersected_never_overridden() {
        let derived = vec!["mlx5_0:1".to_string(), "eth0".to_string()];
        for all in [None, Some(""), Some("all"), Some(" all ")] {
            assert_eq!(intersect(&derived, all, "x").unwrap(), "mlx5_0:1,eth0");
        }
        assert_eq!(
            intersect(&derived, Some("eth0,lo,mlx5_1:1"), "x").unwrap(),
            "eth0"
        );
        assert_eq!(
            intersect(&derived, Some(" mlx5_0:1 , eth9"), "x").unwrap(),
            "mlx5_0:1"
        );
        let why = intersect(&derived, Some("lo,eth1"), "interface eth0 (of 10.0.0.1)").unwrap_err();
        assert!(why.contains("UCX_NET_DEVICES=lo,eth1"), "{why}");
        assert!(why.contains("mlx5_0:1,eth0"), "{why}");
        assert!(why.contains("interface eth0 (of 10.0.0.1)"), "{why}");
        // Prefixes and device names without their port are not the same device.
        assert!(intersect(&derived, Some("mlx5_0,eth"), "x").is_err());
    }

    #[test]
    fn a_wildcard_address_never_means_every_device() {
        for ip in ["0.0.0.0", "::"] {
            let why = plan(ip.parse().unwrap()).unwrap_err();
            assert!(why.contains("wildcard"), "{why}");
        }
    }

    #[test]
    fn loopback_addresses_map_to_the_loopback_interface() {
        // Every Linux host (and network namespace) has `lo` with 127.0.0.1/8.
        let lo = super::super::netif::interface_of("127.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(lo, "lo");
        // Test nodes bind 127.0.0.2 / .3, which `lo` answers for without naming them.
        let lo2 = super::super::netif::interface_of("127.0.0.3".parse().unwrap()).unwrap();
        assert_eq!(lo2, "lo");
        // An address no interface has is refused, named.
        let why = super::super::netif::interface_of("192.0.2.77".parse().unwrap()).unwrap_err();
        assert!(why.contains("192.0.2.77"), "{why}");
    }

    #[test]
    fn a_client_binds_where_its_config_or_its_route_to_the_master_points() {
        let masters = vec!["127.0.0.1:7000".to_string()];
        assert_eq!(
            client_address(Some("127.0.0.2:9000"), &masters).unwrap(),
            "127.0.0.2".parse::<IpAddr>().unwrap()
        );
        // No node address (or a wildcard, or a host name): the route to the master.
        for node in [None, Some("0.0.0.0:9000"), Some("node-a:9000")] {
            assert_eq!(
                client_address(node, &masters).unwrap(),
                "127.0.0.1".parse::<IpAddr>().unwrap()
            );
        }
        assert!(client_address(None, &[]).is_err());
    }
}
