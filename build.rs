//! Compiles `proto/` with a pure-Rust protobuf parser (protox), so a fresh
//! machine needs no system `protoc`; tonic generates the gRPC services.
//! For an optimized x86_64 Linux build it also hands the linker
//! `link/hot-functions.txt`, the functions the proxy runs (written by
//! `benches/hot-functions.py`), so they lie together at the start of the
//! code: the kernel maps 64 KiB around every page of code that runs, and
//! scattered among cold code they would keep several times their size
//! resident. rustc links that target with lld; a name lld does not find is
//! skipped.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/zds.proto",
        "proto/xds.proto",
        "proto/workload.proto",
        "proto/authorization.proto",
        "proto/citadel.proto",
    ];
    println!("cargo:rerun-if-changed=proto");
    order_hot_functions();
    // The compiler's version, for the config dump's `version` block.
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    if let Ok(out) = std::process::Command::new(rustc).arg("--version").output() {
        let version = String::from_utf8_lossy(&out.stdout);
        println!("cargo:rustc-env=AMBIT_RUST_VERSION={}", version.trim());
    }
    git_revision();
    let fds = protox::compile(protos, ["proto"])?;
    tonic_build::configure()
        .build_client(true)
        .build_server(true)
        .include_file("protos.rs")
        .compile_fds(fds)?;
    Ok(())
}

fn order_hot_functions() {
    let list = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("link/hot-functions.txt");
    println!("cargo:rerun-if-changed={}", list.display());
    let optimized = std::env::var("PROFILE").as_deref() == Ok("release");
    let lld_target = std::env::var("TARGET").as_deref() == Ok("x86_64-unknown-linux-gnu");
    if optimized && lld_target && list.exists() {
        println!(
            "cargo:rustc-link-arg-bin=ambit=-Wl,--symbol-ordering-file={}",
            list.display()
        );
        println!("cargo:rustc-link-arg-bin=ambit=-Wl,--no-warn-symbol-ordering");
    }
}

/// The commit built, for the config dump's `version.gitRevision`, when the
/// source is a git checkout (an image built from a copy says `unknown`).
/// Rebuilt when HEAD moves: the files that say where it points are watched
/// (only those that exist: a missing one would rerun this every build).
fn git_revision() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(dir)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(rev) = git(&["rev-parse", "HEAD"]) else {
        return;
    };
    println!("cargo:rustc-env=AMBIT_GIT_REVISION={rev}");
    let mut watched = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(branch);
    }
    for name in watched {
        if let Some(path) = git(&["rev-parse", "--git-path", &name]) {
            let path = std::path::Path::new(dir).join(path);
            if path.exists() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
}
