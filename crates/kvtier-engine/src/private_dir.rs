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
}
