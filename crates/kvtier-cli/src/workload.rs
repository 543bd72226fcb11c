//! `kvtier bench workload ARGS...`: the SGLang-shaped workload benchmark, which lives in
//! Python (`python -m kvtier_dev.bench workload`, real SGLang host pools and adapter). This
//! module only finds a Python that has kvtier installed and runs it with the arguments as
//! given, passing its exit status through. The module is not in the wheel (it lives in the
//! checkout's `tools/python`, made importable by `scripts/setup.sh`); when this binary runs
//! from a checkout's `target/`, that directory is also put on `PYTHONPATH`.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The Python module (and its sub-command) that runs the benchmark.
const MODULE: &str = "kvtier_dev.bench";
const SUITE: &str = "workload";

#[derive(clap::Args)]
pub struct WorkloadArgs {
    /// The Python interpreter (default: $KVTIER_PYTHON, else $VIRTUAL_ENV/bin/python, else
    /// the repository's .venv next to this binary, else python3 on PATH).
    #[arg(long, value_name = "PATH")]
    python: Option<PathBuf>,
    /// Arguments for `python -m kvtier_dev.bench workload` (see `kvtier bench workload -- --help`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
    args: Vec<String>,
}

/// Candidate interpreters, most specific first.
fn candidates(explicit: Option<&Path>) -> Vec<PathBuf> {
    if let Some(p) = explicit {
        return vec![p.to_path_buf()];
    }
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("KVTIER_PYTHON").filter(|p| !p.is_empty()) {
        return vec![PathBuf::from(p)];
    }
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV").filter(|p| !p.is_empty()) {
        out.push(Path::new(&venv).join("bin/python"));
    }
    // target/release/kvtier in a checkout: <repo>/.venv/bin/python.
    if let Ok(exe) = std::env::current_exe() {
        if let Some(repo) = exe.ancestors().nth(3) {
            out.push(repo.join(".venv/bin/python"));
        }
    }
    out.push(PathBuf::from("python3"));
    out
}

/// `PYTHONPATH` with the checkout's `tools/python` first, when this binary is
/// `<repo>/target/<profile>/kvtier` and that directory exists (issue 16: kvtier_dev moved out
/// of the wheel); `None` leaves the environment as it is.
fn python_path() -> Option<std::ffi::OsString> {
    let exe = std::env::current_exe().ok()?;
    let tools = exe.ancestors().nth(3)?.join("tools/python");
    if !tools.is_dir() {
        return None;
    }
    let mut paths = vec![tools];
    if let Some(old) = std::env::var_os("PYTHONPATH") {
        paths.extend(std::env::split_paths(&old));
    }
    std::env::join_paths(paths).ok()
}

/// `python` with `PYTHONPATH` set by [`python_path`].
fn python_command(python: &Path) -> Command {
    let mut cmd = Command::new(python);
    if let Some(path) = python_path() {
        cmd.env("PYTHONPATH", path);
    }
    cmd
}

/// Whether `python` runs and can import the benchmark module.
fn has_module(python: &Path) -> Result<bool, std::io::Error> {
    let probe = format!(
        "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('{MODULE}.{SUITE}') else 3)"
    );
    python_command(python)
        .args(["-c", &probe])
        .env("CUDA_VISIBLE_DEVICES", "")
        .status()
        .map(|s| s.success())
}

pub fn run(args: WorkloadArgs) -> Result<ExitCode, String> {
    let mut tried = Vec::new();
    for python in candidates(args.python.as_deref()) {
        match has_module(&python) {
            Ok(true) => {
                let status = python_command(&python)
                    .args(["-m", MODULE, SUITE])
                    .args(&args.args)
                    .status()
                    .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
                let code = status
                    .code()
                    .and_then(|c| u8::try_from(c).ok())
                    .unwrap_or(1);
                return Ok(ExitCode::from(code));
            }
            Ok(false) => tried.push(format!("{} (no module {MODULE}.{SUITE})", python.display())),
            Err(e) => tried.push(format!("{} ({e})", python.display())),
        }
    }
    Err(format!(
        "bench workload needs a Python with kvtier installed and kvtier_dev importable \
         (scripts/setup.sh builds .venv; \
         or pass --python / set KVTIER_PYTHON); tried: {}",
        tried.join(", ")
    ))
}
