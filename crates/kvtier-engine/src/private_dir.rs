//! [`ensure_private_dir`]: create a directory only this user may use, or refuse one that is
//! not. Shared by the SSD tier (its segment directory) and `kvtier serve` (the per-user
//! directory of its default socket), which each kept a near-copy before (issue 16).
//!
//! Why it checks and does not just create: both paths can be predictable or configured by
//! someone else, and an attacker who owns (or may write) the directory could plant entries
//! there, a segment file linked to a victim, or a socket of their own. The check reads the
//! directory itself with `symlink_metadata`, so a symlink in its place is refused rather than
//! followed.
//!
//! Invariant: `Ok(())` means that, at the time of the check, `dir` was a real directory (not a
//! symlink) owned by the effective uid, with none of the `forbidden_mode_bits` set.

use std::io;
use std::path::Path;

/// Create `dir` (mode 0700, missing parents included) if it is missing, then refuse it unless
/// it is a real directory (not a symlink) owned by this process's effective uid with none of
/// `forbidden_mode_bits` set: `0o022` refuses a directory group or others may write,
/// `0o077` one they may access at all.
///
/// The error is `PermissionDenied` and names the directory and the reason (the owner's uid,
/// or the mode found).
pub fn ensure_private_dir(dir: &Path, forbidden_mode_bits: u32) -> io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let meta = std::fs::symlink_metadata(dir)?;
    let uid = rustix::process::geteuid().as_raw();
    let problem = if !meta.file_type().is_dir() {
        Some("is not a directory (a symlink or a file is in the way)".to_string())
    } else if meta.uid() != uid {
        Some(format!("is owned by uid {}, not {uid}", meta.uid()))
    } else if meta.mode() & forbidden_mode_bits != 0 {
        let hint = if forbidden_mode_bits & 0o044 != 0 {
            "it must not be accessible to group or others (0700)"
        } else {
            "group or others may write it (chmod go-w, or use a private directory)"
        };
        Some(format!("has mode {:o}: {hint}", meta.mode() & 0o7777))
    } else {
        None
    };
    match problem {
        Some(why) => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{} {why}", dir.display()),
        )),
        None => Ok(()),
    }
}

/// Issue 26: create a fresh directory `<parent>/<prefix>-XXXXXXXX` with mode 0700 (the
/// `mkdtemp` pattern). `mkdir` is atomic and never reuses an existing entry, so a name someone
/// else created first is skipped, never adopted; the name need not be unpredictable. Gives up
/// after 64 taken names.
pub fn create_fresh_private_dir(parent: &Path, prefix: &str) -> io::Result<std::path::PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    use std::time::{SystemTime, UNIX_EPOCH};
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ (u64::from(std::process::id()) << 32);
    let mut last = None;
    for attempt in 0..64u64 {
        // splitmix64 of the seed: distinct names per attempt, no crate needed.
        let mut x = seed.wrapping_add(attempt.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
        let dir = parent.join(format!("{prefix}-{:08x}", x as u32));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {
                // The umask may have cleared bits only; check as for any private directory.
                ensure_private_dir(&dir, 0o077)?;
                return Ok(dir);
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("cannot create a directory in {}: {e}", parent.display()),
                ))
            }
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no free name")))
}

/// Issue 26: the user's own persistent state directory for `name`:
/// `$XDG_STATE_HOME/kvtier/<name>`, else `$HOME/.local/state/kvtier/<name>` (absolute
/// variables only), or `None` when neither is set. Not created here.
pub fn user_state_dir(name: &str) -> Option<std::path::PathBuf> {
    let absolute = |var: &str| {
        std::env::var_os(var)
            .map(std::path::PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    absolute("XDG_STATE_HOME")
        .or_else(|| absolute("HOME").map(|h| h.join(".local/state")))
        .map(|base| base.join("kvtier").join(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    #[test]
    fn creates_0700_and_refuses_by_the_given_bits() {
        let tmp = tempfile::tempdir().unwrap();
        let fresh = tmp.path().join("a/b");
        ensure_private_dir(&fresh, 0o077).unwrap();
        assert_eq!(std::fs::metadata(&fresh).unwrap().mode() & 0o777, 0o700);
        let readable = tmp.path().join("readable");
        std::fs::create_dir(&readable).unwrap();
        std::fs::set_permissions(&readable, PermissionsExt::from_mode(0o755)).unwrap();
        ensure_private_dir(&readable, 0o022).unwrap();
        let e = ensure_private_dir(&readable, 0o077).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(
            e.to_string().contains("accessible to group or others"),
            "{e}"
        );
        std::fs::set_permissions(&readable, PermissionsExt::from_mode(0o775)).unwrap();
        let e = ensure_private_dir(&readable, 0o022).unwrap_err();
        assert!(
            e.to_string().contains("group or others may write it"),
            "{e}"
        );
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&fresh, &link).unwrap();
        assert!(ensure_private_dir(&link, 0o022).is_err());
    }

    #[test]
    fn fresh_private_dirs_are_new_and_0700() {
        let tmp = tempfile::tempdir().unwrap();
        let a = create_fresh_private_dir(tmp.path(), "kvtier-x").unwrap();
        let b = create_fresh_private_dir(tmp.path(), "kvtier-x").unwrap();
        assert_ne!(a, b);
        for d in [&a, &b] {
            assert_eq!(std::fs::metadata(d).unwrap().mode() & 0o777, 0o700);
            assert!(d
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("kvtier-x-"));
        }
    }
}
