//! Compiles `proto/` with a pure-Rust protobuf parser (protox), so a fresh
//! machine needs no system `protoc`; tonic generates the gRPC services.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/zds.proto",
        "proto/xds.proto",
        "proto/workload.proto",
        "proto/authorization.proto",
        "proto/citadel.proto",
    ];
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(protos, ["proto"])?;
    tonic_build::configure()
        .build_client(true)
        .build_server(true)
        .include_file("protos.rs")
        .compile_fds(fds)?;
    Ok(())
}
