//! Compiles `proto/` with a pure-Rust protobuf parser (protox), so a fresh
//! machine needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/zds.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
