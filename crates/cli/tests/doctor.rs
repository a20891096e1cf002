//! `kiln doctor` as a person or a script runs it.

use std::process::Command;

fn kiln() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
}

/// The JSON report has the documented shape, and the exit code agrees with `can_run`.
#[test]
fn doctor_json_schema_and_exit_code() {
    let out = kiln().args(["doctor", "--json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor --json is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    assert_eq!(v["schema"], 1);
    assert!(v["kernel"].as_str().is_some_and(|k| !k.is_empty()));
    assert!(["v1", "v2", "hybrid", "none"].contains(&v["cgroup_mode"].as_str().unwrap()));
    assert!(v["kvm"]["present"].is_boolean());
    assert!(v["kvm"]["hardware_speed"].is_boolean());
    assert!(v["kvm"]["detail"].is_string());
    assert!(v["runsc"]["working_platforms"].is_array());
    for c in v["checks"].as_array().unwrap() {
        assert!(
            c["name"].is_string() && c["ok"].is_boolean() && c["detail"].is_string(),
            "{c}"
        );
    }
    let can_run = v["can_run"].as_bool().unwrap();
    assert_eq!(out.status.code(), Some(if can_run { 0 } else { 3 }));
    assert_eq!(v["driver"].is_null(), !can_run);

    // Where /dev/kvm exists the probe must have measured both modes, and the driver follows it.
    if v["kvm"]["present"] == true {
        let p = &v["kvm"]["probe"];
        assert!(p["kernel_ips"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["user_ips"].as_f64().unwrap() > 0.0, "{p}");
        if v["kvm"]["hardware_speed"] == false && can_run {
            assert_eq!(v["driver"], "gvisor");
        }
    }
}

#[test]
fn doctor_screen_names_the_driver_decision() {
    let out = kiln().args(["doctor", "--quick"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("kiln doctor"), "{text}");
    assert!(text.contains("cgroups"), "{text}");
    assert!(
        text.contains("driver:") || text.contains("cannot run"),
        "{text}"
    );
}

#[test]
fn template_build_of_unknown_recipe_is_a_clear_error() {
    let cache = tempfile::tempdir().unwrap();
    let out = kiln()
        .args(["template", "build", "no-such-recipe"])
        .env("KILN_CACHE_DIR", cache.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no recipe named \"no-such-recipe\""), "{err}");
}

#[test]
fn template_build_of_invalid_recipe_file_names_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bad.toml");
    std::fs::write(
        &f,
        "name = \"x\"\n[from]\ndebian = \"bookworm\"\n[[steps]]\nrun = \"\"\n",
    )
    .unwrap();
    let out = kiln()
        .args(["template", "build"])
        .arg(&f)
        .env("KILN_CACHE_DIR", dir.path().join("cache"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("step 1: run command is empty"), "{err}");
}
