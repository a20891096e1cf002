//! Compiles the envd protos with protox (no protoc needed) and generates prost types plus
//! proto3-JSON serde impls with pbjson.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/process/process.proto",
        "proto/filesystem/filesystem.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor_path = out.join("envd_descriptor.bin");
    let bytes = prost::Message::encode_to_vec(&fds);
    std::fs::write(&descriptor_path, &bytes)?;

    let mut cfg = prost_build::Config::new();
    cfg.file_descriptor_set_path(&descriptor_path)
        .skip_protoc_run()
        .compile_well_known_types()
        .extern_path(".google.protobuf", "::pbjson_types");
    cfg.compile_protos(&files, &["proto"])?;

    pbjson_build::Builder::new()
        .register_descriptors(&bytes)?
        .ignore_unknown_fields()
        .build(&[".process", ".filesystem"])?;
    Ok(())
}
