//! Two test hosts on one machine: network namespaces `a` and `b` joined by a veth pair, each
//! end with its own address, made by the test and removed on drop (after killing whatever the
//! test left inside). The multi-host UCX tests run a node in one and a peer in the other, so
//! traffic crosses a real interface that is not loopback.

use std::process::{Command, Stdio};

/// Run `ip ARGS`; the error names the command and what `ip` printed.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Namespaces `ns_a`/`ns_b` with veth ends `veth_a` (address `ip_a`/24) and `veth_b` (`ip_b`).
pub struct TwoHosts {
    pub ns_a: String,
    pub ns_b: String,
    pub veth_a: String,
    pub veth_b: String,
}

impl TwoHosts {
    /// `tag`: a short name per test (at most 4 bytes: interface names are at most 15 bytes and
    /// pids 7 digits), so tests running at once get their own namespaces and interfaces.
    pub fn create(tag: &str, ip_a: &str, ip_b: &str) -> Result<TwoHosts, String> {
        assert!(tag.len() <= 4, "netns tag {tag:?} is longer than 4 bytes");
        let pid = std::process::id();
        let hosts = TwoHosts {
            ns_a: format!("kvtier-{tag}a-{pid}"),
            ns_b: format!("kvtier-{tag}b-{pid}"),
            veth_a: format!("kv{tag}a{pid}"),
            veth_b: format!("kv{tag}b{pid}"),
        };
        // From here on a failure drops `hosts`, which removes whatever was made.
        ip(&["netns", "add", &hosts.ns_a])?;
        ip(&["netns", "add", &hosts.ns_b])?;
        ip(&[
            "link",
            "add",
            &hosts.veth_a,
            "type",
            "veth",
            "peer",
            "name",
            &hosts.veth_b,
        ])?;
        ip(&["link", "set", &hosts.veth_a, "netns", &hosts.ns_a])?;
        ip(&["link", "set", &hosts.veth_b, "netns", &hosts.ns_b])?;
        for (ns, dev, addr) in [
            (&hosts.ns_a, &hosts.veth_a, ip_a),
            (&hosts.ns_b, &hosts.veth_b, ip_b),
        ] {
            let cidr = format!("{addr}/24");
            ip(&["-n", ns, "addr", "add", &cidr, "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in [&self.ns_a, &self.ns_b] {
            // Processes left inside (a child killed on its deadline leaves its nodes): all
            // were started by this test; killed by pid.
            if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            let _ = ip(&["netns", "del", ns]);
        }
        // Only if it never reached a namespace (deleting a namespace deletes its end).
        let _ = Command::new("ip")
            .args(["link", "del", &self.veth_a])
            .stderr(Stdio::null())
            .status();
    }
}
