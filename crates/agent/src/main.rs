fn main() {
    eprintln!("kiln-agent: not built yet");
    std::process::exit(2);
}
