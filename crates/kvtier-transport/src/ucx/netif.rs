//! The network interface that holds an IP address (issue 26 §1: kvtier's UCX binds only to
//! the interface of the address the operator named), read with `getifaddrs(3)`.
//!
//! Owns: [`interface_of`], the one `unsafe` walk of the kernel's interface address list.
//!
//! Invariants:
//! - The list `getifaddrs` returns is read only between that call and its `freeifaddrs`, on
//!   one thread, and freed on every path (a guard).
//! - An address matches an interface when that interface holds exactly it; a loopback address
//!   the kernel answers for without its being configured (127.0.0.2 on `lo`, which holds
//!   127.0.0.1/8) matches the loopback interface whose network contains it. Nothing else is
//!   inferred: an address no interface holds is refused, named.

#![allow(unsafe_code)]

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// One interface address: (interface name, address, netmask, loopback flag).
type Entry = (String, IpAddr, Option<IpAddr>, bool);

/// The IP address in `sa`, if it is an IPv4 or IPv6 one.
///
/// # Safety
/// `sa` is null or points to a `sockaddr` whose family says how long it is (as
/// `getifaddrs` gives them).
unsafe fn ip_of(sa: *const libc::sockaddr) -> Option<IpAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: non-null and valid for a `sockaddr` header (the caller's contract).
    match i32::from(unsafe { (*sa).sa_family }) {
        libc::AF_INET => {
            // SAFETY: the family is AF_INET, so the storage is a `sockaddr_in`.
            let sin = unsafe { &*sa.cast::<libc::sockaddr_in>() };
            Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                sin.sin_addr.s_addr,
            ))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family is AF_INET6, so the storage is a `sockaddr_in6`.
            let sin6 = unsafe { &*sa.cast::<libc::sockaddr_in6>() };
            Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
        }
        _ => None,
    }
}

/// Frees the list on drop.
struct IfAddrs(*mut libc::ifaddrs);

impl Drop for IfAddrs {
    fn drop(&mut self) {
        // SAFETY: the pointer came from a successful `getifaddrs` and is freed once.
        unsafe { libc::freeifaddrs(self.0) };
    }
}

/// Every IPv4 / IPv6 address of every interface.
fn entries() -> Result<Vec<Entry>, String> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `head` is written on success; the list is freed by the guard below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(format!(
            "getifaddrs failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    let list = IfAddrs(head);
    let mut out = Vec::new();
    let mut cursor = list.0;
    while !cursor.is_null() {
        // SAFETY: `cursor` is a node of the live list (freed only when `list` drops).
        let node = unsafe { &*cursor };
        // SAFETY: the address and netmask pointers are null or valid sockaddrs of the list.
        let (addr, mask) = unsafe { (ip_of(node.ifa_addr), ip_of(node.ifa_netmask)) };
        if let Some(addr) = addr {
            if !node.ifa_name.is_null() {
                // SAFETY: a non-null `ifa_name` is a NUL-terminated string of the live list.
                let name = unsafe { CStr::from_ptr(node.ifa_name) }
                    .to_string_lossy()
                    .into_owned();
                let loopback = node.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
                out.push((name, addr, mask, loopback));
            }
        }
        cursor = node.ifa_next;
    }
    Ok(out)
}

/// Whether `ip` lies in the network of `addr` / `mask`.
fn in_network(ip: IpAddr, addr: IpAddr, mask: IpAddr) -> bool {
    match (ip, addr, mask) {
        (IpAddr::V4(ip), IpAddr::V4(addr), IpAddr::V4(mask)) => {
            let m = u32::from(mask);
            u32::from(ip) & m == u32::from(addr) & m
        }
        (IpAddr::V6(ip), IpAddr::V6(addr), IpAddr::V6(mask)) => {
            let m = u128::from(mask);
            u128::from(ip) & m == u128::from(addr) & m
        }
        _ => false,
    }
}

/// The name of the interface that holds `ip` (see the module doc), or why there is none.
pub fn interface_of(ip: IpAddr) -> Result<String, String> {
    let list = entries()?;
    if let Some((name, ..)) = list.iter().find(|(_, addr, ..)| *addr == ip) {
        return Ok(name.clone());
    }
    if ip.is_loopback() {
        if let Some((name, ..)) = list.iter().find(|(_, addr, mask, loopback)| {
            *loopback && mask.is_some_and(|m| in_network(ip, *addr, m))
        }) {
            return Ok(name.clone());
        }
    }
    Err(format!(
        "no network interface of this host holds {ip}, so there is no interface to bind UCX to"
    ))
}
