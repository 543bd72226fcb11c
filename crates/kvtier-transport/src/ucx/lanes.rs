//! Which UCX transports kvtier lets its own contexts use (issue 26 §1): an allow-list of
//! transports whose one-sided reads and writes the hardware or the kernel checks, intersected
//! with what the operator asked for in `UCX_TLS`.
//!
//! Owns: [`plan`] (the `TLS` value [`super::plane::Context::new`] sets with
//! `ucp_config_modify` before `ucp_init`), its pure core [`protected_tls`], and the insecure
//! test hook [`INSECURE_EMULATED_RMA_ENV`].
//!
//! Why: UCX 1.13 emulates one-sided operations over `tcp`, `posix`, `sysv` and other
//! active-message lanes in software, and that emulation writes to or reads from whatever
//! address a peer names, with a remote key that carries no secret; and UCX's `tcp` transport
//! listens on every interface. Whoever reaches such a worker (no cluster token needed) reads
//! and writes the process's memory. The attacker, not kvtier, would pick the lane, so kvtier
//! never loads those transports at all, whatever `UCX_TLS` says.
//!
//! Invariants:
//! - Allowed: RDMA RC / DC (`rc_verbs`, `rc_mlx5`, `dc_mlx5`: the adapter checks every access
//!   against the memory key's bounds and rights), UD only as `:aux` (UCX's wire-up of RC, no
//!   data) and `cma` (a kernel copy that needs ptrace rights over the target). Everything else
//!   (`tcp`, `posix`, `sysv`, `self`, `knem`, `xpmem`, `ud` as a data lane, GPU transports)
//!   is never loaded.
//! - UCX 1.13 connects workers over an active-message lane, and `cma` carries none: without an
//!   RDMA transport left, there is no UCX lane, [`plan`] says why and the caller uses frames.
//! - [`INSECURE_EMULATED_RMA_ENV`] (test hook, off by default, not a `KVTIER_*` setting) turns
//!   the allow-list off so the protocol tests can run over UCX's emulated lanes on hosts
//!   without RDMA; every context created under it logs an error saying memory is exposed.

/// Test hook: when set to `1`, kvtier's UCX contexts use `UCX_TLS` as the environment gives
/// it (emulated lanes included). INSECURE: any process that reaches the worker then reads and
/// writes this process's memory. For the UCX protocol tests on hosts without RDMA only.
pub const INSECURE_EMULATED_RMA_ENV: &str = "TEST_INSECURE_UCX_EMULATED_RMA";

/// RDMA transports whose one-sided operations the adapter checks against the memory key.
pub const RDMA_DATA_TRANSPORTS: [&str; 3] = ["rc_verbs", "rc_mlx5", "dc_mlx5"];

/// Kernel-assisted shared memory: `process_vm_readv` / `writev` need ptrace rights over the
/// target process.
pub const KERNEL_TRANSPORTS: [&str; 1] = ["cma"];

/// UCX's transport aliases (1.13, `ucp_context.c`), expanded to the transports they name; an
/// `ud_*` entry under an `rc` alias is UCX's auxiliary (wire-up) use of it.
const ALIASES: [(&str, &[&str]); 12] = [
    ("all", &ALL),
    ("sm", &["posix", "sysv", "xpmem", "knem", "cma"]),
    ("shm", &["posix", "sysv", "xpmem", "knem", "cma"]),
    ("mm", &["posix", "sysv", "xpmem"]),
    (
        "ib",
        &["rc_verbs", "ud_verbs", "rc_mlx5", "ud_mlx5", "dc_mlx5"],
    ),
    ("rc", &["rc_mlx5", "rc_verbs"]),
    ("rc_v", &["rc_verbs"]),
    ("rc_x", &["rc_mlx5"]),
    ("dc", &["dc_mlx5"]),
    ("dc_x", &["dc_mlx5"]),
    ("ud", &["ud_mlx5", "ud_verbs"]),
    ("ud_x", &["ud_mlx5"]),
];

/// Every transport `all` may load that the allow-list cares about (others are refused anyway).
const ALL: [&str; 12] = [
    "rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5", "cma", "tcp", "posix", "sysv", "self",
    "knem", "xpmem",
];

/// The auxiliary (wire-up) transport UCX pairs with an RC transport.
fn aux_of(rc: &str) -> Option<&'static str> {
    match rc {
        "rc_verbs" => Some("ud_verbs"),
        "rc_mlx5" => Some("ud_mlx5"),
        _ => None,
    }
}

/// The transports an operator's `UCX_TLS` value enables (aliases expanded, `^` exclusion,
/// `:aux` suffixes read as the transport).
fn operator_transports(tls: &str) -> Vec<String> {
    let tls = tls.trim();
    let (negate, list) = match tls.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, tls),
    };
    let mut named: Vec<String> = Vec::new();
    for token in list.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let token = token.strip_suffix(":aux").unwrap_or(token);
        match ALIASES.iter().find(|(alias, _)| *alias == token) {
            Some((_, expanded)) => named.extend(expanded.iter().map(|s| s.to_string())),
            None => named.push(token.to_string()),
        }
    }
    if negate {
        ALL.iter()
            .filter(|t| !named.iter().any(|n| n == *t))
            .map(|t| t.to_string())
            .collect()
    } else {
        named
    }
}

/// The `TLS` value for kvtier's UCX contexts given the operator's `UCX_TLS` (`None`: unset,
/// UCX's default `all`) and whether this host has an RDMA device: `Ok(list)` of allowed
/// transports, or `Err(why no UCX lane is left)`.
pub fn protected_tls(operator: Option<&str>, rdma_device: bool) -> Result<String, String> {
    let asked = operator_transports(operator.unwrap_or("all"));
    let has = |t: &str| asked.iter().any(|a| a == t);
    let mut allowed: Vec<String> = Vec::new();
    for rdma in RDMA_DATA_TRANSPORTS {
        if has(rdma) {
            allowed.push(rdma.to_string());
            if let Some(aux) = aux_of(rdma) {
                allowed.push(format!("{aux}:aux"));
            }
        }
    }
    let rdma_left = !allowed.is_empty();
    for kernel in KERNEL_TRANSPORTS {
        if has(kernel) {
            allowed.push(kernel.to_string());
        }
    }
    let shown = operator.unwrap_or("all (unset)");
    if !rdma_left {
        return Err(format!(
            "UCX_TLS={shown} leaves no transport that protects memory (kvtier allows only RDMA \
             {RDMA_DATA_TRANSPORTS:?} and cma; tcp, posix, sysv and the other lanes emulate \
             one-sided access in software and would serve any peer's read or write), and UCX \
             1.13 cannot connect over cma alone"
        ));
    }
    if !rdma_device {
        return Err(format!(
            "this host has no RDMA device (/sys/class/infiniband is empty): of the transports \
             kvtier allows ({}), only RDMA ones carry UCX's connections",
            allowed.join(",")
        ));
    }
    Ok(allowed.join(","))
}

/// Whether the insecure test hook is on ([`INSECURE_EMULATED_RMA_ENV`] = `1`).
pub fn insecure_hook() -> bool {
    std::env::var_os(INSECURE_EMULATED_RMA_ENV).is_some_and(|v| v == "1")
}

/// The `TLS` value kvtier's next UCX context uses: `Ok(Some(list))` (the allow-list applied),
/// `Ok(None)` (the insecure test hook is on: `UCX_TLS` as the environment gives it, logged as
/// an error), or `Err(why there is no UCX lane)`.
pub fn plan() -> Result<Option<String>, String> {
    if insecure_hook() {
        tracing::error!(
            hook = INSECURE_EMULATED_RMA_ENV,
            ucx_tls = %super::ucx_tls(),
            "kvtier: INSECURE test hook on: UCX may use emulated one-sided lanes (tcp, posix); \
             any process that reaches this worker can read and write this process's memory. \
             Never set this outside kvtier's tests."
        );
        eprintln!(
            "kvtier: INSECURE: {INSECURE_EMULATED_RMA_ENV}=1: UCX may use emulated one-sided \
             lanes; this process's memory is exposed to anyone who reaches UCX (tests only)"
        );
        return Ok(None);
    }
    let operator = std::env::var("UCX_TLS").ok();
    protected_tls(operator.as_deref(), !super::rdma_devices().is_empty()).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emulated_lanes_are_never_allowed_whatever_ucx_tls_says() {
        for tls in [
            "tcp",
            "posix",
            "sysv",
            "self",
            "tcp,posix,sysv,self",
            "sm",
            "shm",
            "mm",
            "ud",
            "ud_verbs",
            "^rc,dc",
            "cma",
            "posix,cma,self",
            "knem,xpmem",
        ] {
            for device in [false, true] {
                let got = protected_tls(Some(tls), device);
                assert!(got.is_err(), "UCX_TLS={tls} rdma={device}: {got:?}");
                let why = got.unwrap_err();
                assert!(why.contains(tls), "{why}");
            }
        }
    }

    #[test]
    fn rdma_is_kept_and_intersected_with_the_operators_list() {
        assert_eq!(
            protected_tls(None, true).unwrap(),
            "rc_verbs,ud_verbs:aux,rc_mlx5,ud_mlx5:aux,dc_mlx5,cma"
        );
        assert_eq!(
            protected_tls(Some("all"), true).unwrap(),
            "rc_verbs,ud_verbs:aux,rc_mlx5,ud_mlx5:aux,dc_mlx5,cma"
        );
        assert_eq!(
            protected_tls(Some("rc,tcp,sm"), true).unwrap(),
            "rc_verbs,ud_verbs:aux,rc_mlx5,ud_mlx5:aux,cma"
        );
        assert_eq!(
            protected_tls(Some("rc_x,ud_x:aux"), true).unwrap(),
            "rc_mlx5,ud_mlx5:aux"
        );
        assert_eq!(protected_tls(Some("dc_x,self"), true).unwrap(), "dc_mlx5");
        assert_eq!(
            protected_tls(Some("^tcp,posix"), true).unwrap(),
            "rc_verbs,ud_verbs:aux,rc_mlx5,ud_mlx5:aux,dc_mlx5,cma"
        );
        assert_eq!(
            protected_tls(Some("^rc_mlx5,cma"), true).unwrap(),
            "rc_verbs,ud_verbs:aux,dc_mlx5"
        );
        // Look-alike names are not taken for the allowed ones.
        assert!(protected_tls(Some("rc_verbsx,cmax,tcp_rc"), true).is_err());
    }

    #[test]
    fn no_rdma_device_leaves_no_lane_and_says_why() {
        let why = protected_tls(None, false).unwrap_err();
        assert!(why.contains("no RDMA device"), "{why}");
        assert!(why.contains("cma"), "{why}");
        let why = protected_tls(Some("tcp"), false).unwrap_err();
        assert!(why.contains("UCX_TLS=tcp"), "{why}");
    }
}
