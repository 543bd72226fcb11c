fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/kvtier_master.proto");
    tonic_prost_build::configure().compile_protos(&["proto/kvtier_master.proto"], &["proto"])?;
    Ok(())
}
